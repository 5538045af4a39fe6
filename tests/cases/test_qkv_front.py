"""The qkv_front family's inputs and checks on CPU: the adversarial draw, the expected out and
cache from a projection (the reference), and fault injection proving the checks fail: a flipped
bit of out, a write outside the slots, a projection worse than cuBLAS's."""

from __future__ import annotations

import pytest
import torch

from musebench import numerics as nx
from musebench.cases import qkv_front as front
from musebench.harness import checks


def small_case(**kw):
    return front.FrontCase(tp=16, tokens=kw.pop("tokens", 6), **kw)


def test_inputs_are_deterministic_and_adversarial():
    case = small_case(inputs="adversarial")
    a, b = front.make_inputs(case), front.make_inputs(case)
    assert torch.equal(a.x.view(torch.int16), b.x.view(torch.int16))
    assert not a.x[0].any() and a.positions[0] == 0 and a.positions[1] == front.MAX_POS - 1
    assert a.slots[2] == -1 and a.slots[4] == a.slots[3] and torch.equal(a.x[4], a.x[3])
    assert len(a.weights) == 16 and a.weights[0].shape == (1152, 8192)
    assert front.make_inputs(small_case(rope=False)).cos_sin is None


@pytest.mark.parametrize("tp", [2, 3, 32])
def test_other_tps_are_refused(tp):
    with pytest.raises(ValueError, match="tp 4, 8, 16"):
        front.kv_heads_for(tp)


def _projection(inputs):
    return (inputs.x.float() @ inputs.weights[0].float().t()).bfloat16()


def _got(case, inputs, projection):
    """What a correct kernel writes: the reference's out and cache (from the poisoned cache)."""
    return front.expected_from_projection(case, inputs, projection, nx.PRECISE)


def _mismatches(got, want):
    return sum(checks.compare_bits(got[k], want[k])[0] for k in want)


@pytest.mark.parametrize("rope", [True, False])
def test_a_correct_output_passes_and_faults_fail(rope):
    case = small_case(inputs="adversarial", rope=rope)
    inputs = front.make_inputs(case)
    projection = _projection(inputs)
    want = _got(case, inputs, projection)
    got = {k: v.clone() for k, v in want.items()}
    assert _mismatches(got, want) == 0
    flipped = {k: v.clone() for k, v in want.items()}
    checks.flip_one_bit(flipped[front.OUT], index=5)
    assert _mismatches(flipped, want) == 1
    stray = {k: v.clone() for k, v in want.items()}
    free_page = 7 if int(inputs.slots.max()) // 16 != 7 else 0
    stray[front.CACHE][free_page, 0, 3, 0] = 1.0  # a write outside the slots
    assert _mismatches(stray, want) == 1
    # a write into a negative slot's would-be cell: row 2 is skipped, so nothing may land anywhere else
    cache = want[front.CACHE]
    written = ~checks.poison(torch.empty_like(cache)).view(torch.int16).eq(cache.view(torch.int16))
    assert int(written.any(dim=-1).sum()) == len({s for s in inputs.slots.tolist() if s >= 0})


def test_v_written_unnormed_into_the_cache():
    case = small_case(tokens=2)
    inputs = front.make_inputs(case)
    projection = _projection(inputs)
    want = _got(case, inputs, projection)
    slot = int(inputs.slots[0])
    v = projection[0, 9 * 64: 10 * 64]
    assert torch.equal(want[front.CACHE][slot // 16, 0, slot % 16, 64:].view(torch.int16), v.view(torch.int16))


def test_projection_verdict_fails_a_worse_projection():
    case = small_case(tokens=3)
    inputs = front.make_inputs(case)
    exact = inputs.x.double() @ inputs.weights[0].double().t()
    good = exact.bfloat16()
    line, ok = front.projection_verdict(good, good, inputs.x, inputs.weights[0])
    assert ok and "cuBLAS max" in line
    worse = good.clone()
    worse[0, 0] = float(worse[0, 0]) + 0.5
    assert front.projection_verdict(worse, good, inputs.x, inputs.weights[0])[1] is False


def test_bytes_moved_is_the_weight():
    assert front.bytes_moved(front.FrontCase(tp=8, tokens=1)) == 2304 * 8192 * 2
