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
