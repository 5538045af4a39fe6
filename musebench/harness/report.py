"""The report layer: how a `RunReport` is shown, stored, exported and compared.

Contract:

- `render_table` prints one rich table per run, one row per case, in the report's case order;
  nothing is grouped or aggregated away. Only bench rows (`measurement` "bench": CUDA-graph
  medians) fill µs columns, and the columns exist only where such rows are: a check run (the
  CPU model always) has no µs or ratio column, and one line under the table (`TIMING_POINTER`)
  says where kernel timings come from. A failed case's row is red, and under the table each
  failed case gets exactly one diagnostic line (`diagnostic`), each skipped run one line
  (`skipped_line`: "routing: skipped, REASON — NAME, N cases"); a run with no case rows
  but skipped runs prints no empty table, then one summary line
  "N passed, N failed" (", N skipped" appended, counting cases, when runs were skipped).
- `write_json` writes `RunReport.to_dict()` as UTF-8 JSON; `read_json` reads it back into an equal
  `RunReport`, and raises ValueError naming the file for anything that is not a readable report of
  a supported schema (an absent or unreadable file raises the usual OSError).
- `write_junit` writes JUnit XML: a <testsuites> root holding one <testsuite name="musebench">
  with one <testcase> per case (name from the case's key, classname its kernel) and one <failure>,
  carrying the diagnostic line, per failed case; each skipped run is one <testcase> holding a
  <skipped> with its reason.
- `compare` lists what got worse from one run to the next: cases that passed and now fail, cases
  whose median tail time grew by more than a relative threshold (bench rows on both sides: the
  host wall-clock µs of check rows in files before schema 1.3 are ignored), and cases that
  disappeared. Improvements and cases new in the second run are not reported.
- `machine_info`, `version_info`, `git_commit` and `now_utc` fill a report's provenance fields;
  none of them raises for a missing tool or package, they report it as absent instead.

This module imports neither torch nor cutlass at import time, so `musebench --help` stays cheap;
`machine_info` and `version_info` import torch inside the call.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from musebench.harness.results import CaseResult, Mismatch, RunReport, SkippedRun

__all__ = [
    "Regression",
    "case_name",
    "compare",
    "diagnostic",
    "git_commit",
    "key_name",
    "machine_info",
    "now_utc",
    "read_json",
    "render_comparison",
    "render_table",
    "skipped_line",
    "timed",
    "version_info",
    "write_json",
    "write_junit",
]

_MISSING = "—"
# Under a table with check rows: a check times nothing (a host clock around a Python call would
# time the interpreter); kernel timings are the benches' graph medians.
TIMING_POINTER = ("timings: a check times nothing; kernel timings (CUDA-graph medians, GPU) come from "
                  "`musebench bench tail`")
ROUTING_POINTER = " and `musebench bench routing`"
# Long stock paths would push the numeric columns off an ordinary terminal; the tail of a dotted
# path names the function, which is what tells two stock paths apart.
_STOCK_PATH_WIDTH = 32


# --------------------------------------------------------------------------------------------
# Naming and formatting
# --------------------------------------------------------------------------------------------


def key_name(key: tuple) -> str:
    """A readable, stable name for a case key, e.g. `ep_tail[tp4-tok8-bf16-before-random-local]`.

    The name is built from `CaseResult.key` alone, so the same case carries the same name in
    every run (JUnit history and `compare` rely on that).
    """
    if len(key) == 7:
        kernel, tp, tokens, weight_dtype, norm, inputs, transport = key
        return f"{kernel}[tp{tp}-tok{tokens}-{weight_dtype}-{norm}-{inputs}-{transport}]"
    # A key of another shape (the data model grew a field) still gets a unique name.
    head, *rest = key or ("case",)
    return f"{head}[{'-'.join(str(part) for part in rest)}]"


def case_name(case: CaseResult) -> str:
    """The key's name; a row of one group of a larger job adds the group (`...[...] group 1`)."""
    name = key_name(case.key)
    return name if case.group is None else f"{name} group {case.group}"


def short_stock_path(case: CaseResult) -> str:
    """The stock path cut to its trailing components, or the stock's name when no path is known."""
    path = case.stock_path or case.stock
    if len(path) <= _STOCK_PATH_WIDTH:
        return path
    parts = re.split(r"(?<=[./:])", path)
    tail = ""
    for part in reversed(parts):
        if len(tail) + len(part) + 1 > _STOCK_PATH_WIDTH:
            break
        tail = part + tail
    if not tail:
        tail = path[-(_STOCK_PATH_WIDTH - 1) :]
    return "…" + tail


