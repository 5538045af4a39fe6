"""scripts/read-floor.py: its option checks (every refusal before the GPU, exit 2 with the reason),
the cold rotation's copy count, the GB/s and roofline arithmetic, the best-row choice, the JSON
document, the check after the replays (on CPU, a stand-in timer: it fails when the captured
launches wrote nothing, though the warm-up did), and on a GPU a tiny run end to end. The reader
and its sum check are tested in tests/stock/test_read_floor.py."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests._scripts import script_module
from tests._scripts import run_script as run_script_file

@pytest.fixture(scope="module")
def floor():
    """The script as a module (`tests._scripts.script_module`)."""
    with script_module("read-floor.py", "read_floor") as module:
        yield module


def run_script(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python3 scripts/read-floor.py args` (`tests._scripts.run_script`)."""
    return run_script_file("read-floor.py", args, **env)


def _plan(floor, *args: str):
    return floor.check_options(floor.parser().parse_args(list(args)))


def test_the_defaults_plan_the_issues_byte_counts_both_states_and_the_sweep(floor):
    from musebench.stock.attn2 import hbm_bytes

    plan = _plan(floor)
    assert plan.sizes == (18874368, 37748736, 75497472, 33554432, 67108864)
    assert plan.sizes[:3] == tuple(n * 8192 * 2 for n in (1152, 2304, 4608))  # qkv_front's weights
    assert plan.sizes[3:] == tuple(hbm_bytes(131072, heads, 0) for heads in (1, 2))  # attn2's K + V at 128k
    assert plan.states == ("cold", "warm") and (plan.calls, plan.replays, plan.json_path) == (20, 20, None)
    assert len(plan.configs) == 4 * 4 * 2 and len(set(plan.configs)) == len(plan.configs)
    assert {c.programs_per_sm for c in plan.configs} == {1, 2, 4, 8}
    assert floor.ReaderConfig(1, 4, 8).chunk_words == 4 * 8 * 32 * 4  # 4 x 16-byte loads a thread


@pytest.mark.parametrize("args, reason", [
    (["--bytes", "37.7M"], "not a plain positive int"),  # no suffixes
    (["--bytes", "1e6"], "not a plain positive int"),
    (["--bytes", "-16"], "not a plain positive int"),
    (["--bytes", "0"], "0 is not a positive int"),
    (["--bytes", ","], "at least one value"),
    (["--bytes", "18874368,18874368"], "each value once"),
    (["--bytes", "18874370"], "--bytes: the read floor reads a positive multiple of 16 bytes (16-byte loads), got 18874370"),
    (["--bytes", str((1 << 32) + 16), "--states", "warm"],
     "--bytes: the read floor reads at most 4294967296 bytes (int32 word offsets)"),
    (["--states", "hot"], "--states"),
    (["--states", "cold,cold"], "--states"),
    (["--programs-per-sm", "64"], "at most 32"),
    (["--loads-in-flight", "3"], "not one of (1, 2, 4, 8, 16)"),
    (["--num-warps", "32"], "not one of (1, 2, 4, 8, 16)"),
    (["--calls", "0"], "must be >= 1"),
    (["--replays", "0"], "must be >= 1"),
    (["--calls", "12"], "needs --calls >= 13"),  # 18.9 MB: 12 calls keep fewer than 4 L2s between reads
    (["--bytes", "1073741824", "--calls", "20"], "at most 16 GiB"),
    (["--json", "/no/such/folder/floor.json"], "does not exist"),
])
def test_a_bad_option_is_refused_with_its_reason(floor, args, reason):
    with pytest.raises(ValueError) as refused:
        _plan(floor, *args)
    assert reason in str(refused.value)


def test_a_warm_only_run_needs_no_cold_copies(floor):
    assert _plan(floor, "--states", "warm", "--calls", "1").calls == 1


