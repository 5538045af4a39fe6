"""Compact summaries of run records, the form records/ keeps in git.

A full run JSON (`RunReport.to_dict()`) carries every rank's digest, timings and first mismatch;
a parity run is over 1 MB. What a reader of records/ needs is smaller: which run (date, GPU,
commit, command, versions), and per case its key, whether it passed, how many elements were
wrong, how far (max ULP), why it failed in one line, and its timings. The full files live in CI
artifacts and in the device call's `$OUT`; records/README.md gives each one's sha256.

Run summary (`summarize`), format "musebench-run-summary" 1.0:

- provenance: `date` (the report's `created`), `gpu` ("4x NVIDIA H200", or "none"), `commit`,
  `command`, `backend_note`, `versions`, `source_schema` (the full report's schema version), and
  `empty_launch_us` where the run measured it;
- `passed` (the run's verdict, as `RunReport.passed`), `totals` (cases, passed, failed,
  skipped_cases) and `skipped` (the runs not executed here, with their reasons);
- the cases as a table: `columns` names the fields of each row of `cases`; a field that has the
  same value in every case (two or more cases) is given once in `common` and left out of the rows.
  `case_rows(summary)` turns the table back into one dict per case.

Per case: the key (kernel, mode, tp, tokens, weight_dtype, norm, inputs, seed, backend, launcher,
transport, stock, stock_path); the verdict (passed, mismatches, max_ulp, rank_identical,
deterministic); `first_mismatch` and `error` as one line each (at most `LINE_CHARS`);
`rank_errors`, the ranks' own error lines (failed cases only); the timings (tail_us, stock_us,
baselines_us, kernels_us) rounded by `round_us`; iters, bytes_moved and notes. Per-rank digests,
timings and mismatches are left out.

Logs and other text (`tail_text`): kept whole up to `RECORD_LIMIT_BYTES`, else cut to their last
lines (where a run's verdict is) under a first line saying how much was left out.

JUnit summary (`summarize_junit`), format "musebench-junit-summary" 1.0: date, host, counts
(tests, passed, failed, errors, skipped), time_s, the suite properties, the failed and errored
tests by name with their one-line message, and skip reasons with how often each occurred.

`dumps` writes a summary as JSON text, one case row per line so diffs stay readable;
`check_summary` says what a summary lacks. scripts/compact-records.py writes the files and adds
`source` to each (the full file's name, bytes and sha256). This module imports neither torch nor cutlass.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Any

from musebench.harness.results import CaseResult, Mismatch, RunReport

RUN_FORMAT = "musebench-run-summary"
JUNIT_FORMAT = "musebench-junit-summary"
FORMAT_VERSION = "1.0"
LINE_CHARS = 240  # one error / mismatch / message line, after which it is cut with "…"
MAX_LISTED = 100  # failed tests, errored tests, skip reasons and rank errors listed at most
RECORD_LIMIT_BYTES = 100_000  # one file in records/
RECORDS_LIMIT_BYTES = 1_000_000  # all of records/ together

KEY_FIELDS = ("kernel", "mode", "tp", "tokens", "weight_dtype", "norm", "inputs", "seed", "backend", "launcher",
              "transport", "stock", "stock_path", "measurement")
VERDICT_FIELDS = ("passed", "mismatches", "max_ulp", "rank_identical", "deterministic", "first_mismatch", "error",
                  "rank_errors")
TIMING_FIELDS = ("tail_us", "stock_us", "baselines_us", "kernels_us", "iters", "bytes_moved", "notes")
CASE_FIELDS = KEY_FIELDS + VERDICT_FIELDS + TIMING_FIELDS

RUN_KEYS = ("format", "format_version", "source_schema", "date", "gpu", "commit", "command", "backend_note",
            "versions", "passed", "totals", "skipped", "common", "columns", "cases")
JUNIT_KEYS = ("format", "format_version", "date", "host", "tests", "passed", "failed", "errors", "skipped", "time_s",
              "properties", "failures", "errored", "skip_reasons")


def one_line(text: Any, limit: int = LINE_CHARS) -> str | None:
    """`text` as a single line of at most `limit` characters (None stays None)."""
    if text is None:
        return None
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def round_us(value: float | None) -> float | int | None:
    """A time in µs kept to about four significant digits, never finer than 1 ns.

    4.92240 -> 4.922, 12.6968 -> 12.7, 687.0155 -> 687.0, 321961.396 -> 321961 (an int from 1 ms
    up: host wall-clock times need no fraction). None and non-finite values give None.
    """
    if value is None or not math.isfinite(value):
        return None
    digits = len(str(int(abs(value))))  # digits before the point
    if digits >= 4:
        return int(round(value))
    return round(value, 4 - digits)


def _mismatch_line(mismatch: Mismatch | None) -> str | None:
    if mismatch is None:
        return None
    width = 4 if max(mismatch.got_bits, mismatch.want_bits) < (1 << 16) else 8
    index = ", ".join(str(i) for i in mismatch.index)
    return one_line(f"rank {mismatch.rank} index ({index}): got 0x{mismatch.got_bits:0{width}x} ({mismatch.got!r}) "
                    f"want 0x{mismatch.want_bits:0{width}x} ({mismatch.want!r})")


def _case_fields(case: CaseResult) -> dict[str, Any]:
    """One case's summary fields. A check row keeps no timings: what older files hold there is a
    host clock around a Python call, not a kernel time (results.infer_measurement tells them)."""
    rank_errors = [one_line(rank.error) for rank in case.ranks if rank.error] if not case.passed else []
    timed = case.measurement == "bench"
    return {
        **{name: getattr(case, name) for name in KEY_FIELDS},
        "passed": case.passed,
        "mismatches": case.mismatches,
        "max_ulp": case.max_ulp,
        "rank_identical": case.rank_identical,
        "deterministic": case.deterministic,
        "first_mismatch": _mismatch_line(case.first_mismatch),
        "error": one_line(case.error),
        "rank_errors": rank_errors[:MAX_LISTED] or None,
        "tail_us": round_us(case.tail_us) if timed else None,
        "stock_us": round_us(case.stock_us) if timed else None,
        "baselines_us": ({name: round_us(us) for name, us in case.baselines_us.items()} or None) if timed else None,
        "kernels_us": ({name: round_us(us) for name, us in case.kernels_us.items()} or None) if timed else None,
        "iters": case.iters,
        "bytes_moved": case.bytes_moved,
        "notes": one_line("; ".join(case.notes)) if case.notes else None,
    }


def _gpu_line(machine: dict[str, Any]) -> str:
    gpus = machine.get("gpus") or []
    names = Counter(str(gpu.get("name", "?")) if isinstance(gpu, dict) else str(gpu) for gpu in gpus)
    if not names:
        return "none"
    return ", ".join(name if count == 1 else f"{count}x {name}" for name, count in names.items())


def summarize(report_dict: dict[str, Any]) -> dict[str, Any]:
    """The compact summary of a full run record (`RunReport.to_dict()`, any 1.x schema).

    Raises ValueError for a dict that is not a run report of a supported schema. The result is
    plain JSON data; its layout is the module docstring's. Deterministic: the same report gives
    the same summary.
    """
    if not isinstance(report_dict, dict) or "command" not in report_dict or "cases" not in report_dict:
        raise ValueError("not a musebench run report (no 'command' and 'cases')")
    report = RunReport.from_dict(report_dict)
    rows = [_case_fields(case) for case in report.cases]
    common: dict[str, Any] = {}
    if len(rows) >= 2:
        common = {name: rows[0][name] for name in CASE_FIELDS if all(row[name] == rows[0][name] for row in rows)}
    columns = [name for name in CASE_FIELDS if name not in common]
    failed = sum(not row["passed"] for row in rows)
    summary: dict[str, Any] = {
        "format": RUN_FORMAT,
        "format_version": FORMAT_VERSION,
        "source_schema": report.schema_version,
        "date": report.created,
        "gpu": _gpu_line(report.machine if isinstance(report.machine, dict) else {}),
        "commit": report.git_commit,
        "command": report.command,
        "backend_note": one_line(report.backend_note, 400),
        "versions": dict(report.versions),
        "passed": report.passed,
        "totals": {
            "cases": len(rows),
            "passed": len(rows) - failed,
            "failed": failed,
            "skipped_cases": sum(run.cases for run in report.skipped),
        },
        "skipped": [{"name": run.name, "kernel": run.kernel, "cases": run.cases, "reason": one_line(run.reason)}
                    for run in report.skipped],
        "common": common,
        "columns": columns,
        "cases": [[row[name] for name in columns] for row in rows],
    }
    empty_launch = report.machine.get("empty_launch_us") if isinstance(report.machine, dict) else None
    if empty_launch is not None:
        summary["empty_launch_us"] = round_us(empty_launch)
    return summary


def case_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per case (every field of CASE_FIELDS) from a run summary's table."""
    return [{**summary["common"], **dict(zip(summary["columns"], row, strict=True))} for row in summary["cases"]]