def _format_us(value: float | None) -> str:
    if value is None:
        return _MISSING
    if math.isnan(value):
        return "nan"
    return f"{value:.2f}"


def timed(case: CaseResult) -> bool:
    """The row's µs are kernel timings (a bench's graph medians), not absent or host wall-clock."""
    return case.measurement == "bench"


def _format_ratio(value: float | None) -> str:
    return _MISSING if value is None else f"{value:.2f}×"


BASELINE_LEGEND = "baseline columns: µs (tail / that baseline, same run, each the max over ranks)"


def baseline_legend(cases: list[CaseResult]) -> str:
    """BASELINE_LEGEND, then each baseline whose ratio divides another baseline's µs instead of
    the tail's (a row's `baseline_ratio_of`): `...; but torch matmul, cold weights: cold weights / it`."""
    pairs = dict.fromkeys((name, over) for case in cases for name, over in case.baseline_ratio_of.items())
    return BASELINE_LEGEND + "".join(f"; but {name}: {over} / it" for name, over in pairs)


def _baseline_cell(case: CaseResult, name: str) -> str:
    """A baseline's µs and the row's ratio to it (`CaseResult.baseline_ratios`: the tail's, or
    the other baseline's its row names): `12.70 (0.37×)`."""
    us = case.baselines_us.get(name)
    ratio = case.baseline_ratios.get(name)
    return _format_us(us) if ratio is None else f"{_format_us(us)} ({_format_ratio(ratio)})"


def _format_bits(bits: int, width_digits: int) -> str:
    return f"0x{bits:0{width_digits}x}"


def _format_mismatch(mismatch: Mismatch) -> str:
    # 16-bit patterns are bf16 outputs, wider ones fp32; both bit patterns share one width so they
    # line up for a by-eye diff.
    widest = max(mismatch.got_bits, mismatch.want_bits)
    digits = 4 if widest < (1 << 16) else 8 if widest < (1 << 32) else 16
    index = ", ".join(str(i) for i in mismatch.index)
    return (
        f"rank {mismatch.rank} index ({index}): "
        f"got {_format_bits(mismatch.got_bits, digits)} ({mismatch.got!r}) "
        f"want {_format_bits(mismatch.want_bits, digits)} ({mismatch.want!r})"
    )


def diagnostic(case: CaseResult) -> str:
    """One line saying why a case failed: its error, else its first mismatch, then its flags.

    The line is the same in the terminal table and in the JUnit <failure>, so a CI log and a
    local run can be grepped for the same text.
    """
    if case.error is not None:
        cause = f"error: {case.error}"
    elif case.first_mismatch is not None:
        cause = f"{case.mismatches} wrong, max ulp {case.max_ulp}; first at {_format_mismatch(case.first_mismatch)}"
    elif case.mismatches:
        cause = f"{case.mismatches} wrong, max ulp {case.max_ulp}; first mismatch not recorded"
    else:
        cause = "bits match the stock"
    flags = f"rank_identical={case.rank_identical} deterministic={case.deterministic}"
    return f"{case_name(case)}: {cause}; {flags}"


def skipped_name(run: SkippedRun) -> str:
    return f"{run.kernel}[skipped: {run.name}]"


def skipped_line(run: SkippedRun) -> str:
    """One line for a run that did not run: kernel, name, case count and why."""
    return f"{run.kernel}: skipped, {run.reason} — {run.name}, {run.cases} cases"


# --------------------------------------------------------------------------------------------
# Terminal table
# --------------------------------------------------------------------------------------------