def test_the_script_exits_2_on_a_bad_option_before_naming_the_missing_gpu():
    bad = run_script(["--bytes", "37.7M"])
    assert bad.returncode == 2 and "--bytes" in bad.stderr and "CUDA" not in bad.stderr, bad.stderr
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the run would start")
    missing = run_script(["--bytes", "67108864", "--calls", "5", "--states", "cold"])
    assert missing.returncode == 2 and missing.stderr.strip() == "read-floor.py: needs a CUDA GPU; none is visible"


def test_cold_reads_put_four_l2s_of_other_copies_between_two_reads(floor):
    """--states cold needs one copy a call with at least 4 L2s of other copies between two reads of
    one (`check_cold_calls`): refused at the fewest calls less one, planned at the fewest."""
    l2 = floor.L2_BYTES
    for nbytes, needed in ((18874368, 13), (37748736, 7), (75497472, 4), (33554432, 8), (67108864, 5)):
        assert _plan(floor, "--bytes", str(nbytes), "--calls", "20").calls == 20  # one copy a call
        assert _plan(floor, "--bytes", str(nbytes), "--calls", str(needed)).calls == needed
        assert (needed - 1) * nbytes >= 4 * l2 > (needed - 2) * nbytes  # the fewest calls that evict
        with pytest.raises(ValueError, match=f"^--states cold .*--bytes {nbytes}: .*needs --calls >= {needed} .*"
                                             f"got --calls {needed - 1}$"):
            _plan(floor, "--bytes", str(nbytes), "--calls", str(needed - 1))


def test_gb_per_s_and_the_roofline_ratio(floor):
    assert floor.roofline_us(42_000_000) == pytest.approx(10.0)  # 42 MB at 4.2 TB/s
    assert floor.gb_per_s(42_000_000, 10.0) == pytest.approx(4200.0)
    row = floor.timing_row(42_000_000, "cold", "torch.sum", [21.0, 20.0, 30.0], copies=20)
    assert (row["us_median"], row["us_min"], row["us_max"]) == (21.0, 20.0, 30.0)
    assert row["gb_per_s"] == 2000.0 and row["ratio_to_roofline"] == 2.1 and row["reader"] == "torch"
    config = floor.ReaderConfig(2, 4, 8)
    triton_row = floor.timing_row(42_000_000, "warm", config.name(), [10.0], copies=1, config=config)
    assert triton_row["reader"] == "triton" and triton_row["ratio_to_roofline"] == 1.0
    assert (triton_row["programs_per_sm"], triton_row["loads_in_flight"], triton_row["num_warps"]) == (2, 4, 8)


def test_the_best_row_is_the_fastest_triton_reader_per_bytes_and_state(floor):
    configs = [floor.ReaderConfig(p, 2, 4) for p in (1, 2)]
    rows = [floor.timing_row(33554432, "cold", c.name(), [us], 20, c) for c, us in zip(configs, (12.0, 11.0))]
    rows += [floor.timing_row(33554432, "cold", floor.TORCH_READER, [9.0], 20)]  # faster, but not a Triton reader
    rows += [floor.timing_row(33554432, "warm", c.name(), [us], 1, c) for c, us in zip(configs, (5.0, 6.0))]
    best = floor.mark_best(rows)
    assert [(r["state"], r["programs_per_sm"]) for r in best] == [("cold", 2), ("warm", 1)]
    assert [r["best"] for r in rows] == [False, True, False, True, False]


def test_the_json_document_holds_every_number_and_the_machine(floor, monkeypatch):
    monkeypatch.setenv("MUSEBENCH_GIT_COMMIT", "abc1234")
    plan = _plan(floor, "--bytes", "67108864", "--calls", "5")
    config = plan.configs[0]
    rows = [floor.timing_row(67108864, "cold", config.name(), [20.0, 21.0], 5, config),
            floor.timing_row(67108864, "cold", floor.TORCH_READER, [25.0], 5)]
    floor.mark_best(rows)
    facts = dict(gpu="NVIDIA H200", sm_count=132, torch="2.9", triton="3.6", empty_launch_us=2.0)
    document = json.loads(json.dumps(floor.record(rows, plan, facts)))
    assert document["git_commit"] == "abc1234" and document["gpu"] == "NVIDIA H200" and document["sm_count"] == 132
    assert (document["calls"], document["replays"], document["roofline_bytes_per_s"]) == (5, 20, 4.2e12)
    assert document["torch_reader"] == floor.TORCH_READER and document["rows"] == rows
    assert document["best"] == [rows[0]]
    assert {"bytes", "state", "reader", "name", "copies", "us_median", "us_min", "us_max", "gb_per_s",
            "roofline_us", "ratio_to_roofline", "best"} <= set(rows[1])


