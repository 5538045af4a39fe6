"""Compact record summaries (musebench.harness.summary) and scripts/compact-records.py. CPU only."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import pytest

from musebench.harness import summary
from musebench.harness.report import write_junit
from musebench.harness.results import CaseResult, Mismatch, RankResult, RunReport, SkippedRun

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "compact-records.py"


def _case(**overrides) -> CaseResult:
    fields = dict(kernel="ep_tail", mode="ep", tp=2, tokens=1, weight_dtype="bf16", norm="before", inputs="random",
                  seed=0, backend="cute", launcher="virtual", transport="local", stock="reference",
                  stock_path="ep-ll one-shot", tail_us=4.92240004, stock_us=12.6968, iters=600, bytes_moved=16384,
                  measurement="bench",
                  ranks=[RankResult(rank=0, digest="ab" * 32, tail_us=4.8), RankResult(rank=1, digest="cd" * 32)])
    return CaseResult(**{**fields, **overrides})


def _report() -> RunReport:
    mismatch = Mismatch(rank=1, index=(0, 17), got_bits=0x3F81, want_bits=0x3F80, got=1.0078125, want=1.0)
    return RunReport(
        command="musebench bench tail --tp 2 --json out.json",
        backend_note="cute (CuTe DSL kernels on NVIDIA H200)",
        created="2026-11-29T18:40:00+00:00",
        machine={"hostname": "vm", "gpus": [{"name": "NVIDIA H200"}, {"name": "NVIDIA H200"}], "empty_launch_us": 1.08239},
        versions={"torch": "2.14.0", "cutlass-dsl": "4.8.0"},
        git_commit="d8a9b61",
        cases=[
            _case(baselines_us={"finalize": 3.11120003, "finalize+nccl": 12.6968}, kernels_us={"publisher": 3.94}),
            _case(tokens=8, mismatches=3, max_ulp=1, first_mismatch=mismatch, rank_identical=False,
                  notes=["processes share GPUs", "no MPS"]),
            _case(tokens=2, error="rank 1: InjectedFault: injected fault\nsecond line " + "x" * 500, tail_us=None,
                  ranks=[RankResult(rank=0, error="rank 0: timed out waiting for rank 1"),
                         RankResult(rank=1, error="rank 1: InjectedFault")]),
        ],
        skipped=[SkippedRun(name="routing (tp=8)", kernel="routing", cases=64, reason="needs a CUDA GPU")],
    )


def test_a_run_summary_keeps_provenance_verdicts_and_timings():
    data = summary.summarize(_report().to_dict())
    assert summary.check_summary(data) == []
    assert (data["date"], data["gpu"], data["commit"]) == ("2026-11-29T18:40:00+00:00", "2x NVIDIA H200", "d8a9b61")
    assert data["command"].startswith("musebench bench tail") and data["versions"]["cutlass-dsl"] == "4.8.0"
    assert data["passed"] is False
    assert data["totals"] == {"cases": 3, "passed": 1, "failed": 2, "skipped_cases": 64}
    assert data["skipped"] == [{"name": "routing (tp=8)", "kernel": "routing", "cases": 64, "reason": "needs a CUDA GPU"}]
    assert data["empty_launch_us"] == 1.082
    # fields equal in every case are given once
    assert data["common"]["kernel"] == "ep_tail" and "kernel" not in data["columns"]
    ok, wrong, crashed = summary.case_rows(data)
    assert set(ok) == set(summary.CASE_FIELDS)
    assert (ok["passed"], ok["tail_us"], ok["stock_us"]) == (True, 4.922, 12.7)
    assert ok["baselines_us"] == {"finalize": 3.111, "finalize+nccl": 12.7} and ok["kernels_us"] == {"publisher": 3.94}
    assert ok["rank_errors"] is None and ok["first_mismatch"] is None
    assert (wrong["passed"], wrong["mismatches"], wrong["max_ulp"], wrong["rank_identical"]) == (False, 3, 1, False)
    assert wrong["first_mismatch"] == "rank 1 index (0, 17): got 0x3f81 (1.0078125) want 0x3f80 (1.0)"
    assert wrong["notes"] == "processes share GPUs; no MPS"
    assert crashed["error"].startswith("rank 1: InjectedFault: injected fault second line xxx")
    assert len(crashed["error"]) == summary.LINE_CHARS and crashed["error"].endswith("…")
    assert crashed["rank_errors"] == ["rank 0: timed out waiting for rank 1", "rank 1: InjectedFault"]
    assert crashed["tail_us"] is None


def test_a_summary_drops_the_per_rank_detail():
    text = summary.dumps(summary.summarize(_report().to_dict()))
    assert "ab" * 32 not in text and "digest" not in text
    assert json.loads(text) == summary.summarize(_report().to_dict())
    rows = text.split('"cases": [\n', 1)[1].splitlines()
    assert len([row for row in rows if row.startswith("  [")]) == 3  # one line per case


def test_a_single_case_factors_nothing_out():
    report = _report()
    report.cases = report.cases[:1]
    data = summary.summarize(report.to_dict())
    assert data["common"] == {} and data["columns"] == list(summary.CASE_FIELDS)
    assert summary.check_summary(data) == []


def test_what_is_no_run_report_is_refused():
    with pytest.raises(ValueError, match="not a musebench run report"):
        summary.summarize({"torch": "2.14.0", "gpus": []})
    with pytest.raises(ValueError, match="schema"):
        summary.summarize({**_report().to_dict(), "schema_version": "2.0"})


@pytest.mark.parametrize("value, rounded", [(4.92240004, 4.922), (12.6968, 12.7), (687.0155, 687.0), (0.98243, 0.982),
                                            (321961.396, 321961), (1309.4, 1309), (None, None), (float("nan"), None)])
def test_times_keep_four_significant_digits(value, rounded):
    assert summary.round_us(value) == rounded


def test_check_summary_names_what_is_missing():
    data = summary.summarize(_report().to_dict())
    del data["commit"]
    data["cases"][0] = data["cases"][0][:-1]
    problems = summary.check_summary(data)
    assert "missing 'commit'" in problems
    assert any(problem.startswith("case 0 has") for problem in problems)
    assert summary.check_summary({"format": "other"}) == ["unknown format 'other'"]


PYTEST_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest"
 errors="1" failures="1" skipped="2" tests="5" time="116.223" timestamp="2026-11-29T17:33:45+00:00" hostname="vm">
<testcase classname="tests.a" name="test_ok" time="1.0" />
<testcase classname="tests.a" name="test_bad[2]" time="1.0"><failure message="AssertionError: assert (0 == 1)&#10; + more">x</failure></testcase>
<testcase classname="tests.b" name="test_crash" time="1.0"><error message="fixture failed">tb</error></testcase>
<testcase classname="tests.b" name="test_vllm1" time="0"><skipped type="pytest.skip" message="No module named 'vllm'">s</skipped></testcase>
<testcase classname="tests.b" name="test_vllm2" time="0"><skipped type="pytest.skip" message="No module named 'vllm'">s</skipped></testcase>
</testsuite></testsuites>"""