def render_table(report: RunReport, console: Console, title: str | None = None) -> None:
    """Print the run as one table (one row per case), the failed cases' diagnostics, and a summary."""
    heading = title if title is not None else f"musebench {report.command}".rstrip()
    if report.backend_note:
        heading = f"{heading} — {report.backend_note}"
    caption_parts = [part for part in (report.created, report.git_commit and f"git {report.git_commit}") if part]

    table = Table(
        title=Text(heading),
        caption=Text(" · ".join(caption_parts)) if caption_parts else None,
        header_style="bold",
    )
    table.add_column("kernel")
    table.add_column("mode")
    table.add_column("tp", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("weights")
    table.add_column("norm")
    table.add_column("inputs")
    table.add_column("transport")
    table.add_column("stock path")
    table.add_column("✓/✗", justify="center")
    table.add_column("#wrong", justify="right")
    table.add_column("max ulp", justify="right")
    benches = [case for case in report.cases if timed(case)]
    if benches:
        table.add_column("tail µs", justify="right")
        table.add_column("stock µs", justify="right")
        table.add_column("ratio", justify="right")
    baselines = list(dict.fromkeys(name for case in benches for name in case.baselines_us))
    for name in baselines:
        table.add_column(f"{name} µs", justify="right")
    parts = list(dict.fromkeys(name for case in benches for name in case.kernels_us))
    for name in parts:
        table.add_column(f"{name} µs", justify="right")
    rooflines = any(case.roofline_us is not None for case in benches)
    if rooflines:
        table.add_column("roofline µs", justify="right")
        table.add_column("/ roofline", justify="right")

    for case in report.cases:
        passed = case.passed
        mark = Text("✓", style="bold green") if passed else Text("✗", style="bold red")
        cells = [
            case.kernel,
            case.mode,
            str(case.tp) if case.group is None else f"{case.tp} g{case.group}",  # one group of a larger job
            str(case.tokens),
            case.weight_dtype,
            case.norm,
            case.inputs,
            case.transport,
            short_stock_path(case),
        ]
        # Text cells keep brackets in stock paths or kernel names from being read as rich markup.
        row = [Text(cell) for cell in cells]
        row.append(mark)
        row += [Text(str(case.mismatches)), Text(str(case.max_ulp))]
        if benches:  # a check row beside bench rows: its µs are absent, never host wall-clock
            bench = timed(case)
            row += [
                Text(_format_us(case.tail_us if bench else None)),
                Text(_format_us(case.stock_us if bench else None)),
                Text(_format_ratio(case.ratio if bench else None)),
            ]
            row += [Text(_baseline_cell(case, name) if bench else _MISSING) for name in baselines]
            row += [Text(_format_us(case.kernels_us.get(name) if bench else None)) for name in parts]
            if rooflines:
                roofline = case.roofline_us if bench else None
                row += [Text(_format_us(roofline)),
                        Text(_format_ratio(case.tail_us / roofline if roofline and case.tail_us is not None else None))]
        table.add_row(*row, style=None if passed else "red")

    if report.cases or not report.skipped:
        console.print(table)
    else:  # only skipped runs: the heading still says which machine and command this was
        console.print(Text(heading, style="italic"))
    if baselines:
        console.print(Text(baseline_legend(benches)), soft_wrap=True)
    notes = list(dict.fromkeys(note for case in report.cases for note in case.notes))
    for note in notes:
        console.print(Text(f"note: {note}"), soft_wrap=True)
    checks = [case for case in report.cases if not timed(case)]
    if checks:
        routing = any(case.mode == "routing" for case in checks)
        console.print(Text(TIMING_POINTER + (ROUTING_POINTER if routing else "")), soft_wrap=True)

    failed = [case for case in report.cases if not case.passed]
    for case in failed:
        # soft_wrap keeps each diagnostic on one physical line, so it survives copy-paste and grep.
        console.print(Text(f"✗ {diagnostic(case)}", style="red"), soft_wrap=True)
    for run in report.skipped:
        console.print(Text(f"○ {skipped_line(run)}", style="yellow"), soft_wrap=True)

    passed_count = len(report.cases) - len(failed)
    summary = Text()
    summary.append(f"{passed_count} passed", style="green" if passed_count else "")
    summary.append(", ")
    summary.append(f"{len(failed)} failed", style="bold red" if failed else "")
    if report.skipped:
        summary.append(", ")
        summary.append(f"{sum(run.cases for run in report.skipped)} skipped", style="yellow")
    console.print(summary)


# --------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    # platform.processor() is empty on most Linux systems; /proc/cpuinfo names the part.
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Host facts for `RunReport.machine`: hostname, platform, CPU, Python and visible CUDA GPUs.

    Values are JSON-native (lists, not tuples), so a report read back from JSON compares equal.
    """
    try:
        usable_cpus: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable_cpus = os.cpu_count()
    from musebench.harness.environment import gpus

    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cpus,
        "python": platform.python_version(),
        "gpus": gpus(),
    }


def version_info() -> dict[str, Any]:
    """Software versions for `RunReport.versions`; an absent package is reported as None.

    `cuda` is the CUDA runtime torch was built with, present only when torch sees a CUDA GPU.
    `cutlass-dsl` comes from the package metadata, so cutlass itself is never imported here.
    """
    from musebench import __version__

    versions: dict[str, Any] = {
        "musebench": __version__,
        "python": platform.python_version(),
        "torch": None,
        "cuda": None,
        "cutlass-dsl": _distribution_version("nvidia-cutlass-dsl"),
        "click": _distribution_version("click"),
        "rich": _distribution_version("rich"),
    }
    try:
        import torch

        versions["torch"] = torch.__version__
        if torch.version.cuda and torch.cuda.is_available():
            versions["cuda"] = torch.version.cuda
    except Exception:  # a broken torch install must not stop a report from being written
        versions["torch"] = _distribution_version("torch")
    return versions


def git_commit(path: str | os.PathLike[str] = ".") -> str:
    """HEAD's hash of the git work tree at `path`, with "-dirty" when tracked files have changes.

    Untracked files do not count as changes (as with `git describe --dirty`). Returns "" when
    `path` is not in a git work tree, the repository has no commit yet, or git is unavailable.
    MUSEBENCH_GIT_COMMIT, when set, wins: a copy of the tree without its .git (a device machine)
    is stamped with the commit it was copied from.
    """
    stamped = os.environ.get("MUSEBENCH_GIT_COMMIT", "").strip()
    if stamped:
        return stamped

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "-C", os.fspath(path), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )

    try:
        head = git("rev-parse", "--verify", "--quiet", "HEAD")
        if head.returncode != 0:
            return ""
        commit = head.stdout.strip()
        status = git("status", "--porcelain", "--untracked-files=no")
        if status.returncode == 0 and status.stdout.strip():
            commit += "-dirty"
        return commit
    except (OSError, subprocess.SubprocessError):
        return ""


def now_utc() -> str:
    """The current time as ISO-8601 in UTC to the second, e.g. `2026-11-20T14:03:07+00:00`."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------


def write_json(report: RunReport, path: str | os.PathLike[str]) -> None:
    """Write the report as indented UTF-8 JSON, creating parent folders.

    The file is written beside its destination and renamed into place, so a reader never sees a
    half-written report.
    """
    destination = Path(path)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    try:
        staging.write_text(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(staging, destination)
    finally:
        staging.unlink(missing_ok=True)


def read_json(path: str | os.PathLike[str]) -> RunReport:
    """Read a report written by `write_json`.

    Raises ValueError, naming the file, when it is not UTF-8 JSON, not a JSON object, of an
    unsupported schema major, or lacks or mistypes the fields of a report.
    """
    source = Path(path)
    raw = source.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{source}: not a musebench report (invalid JSON: {exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{source}: not a musebench report (top level is {type(data).__name__}, expected an object)")
    if "schema_version" not in data:
        raise ValueError(f"{source}: not a musebench report (no schema_version field)")
    try:
        return RunReport.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc
    except (KeyError, TypeError, AttributeError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{source}: malformed musebench report ({detail})") from exc


# --------------------------------------------------------------------------------------------
# JUnit
# --------------------------------------------------------------------------------------------

# XML 1.0 cannot carry most control characters, even escaped; an error string captured from a
# crashed rank may hold some, and one would make the whole file unparseable.
_XML_INVALID = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_text(value: Any) -> str:
    return _XML_INVALID.sub("\ufffd", str(value))


def _case_seconds(case: CaseResult) -> float:
    if not timed(case) or case.tail_us is None or not case.iters or not math.isfinite(case.tail_us):
        return 0.0
    return case.tail_us * case.iters / 1e6


def write_junit(report: RunReport, path: str | os.PathLike[str]) -> None:
    """Write the report as JUnit XML for CI test views.

    Each case is a <testcase> named `case_name(case)` with classname = its kernel and time =
    tail_us × iters / 1e6 seconds (0 when untimed: every check row). A failed case holds one <failure> whose
    message is its diagnostic line and whose type is "error" for a crashed case, else "mismatch".
    A skipped run is one <testcase> named `skipped_name(run)`, classname its kernel, time 0, holding
    a <skipped> whose message is its `skipped_line`; it counts in `tests` and `skipped`.
    The suite's <properties> record the git commit, backend note, backends, command and schema.
    """
    failures = [case for case in report.cases if not case.passed]
    total_seconds = sum(_case_seconds(case) for case in report.cases)
    counts = {
        "tests": str(len(report.cases) + len(report.skipped)),
        "failures": str(len(failures)),
        "errors": "0",
        "skipped": str(len(report.skipped)),
        "time": f"{total_seconds:.6f}",
    }

    root = ET.Element("testsuites", {"name": "musebench", **counts})
    suite_attributes = {"name": "musebench", **counts}
    if report.created:
        suite_attributes["timestamp"] = _xml_text(report.created)
    hostname = report.machine.get("hostname") if isinstance(report.machine, dict) else None
    if hostname:
        suite_attributes["hostname"] = _xml_text(hostname)
    suite = ET.SubElement(root, "testsuite", suite_attributes)

    backends = sorted({case.backend for case in report.cases})
    properties = ET.SubElement(suite, "properties")
    for name, value in (
        ("git_commit", report.git_commit),
        ("backend", ",".join(backends)),
        ("backend_note", report.backend_note),
        ("command", report.command),
        ("schema_version", report.schema_version),
    ):
        ET.SubElement(properties, "property", {"name": name, "value": _xml_text(value)})

    for case in report.cases:
        testcase = ET.SubElement(
            suite,
            "testcase",
            {"name": _xml_text(case_name(case)), "classname": _xml_text(case.kernel), "time": f"{_case_seconds(case):.6f}"},
        )
        if not case.passed:
            line = _xml_text(diagnostic(case))
            failure = ET.SubElement(
                testcase, "failure", {"message": line, "type": "error" if case.error is not None else "mismatch"}
            )
            failure.text = line
    for run in report.skipped:
        testcase = ET.SubElement(
            suite, "testcase", {"name": _xml_text(skipped_name(run)), "classname": _xml_text(run.kernel), "time": "0.000000"}
        )
        ET.SubElement(testcase, "skipped", {"message": _xml_text(skipped_line(run))})

    tree = ET.ElementTree(root)
    ET.indent(tree)
    destination = Path(path)
    destination.parent.mkdir(parents=True, exist_ok=True)
    tree.write(destination, encoding="utf-8", xml_declaration=True)


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


@dataclass
class Regression:
    """One way the new run is worse than the old one for the case identified by `key`.

    kind "correctness": old = "passed", new = "failed"; message is the new diagnostic line.
    kind "timing": old and new are the median tail times in µs.
    kind "missing": old = "present", new = None; the case is absent from the new run.
    """

    key: tuple
    kind: str  # "correctness" | "timing" | "missing"
    old: Any
    new: Any
    message: str


def _cases_by_key(report: RunReport) -> dict[tuple, list[CaseResult]]:
    grouped: dict[tuple, list[CaseResult]] = {}
    for case in report.cases:
        grouped.setdefault(tuple(case.key), []).append(case)
    return grouped


def _matched(old: RunReport, new: RunReport):
    """(key, old case, new case or None) for every case of `old`, in its order; cases sharing a
    key are paired in their order of appearance."""
    new_by_key = _cases_by_key(new)
    seen: dict[tuple, int] = {}
    for old_case in old.cases:
        key = tuple(old_case.key)
        position = seen.get(key, 0)
        seen[key] = position + 1
        candidates = new_by_key.get(key, [])
        yield key, old_case, candidates[position] if position < len(candidates) else None


def compare(old: RunReport, new: RunReport, threshold: float = 0.05) -> list[Regression]:
    """The regressions from `old` to `new`, in `old`'s case order.

    Cases are matched by `CaseResult.key`; cases sharing a key (e.g. several seeds) are paired in
    their order of appearance, and an unpaired old one counts as missing. A timing regression is
    new.tail_us > old.tail_us × (1 + threshold) with both bench rows (`timed`), both timed and
    old.tail_us > 0; it is reported whether or not the case still passes. Check rows are compared
    for correctness only. Raises ValueError for a negative threshold.
    """
    if threshold < 0 or math.isnan(threshold):
        raise ValueError(f"threshold must be a non-negative fraction, got {threshold!r}")
    regressions: list[Regression] = []
    for key, old_case, new_case in _matched(old, new):
        if new_case is None:
            regressions.append(
                Regression(key, "missing", "present", None, f"{key_name(key)}: in the old run, absent from the new one")
            )
            continue

        if old_case.passed and not new_case.passed:
            regressions.append(Regression(key, "correctness", "passed", "failed", diagnostic(new_case)))

        before, after = _kernel_us(old_case), _kernel_us(new_case)
        if _comparable(before, after):
            change = (after - before) / before
            if change > threshold:
                regressions.append(
                    Regression(
                        key,
                        "timing",
                        before,
                        after,
                        f"{key_name(key)}: tail {before:.2f} µs → {after:.2f} µs "
                        f"(+{change:.1%}, threshold {threshold:.1%})",
                    )
                )
    return regressions


@dataclass(frozen=True)
class Pairing:
    """One case of two runs side by side: µs of the call (`tail`) and of each kernel timed apart
    in both (`kernels_us`, by name), as (old, new)."""

    key: tuple
    tail: tuple[float | None, float | None]
    kernels: dict[str, tuple[float, float]]


def side_by_side(old: RunReport, new: RunReport) -> list[Pairing]:
    """The cases both runs hold, matched as `compare` matches them, in `old`'s order: for an A/B of
    two builds on one machine, where every ratio matters, not only the regressions. A check row's
    µs are None (a 1.2 file's host wall-clock is not shown)."""
    pairs: list[Pairing] = []
    for key, old_case, new_case in _matched(old, new):
        if new_case is None:
            continue
        both = timed(old_case) and timed(new_case)
        kernels = {name: (old_case.kernels_us[name], new_case.kernels_us[name])
                   for name in old_case.kernels_us if both and name in new_case.kernels_us}
        pairs.append(Pairing(key, (_kernel_us(old_case), _kernel_us(new_case)), kernels))
    return pairs


def _kernel_us(case: CaseResult) -> float | None:
    """The row's tail µs where they are kernel timings (a bench row), else None."""
    return case.tail_us if timed(case) else None


def _comparable(before: float | None, after: float | None) -> bool:
    """Two timings of one case can be compared: both measured, the old one positive, the new one finite."""
    return before is not None and after is not None and before > 0 and math.isfinite(after)


def _ratio_text(old: float | None, new: float | None) -> str:
    return f"{new / old:.2f}" if _comparable(old, new) else _MISSING


def render_side_by_side(pairs: list[Pairing], console: Console) -> None:
    """Old and new µs and new / old, per case and per kernel timed apart."""
    table = Table(title=Text("side by side (new / old)"), header_style="bold")
    for column in ("case", "old µs", "new µs", "new / old", "kernels: old → new µs (new / old)"):
        table.add_column(column, justify="left" if column.startswith(("case", "kernels")) else "right")
    for pair in pairs:
        old, new = pair.tail
        kernels = "; ".join(f"{name} {_format_us(a)} → {_format_us(b)} ({_ratio_text(a, b)})" for name, (a, b) in pair.kernels.items())
        table.add_row(Text(key_name(pair.key)), _format_us(old), _format_us(new), _ratio_text(old, new), Text(kernels))
    console.print(table)


def render_comparison(regressions: list[Regression], console: Console) -> None:
    """Print the regressions as a table and a count by kind, or one line saying there are none."""
    if not regressions:
        console.print(Text("no regressions", style="green"))
        return
    table = Table(title=Text("regressions"), header_style="bold")
    table.add_column("case")
    table.add_column("kind")
    table.add_column("old", justify="right")
    table.add_column("new", justify="right")
    table.add_column("detail")

    def shown(value: Any) -> str:
        if value is None:
            return _MISSING
        if isinstance(value, float):
            return f"{value:.2f} µs"
        return str(value)

    for regression in regressions:
        detail = regression.message
        prefix = f"{key_name(regression.key)}: "
        if detail.startswith(prefix):
            detail = detail[len(prefix) :]
        table.add_row(
            Text(key_name(regression.key)),
            Text(regression.kind, style="bold red" if regression.kind == "correctness" else "yellow"),
            Text(shown(regression.old)),
            Text(shown(regression.new)),
            Text(detail),
        )
    console.print(table)

    counts = {kind: sum(r.kind == kind for r in regressions) for kind in ("correctness", "timing", "missing")}
    breakdown = ", ".join(f"{count} {kind}" for kind, count in counts.items() if count)
    noun = "regression" if len(regressions) == 1 else "regressions"
    console.print(Text(f"{len(regressions)} {noun} ({breakdown})", style="red"))

