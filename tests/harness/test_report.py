"""The report layer: JSON round trip, malformed files, JUnit counts, comparison, and the table."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from musebench.harness.report import (
    TIMING_POINTER,
    Regression,
    case_name,
    compare,
    diagnostic,
    git_commit,
    now_utc,
    read_json,
    render_comparison,
    render_table,
    side_by_side,
    skipped_line,
    version_info,
    write_json,
    write_junit,
)
from musebench.harness.results import SCHEMA_VERSION, CaseResult, Mismatch, RankResult, RunReport, SkippedRun


def make_case(**overrides) -> CaseResult:
    """A bench row (µs are graph medians); `check_case` makes a check row."""
    fields = dict(
        kernel="ep_tail",
        mode="ep",
        tp=4,
        tokens=8,
        weight_dtype="bf16",
        norm="before",
        inputs="random",
        seed=0,
        backend="cpu",
        launcher="virtual",
        transport="cpu-local",
        stock="reference",
        stock_path="musebench.stock.reference.finalize_allreduce_rmsnorm",
        tail_us=10.0,
        stock_us=12.5,
        iters=100,
        ranks=[RankResult(rank=r, digest=f"{r:064x}", tail_us=10.0, stock_us=12.5) for r in range(4)],
        measurement="bench",
    )
    fields.update(overrides)
    return CaseResult(**fields)


def check_case(**overrides) -> CaseResult:
    """A check row: bits checked, nothing timed."""
    fields = dict(tail_us=None, stock_us=None, measurement="check",
                  ranks=[RankResult(rank=r, digest=f"{r:064x}") for r in range(4)])
    fields.update(overrides)
    return make_case(**fields)


def wrong_case(**overrides) -> CaseResult:
    mismatch = Mismatch(rank=2, index=(3, 17), got_bits=0x3F81, want_bits=0x3F80, got=1.0078125, want=1.0)
    fields = dict(tokens=1, mismatches=5, max_ulp=1, first_mismatch=mismatch)
    fields.update(overrides)
    case = make_case(**fields)
    case.ranks[2] = replace(case.ranks[2], mismatches=5, max_ulp=1, first_mismatch=mismatch)
    return case


def make_report(cases: list[CaseResult]) -> RunReport:
    return RunReport(
        command="run --kernel ep_tail",
        backend_note="CPU model (no GPU present)",
        created="2026-11-20T12:00:00+00:00",
        machine={"hostname": "testhost", "gpus": [], "cpu_count": 8},
        versions={"musebench": "0.1.0", "torch": "2.13.0+cpu", "cuda": None},
        git_commit="0123abcd-dirty",
        cases=cases,
    )


SKIPPED_ROUTING = SkippedRun(name="routing (tp=8)", kernel="routing", cases=128,
                             reason="needs a CUDA GPU with SM >= 90 and CuTe DSL (no such GPU here)")


def mixed_report() -> RunReport:
    return make_report(
        [
            make_case(),
            wrong_case(),
            make_case(tokens=2, error="rank 1: timeout after 30 s", tail_us=None, stock_us=None),
            make_case(tokens=4, deterministic=False),
        ]
    )


# ------------------------------------------------------------------------------------ JSON


def test_json_round_trip_equals(tmp_path):
    report = mixed_report()
    path = tmp_path / "nested" / "report.json"
    write_json(report, path)
    assert read_json(path) == report
    assert json.loads(path.read_text(encoding="utf-8"))["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2, 3]",
        '{"command": "run"}',  # no schema_version
        json.dumps({"schema_version": "99.0", "command": "run"}),  # unsupported major
        json.dumps({"schema_version": SCHEMA_VERSION}),  # no command
        json.dumps({"schema_version": SCHEMA_VERSION, "command": "run", "cases": [{"kernel": "ep_tail"}]}),
        json.dumps({"schema_version": SCHEMA_VERSION, "command": "run", "cases": [1]}),
    ],
)
def test_malformed_json_raises_value_error(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match="bad.json"):
        read_json(path)


def test_skipped_runs_round_trip_and_a_1_0_file_reads_with_none(tmp_path):
    report = replace(mixed_report(), skipped=[SKIPPED_ROUTING])
    path = tmp_path / "report.json"
    write_json(report, path)
    assert read_json(path) == report
    assert json.loads(path.read_text())["skipped"][0]["reason"].startswith("needs a CUDA GPU")
    old = json.loads(path.read_text())
    del old["skipped"]
    old["schema_version"] = "1.0"
    path.write_text(json.dumps(old))
    assert read_json(path).skipped == []


def test_kernel_medians_round_trip_and_rows_of_other_minors_read(tmp_path):
    case = replace(make_case(), kernels_us={"publisher": 2.5, "reduce (call - publisher)": 3.25})
    report = make_report([case])
    path = tmp_path / "report.json"
    write_json(report, path)
    assert read_json(path) == report
    data = json.loads(path.read_text())
    del data["cases"][0]["kernels_us"]  # a 1.1 row
    data["schema_version"] = "1.1"
    path.write_text(json.dumps(data))
    assert read_json(path).cases[0].kernels_us == {}
    data["cases"][0]["a_later_field"] = 1  # a row of a later 1.x
    data["schema_version"] = "1.9"
    path.write_text(json.dumps(data))
    assert read_json(path).cases[0].tail_us == case.tail_us


def _a_1_2_check_file(tmp_path, tail_us: float, command: str = "musebench tail --tp 4") -> Path:
    """A check run as schema 1.2 wrote it: host wall-clock µs in its rows, no `measurement`."""
    data = make_report([check_case(tail_us=tail_us, stock_us=4 * tail_us,
                                   ranks=[RankResult(rank=r, digest=f"{r:064x}", tail_us=tail_us) for r in range(4)])]
                       ).to_dict()
    data["schema_version"], data["command"] = "1.2", command
    for row in data["cases"]:
        del row["measurement"]
    path = tmp_path / f"old-{tail_us}.json"
    path.write_text(json.dumps(data))
    return path


def test_a_1_2_file_reads_with_its_rows_measurement_inferred(tmp_path):
    assert read_json(_a_1_2_check_file(tmp_path, 48015.0)).cases[0].measurement == "check"
    bench = _a_1_2_check_file(tmp_path, 5.0, command="musebench bench routing --tokens 1")  # no kernels_us
    assert read_json(bench).cases[0].measurement == "bench"
    data = json.loads(_a_1_2_check_file(tmp_path, 6.0).read_text())
    data["cases"][0]["kernels_us"] = {"publisher": 2.0}  # a tail bench row
    assert RunReport.from_dict(data).cases[0].measurement == "bench"
    data["cases"][0]["measurement"] = "guess"
    with pytest.raises(ValueError, match="unknown measurement"):
        RunReport.from_dict(data)


def test_check_rows_have_no_us_columns_and_point_to_the_bench(tmp_path):
    """The 48,015 µs vs 176,685 µs "0.27×" of a CPU check, host wall-clock, is no longer shown."""
    console = Console(record=True, width=200)
    render_table(read_json(_a_1_2_check_file(tmp_path, 48015.0)), console)
    text = console.export_text()
    assert "µs" not in text and "ratio" not in text and "48015" not in text and "×" not in text
    assert TIMING_POINTER in text and "1 passed, 0 failed" in text


def test_a_check_row_beside_bench_rows_shows_no_timing():
    console = Console(record=True, width=200)
    render_table(make_report([make_case(tokens=1), check_case(tokens=2, tail_us=48015.0)]), console)
    text = console.export_text()
    assert "tail µs" in text and "10.00" in text and "48015" not in text
    assert TIMING_POINTER in text  # for the check row
    console = Console(record=True, width=200)
    render_table(make_report([make_case()]), console)
    assert TIMING_POINTER not in console.export_text()


def test_a_roofline_column_only_where_a_bench_row_has_one(tmp_path):
    console = Console(record=True, width=250)
    render_table(make_report([make_case(tokens=1, roofline_us=4.5), check_case(tokens=2, roofline_us=4.5)]), console)
    text = console.export_text()
    assert "roofline µs" in text and "4.50" in text and "2.22×" in text  # 10.0 / 4.5
    console = Console(record=True, width=250)
    render_table(make_report([make_case()]), console)
    assert "roofline" not in console.export_text()
    path = tmp_path / "r.json"
    write_json(make_report([make_case(roofline_us=9.0)]), path)
    assert read_json(path).cases[0].roofline_us == 9.0


def test_compare_ignores_the_host_timings_of_check_rows(tmp_path):
    """Old check files carry host µs: a slower host is no regression; a failure still is."""
    old = read_json(_a_1_2_check_file(tmp_path, 10.0))
    slower = read_json(_a_1_2_check_file(tmp_path, 1000.0))
    assert compare(old, slower) == []
    failed = make_report([check_case(error="rank 1 stopped making progress in case 0 (call 1 of 4)")])
    assert [r.kind for r in compare(old, failed)] == ["correctness"]
    assert side_by_side(old, slower)[0].tail == (None, None)
    assert compare(make_report([make_case(tail_us=10.0)]), make_report([check_case()])) == []  # bench → check


def test_a_skipped_run_is_no_pass_and_no_failure():
    assert not make_report([]).passed  # nothing run, nothing skipped: no evidence
    assert RunReport(command="run", skipped=[SKIPPED_ROUTING]).passed
    assert replace(make_report([make_case()]), skipped=[SKIPPED_ROUTING]).passed
    assert not replace(make_report([wrong_case()]), skipped=[SKIPPED_ROUTING]).passed


def test_non_utf8_file_raises_value_error(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError):
        read_json(path)


# ----------------------------------------------------------------------------------- JUnit


def test_junit_counts_and_failures(tmp_path):
    report = mixed_report()
    path = tmp_path / "junit.xml"
    write_junit(report, path)

    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None and suite.get("name") == "musebench"
    assert suite.get("tests") == "4"
    assert suite.get("failures") == "3"
    testcases = suite.findall("testcase")
    assert len(testcases) == 4
    assert [tc.get("name") for tc in testcases] == [case_name(case) for case in report.cases]
    assert all(tc.get("classname") == "ep_tail" for tc in testcases)
    assert float(testcases[0].get("time")) == pytest.approx(10.0 * 100 / 1e6)
    assert float(testcases[2].get("time")) == 0.0  # untimed (errored) case

    failures = [tc.find("failure") for tc in testcases]
    assert failures[0] is None
    assert failures[1].get("message") == diagnostic(report.cases[1])
    assert failures[2].get("type") == "error"
    assert sum(f is not None for f in failures) == 3

    properties = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert properties["git_commit"] == "0123abcd-dirty"
    assert properties["backend"] == "cpu"


def test_junit_marks_skipped_runs_skipped(tmp_path):
    report = replace(make_report([make_case()]), skipped=[SKIPPED_ROUTING])
    path = tmp_path / "junit.xml"
    write_junit(report, path)
    suite = ET.parse(path).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("2", "0", "1")
    skipped = suite.findall("testcase")[1]
    assert skipped.get("classname") == "routing" and skipped.find("failure") is None
    assert skipped.find("skipped").get("message") == skipped_line(SKIPPED_ROUTING)


def test_junit_survives_control_characters(tmp_path):
    report = make_report([make_case(error="segfault \x00\x1b[31m in rank 0")])
    path = tmp_path / "junit.xml"
    write_junit(report, path)
    failure = ET.parse(path).getroot().find("testsuite/testcase/failure")
    assert "segfault" in failure.get("message")


# --------------------------------------------------------------------------------- compare


def test_compare_flags_correctness_timing_and_missing():
    old = make_report([make_case(tokens=1), make_case(tokens=2), make_case(tokens=4), make_case(tokens=8)])
    new = make_report(
        [
            wrong_case(tokens=1),  # passed before, fails now
            make_case(tokens=2, tail_us=11.0),  # 10% slower, above the 5% threshold
            make_case(tokens=4, tail_us=10.4),  # 4% slower: within the threshold
        ]  # tokens=8 is gone
    )
    regressions = compare(old, new, threshold=0.05)
    by_kind = {r.kind: r for r in regressions}
    assert sorted(by_kind) == ["correctness", "missing", "timing"]
    assert len(regressions) == 3
    assert by_kind["correctness"].key == make_case(tokens=1).key
    assert by_kind["timing"].key == make_case(tokens=2).key
    assert (by_kind["timing"].old, by_kind["timing"].new) == (10.0, 11.0)
    assert by_kind["missing"].key == make_case(tokens=8).key


def test_compare_ignores_improvements_and_old_failures():
    old = make_report([make_case(tokens=1, tail_us=20.0), wrong_case(tokens=2)])
    new = make_report([make_case(tokens=1, tail_us=10.0), wrong_case(tokens=2), make_case(tokens=64)])
    assert compare(old, new) == []


def test_compare_pairs_repeated_keys_in_order():
    old = make_report([make_case(seed=0), make_case(seed=1)])
    new = make_report([make_case(seed=0)])
    assert [r.kind for r in compare(old, new)] == ["missing"]


def test_compare_rejects_negative_threshold():
    with pytest.raises(ValueError):
        compare(make_report([]), make_report([]), threshold=-0.1)


def test_side_by_side_pairs_every_shared_case_with_its_kernels():
    from musebench.harness.report import render_side_by_side, side_by_side

    old = make_report([make_case(tokens=1, tail_us=10.0, kernels_us={"publisher": 4.0, "gone": 1.0}),
                       make_case(tokens=2, tail_us=10.0)])
    new = make_report([make_case(tokens=1, tail_us=8.0, kernels_us={"publisher": 3.0}), make_case(tokens=64)])
    pairs = side_by_side(old, new)
    assert [pair.key for pair in pairs] == [make_case(tokens=1).key]  # tokens=2 is absent from new
    assert pairs[0].tail == (10.0, 8.0) and pairs[0].kernels == {"publisher": (4.0, 3.0)}
    console = Console(record=True, width=250)
    render_side_by_side(pairs, console)
    text = console.export_text()
    assert "0.80" in text and "publisher 4.00 → 3.00 (0.75)" in text


def test_render_comparison():
    console = Console(record=True, width=200)
    render_comparison([], console)
    assert "no regressions" in console.export_text()

    console = Console(record=True, width=200)
    key = make_case().key
    render_comparison([Regression(key, "timing", 10.0, 11.0, "slower"), Regression(key, "missing", "present", None, "gone")], console)
    text = console.export_text()
    assert "ep_tail[tp4-tok8-bf16-before-random-cpu-local]" in text
    assert "2 regressions (1 timing, 1 missing)" in text


# ----------------------------------------------------------------------------------- table


def test_render_table_rows_marks_and_diagnostics():
    report = mixed_report()
    console = Console(record=True, width=200)
    render_table(report, console)
    text = console.export_text()

    assert "CPU model (no GPU present)" in text
    assert "✓" in text and "✗" in text
    assert "1 passed, 3 failed" in text
    # One row per case: every case's token count shows in the tokens column, none aggregated away.
    assert text.count("ep_tail") >= 4
    # The mismatch diagnostic: rank, index, bits in hex and values, and the flags.
    assert "rank 2 index (3, 17): got 0x3f81 (1.0078125) want 0x3f80 (1.0)" in text
    assert "rank_identical=True deterministic=True" in text
    assert "error: rank 1: timeout after 30 s" in text
    assert "deterministic=False" in text
    for case in report.cases[1:]:
        assert diagnostic(case) in text


def test_render_table_title_and_markup_safety():
    report = make_report([make_case(stock_path="vllm[fused].finalize")])
    console = Console(record=True, width=200)
    render_table(report, console, title="nightly")
    text = console.export_text()
    assert "nightly — CPU model (no GPU present)" in text
    assert "vllm[fused].finalize" in text
    assert "1 passed, 0 failed" in text


def test_skipped_runs_get_one_line_each_and_count_in_the_summary():
    console = Console(record=True, width=200)
    render_table(replace(make_report([make_case()]), skipped=[SKIPPED_ROUTING, replace(SKIPPED_ROUTING, cases=2)]),
                 console)
    text = console.export_text()
    assert ("routing: skipped, needs a CUDA GPU with SM >= 90 and CuTe DSL (no such GPU here) — routing (tp=8), "
            "128 cases") in text
    assert "1 passed, 0 failed, 130 skipped" in text
    console = Console(record=True, width=200)
    render_table(make_report([make_case()]), console)
    assert "skipped" not in console.export_text()


def test_only_skipped_runs_print_no_empty_table():
    console = Console(record=True, width=200)
    render_table(RunReport(command="parity", skipped=[SKIPPED_ROUTING]), console, title="musebench parity")
    text = console.export_text()
    assert "┃" not in text and "musebench parity" in text and "0 passed, 0 failed, 128 skipped" in text


def test_failed_rows_are_red_and_passed_rows_are_not():
    console = Console(record=True, width=200, force_terminal=True, color_system="standard")
    render_table(make_report([wrong_case(), make_case()]), console)
    rows = [line for line in console.export_text(styles=True).splitlines() if line.startswith("│")]
    red = "\x1b[31m"
    assert len(rows) == 2
    assert red + "ep_tail" in rows[0]  # the failed case (tokens=1)
    assert red not in rows[1]


# ------------------------------------------------------------------------------ provenance


def test_git_commit_outside_a_repository(tmp_path):
    assert git_commit(tmp_path) == ""


def test_git_commit_clean_and_dirty(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    try:
        git("init", "-q")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git unavailable")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "empty")
    (tmp_path / "tracked.txt").write_text("a")
    assert len(git_commit(tmp_path)) == 40  # untracked files do not make the tree dirty
    git("add", "tracked.txt")
    assert git_commit(tmp_path).endswith("-dirty")


def test_now_utc_and_versions():
    assert now_utc().endswith("+00:00")
    versions = version_info()
    assert versions["musebench"]
    assert "cutlass-dsl" in versions and "click" in versions and "rich" in versions


def test_report_module_does_not_import_torch():
    code = "import sys, musebench.harness.report; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert result.stdout.strip() == "False"


def test_each_baseline_shows_its_us_and_the_tails_ratio_to_it():
    from musebench.harness.report import BASELINE_LEGEND

    console = Console(record=True, width=300)
    row = make_case(tail_us=5.0, baselines_us={"finalize+nccl": 20.0, "finalize+one-shot(own)": 10.0})
    render_table(make_report([row, check_case(tokens=2)]), console)
    text = console.export_text()
    assert "20.00 (0.25×)" in text and "10.00 (0.50×)" in text
    assert "finalize+one-shot(own) µs" in text and BASELINE_LEGEND in text
    console = Console(record=True, width=300)
    render_table(make_report([make_case()]), console)  # no baselines: no legend
    assert BASELINE_LEGEND not in console.export_text()


def test_a_baseline_paired_with_another_shows_that_ratio_and_says_so():
    """A row's baseline_ratio_of (qkv_front's cold cuBLAS against the cold launch): the cell's
    ratio is the other baseline over it and the legend names the pair; rows without it keep the
    plain legend and no such column."""
    from musebench.harness.report import BASELINE_LEGEND

    console = Console(record=True, width=400)
    row = make_case(tail_us=5.0, baselines_us={"cold weights": 8.0, "torch matmul, cold weights": 10.0},
                    baseline_ratio_of={"torch matmul, cold weights": "cold weights"})
    render_table(make_report([row]), console)
    text = console.export_text()
    assert "8.00 (0.62×)" in text and "10.00 (0.80×)" in text and "10.00 (0.50×)" not in text
    assert f"{BASELINE_LEGEND}; but torch matmul, cold weights: cold weights / it" in text
    console = Console(record=True, width=400)
    render_table(make_report([make_case(tail_us=5.0, baselines_us={"torch matmul": 10.0})]), console)
    text = console.export_text()
    assert "cold weights" not in text and "; but" not in text and "10.00 (0.50×)" in text