def test_a_junit_summary_counts_and_names_the_failures():
    data = summary.summarize_junit(PYTEST_XML)
    assert summary.check_summary(data) == []
    assert {key: data[key] for key in ("tests", "passed", "failed", "errors", "skipped")} == {
        "tests": 5, "passed": 1, "failed": 1, "errors": 1, "skipped": 2}
    assert (data["date"], data["host"], data["time_s"]) == ("2026-11-29T17:33:45+00:00", "vm", 116.2)
    assert data["failures"] == [{"name": "tests.a::test_bad[2]", "message": "AssertionError: assert (0 == 1) + more"}]
    assert data["errored"] == [{"name": "tests.b::test_crash", "message": "fixture failed"}]
    assert data["skip_reasons"] == {"No module named 'vllm'": 2}


def test_musebench_junit_summarizes_with_its_properties(tmp_path):
    path = tmp_path / "run.xml"
    write_junit(_report(), path)
    data = summary.summarize_junit(path.read_bytes())
    assert (data["tests"], data["passed"], data["failed"], data["skipped"]) == (4, 1, 2, 1)
    assert data["properties"]["git_commit"] == "d8a9b61"


def test_what_is_no_junit_is_refused():
    with pytest.raises(ValueError, match="not XML"):
        summary.summarize_junit("{}")
    with pytest.raises(ValueError, match="not JUnit"):
        summary.summarize_junit("<html/>")


def test_a_long_log_keeps_its_tail_under_a_note():
    data = b"".join(b"line %d\n" % i for i in range(20000))
    cut = summary.tail_text(data, 1000, source="sha256 0123")
    assert len(cut) <= 1000 and cut.endswith(b"line 19999\n")
    note, first, *_ = cut.split(b"\n")
    assert note.startswith(b"[compact-records: the first ") and b"sha256 0123" in note
    assert data.endswith(cut[len(note) + 1:]) and first.startswith(b"line ")  # whole lines only
    assert summary.tail_text(b"short\n", 1000) == b"short\n"


def test_the_script_summarizes_keeps_and_replaces(tmp_path):
    run = tmp_path / "2026-11-29-h200-tail.json"
    run.write_text(json.dumps(_report().to_dict()))
    env = tmp_path / "2026-11-29-h200-env.json"
    env.write_text(json.dumps({"torch": "2.14.0"}))
    digest = hashlib.sha256(run.read_bytes()).hexdigest()
    result = subprocess.run([sys.executable, str(SCRIPT), "--replace", str(run), str(env)],
                            capture_output=True, text=True, check=True)
    written = tmp_path / "2026-11-29-h200-tail.summary.json"
    assert not run.exists() and env.exists()
    data = json.loads(written.read_text())
    assert data["source"] == {"file": run.name, "bytes": len(json.dumps(_report().to_dict())), "sha256": digest}
    assert summary.check_summary(data) == []
    lines = [line.split("\t") for line in result.stdout.splitlines()]
    assert [(line[0], line[2], line[3]) for line in lines][0] == (str(run), digest, str(written))
    assert lines[1][5] == "kept"


def test_the_script_refuses_large_json_it_cannot_summarize(tmp_path):
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"x": "y" * 2000}))
    result = subprocess.run([sys.executable, str(SCRIPT), "--limit", "1000", str(big)], capture_output=True, text=True)
    assert result.returncode == 1 and "no run report" in result.stderr and big.exists()


def test_a_check_row_keeps_no_timings():
    """Files before schema 1.3 hold a host clock around a Python call in check rows: a summary of
    them keeps no µs, however the row reads (`results.infer_measurement` tells check from bench)."""
    check = _case(measurement="check", baselines_us={"finalize": 3.0}, kernels_us={"publisher": 2.0})
    report = RunReport(command="musebench tail --tp 2", backend_note="", created="", machine={}, versions={},
                       git_commit="", cases=[check])
    row = summary.case_rows(summary.summarize(report.to_dict()))[0]
    assert row["measurement"] == "check"
    assert (row["tail_us"], row["stock_us"], row["baselines_us"], row["kernels_us"]) == (None, None, None, None)
