"""The process bench on GPUs: one process per rank, every timed row checked bitwise.

On one GPU the ranks share it through CUDA IPC and only the finalize baseline runs; with a GPU per
rank the NCCL and SymmetricMemory paths are timed beside the tails.
"""

from __future__ import annotations

import pytest
import torch

from musebench.harness import launch
from musebench.harness.bench import BenchOptions
from musebench.harness.cases import TailCase
from musebench.harness.driver import RunOptions

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_two_processes_time_the_tail_and_the_stock_paths(mode, job_id):
    cases = [TailCase(mode=mode, tp=2, tokens=m) for m in (1, 8)]
    rows = launch.run_torchrun(cases, RunOptions(backend="cute", launcher="torchrun", timeout_s=2.0),
                               bench=BenchOptions(calls=5, replays=5))
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
