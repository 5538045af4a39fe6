"""The CPU model of the tails produces the stock reference's bits on every rank."""

from __future__ import annotations

import pytest

from musebench.harness.cases import TailCase
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
    from musebench.harness.cases import TailInputs
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
    from musebench.harness.cases import TailInputs
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
