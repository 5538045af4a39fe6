"""Routing cases: inputs and rank ranges on CPU; the whole check on the GPU."""

from __future__ import annotations

import pytest
import torch

from musebench.harness.routing import RoutingCase, local_experts, make_routing_inputs, run_routing_case


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


@pytest.mark.gpu
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("inputs", ["random", "adversarial"])
def test_routing_case_passes_on_every_rank(renormalize, inputs):
    for tokens in (1, 5, 8):
        row = run_routing_case(RoutingCase(tp=8, tokens=tokens, tile_n=8, renormalize=renormalize, inputs=inputs))
        assert row.passed, (row.error, row.first_mismatch)


@pytest.mark.gpu
def test_bench_routing_rows_are_timed_and_checked():
    """Every variant, the Triton stock followed by its separate metadata pass included, is timed
    and its outputs (metadata too where it writes them) checked against the reference."""
    from musebench.harness.bench import BenchOptions
    from musebench.harness.routing import bench_routing

    rows = bench_routing(2, 8, BenchOptions(calls=3, replays=3))
    assert [row.kernel for row in rows] == ["routing", "routing+metadata", "triton stock", "triton stock+metadata"]
    for row in rows:
        assert row.passed and row.tail_us > 0, (row.kernel, row.error, row.first_mismatch)
        assert row.stock_us == rows[2].tail_us
