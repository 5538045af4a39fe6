"""Turn full run records into the compact files records/ keeps in git (musebench.harness.summary).

    python scripts/compact-records.py [--replace] [--out-dir DIR] PATH...

Per PATH, by what it holds:

- a run JSON (`musebench ... --json`): its summary, `<stem>.summary.json`;
- a JUnit XML (pytest's or `musebench ... --junit`): its counts and failures, `<stem>.summary.json`;
- any other file (`musebench env` JSON, machine facts, logs): kept as it is when it fits in
  100 KB; a larger text file is cut to its tail under a note (`<stem>.tail<suffix>`, or in place
  with --replace); a larger JSON that is no run report is refused.

A summary records its source file's name, size and sha256 (`source`), computed before anything
is replaced. Outputs go beside their inputs, or into --out-dir. --replace removes each original
once its summary is written (what records/ does: the full files stay in CI artifacts and the
device call's $OUT). One tab-separated line per PATH on stdout: original, bytes, sha256, output,
output bytes, action. Exit 1 if any PATH could not be handled (the others still are).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

# this checkout's musebench, not whichever one is installed: the records belong to this tree
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from musebench.harness import summary as records  # noqa: E402


def _summary_of(path: Path, data: bytes) -> dict | None:
    """The summary for a run JSON or a JUnit XML; None for any other file."""
    if path.suffix == ".xml":
        return records.summarize_junit(data)
    if path.suffix == ".json":
        content = json.loads(data)
        if isinstance(content, dict) and "cases" in content and "command" in content:
            return records.summarize(content)
    return None


def compact(path: Path, out_dir: Path | None, replace: bool, limit: int) -> tuple[Path, int, str]:
    """Write `path`'s compact form; return (output path, its size in bytes, the action taken)."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    folder = out_dir or path.parent
    summary = _summary_of(path, data)
    if summary is not None:
        summary["source"] = {"file": path.name, "bytes": len(data), "sha256": digest}
        text = records.dumps(summary).encode()
        if len(text) > limit:
            raise ValueError(f"its summary is {len(text)} bytes, over the {limit}-byte limit")
        target = folder / f"{path.stem}.summary.json"
        target.write_bytes(text)
        if replace:
            path.unlink()
        return target, len(text), "summarized" + (", original removed" if replace else "")
    if len(data) <= limit:
        target = folder / path.name
        if target.resolve() != path.resolve():
            target.write_bytes(data)
        return target, len(data), "kept"
    if path.suffix == ".json":
        raise ValueError(f"{len(data)} bytes of JSON that is no run report: nothing to summarize it with")
    cut = records.tail_text(data, limit, source=f"sha256 {digest}")
    target = folder / path.name if replace or out_dir else folder / f"{path.stem}.tail{path.suffix}"
    target.write_bytes(cut)
    return target, len(cut), "cut to its tail"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    parser.add_argument("--out-dir", type=Path, help="write outputs here (default: beside each input)")
    parser.add_argument("--replace", action="store_true", help="remove each original once its summary is written")
    parser.add_argument("--limit", type=int, default=records.RECORD_LIMIT_BYTES, help="bytes one output may take")
    args = parser.parse_args(argv)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    for path in args.paths:
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            size = path.stat().st_size
            target, written, action = compact(path, args.out_dir, args.replace, args.limit)
        except (OSError, ValueError) as error:
            print(f"compact-records: {path}: {error}", file=sys.stderr)
            failed = True
            continue
        print(f"{path}\t{size}\t{digest}\t{target}\t{written}\t{action}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
