"""Input generation: deterministic per case, fresh per seed, the stock's layouts, adversarial content."""

from __future__ import annotations

import pytest
import torch

from musebench.harness.cases import TailCase, expert_owner, make_tail_inputs, tail_cases


def _bits(inputs):
    return [u.gemm2_permuted.view(torch.int16) for u in inputs.per_rank]


def test_same_case_same_inputs_new_seed_new_inputs():
    case = TailCase(mode="ep", tp=4, tokens=8)
    a, b, c = make_tail_inputs(case), make_tail_inputs(case), make_tail_inputs(case.with_seed(1))
    assert all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b)))
    assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(_bits(a), _bits(c)))


@pytest.mark.parametrize("tp", [2, 3, 8, 32])  # even splits, an uneven split, the largest group
def test_ep_layout_each_route_on_exactly_one_rank(tp):
    case = TailCase(mode="ep", tp=tp, tokens=8)
    inputs = make_tail_inputs(case)
    held = sum((u.expanded_idx_to_permuted_idx >= 0).int() for u in inputs.per_rank)
    assert bool((held == 1).all())
    for u in inputs.per_rank:
        u.validate()
        assert u.route_weights.dtype == torch.bfloat16


def test_expert_owner_covers_every_rank():
    for tp in (2, 3, 7, 32):
        owners = {expert_owner(e, tp, 256) for e in range(256)}
        assert owners == set(range(tp))


def test_tp_layout_every_rank_holds_every_route():
    case = TailCase(mode="tp", tp=4, tokens=5, weight_dtype="fp32")
    inputs = make_tail_inputs(case)
    index = inputs.per_rank[0].expanded_idx_to_permuted_idx
    assert bool((index >= 0).all())
    for u in inputs.per_rank:
        assert torch.equal(u.expanded_idx_to_permuted_idx, index)
        assert u.route_weights.dtype == torch.float32


def test_adversarial_inputs_hold_the_hard_values():
    case = TailCase(mode="ep", tp=2, tokens=8, inputs="adversarial")
    rows = torch.cat([u.gemm2_permuted for u in make_tail_inputs(case).per_rank]).float()
    bits = torch.cat([u.gemm2_permuted.view(torch.int16) for u in make_tail_inputs(case).per_rank])
    assert bool((bits == -32768).any()), "no -0.0"
    assert bool(((rows != 0) & (rows.abs() < 2.0**-126)).any()), "no subnormal"
    assert bool((rows.abs() >= 2.0**64).any()), "no magnitude whose square overflows"
    assert bool((rows == 0).all(dim=1).any()), "no zero row"


def test_tp_adversarial_rows_cancel_across_ranks():
    case = TailCase(mode="tp", tp=4, tokens=2, inputs="adversarial")
    rows = torch.stack([u.gemm2_permuted[-1].float() for u in make_tail_inputs(case).per_rank])
    assert bool((rows.sum(dim=0) == 0).all())


def test_zero_tokens_is_a_valid_case():
    inputs = make_tail_inputs(TailCase(mode="ep", tp=2, tokens=0))
    assert all(u.tokens == 0 for u in inputs.per_rank)


def test_bad_case_values_raise():
    with pytest.raises(ValueError):
        TailCase(mode="xp", tp=2, tokens=1)
    with pytest.raises(ValueError):
        TailCase(mode="ep", tp=2, tokens=1, weight_dtype="fp16")


def test_tail_cases_cross_product():
    cases = tail_cases(modes=("ep", "tp"), tp=2, tokens=(1, 2), weight_dtypes=("bf16", "fp32"), norms=("before",),
                       inputs=("random",), seeds=(0, 1))
    assert len(cases) == 2 * 2 * 2 * 2
    assert len(set(cases)) == len(cases)
