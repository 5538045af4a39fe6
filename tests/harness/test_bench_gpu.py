"""The bench measurement on GPUs, through the one driver: virtual ranks and one process per rank,
every timed row checked bitwise.

On one GPU the processes share it through CUDA IPC and only the finalize baseline runs; with a GPU
per rank the NCCL and SymmetricMemory paths are timed beside the tails.
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
