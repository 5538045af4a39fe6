"""The stock QKV front reference (`musebench.stock.qkv_front`) against a scalar exact-rational
model of the stock's thread program (tests/_scalar.py), lane by lane; the layout of the cache
insert; the projection yardstick. CPU, PRECISE approximations (the same code takes the
hardware's rsqrt on a GPU).
"""

from __future__ import annotations

import struct

import pytest
import torch

from musebench import numerics as nx
from musebench.stock import qkv_front as ref
from tests import _scalar as sc

EPS = 1e-5


def scalar_head(values: list[float], pos_row: list[float] | None) -> list[int]:
    """One head as the stock's 8 threads compute it, in scalar exact arithmetic: BF16 bits."""
    partial = []
    for lane in range(8):
        ss = 0.0
        for e in range(8):
            v = values[8 * lane + e]
            ss = sc.fma(v, v, ss)
        partial.append(ss)
    for offset in (4, 2, 1):
        partial = [sc.add(partial[i], partial[i ^ offset]) for i in range(8)]
    assert len(set(struct.pack("<f", p) for p in partial)) == 1  # every lane holds the same sum
    r = sc.rsqrt_precise(sc.fma(partial[0], 0.015625, sc.f32(EPS)))
    y = [sc.mul(v, r) for v in values]
    if pos_row is not None:
        o = []
        for j in range(32):
            c, s = pos_row[j], pos_row[32 + j]
            o.append(sc.fma(c, y[2 * j], -sc.mul(s, y[2 * j + 1])))
            o.append(sc.fma(s, y[2 * j], sc.mul(c, y[2 * j + 1])))
        y = o
    return [sc.to_bf16_bits(v) for v in y]


def draw(tokens: int, kv: int, seed: int, max_pos: int = 64):
    g = torch.Generator().manual_seed(seed)
    n = 1152 * kv
    qkv = (torch.randn(tokens, n, generator=g) * 3).bfloat16()
    qkv[0, :64] = 0.0  # a zero head: rsqrt(eps)
    qkv[0, 64:128] = -0.0
    if tokens > 1:
        qkv[1, 128:192] = 2.0 ** 60  # huge
        qkv[1, 192:256] = 2.0 ** -130  # subnormal
    cs = torch.randn(max_pos, 64, generator=g)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    positions[0] = max_pos - 1
    return qkv, cs, positions


@pytest.mark.parametrize("rope", [True, False])
def test_epilogue_is_the_scalar_thread_program(rope):
    kv, tokens = 1, 3
    qkv, cs, positions = draw(tokens, kv, seed=1)
    out, _ = ref.qkv_epilogue_reference(qkv, positions, cs if rope else None, torch.full((tokens,), -1),
                                        torch.zeros(1, kv, 16, 128, dtype=torch.bfloat16), kv)
    bits = out.view(torch.int16).to(torch.int32) & 0xFFFF
    for t in range(tokens):
        for head in [0, 1, 2, 3, 7, 8]:  # q heads (zero, -0.0, huge, subnormal, random) and the k head
            values = [float(v) for v in qkv[t, head * 64:(head + 1) * 64].float()]
            row = [float(v) for v in cs[positions[t]]] if rope else None
            assert bits[t, head * 64:(head + 1) * 64].tolist() == scalar_head(values, row), (t, head)


def test_v_and_gate_are_untouched_and_inputs_not_written():
    qkv, cs, positions = draw(2, 2, seed=2)
    before = qkv.clone()
    cache = torch.zeros(2, 2, 16, 128, dtype=torch.bfloat16)
    out, new_cache = ref.qkv_epilogue_reference(qkv, positions, cs, torch.tensor([5, 17]), cache, 2)
    cols = ref.head_columns(2)
    assert torch.equal(out[:, cols["v"][0]:].view(torch.int16), qkv[:, cols["v"][0]:].view(torch.int16))
    assert torch.equal(qkv.view(torch.int16), before.view(torch.int16))
    assert not cache.any() and new_cache.any()


