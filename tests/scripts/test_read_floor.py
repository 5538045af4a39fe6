"""scripts/read-floor.py: its option checks (every refusal before the GPU, exit 2 with the reason),
the cold rotation's copy count, the GB/s and roofline arithmetic, the best-row choice, the JSON
document, the sum check that proves a reader read every byte (and fails when one did not), the
Triton reader in Triton's CPU interpreter where Triton imports, and on a GPU a tiny run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests._scripts import REPO, SCRIPTS, script_module
from tests._scripts import run_script as run_script_file

SCRIPT = SCRIPTS / "read-floor.py"


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
    (["--bytes", "18874370"], "not a multiple of 16"),
    (["--bytes", str((1 << 32) + 16), "--states", "warm"], "int32 word offsets"),
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


def test_cold_copies_put_four_l2s_of_other_copies_between_two_reads(floor):
    l2 = floor.L2_BYTES
    for nbytes, needed in ((18874368, 13), (37748736, 7), (75497472, 4), (33554432, 8), (67108864, 5)):
        assert floor.cold_copies(nbytes, 20) == 20  # one copy a call: each read once a replay
        assert floor.cold_copies(nbytes, needed) == needed
        assert (needed - 1) * nbytes >= 4 * l2 > (needed - 2) * nbytes  # the fewest calls that evict
        with pytest.raises(ValueError, match=f"needs --calls >= {needed}"):
            floor.cold_copies(nbytes, needed - 1)


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


def test_the_sum_check_fails_a_reader_that_skipped_or_changed_a_word(floor):
    words = torch.randint(-2 ** 31, 2 ** 31, (1000,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    total = int(words.sum(dtype=torch.int64))
    partials = torch.stack([words[i::4].sum(dtype=torch.int64) for i in range(4)])  # what 4 programs would sum
    wrapped = ((partials + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)  # their int32 arithmetic
    floor.check_partials(wrapped, total, "exact")
    skipped = torch.stack([words[:-1][i::4].sum(dtype=torch.int64) for i in range(4)]).to(torch.int32)
    with pytest.raises(RuntimeError, match="did not read every byte"):
        floor.check_partials(skipped, total, "one word short")
    with pytest.raises(RuntimeError, match="did not read every byte"):
        floor.check_partials(torch.zeros(4, dtype=torch.int32), total, "never written")


INTERPRETED = """
import sys, torch
sys.path.insert(0, {repo!r})
import importlib.util
spec = importlib.util.spec_from_file_location("read_floor", {script!r})
floor = importlib.util.module_from_spec(spec); sys.modules["read_floor"] = floor; spec.loader.exec_module(floor)
g = torch.Generator().manual_seed(0)
for n_words in (2048, 3 * 2048 + 4, 5 * 512 + 12):  # whole chunks, a partial chunk, more programs than chunks
    words = torch.randint(-1000, 1000, (n_words,), dtype=torch.int32, generator=g)  # no int32 wrap: numpy would raise
    total = int(words.sum(dtype=torch.int64))
    for config in (floor.ReaderConfig(1, 1, 1), floor.ReaderConfig(3, 2, 2), floor.ReaderConfig(2, 4, 1)):
        partials = torch.zeros(config.programs_per_sm * 2, dtype=torch.int32)
        floor.triton_read(words, partials, config)
        floor.check_partials(partials, total, "interpreted")
        short = torch.zeros_like(partials)
        floor.triton_read(words[:-4], short, config)
        try:
            floor.check_partials(short, total, "short")
        except RuntimeError:
            continue
        sys.exit("a reader four words short passed the check")
print("interpreted reader ok")
"""


def test_the_triton_reader_reads_every_word_in_the_interpreter():
    """The Triton reader on CPU tensors (TRITON_INTERPRET=1): its partials add to the buffer's sum
    for whole and partial chunks and grids wider than the chunks; a read four words short fails."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", INTERPRETED.format(repo=str(REPO), script=str(SCRIPT))],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})
    if "only 0-dimensional arrays can be converted" in done.stderr:
        pytest.skip("Triton's interpreter cannot bound a loop by program_id under this numpy (>= 2.3)")
    assert done.returncode == 0 and "interpreted reader ok" in done.stdout, done.stdout + done.stderr


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


@pytest.mark.gpu
def test_the_gpu_reader_fails_the_check_when_it_reads_short(floor):
    """The compiled reader's partials add to the buffer's sum; over the buffer less its last 16
    bytes, the check fails: the check can see a skipped vector."""
    pytest.importorskip("triton")
    words = torch.randint(-2 ** 31, 2 ** 31, (1 << 20,), dtype=torch.int32, device="cuda")
    total = int(words.sum(dtype=torch.int64))
    config = floor.ReaderConfig(2, 4, 4)
    partials = torch.zeros(2 * torch.cuda.get_device_properties(0).multi_processor_count, dtype=torch.int32,
                           device="cuda")
    floor.triton_read(words, partials, config)
    floor.check_partials(partials, total, "whole")
    partials.zero_()
    floor.triton_read(words[:-4], partials, config)
    with pytest.raises(RuntimeError, match="did not read every byte"):
        floor.check_partials(partials, total, "16 bytes short")
