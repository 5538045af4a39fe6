"""The CPU model of the tails produces the stock reference's bits on every rank."""

from __future__ import annotations

import pytest

from musebench.cases.tail_inputs import TailCase
from musebench.harness.driver import RunOptions, run_virtual


@pytest.mark.parametrize(
    "tp, tokens",
    [(2, (1, 8)), (3, (1, 5)), (8, (1, 8)), (32, (2,))],  # smallest, uneven, decode, largest group
)
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_cpu_model_matches_reference(mode, tp, tokens):
    cases = [TailCase(mode=mode, tp=tp, tokens=m, inputs=family, weight_dtype=w, norm=n)
             for m in tokens for family, w, n in (("random", "bf16", "before"), ("adversarial", "fp32", "after"))]
    rows = run_virtual(cases, RunOptions(iters=2, warmup=0, timeout_s=20.0))
    for row in rows:
        assert row.passed, (row.error, row.first_mismatch)


def test_repeated_calls_wrap_the_generations():
    """More calls than generations, back to back, no barrier: every call's digest is the same."""
    rows = run_virtual([TailCase(mode="ep", tp=4, tokens=3)], RunOptions(iters=7, warmup=0))
    assert rows[0].passed and rows[0].deterministic


def test_tp_owner_keeps_negative_zero_copies_are_scrubbed_per_word(monkeypatch):
    """tp=3 (FMA-chain combine): products that underflow below zero leave -0.0 on the owner only."""
    import torch

    from musebench.cases import tp_tail
    from musebench.cases.tail_inputs import TailInputs
    from musebench.layout import UnfinalizedMoEOutput

    case = TailCase(mode="tp", tp=3, tokens=2, weight_dtype="fp32", norm="before")
    rows = -torch.ones(16, 4096, dtype=torch.bfloat16)  # every normalized value is negative
    weights = torch.full((2, 8), 1e-45, dtype=torch.float32)  # every product underflows to -0.0
    index = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    per_rank = tuple(UnfinalizedMoEOutput(rows.clone(), weights, index) for _ in range(3))
    inputs = TailInputs(per_rank, torch.zeros(4096, dtype=torch.bfloat16))
    monkeypatch.setattr(tp_tail, "make_inputs", lambda c: inputs)
    row = run_virtual([case], RunOptions(iters=1, warmup=0))[0]
    assert row.passed, (row.error, row.first_mismatch)
    assert "extension" in row.stock_path
    # token 0 is owned by rank 0, token 1 by rank 1: each keeps -0.0 in its own row only, and
    # rank 2 owns none, so the three ranks hold three different (stock-correct) outputs
    assert len({r.digest for r in row.ranks}) == 3
    assert row.rank_identical


def test_tp_expert_owner_path_delivers_the_owners_bits_everywhere(monkeypatch):
    """tp=4, m=5 (expert-owner): sums in [-2^-134, 0) round to -0.0, and every rank gets them."""
    import torch

    from musebench.cases import tp_tail
    from musebench.cases.tail_inputs import TailInputs
    from musebench.layout import UnfinalizedMoEOutput

    case = TailCase(mode="tp", tp=4, tokens=5, weight_dtype="fp32", norm="before")
    rows = -torch.ones(40, 4096, dtype=torch.bfloat16)
    weights = torch.full((5, 8), 1e-42, dtype=torch.float32)  # products are negative subnormals
    index = torch.arange(40, dtype=torch.int32).reshape(5, 8)
    per_rank = tuple(UnfinalizedMoEOutput(rows.clone(), weights, index) for _ in range(4))
    inputs = TailInputs(per_rank, torch.zeros(4096, dtype=torch.bfloat16))
    monkeypatch.setattr(tp_tail, "make_inputs", lambda c: inputs)
    row = run_virtual([case], RunOptions(iters=1, warmup=0))[0]
    assert "expert-owner" in row.stock_path
    assert row.passed, (row.error, row.first_mismatch)
    assert len({r.digest for r in row.ranks}) == 1


def _run_on(monkeypatch, case, inputs, **options):
    """run_virtual on given inputs; the row and the reference's per-rank bits."""
    from musebench.harness import driver

    family = driver.family_of(case)
    monkeypatch.setattr(family, "make_inputs", lambda c: inputs)
    run_options = RunOptions(iters=1, warmup=0, **options)
    row = run_virtual([case], run_options)[0]
    expected = driver.expected_for(case, inputs, run_options)
    return row, [want["out"] for want in expected.per_rank]