def test_insert_goes_to_the_slots_only():
    kv, tokens = 2, 4
    qkv, cs, positions = draw(tokens, kv, seed=3)
    cache = torch.full((3, kv, 16, 128), 7.0, dtype=torch.bfloat16)
    slots = torch.tensor([0, -1, 47, 20])
    out, new = ref.qkv_epilogue_reference(qkv, positions, cs, slots, cache, kv)
    cols = ref.head_columns(kv)
    written = torch.zeros(3, 16, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        page, row = divmod(s, 16)
        written[page, row] = True
        for h in range(kv):
            k = out[t, cols["k"][0] + 64 * h: cols["k"][0] + 64 * (h + 1)]
            v = qkv[t, cols["v"][0] + 64 * h: cols["v"][0] + 64 * (h + 1)]
            assert torch.equal(new[page, h, row].view(torch.int16), torch.cat([k, v]).view(torch.int16))
    untouched = ~written.unsqueeze(1).expand(3, kv, 16)
    assert bool((new[untouched] == 7.0).all())


def test_the_sum_of_squares_is_the_butterfly_not_a_sequential_sum():
    # order-sensitive: lane 0 holds 2^24 and the others 1s: the butterfly pairs differ from a chain
    head = torch.zeros(1, 64)
    head[0, 0] = 2.0 ** 12  # squares to 2^24
    head[0, 8:] = 1.0
    got = ref.sum_of_squares(head)
    partial = [2.0 ** 24] + [8.0] * 7
    for offset in (4, 2, 1):
        partial = [sc.add(partial[i], partial[i ^ offset]) for i in range(8)]
    assert float(got[0]) == partial[0]


def test_projection_error_is_in_bf16_epsilons_of_the_term_magnitudes():
    x = torch.randn(3, 64).bfloat16()
    w = torch.randn(8, 64).bfloat16()
    x[2] = 0.0
    exact = ref.fp64_projection(x, w)
    scale = ref.term_magnitudes(x, w)
    assert torch.equal(scale, x.double().abs() @ w.double().abs().t())
    rounded = ref.projection_error(exact.bfloat16(), exact, scale)
    assert rounded.unbounded == 0 and 0 < rounded.mean < rounded.max <= 0.5  # a correct rounding
    assert rounded.max < ref.projection_error((exact * 1.01).bfloat16(), exact, scale).max
    # 2^60 times the inputs: the same errors (the unit scales with the row)
    big = ref.projection_error((exact * 2.0 ** 60).bfloat16(), exact * 2.0 ** 60, scale * 2.0 ** 60)
    assert (big.max, big.mean) == (rounded.max, rounded.mean)
    broken = exact.bfloat16()
    broken[0, 0] = float("nan")
    broken[2, 1] = 1.0  # the zero row: nonzero where every term is zero
    got = ref.projection_error(broken, exact, scale)
    assert got.unbounded == 2 and "unbounded 2" in str(got)


def test_refuses_other_widths():
    with pytest.raises(ValueError):
        ref.qkv_epilogue_reference(torch.zeros(1, 1000, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64),
                                   None, torch.zeros(1, dtype=torch.int64),
                                   torch.zeros(1, 1, 16, 128, dtype=torch.bfloat16), 1)


@pytest.mark.parametrize("position, slot, message", [
    (-1, 0, r"positions \[-1\] outside the rotary table's \[0, 64\)"),  # torch would wrap it to row 63
    (64, 0, r"positions \[64\] outside the rotary table's \[0, 64\)"),
    (3, 32, r"slots \[32\] past the cache's 32 slots"),
])
def test_refuses_indices_outside_the_tables(position, slot, message):
    qkv, cs, _ = draw(1, 1, seed=4)
    with pytest.raises(ValueError, match=message):
        ref.qkv_epilogue_reference(qkv, torch.tensor([position]), cs, torch.tensor([slot]),
                                   torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16), 1)


def test_kernel_bounds_clamp_the_position_and_skip_a_slot_past_the_cache():
    """bounds "kernel" (cute_ops.launch_qkv_front's contract): a position below 0 or at / past
    max_pos is rotated with the first / last row, a slot at or past pages * 16 inserts nothing
    (a slot inside is still inserted); the refusing default is unchanged."""
    qkv, cs, _ = draw(4, 1, seed=4)
    qkv = torch.cat([qkv[:1]] * 4)  # four equal rows: only the position and slot differ
    cache = torch.zeros(2, 1, 16, 128, dtype=torch.bfloat16)
    out, got = ref.qkv_epilogue_reference(qkv, torch.tensor([-3, 0, 64, 63]), cs, torch.tensor([32, 5, 99, 6]),
                                          cache, 1, bounds="kernel")
    same, want = ref.qkv_epilogue_reference(qkv, torch.tensor([0, 0, 63, 63]), cs, torch.tensor([-1, 5, -1, 6]),
                                            cache, 1)
    assert torch.equal(out.view(torch.int16), same.view(torch.int16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got.view(torch.int16).count_nonzero() > 0  # slots 5 and 6 were inserted
    # fault injection: a reference that wrapped -3 (torch indexing) or inserted slot 32 would differ
    wrapped, _ = ref.qkv_epilogue_reference(qkv, torch.tensor([61, 0, 63, 63]), cs, torch.tensor([-1, 5, -1, 6]),
                                            cache, 1)
    assert not torch.equal(out.view(torch.int16), wrapped.view(torch.int16))
    with pytest.raises(ValueError, match="bounds must be one of"):
        ref.qkv_epilogue_reference(qkv, torch.tensor([0] * 4), cs, torch.tensor([0] * 4), cache, 1, bounds="clamp")


def test_a_nope_layer_takes_any_position():
    """Without a table the position is never read: any value is taken, and gives the same bits."""
    qkv, _, _ = draw(1, 1, seed=4)
    cache = torch.zeros(1, 1, 16, 128, dtype=torch.bfloat16)
    out, kept = ref.qkv_epilogue_reference(qkv, torch.tensor([-5]), None, torch.tensor([-1]), cache, 1)
    at_zero, _ = ref.qkv_epilogue_reference(qkv, torch.tensor([0]), None, torch.tensor([-1]), cache, 1)
    assert torch.equal(out.view(torch.int16), at_zero.view(torch.int16))
    assert torch.equal(kept.view(torch.int16), cache.view(torch.int16))  # slot -1: nothing inserted


def test_precise_is_the_cpu_default():
    assert nx.PRECISE.name == "precise"