def _test_name(case: ET.Element) -> str:
    classname = case.get("classname", "")
    name = case.get("name", "")
    return f"{classname}::{name}" if classname else name


def summarize_junit(xml_text: str | bytes) -> dict[str, Any]:
    """The compact summary of a JUnit XML file (pytest's, or `musebench --junit`).

    Counts come from the <testcase> elements themselves: a case holding <failure> failed, one
    holding <error> errored, one holding <skipped> was skipped, any other passed. Raises
    ValueError for text that is not JUnit XML.
    """
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as error:
        raise ValueError(f"not XML: {error}") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite") if root.tag == "testsuites" else None
    if suites is None:
        raise ValueError(f"not JUnit XML (root <{root.tag}>)")
    failures: list[dict[str, Any]] = []
    errored: list[dict[str, Any]] = []
    skip_reasons: Counter[str] = Counter()
    tests = passed = 0
    properties: dict[str, Any] = {}
    for suite in suites:
        for prop in suite.iter("property"):
            properties[prop.get("name", "")] = one_line(prop.get("value", ""), 400)
        for case in suite.iter("testcase"):
            tests += 1
            failure, error, skipped = case.find("failure"), case.find("error"), case.find("skipped")
            if failure is not None:
                failures.append({"name": _test_name(case), "message": one_line(failure.get("message") or failure.text)})
            elif error is not None:
                errored.append({"name": _test_name(case), "message": one_line(error.get("message") or error.text)})
            elif skipped is not None:
                skip_reasons[one_line(skipped.get("message") or skipped.text or "") or ""] += 1
            else:
                passed += 1
    first = suites[0] if suites else root
    return {
        "format": JUNIT_FORMAT,
        "format_version": FORMAT_VERSION,
        "date": first.get("timestamp", ""),
        "host": first.get("hostname", ""),
        "tests": tests,
        "passed": passed,
        "failed": len(failures),
        "errors": len(errored),
        "skipped": sum(skip_reasons.values()),
        "time_s": round(sum(float(suite.get("time", 0) or 0) for suite in suites), 1),
        "properties": properties,
        "failures": failures[:MAX_LISTED],
        "errored": errored[:MAX_LISTED],
        "skip_reasons": dict(skip_reasons.most_common(MAX_LISTED)),
    }


