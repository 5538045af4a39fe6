"""The check's verdicts (`harness.measure.evaluate`), on CPU: rank identity output by output, so a
rank that differs on an output the stock gives every rank fails even where another output is each
rank's own; several expectations of one output must all hold."""

from __future__ import annotations

import torch

from musebench.harness.case import Expected
from musebench.harness.measure import RankOutcome, evaluate
from musebench.harness.results import CaseResult

IDS = torch.arange(16, dtype=torch.int32).reshape(2, 8)


def _row() -> CaseResult:
    return CaseResult(kernel="routing", mode="routing", tp=2, tokens=2, weight_dtype="fp32", norm="renorm",
                      inputs="random", seed=0, backend="cute", launcher="virtual", transport="local", stock="triton")


def _expected() -> Expected:
    """ids the same on both ranks (the stock's and the reference's), metadata each rank's own."""
    return Expected([{"ids": (IDS, IDS.clone()), "metadata": torch.full((4,), rank, dtype=torch.int32)}
                     for rank in range(2)], "test")


def _outcomes(ids_of_rank1: torch.Tensor) -> list[RankOutcome]:
    return [RankOutcome(rank=0, outputs={"ids": IDS.clone(), "metadata": torch.full((4,), 0, dtype=torch.int32)}),
            RankOutcome(rank=1, outputs={"ids": ids_of_rank1, "metadata": torch.full((4,), 1, dtype=torch.int32)})]


def test_ranks_that_agree_where_the_stock_does_pass():
    row = evaluate(_row(), 2, _outcomes(IDS.clone()), _expected())
    assert row.passed and row.rank_identical


def test_a_rank_that_differs_on_a_shared_output_breaks_rank_identity():
    flipped = IDS.clone()
    flipped[1, 3] ^= 1
    row = evaluate(_row(), 2, _outcomes(flipped), _expected())
    assert not row.rank_identical  # metadata differs per rank by design: it must not hide the ids
    assert row.mismatches == 2 and row.first_mismatch.rank == 1  # against both expectations of ids
