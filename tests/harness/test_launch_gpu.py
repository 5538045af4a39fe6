"""Processes sharing one GPU through CUDA IPC mailboxes: the cute EP tail under torchrun."""

from __future__ import annotations

import pytest
import torch

from musebench.harness import launch
from musebench.cases.tail_inputs import TailCase
from musebench.harness.driver import Faults, RunOptions

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CUTE = dict(backend="cute", launcher="torchrun", iters=2, warmup=1, timeout_s=5.0)


@pytest.mark.parametrize("mode", ["ep", "tp"])
@pytest.mark.parametrize("tp", [4, 8])  # the 4 and 8 processes on one GPU
def test_processes_sharing_a_gpu_match_the_stock(mode, tp, job_id, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # every rank on one GPU, however many the machine has
    cases = [TailCase(mode=mode, tp=tp, tokens=m, weight_dtype=w, norm=n, inputs=family)
             for m in (1, 8) for w, n, family in (("bf16", "before", "random"), ("fp32", "after", "adversarial"))]
    rows = launch.run_torchrun(cases, RunOptions(**CUTE))
    for row in rows:
        assert row.passed, (row.key, row.error, row.first_mismatch)
        assert row.transport == "ipc"


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_peers_opened_on_this_device_match_the_stock(mode, job_id, monkeypatch):
    """The raw CUDA IPC open (`IpcMapping`, how peers on another GPU are mapped) for every peer."""
    monkeypatch.setenv("MUSEBENCH_IPC_OPEN", "this-device")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # peers to open: on four GPUs tp 4 would have one per GPU
    cases = [TailCase(mode=mode, tp=4, tokens=m, weight_dtype="bf16", norm="before", inputs="adversarial")
             for m in (1, 8)]
    for row in launch.run_torchrun(cases, RunOptions(**CUTE)):
        assert row.passed, (row.key, row.error, row.first_mismatch)
        assert row.transport == "ipc"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_two_processes_per_gpu_match_the_stock(mode, job_id):
    """Processes on several GPUs, two per GPU: peers on this GPU through torch, the others opened
    on this device (on two H200s without it: an illegal address)."""
    tp = 2 * torch.cuda.device_count()
    cases = [TailCase(mode=mode, tp=tp, tokens=m, weight_dtype=w, norm=n, inputs=family)
             for m in (1, 8) for w, n, family in (("bf16", "before", "random"), ("fp32", "after", "adversarial"))]
    for row in launch.run_torchrun(cases, RunOptions(**CUTE)):
        assert row.passed, (row.key, row.error, row.first_mismatch)
        assert row.transport == "ipc"


def test_a_silent_process_is_reported_not_hung(job_id):
    rows = launch.run_torchrun([TailCase(mode="ep", tp=4, tokens=2)],
                               RunOptions(**{**CUTE, "timeout_s": 1.0}, faults=Faults(silent_rank=3)))
    assert not rows[0].passed and "rank 3" in rows[0].error


def test_a_process_killed_mid_run_ends_the_job(job_id):
    rows = launch.run_torchrun([TailCase(mode="ep", tp=4, tokens=2)],
                               RunOptions(**{**CUTE, "timeout_s": 1.0}, faults=Faults(exit_rank=2)))
    assert not rows[0].passed and "rank 2 exited with code 17" in rows[0].error


def test_the_single_launch_ep_tail_across_processes(job_id):
    cases = [TailCase(mode="ep", tp=4, tokens=m, weight_dtype=w, norm=n, inputs=family)
             for m in (1, 8) for w, n, family in (("bf16", "before", "random"), ("fp32", "after", "adversarial"))]
    for row in launch.run_torchrun(cases, RunOptions(**CUTE, ep_launch="single")):
        assert row.passed, (row.key, row.error, row.first_mismatch)
    silent = launch.run_torchrun([TailCase(mode="ep", tp=4, tokens=2)],
                                 RunOptions(**{**CUTE, "timeout_s": 1.0}, ep_launch="single", faults=Faults(silent_rank=3)))
    assert not silent[0].passed and "rank 3" in silent[0].error