def tail_text(data: bytes, limit: int = RECORD_LIMIT_BYTES, *, source: str = "") -> bytes:
    """`data` itself when it fits in `limit` bytes, else a note line and the whole lines of its tail.

    The note names how many bytes were left out and `source` (e.g. the full file's sha256); the
    result, note included, is at most `limit` bytes.
    """
    if len(data) <= limit:
        return data
    where = f" {source};" if source else ""

    def note(left_out: int) -> bytes:
        return (f"[compact-records: the first {left_out} of {len(data)} bytes are left out;{where} the full file is "
                f"in the run's CI artifacts or the device call's $OUT]\n").encode()

    room = limit - len(note(len(data)))  # the note's widest form: every byte left out
    if room <= 0:
        raise ValueError(f"a limit of {limit} bytes leaves no room for the note")
    tail = data[len(data) - room:]
    if b"\n" in tail[:-1]:
        tail = tail[tail.index(b"\n") + 1:]  # whole lines only
    return note(len(data) - len(tail)) + tail


def dumps(summary: dict[str, Any]) -> str:
    """A summary as JSON text (UTF-8, newline-terminated), each case row of a run summary on its own line."""
    if summary.get("format") != RUN_FORMAT:
        return json.dumps(summary, indent=1, ensure_ascii=False) + "\n"
    head = json.dumps({key: value for key, value in summary.items() if key != "cases"}, indent=1, ensure_ascii=False)
    rows = ",\n".join("  " + json.dumps(row, ensure_ascii=False, separators=(",", ":")) for row in summary["cases"])
    return head[:-2] + ',\n "cases": [\n' + rows + "\n ]\n}\n"


def check_summary(summary: Any) -> list[str]:
    """What is wrong with a summary read back from JSON: missing keys, rows of the wrong width (empty if none)."""
    if not isinstance(summary, dict):
        return ["not a JSON object"]
    kind = summary.get("format")
    if kind == RUN_FORMAT:
        problems = [f"missing {key!r}" for key in RUN_KEYS if key not in summary]
        if not all(key in summary for key in ("common", "columns", "cases", "totals")):
            return problems
        if sorted(list(summary["common"]) + list(summary["columns"])) != sorted(CASE_FIELDS):
            problems.append("common and columns do not cover the case fields exactly")
        width = len(summary["columns"])
        problems += [f"case {i} has {len(row)} fields, not {width}" for i, row in enumerate(summary["cases"])
                     if len(row) != width]
        if summary["totals"].get("cases") != len(summary["cases"]):
            problems.append("totals.cases is not the number of rows")
        return problems
    if kind == JUNIT_FORMAT:
        return [f"missing {key!r}" for key in JUNIT_KEYS if key not in summary]
    return [f"unknown format {kind!r}"]