def _read_size_on_cpu(floor, monkeypatch, silent: str | None = None):
    """`read_size` over 4096 B warm on CPU, one Triton configuration (the reader emulated by the
    caller's fixture) and torch, with a stand-in for `graph_median_us`: the eager warm-up call,
    then `before_replays`, then the replays' calls, none for the `silent` reader ("triton",
    "torch"): its captured launches write nothing."""
    from musebench.harness import measure

    def timer(call, stream, options, before_replays=None, samples=None):
        reader = "triton" if isinstance(call, floor.FloorRead) else "torch"
        call()  # the warm-up: writes the results the captured launches must write again
        before_replays()
        for _ in range(0 if reader == silent else options.replays * options.calls):
            call()
        samples.extend([1.0] * options.replays)
        return 1.0

    monkeypatch.setattr(measure, "graph_median_us", timer)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    plan = _plan(floor, "--bytes", "4096", "--states", "warm", "--calls", "3", "--replays", "2",
                 "--programs-per-sm", "2", "--loads-in-flight", "1", "--num-warps", "1")
    stream = type("CpuStream", (), {"device": torch.device("cpu")})()
    return floor.read_size(4096, plan, stream, torch.Generator().manual_seed(0))


def test_the_check_after_the_replays_reads_what_the_replays_wrote(floor, monkeypatch, emulated_read_floor):
    rows = _read_size_on_cpu(floor, monkeypatch)
    assert [(r["state"], r["reader"]) for r in rows] == [("warm", "triton"), ("warm", "torch")]
    assert len(emulated_read_floor) == 1 + 2 * 3  # the warm-up, then 2 replays of 3 calls


@pytest.mark.parametrize("silent, reason", [
    ("triton", r"^triton 2/SM x 1 warps x 1 loads, 4096 B warm, copy 0: .* did not read every byte once"),
    ("torch", r"^torch.sum\(int32 view, dtype=torch.int64\), 4096 B warm, copy 0: 0 != "),
])
def test_a_reader_whose_captured_launches_write_nothing_fails(floor, monkeypatch, emulated_read_floor, silent,
                                                              reason):
    """Fault injection: the warm-up wrote the right results, the replays nothing: the results
    zeroed before the replays (`before_replays`) make the check after them fail."""
    with pytest.raises(RuntimeError, match=reason):
        _read_size_on_cpu(floor, monkeypatch, silent)


@pytest.mark.gpu
def test_a_tiny_read_floor_runs_end_to_end(tmp_path):
    """On a GPU: 64 MiB + 16 B (a partial last chunk), cold over 5 copies and warm, two Triton
    configurations and torch: every reader's sum checked, one row each, the best marked, the JSON written."""
    pytest.importorskip("triton")
    path = tmp_path / "floor.json"
    done = run_script(["--bytes", "67108880", "--calls", "5", "--replays", "3", "--programs-per-sm", "1,2",
                       "--loads-in-flight", "2", "--num-warps", "4", "--json", str(path)],
                      MUSEBENCH_GIT_COMMIT="test")
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(path.read_text())
    rows = document["rows"]
    assert [(r["state"], r["reader"]) for r in rows] == [(s, r) for s in ("cold", "warm")
                                                         for r in ("triton", "triton", "torch")]
    assert [r["copies"] for r in rows] == [5, 5, 5, 1, 1, 1] and document["git_commit"] == "test"
    assert all(0 < r["us_min"] <= r["us_median"] <= r["us_max"] for r in rows)
    assert len(document["best"]) == 2 and document["sm_count"] > 0 and document["triton"]
    assert done.stdout.count("best: ") == 2
