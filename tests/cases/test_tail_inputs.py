"""Input generation: deterministic per case, fresh per seed, the stock's layouts, adversarial content."""

from __future__ import annotations

import pytest
import torch

from musebench.cases.tail_inputs import TailCase, expert_owner, make_tail_inputs, tail_cases


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


# sha256 (first 16 hex digits) of every tensor of make_tail_inputs(case), seed 1: the random and
# adversarial draws are what the records were made with; a new family must not move them.
PINNED_DRAWS = {
    ("ep", "random", "bf16", "before", 3, 5): "14957045d695352e",
    ("ep", "random", "fp32", "after", 8, 8): "8e6cf1686797a8dc",
    ("ep", "adversarial", "bf16", "before", 3, 5): "0dcaec1e293b46df",
    ("ep", "adversarial", "fp32", "after", 8, 8): "dca6658c19c17854",
    ("tp", "random", "bf16", "before", 3, 5): "c7ecf2d2fe794abb",
    ("tp", "random", "fp32", "after", 8, 8): "22dac0dbdeab51d6",
    ("tp", "adversarial", "bf16", "before", 3, 5): "e03cab104642fdce",
    ("tp", "adversarial", "fp32", "after", 8, 8): "6c47af28fcdb6843",
}


@pytest.mark.parametrize("key", PINNED_DRAWS, ids=lambda key: "-".join(map(str, key)))
def test_random_and_adversarial_draws_are_unchanged(key):
    import hashlib

    mode, family, weights, norm, tp, m = key
    inputs = make_tail_inputs(TailCase(mode=mode, tp=tp, tokens=m, weight_dtype=weights, norm=norm, inputs=family, seed=1))
    h = hashlib.sha256()
    tensors = [inputs.norm_weight] + [t for u in inputs.per_rank
                                      for t in (u.gemm2_permuted, u.route_weights, u.expanded_idx_to_permuted_idx)]
    for t in tensors:
        t = t.contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    assert h.hexdigest()[:16] == PINNED_DRAWS[key]


def _nan_words(t: torch.Tensor) -> set[int]:
    bits = t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)
    mask = 0xFFFF if t.dtype == torch.bfloat16 else 0xFFFFFFFF
    return {v & mask for v in bits[torch.isnan(t.float())].tolist()}


@pytest.mark.parametrize("weights", ["bf16", "fp32"])
def test_tp_edge_inputs(weights):
    from musebench.cases import tail_inputs as cases

    case = TailCase(mode="tp", tp=4, tokens=8, weight_dtype=weights, norm="after", inputs="edge")
    inputs = make_tail_inputs(case)
    for rank, u in enumerate(inputs.per_rank):
        u.validate()
        rows, index = u.gemm2_permuted, u.expanded_idx_to_permuted_idx
        assert rows.shape[1] == 4096 + cases.EDGE_EXTRA_COLUMNS and rows.is_contiguous()  # row stride > 4096
        assert bool(torch.isnan(rows[:, 4096:].float()).any())  # garbage the kernels must not read
        padding = rows[-cases.EDGE_PADDING_ROWS:, :4096]
        assert bool(torch.isnan(padding.float()).all()) and int(index.max()) < rows.shape[0] - cases.EDGE_PADDING_ROWS
        assert bool((index[0, [1, 6]] == -1).all()) and bool((index[4] == -1).all())  # missing on every rank
        assert (int(index[0, 3]) == -1) == (rank == 1)  # missing on one rank
        for t, k in ((0, 1), (0, 6), (3, 5)):  # the dropped routes' rows are NaN: reading them shows
            assert not bool((inputs.per_rank[0].expanded_idx_to_permuted_idx[t, k] >= 0))
    all_rows = torch.cat([u.gemm2_permuted[:, :4096] for u in inputs.per_rank])
    nans = _nan_words(all_rows)
    assert {0x7FC0, 0xFFC0, 0x7F81, 0xFF81} <= nans  # both signs, quiet and signalling
    assert float(all_rows.float().abs()[torch.isfinite(all_rows.float())].max()) >= 2.0**127  # huge
    # route 0 of token 0: the K-partials' sum is a tie between two BF16 values at (nearly) every column
    route = [u.gemm2_permuted[int(inputs.per_rank[0].expanded_idx_to_permuted_idx[0, 0])].float() for u in inputs.per_rank]
    total = ((route[0] + route[1]) + route[2]) + route[3]
    ties = (total.view(torch.int32) & 0xFFFF) == 0x8000
    assert float(ties.float().mean()) > 0.9
    rounded = total.to(torch.bfloat16).float()
    assert bool((rounded > total).any()) and bool((rounded.abs() < total.abs()).any())  # ties go both ways
    w = inputs.per_rank[0].route_weights
    assert len(_nan_words(w[3:4, 5])) == 1 and len(_nan_words(w[7])) == 2  # NaN weights, varied payloads
    assert (w[3, 0].view(torch.int16 if weights == "bf16" else torch.int32).item() & 0xFFFF) in (0x8000, 0)  # -0.0


def test_ep_edge_inputs():
    from musebench.cases import tail_inputs as cases

    case = TailCase(mode="ep", tp=4, tokens=8, weight_dtype="fp32", norm="after", inputs="edge")
    inputs = make_tail_inputs(case)
    held = sum((u.expanded_idx_to_permuted_idx >= 0).int() for u in inputs.per_rank)
    assert int(held[0, 2]) == 0 and int(held[3, 5]) == 0 and int(held[4].sum()) == 0  # held by no rank
    assert int(held[7, 5]) == 0 and int(held.sum()) == 8 * 8 - 3 - 8  # every other route on exactly one rank
    for u in inputs.per_rank:
        u.validate()
        assert u.width == 4096  # the EP kernel takes rows of exactly its width
        assert bool(torch.isnan(u.gemm2_permuted[-cases.EDGE_PADDING_ROWS:].float()).all())
    weights = inputs.per_rank[0].route_weights
    assert weights[0].tolist() == [1.0] + [0.0] * 7  # the tie token: route 0 alone
    assert torch.isnan(weights[3, 5]) and torch.isnan(weights[7, 1])
    owner = next(u for u in inputs.per_rank if int(u.expanded_idx_to_permuted_idx[0, 0]) >= 0)
    assert set(owner.gemm2_permuted[int(owner.expanded_idx_to_permuted_idx[0, 0])].float().tolist()) == {-1.0, 1.0}
    rows = torch.cat([u.gemm2_permuted for u in inputs.per_rank])
    assert {0x7FC0, 0xFFC0, 0x7F81, 0xFF81} <= _nan_words(rows)
