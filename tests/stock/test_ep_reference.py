"""The EP tail reference against a scalar exact model written from the stock's PTX facts."""

from __future__ import annotations

import pytest
import torch

from musebench.cases.tail_inputs import TailCase, make_tail_inputs
from musebench.layout import UnfinalizedMoEOutput
from musebench.stock import ep
from tests import _scalar as sc

WIDTH = 4096
THREADS, TRIPS, FRAGMENT = 128, 4, 8


def _scalar_partial(x_rows: list[list[float]], weights: list[float], gamma_bf16: list[float], *, eps: float,
                    gain_center: float, before: bool) -> list[int]:
    """One token's partial, thread by thread, as the stock publisher computes it (BF16 bits)."""
    gamma = [sc.add(g, sc.f32(gain_center)) for g in gamma_bf16]
    acc = [0.0] * WIDTH
    for x, weight in zip(x_rows, weights):
        s = [sc.mul(v, g) for v, g in zip(x, gamma)] if before else list(x)
        lane_sums = []
        for t in range(THREADS):
            chain = 0.0
            for e in range(FRAGMENT):  # element-major, trip fastest (CuTe coordinate order)
                for trip in range(TRIPS):
                    v = s[8 * (t + THREADS * trip) + e]
                    chain = sc.fma(v, v, chain)
            lane_sums.append(chain)
        warp_sums = []
        for w in range(THREADS // 32):
            lanes = lane_sums[32 * w : 32 * w + 32]
            for offset in (16, 8, 4, 2, 1):
                lanes = [sc.add(lanes[l], lanes[l ^ offset]) for l in range(32)]
            warp_sums.append(lanes[0])
        total = 0.0
        for value in warp_sums:
            total = sc.add(total, value)
        inv = sc.rsqrt_precise(sc.fma(total, sc.f32(1.0 / WIDTH), sc.f32(eps)))
        for c in range(WIDTH):
            y = sc.mul(s[c], inv)
            if not before:
                y = sc.mul(y, gamma[c])
            acc[c] = sc.fma(y, weight, acc[c])
    out = [sc.to_bf16_bits(v) for v in acc]
    return [0 if b == 0x8000 else b for b in out]


@pytest.mark.parametrize("before", [True, False])  # weight before / after the norm
def test_partial_matches_scalar_model(before):
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(3, WIDTH, generator=g).to(torch.bfloat16)
    rows[1, ::5] = torch.tensor(2.0**20)  # order-sensitive magnitudes
    rows[2] = torch.randn(WIDTH, generator=g).to(torch.bfloat16) * torch.tensor(2.0**-128)  # subnormal squares
    gamma = (torch.randn(WIDTH, generator=g) * 0.1).to(torch.bfloat16)
    index = torch.tensor([[0, -1, 1, 2, -1, -1, -1, -1]], dtype=torch.int32)
    weights = torch.tensor([[0.3, 0.2, 0.11, 0.07, 0.1, 0.1, 0.1, 0.02]], dtype=torch.float32)
    unfinalized = UnfinalizedMoEOutput(rows, weights, index)
    got = ep.ep_partial(unfinalized, gamma, eps=1e-8, gain_center=1.0, weight_before_norm=before)
    want = _scalar_partial(
        [rows[i].float().tolist() for i in (0, 1, 2)], [weights[0, k].item() for k in (0, 2, 3)],
        gamma.float().tolist(), eps=1e-8, gain_center=1.0, before=before,
    )
    got_bits = [b & 0xFFFF for b in got.view(torch.int16)[0].tolist()]
    mismatches = [i for i, (a, b) in enumerate(zip(got_bits, want)) if a != b]
    assert not mismatches, f"{len(mismatches)} mismatches, first at {mismatches[0]}: {got_bits[mismatches[0]]:#x} vs {want[mismatches[0]]:#x}"


def test_thread_chain_order_is_observable():
    """The per-thread order is a fact that changes bits: a trip-major chain disagrees somewhere."""
    g = torch.Generator().manual_seed(3)
    s = (torch.randn(64, WIDTH, generator=g) * torch.exp2(torch.randint(-8, 8, (64, WIDTH), generator=g).float())).float()
    stock_order = ep.thread_sum_of_squares(ep._per_thread(s))
    shaped = s.reshape(64, TRIPS, THREADS, FRAGMENT).movedim(1, 2).reshape(64, THREADS, TRIPS * FRAGMENT)
    trip_major = ep.thread_sum_of_squares(shaped)
    assert not torch.equal(stock_order.view(torch.int32), trip_major.view(torch.int32))


def test_sum_over_ranks_is_in_rank_order():
    big, one = torch.tensor([[2.0**24]], dtype=torch.bfloat16), torch.tensor([[1.0]], dtype=torch.bfloat16)
    # ((0 + 2^24) + 1) - 2^24 = 0: the 1 is absorbed; ((0 + 2^24) - 2^24) + 1 = 1
    assert float(ep.rank_order_sum([big, one, -big])) == 0.0
    assert float(ep.rank_order_sum([big, -big, one])) == 1.0


def test_partials_never_hold_negative_zero():
    case = TailCase(mode="ep", tp=2, tokens=8, inputs="adversarial", norm="after")
    inputs = make_tail_inputs(case)
    for unfinalized in inputs.per_rank:
        partial = ep.ep_partial(unfinalized, inputs.norm_weight, eps=case.eps, gain_center=1.0, weight_before_norm=False)
        assert not bool((partial.view(torch.int16) == -32768).any())


def test_non_local_routes_contribute_nothing():
    rows = torch.randn(1, WIDTH).to(torch.bfloat16)
    gamma = torch.zeros(WIDTH, dtype=torch.bfloat16)
    none_local = UnfinalizedMoEOutput(rows, torch.ones(2, 8), torch.full((2, 8), -1, dtype=torch.int32))
    partial = ep.ep_partial(none_local, gamma, eps=1e-8, gain_center=1.0, weight_before_norm=True)
    assert torch.equal(partial.view(torch.int16), torch.zeros(2, WIDTH, dtype=torch.int16))


def test_bad_inputs_raise_value_error():
    rows = torch.randn(1, WIDTH).to(torch.bfloat16)
    with pytest.raises(ValueError):
        ep.ep_partial(UnfinalizedMoEOutput(rows, torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.int64)),
                      torch.zeros(WIDTH, dtype=torch.bfloat16), eps=1e-8, gain_center=1.0, weight_before_norm=True)
    with pytest.raises(ValueError):
        ep.ep_partial(UnfinalizedMoEOutput(rows, torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.int32)),
                      torch.zeros(WIDTH - 8, dtype=torch.bfloat16), eps=1e-8, gain_center=1.0, weight_before_norm=True)


def test_rows_wider_than_the_norm_are_read_to_its_width():
    """The stock reads `hidden` columns at a row stride of the rows' width (`row_stride`): extra
    columns, NaN here, are never read."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(4, WIDTH, generator=g).to(torch.bfloat16)
    wide = torch.cat([rows, torch.full((4, 24), float("nan"), dtype=torch.bfloat16)], dim=1)
    gamma = (torch.randn(WIDTH, generator=g) * 0.1).to(torch.bfloat16)
    index = torch.tensor([[0, -1, 1, 2, -1, 3, -1, -1]], dtype=torch.int32)
    weights = torch.full((1, 8), 0.125, dtype=torch.float32)
    knobs = dict(eps=1e-8, gain_center=1.0, weight_before_norm=True)
    want = ep.ep_partial(UnfinalizedMoEOutput(rows, weights, index), gamma, **knobs)
    got = ep.ep_partial(UnfinalizedMoEOutput(wide.contiguous(), weights, index), gamma, **knobs)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