@pytest.mark.parametrize("mode, tp", [("ep", 2), ("tp", 3), ("tp", 2)])  # EP; TP token-owner copies; TP expert-owner
def test_nan_outputs_are_the_canonical_nan_on_every_rank(monkeypatch, mode, tp):
    """NaN of any sign and payload in a row leaves the canonical 0x7FFF (the stock's cvt) in every
    rank's output, including the copies the TP owners hand over."""
    import torch

    from musebench.cases.tail_inputs import TailInputs
    from musebench.layout import UnfinalizedMoEOutput

    case = TailCase(mode=mode, tp=tp, tokens=2, weight_dtype="fp32", norm="before")
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(16, 4096, generator=g).to(torch.bfloat16)
    bits = rows.view(torch.int16)
    bits[0, 5], bits[3, 100], bits[9, 4095] = 0x7FC1, -0x3F, 0x7F81  # +qNaN, -qNaN (0xffc1), +sNaN: tokens 0 and 1
    weights = torch.full((2, 8), 0.125, dtype=torch.float32)
    index = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    per_rank = []
    for rank in range(tp):
        if mode == "ep":  # routes alternate between the ranks
            mine = torch.where(torch.arange(16).reshape(2, 8) % tp == rank, index, torch.full_like(index, -1))
            per_rank.append(UnfinalizedMoEOutput(rows.clone(), weights, mine))
        else:
            per_rank.append(UnfinalizedMoEOutput(rows.clone(), weights, index))
    inputs = TailInputs(tuple(per_rank), torch.zeros(4096, dtype=torch.bfloat16))
    row, wants = _run_on(monkeypatch, case, inputs)
    assert row.passed, (row.error, row.first_mismatch)
    for want in wants:
        nan = torch.isnan(want.float())
        assert bool(nan[0].all()) and bool(nan[1].all())  # a NaN column poisons its route's whole row
        assert bool((want.view(torch.int16)[nan] == 0x7FFF).all())


@pytest.mark.parametrize("extra_columns", [0, 40])  # rows of 4096 columns; wider rows
@pytest.mark.parametrize("mode, tp", [("ep", 2), ("tp", 3), ("tp", 2)])  # EP; TP token-owner; TP expert-owner
def test_missing_routes_and_wide_rows_match_the_reference(monkeypatch, mode, tp, extra_columns):
    """Index -1 is a zero row, never the last row; rows wider than 4096 columns (NaN beyond) are
    read to 4096, at a row stride of their width."""
    import torch

    from musebench.cases.tail_inputs import TailInputs
    from musebench.layout import UnfinalizedMoEOutput

    case = TailCase(mode=mode, tp=tp, tokens=2, weight_dtype="bf16", norm="after")
    g = torch.Generator().manual_seed(11)
    extra = torch.full((16, extra_columns), float("nan"), dtype=torch.bfloat16)
    index = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    index[0, 3] = -1  # a route no rank holds
    weights = torch.full((2, 8), 0.25, dtype=torch.bfloat16)
    per_rank = []
    for rank in range(tp):
        rows = torch.randn(16, 4096, generator=g).to(torch.bfloat16)
        rows[15] = 3.0  # the last row: what index -1 would read
        mine = index.clone()
        if mode == "ep":  # routes alternate between the ranks
            mine = torch.where(torch.arange(16).reshape(2, 8) % tp == rank, index, torch.full_like(index, -1))
        elif rank == 1:
            mine[1, 5] = -1  # one rank's K-partial missing
        per_rank.append(UnfinalizedMoEOutput(torch.cat([rows, extra], dim=1).contiguous(), weights, mine))
    inputs = TailInputs(tuple(per_rank), (torch.randn(4096, generator=g) * 0.1).to(torch.bfloat16))
    row, wants = _run_on(monkeypatch, case, inputs)
    assert row.passed, (row.error, row.first_mismatch)
    assert not bool(torch.isnan(wants[0].float()).any())


@pytest.mark.parametrize("tp", [3, 4])  # token-owner copies (extension); expert-owner
@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_cpu_model_matches_reference_on_edge_inputs(mode, tp):
    """The `edge` family (missing routes, NaN payloads, huge values, ties, wide TP rows): m = 4
    holds each token role once, m = 8 twice (token 4: every route missing)."""
    cases = [TailCase(mode=mode, tp=tp, tokens=m, inputs="edge", weight_dtype=w, norm=n)
             for m, w, n in ((4, "bf16", "before"), (8, "fp32", "after"))]
    rows = run_virtual(cases, RunOptions(iters=1, warmup=0, timeout_s=20.0))
    for row in rows:
        assert row.passed, (row.error, row.first_mismatch)
