"""The bench measurement on GPUs, through the one driver: virtual ranks and one process per rank,
every timed row checked bitwise.

On one GPU the processes share it through CUDA IPC and the finalize and musebench's one-shot
all-reduce baselines run (the one-shot's result checked bitwise inside the bench; its µs time the
driver's time slices there); with a GPU per rank the NCCL and SymmetricMemory paths are timed too.
"""

from __future__ import annotations

import pytest
import torch

from musebench.harness import launch
from musebench.cases.tail_inputs import TailCase
from musebench.harness.driver import RunOptions, run_virtual
from musebench.harness.measure import BenchOptions

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_two_processes_time_the_tail_and_the_stock_paths(mode, job_id):
    cases = [TailCase(mode=mode, tp=2, tokens=m) for m in (1, 8)]
    rows = launch.run_torchrun(cases, RunOptions(backend="cute", launcher="torchrun", timeout_s=2.0),
                               bench=BenchOptions(calls=5, replays=5), measurement="bench")
    own_gpus = torch.cuda.device_count() >= 2
    for row in rows:
        assert row.passed, (row.key, row.error, row.first_mismatch, row.notes)
        assert row.tail_us > 0 and row.baselines_us["finalize"] > 0
        if mode == "ep":  # the publisher alone, and the group re-armed after it (the next row passes)
            assert 0 < row.kernels_us["publisher"] and "reduce (call - publisher)" in row.kernels_us
            assert row.kernels_us["single launch"] > 0, row.notes  # timed, and its bits checked
        one_shot = "finalize+one-shot(own)" if mode == "ep" else "one-shot(own)+finalize"
        assert row.baselines_us[one_shot] > 0 and row.baseline_ratios[one_shot] > 0, row.notes
        assert any("own implementation of the published algorithm" in note for note in row.notes)
        if own_gpus:
            assert row.transport == "unicast" and row.stock_us > 0, row.notes
        else:
            assert row.transport == "ipc" and any("one process per GPU" in note for note in row.notes)


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_virtual_ranks_time_the_group_call_and_the_finalize(mode):
    cases = [TailCase(mode=mode, tp=4, tokens=m) for m in (1, 8)]
    rows = run_virtual(cases, RunOptions(backend="cute", timeout_s=2.0), measurement="bench",
                       bench=BenchOptions(calls=5, replays=5))
    for row in rows:
        assert row.passed, (row.key, row.error, row.first_mismatch, row.notes)
        assert row.tail_us > 0 and row.stock_us == row.baselines_us["finalize"] > 0
        if mode == "ep":
            assert row.kernels_us["publisher"] > 0 and row.kernels_us["single launch"] > 0


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_four_processes_on_one_gpu_run_the_one_shot_rows(mode, job_id, monkeypatch):
    """The issue's m = 1, 2, 4, 8 and both weight dtypes, four processes sharing one GPU: every
    row passes, the one-shot baseline among its paths (bitwise checked), the timing note on it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cases = [TailCase(mode=mode, tp=4, tokens=m, weight_dtype=w) for m in (1, 2, 4, 8) for w in ("bf16", "fp32")]
    rows = launch.run_torchrun(cases, RunOptions(backend="cute", launcher="torchrun", timeout_s=2.0),
                               bench=BenchOptions(calls=2, replays=3), measurement="bench")
    one_shot = "finalize+one-shot(own)" if mode == "ep" else "one-shot(own)+finalize"
    assert len(rows) == len(cases)
    for row in rows:
        assert row.passed, (row.key, row.error, row.first_mismatch, row.notes)
        assert row.transport == "ipc" and one_shot in row.baselines_us, row.notes
        assert any("processes share GPUs" in note for note in row.notes)
