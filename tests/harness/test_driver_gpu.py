"""The driver over the cute backend on one GPU: virtual ranks, parity (EP and TP), the fault paths."""

from __future__ import annotations

import pytest
import torch

from musebench.cases.tail_inputs import TailCase
from musebench.harness.driver import Faults, RunOptions, run_virtual

pytestmark = pytest.mark.gpu

CUTE = dict(backend="cute", iters=2, warmup=1, timeout_s=2.0)


@pytest.mark.parametrize("mode", ["ep", "tp"])
@pytest.mark.parametrize("tp", [2, 3, 8])  # smallest, uneven split (TP: the extension), decode TP
def test_cute_tails_are_bitwise_equal_to_the_stock(mode, tp):
    cases = [TailCase(mode=mode, tp=tp, tokens=m, weight_dtype=w, norm=n, inputs=family)
             for m in (1, 8) for w, n, family in (("bf16", "before", "random"), ("fp32", "after", "adversarial"))]
    rows = run_virtual(cases, RunOptions(**CUTE))
    for row in rows:
        assert row.passed, (row.label if hasattr(row, "label") else row.key, row.error, row.first_mismatch)
        assert row.transport == "local"


def test_cute_missing_rank_is_a_timeout_record_not_a_hang():
    row = run_virtual([TailCase(mode="ep", tp=4, tokens=2)], RunOptions(**CUTE, faults=Faults(silent_rank=2)))[0]
    assert not row.passed
    assert row.error.startswith("rank 2: its outputs still hold the poison")  # never launched: the check finds it
    assert all("waiting for rank 2" in (r.error or "") for r in row.ranks if r.rank != 2)
    # the group recovers: the next run on fresh mailboxes passes
    assert run_virtual([TailCase(mode="ep", tp=4, tokens=2)], RunOptions(**CUTE))[0].passed


@pytest.mark.parametrize("repeat", range(4))
def test_cute_flipped_bit_is_caught(repeat):
    """Repeated: with the flip on the device (a torch kernel's first launch, behind the peer's
    spinning reduction: lazy module loading) it timed out in 3 runs of 4 on the H200."""
    row = run_virtual([TailCase(mode="ep", tp=2, tokens=2)], RunOptions(**CUTE, faults=Faults(flip_rank=1)))[0]
    assert row.mismatches == 1 and row.first_mismatch.rank == 1


def test_cute_tp_missing_rank_is_reported():
    row = run_virtual([TailCase(mode="tp", tp=4, tokens=3)], RunOptions(**CUTE, faults=Faults(silent_rank=1)))[0]
    assert not row.passed and row.error.startswith("rank 1: its outputs still hold the poison")
    assert any("waiting for rank 1" in (r.error or "") for r in row.ranks if r.rank != 1)


def test_co_residency_is_checked_before_launching():
    """tp 32 TP tails as virtual ranks need 32 * 31 + 1 resident units (clusters or 512-thread
    CTAs): more than an H200 holds, so the run refuses up front instead of timing out (tp 8, which
    fits, runs in the parity test above)."""
    row = run_virtual([TailCase(mode="tp", tp=32, tokens=8)], RunOptions(**CUTE))[0]
    assert not row.passed and "cannot all be resident" in row.error and "--launcher torchrun" in row.error


def test_the_single_launch_ep_tail_passes_and_its_faults_are_caught():
    """`--ep-launch single`: the same parity, a flipped bit and a silent rank caught the same way."""
    single = dict(CUTE, ep_launch="single")
    cases = [TailCase(mode="ep", tp=3, tokens=m, weight_dtype=w, norm=n, inputs=family)
             for m in (1, 8) for w, n, family in (("bf16", "before", "random"), ("fp32", "after", "adversarial"))]
    for row in run_virtual(cases, RunOptions(**single)):
        assert row.passed, (row.key, row.error, row.first_mismatch)
    flipped = run_virtual([TailCase(mode="ep", tp=2, tokens=2)], RunOptions(**single, faults=Faults(flip_rank=1)))[0]
    assert flipped.mismatches == 1 and flipped.first_mismatch.rank == 1
    silent = run_virtual([TailCase(mode="ep", tp=4, tokens=2)], RunOptions(**single, faults=Faults(silent_rank=2)))[0]
    assert not silent.passed and silent.error.startswith("rank 2: its outputs still hold the poison")
    assert any("waiting for rank 2" in (r.error or "") for r in silent.ranks)


def test_a_hung_virtual_rank_is_named_and_the_group_recovers():
    """Virtual ranks on a GPU: the hung rank's stream is held past the bounded wait on its call,
    which names it; its peers time out; the next run on fresh mailboxes passes."""
    options = RunOptions(**dict(CUTE, timeout_s=1.0), faults=Faults(hang_rank=1))
    row = run_virtual([TailCase(mode="ep", tp=2, tokens=2)], options)[0]
    assert not row.passed and "rank 1" in row.error and "stopped making progress" in row.error, row.error
    torch.cuda.synchronize()  # the held stream frees itself
    assert run_virtual([TailCase(mode="ep", tp=2, tokens=2)], RunOptions(**CUTE))[0].passed
