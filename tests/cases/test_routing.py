"""The routing family: inputs and rank ranges on CPU; the whole check, through the one driver,
on the GPU."""

from __future__ import annotations

import pytest
import torch

from musebench.cases.routing import RoutingCase, local_experts, make_inputs
from musebench.harness.case import Faults, RunOptions
from musebench.harness.driver import RankStalled, run_virtual, wait_for_device
from musebench.harness.jobs import make_routing_job


def make_routing_inputs(case):
    inputs = make_inputs(case)
    return inputs.logits, inputs.bias


def run_routing_case(case, faults=Faults(), timeout_s=10.0):
    options = RunOptions(backend="cute", iters=1, warmup=0, timeout_s=timeout_s, faults=faults)
    return run_virtual([case], options)[0]


def validate_routing_faults(faults, tp):
    make_routing_job(name="r", tp=tp, tokens=(1,), tiles=(8,), renormalize=(True,), inputs=("random",), seeds=(0,),
                     backend="cute", faults=faults, check_machine=False)


@pytest.mark.parametrize("tp", [2, 3, 8, 32])
def test_local_ranges_tile_the_experts(tp):
    ranges = [local_experts(rank, tp) for rank in range(tp)]
    assert ranges[0][0] == 0
    for (offset, count), (next_offset, _) in zip(ranges, ranges[1:]):
        assert offset + count == next_offset
    assert sum(count for _, count in ranges) == 256


def test_inputs_are_deterministic_and_fresh_per_seed():
    a = make_routing_inputs(RoutingCase(tp=2, tokens=4))
    b = make_routing_inputs(RoutingCase(tp=2, tokens=4))
    c = make_routing_inputs(RoutingCase(tp=2, tokens=4, seed=1))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_adversarial_inputs_hold_ties_infinities_and_signed_zeros():
    logits, bias = make_routing_inputs(RoutingCase(tp=2, tokens=4, inputs="adversarial"))
    assert bool((logits[0, 10:40] == 1.25).all())
    assert bool(torch.isinf(logits[1]).all())
    assert bool((logits[2].view(torch.int32) == -(2**31)).any())
    assert bool((bias[200:208] == 1.5).all())


def test_the_tail_only_edge_family_is_refused():
    with pytest.raises(ValueError, match="routing inputs"):
        make_routing_inputs(RoutingCase(tp=2, tokens=4, inputs="edge"))


def test_routing_faults_are_checked_before_launching():
    validate_routing_faults(Faults(flip_rank=1, silent_rank=0, hang_rank=1), tp=2)
    for faults in (Faults(raise_rank=0), Faults(exit_rank=1)):
        with pytest.raises(ValueError, match="routing injects only flip, silent, hang"):
            validate_routing_faults(faults, tp=2)
    with pytest.raises(ValueError, match="names rank 2, but tp is 2"):
        validate_routing_faults(Faults(flip_rank=2), tp=2)


class _Event:
    """A recorded CUDA event's stand-in: done after `polls` queries (never, with None)."""

    def __init__(self, polls):
        self.polls, self.queries = polls, 0

    def query(self):
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


def test_the_device_wait_is_bounded():
    wait_for_device(_Event(polls=3), timeout_s=5.0, what="rank 0: routing")  # done: returns
    with pytest.raises(RankStalled, match="rank 1: routing did not finish within 0.05 s: the rank stopped making progress"):
        wait_for_device(_Event(polls=None), timeout_s=0.05, what="rank 1: routing")


def test_a_poisoned_output_is_told_from_a_written_one():
    from musebench.harness import checks

    for dtype in (torch.int32, torch.float32, torch.bfloat16):
        out = checks.poison(torch.empty(2, 8, dtype=dtype))
        assert checks.still_poisoned(out)
        out.view(-1)[3] = 1
        assert not checks.still_poisoned(out)
    assert not checks.still_poisoned(torch.empty(0, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("inputs", ["random", "adversarial"])
def test_routing_case_passes_on_every_rank(renormalize, inputs):
    for tokens in (1, 5, 8):
        row = run_routing_case(RoutingCase(tp=8, tokens=tokens, tile_n=8, renormalize=renormalize, inputs=inputs))
        assert row.passed, (row.error, row.first_mismatch)


@pytest.mark.gpu
def test_bench_routing_rows_are_timed_and_checked():
    """The kernel with metadata is timed and checked; without metadata, the Triton stock and the
    Triton stock followed by its separate metadata pass are timed beside it."""
    from musebench.harness.measure import BenchOptions

    options = RunOptions(backend="cute", iters=1, warmup=0)
    row = run_virtual([RoutingCase(tp=8, tokens=2)], options, measurement="bench",
                      bench=BenchOptions(calls=3, replays=3))[0]
    assert row.passed and row.tail_us > 0, (row.error, row.first_mismatch)
    assert set(row.kernels_us) == {"without metadata"}
    assert set(row.baselines_us) == {"triton stock", "triton stock+metadata"}
    assert row.stock_us == row.baselines_us["triton stock+metadata"]


@pytest.mark.gpu
def test_routing_checks_catch_a_flipped_bit_a_missing_rank_and_a_hang():
    """Each fault fails the case and names its rank; a run after the hang passes again."""
    case = RoutingCase(tp=4, tokens=3, tile_n=8)
    flipped = run_routing_case(case, faults=Faults(flip_rank=1))
    assert not flipped.passed and flipped.mismatches >= 1 and flipped.first_mismatch.rank == 1
    assert not flipped.rank_identical
    silent = run_routing_case(case, faults=Faults(silent_rank=2))
    assert not silent.passed and "rank 2: its outputs still hold the poison" in silent.error
    hung = run_routing_case(case, faults=Faults(hang_rank=3), timeout_s=2.0)
    assert not hung.passed and hung.error.startswith("rank 3: call 0 of routing")
    assert "stopped making progress" in hung.error
    torch.cuda.synchronize()  # the injected busy stream frees itself about a second later
    assert run_routing_case(case).passed
