"""Tail cases and their inputs, generated per (case, rank) from the seed.

A `TailCase` names one parity point (mode, tp, tokens, route-weight dtype, norm order, input
family, seed). `make_tail_inputs(case)` draws the stock's input (`UnfinalizedMoEOutput` per rank)
for it, fresh for every seed and deterministic for a given case: every rank, in any process,
can draw its own inputs or any peer's without communication.

Input families:
- `random`: Gaussian rows in BF16, router-like positive route weights, gamma ~ N(0, 0.1).
- `adversarial`: the random draw with rows overwritten by what breaks sloppy kernels: all -0.0,
  all +0.0, BF16 subnormals, order-sensitive rows (+-2^24 beside 1), magnitudes whose squares
  overflow FP32, rows that cancel across TP ranks to (-)0.0, and zero or tiny route weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch

from musebench import config
from musebench.layout import UnfinalizedMoEOutput

MODES = ("ep", "tp")
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
NORM_ORDERS = ("before", "after")
INPUT_FAMILIES = ("random", "adversarial")
EP_LAUNCHES = ("two", "single")  # the cute EP tail: publisher + reduction, or one kernel


@dataclass(frozen=True)
class TailCase:
    mode: str
    tp: int
    tokens: int
    weight_dtype: str = "bf16"
    norm: str = "before"
    inputs: str = "random"
    seed: int = 0
    width: int = config.MOE_POOLED_WIDTH
    top_k: int = config.TOP_K
    num_experts: int = config.NUM_EXPERTS
    eps: float = config.POST_NORM_EPS
    gain_center: float = config.POST_NORM_GAIN_CENTER

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype must be one of {tuple(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.norm not in NORM_ORDERS:
            raise ValueError(f"norm must be one of {NORM_ORDERS}, got {self.norm!r}")
        if self.inputs not in INPUT_FAMILIES:
            raise ValueError(f"inputs must be one of {INPUT_FAMILIES}, got {self.inputs!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be positive, got {self.tp}")
        if self.tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {self.tokens}")

    @property
    def kernel(self) -> str:
        return f"{self.mode}_tail"

    @property
    def family(self) -> str:
        """The case family (`musebench.cases.FAMILIES`) that runs it."""
        return f"{self.mode}_tail"

    @property
    def weight_before_norm(self) -> bool:
        return self.norm == "before"

    def label(self) -> str:
        return f"{self.kernel} tp={self.tp} m={self.tokens} w={self.weight_dtype} norm={self.norm} {self.inputs} seed={self.seed}"

    def with_seed(self, seed: int) -> TailCase:
        return replace(self, seed=seed)


@dataclass(frozen=True)
class TailInputs:
    per_rank: tuple[UnfinalizedMoEOutput, ...]
    norm_weight: torch.Tensor  # BF16 [width], the post-expert norm's gamma (zero-centred)


def _seed_for(case: TailCase, *parts: object) -> int:
    key = repr((case.mode, case.tp, case.tokens, case.weight_dtype, case.norm, case.inputs, case.seed, case.width, *parts))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _generator(case: TailCase, *parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(_seed_for(case, *parts))


def expert_owner(expert: int, tp: int, num_experts: int) -> int:
    """EP sharding: contiguous expert ranges, as even as tp allows (tp need not divide 256)."""
    return expert * tp // num_experts


def _routes(case: TailCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts [m, k] (distinct per token) and route weights [m, k] in the case's dtype."""
    g = _generator(case, "routing")
    m, k = case.tokens, case.top_k
    experts = torch.stack([torch.randperm(case.num_experts, generator=g)[:k] for _ in range(m)]) if m else torch.zeros(0, k, dtype=torch.long)
    scores = torch.sigmoid(torch.randn(m, k, generator=g))
    weights = scores / (scores.sum(dim=1, keepdim=True) + 1e-15) * 2.5
    if case.inputs == "adversarial" and m:
        weights[0, 0] = 0.0  # a route that contributes nothing
        weights[m - 1, k - 1] = 1e-30  # a weight that underflows the product
    return experts, weights.to(WEIGHT_DTYPES[case.weight_dtype])


def _permuted_order(experts: torch.Tensor, keep: torch.Tensor) -> list[tuple[int, int]]:
    """The grouped GEMM's row order: by expert, then by token."""
    m, k = experts.shape
    routes = [(int(experts[t, j]), t, j) for t in range(m) for j in range(k) if bool(keep[t, j])]
    routes.sort()
    return [(t, j) for _, t, j in routes]


def _random_rows(case: TailCase, rank: int, count: int) -> torch.Tensor:
    g = _generator(case, "rows", rank)
    return torch.randn(count, case.width, generator=g).to(torch.bfloat16)


def _make_adversarial(rows: torch.Tensor, case: TailCase, rank: int) -> torch.Tensor:
    """Overwrite a seeded selection of rows with the adversarial patterns (in place, returned)."""
    if rows.shape[0] == 0:
        return rows
    g = _generator(case, "adversarial", rank)
    width = case.width
    subnormal = torch.tensor(2.0**-130, dtype=torch.bfloat16)
    patterns = [
        lambda: torch.full((width,), -0.0, dtype=torch.bfloat16),
        lambda: torch.zeros(width, dtype=torch.bfloat16),
        lambda: (torch.randint(-3, 4, (width,), generator=g).to(torch.bfloat16) * subnormal),
        lambda: torch.where(torch.arange(width) % 3 == 0, torch.tensor(2.0**24), torch.tensor(1.0)).to(torch.bfloat16)
        * torch.where(torch.rand(width, generator=g) < 0.5, -1.0, 1.0).to(torch.bfloat16),
        lambda: (torch.randn(width, generator=g) * 2.0**70).to(torch.bfloat16),  # squares overflow FP32
        lambda: torch.where(torch.arange(width) % 2 == 0, -0.0, 0.0).to(torch.bfloat16),
    ]
    picks = torch.randperm(rows.shape[0], generator=g)[: len(patterns)]
    for pattern, row in zip(patterns, picks.tolist()):
        rows[row] = pattern()
    return rows


def _ep_inputs(case: TailCase, experts: torch.Tensor, weights: torch.Tensor) -> list[UnfinalizedMoEOutput]:
    owner = torch.tensor([[expert_owner(int(e), case.tp, case.num_experts) for e in row] for row in experts.tolist()], dtype=torch.long).reshape(
        experts.shape
    )
    per_rank = []
    for rank in range(case.tp):
        order = _permuted_order(experts, owner == rank)
        rows = _random_rows(case, rank, len(order))
        if case.inputs == "adversarial":
            rows = _make_adversarial(rows, case, rank)
        index = torch.full((case.tokens, case.top_k), -1, dtype=torch.int32)
        for row, (t, j) in enumerate(order):
            index[t, j] = row
        per_rank.append(UnfinalizedMoEOutput(rows.contiguous(), weights.clone(), index))
    return per_rank


def _tp_inputs(case: TailCase, experts: torch.Tensor, weights: torch.Tensor) -> list[UnfinalizedMoEOutput]:
    order = _permuted_order(experts, torch.ones_like(experts, dtype=torch.bool))
    index = torch.full((case.tokens, case.top_k), -1, dtype=torch.int32)
    for row, (t, j) in enumerate(order):
        index[t, j] = row
    per_rank = []
    shared = _random_rows(case, -1, len(order))
    for rank in range(case.tp):
        # K-partials of one GEMM2: the ranks' rows add up to the route's row.
        rows = (_random_rows(case, rank, len(order)).float() * 0.5 + shared.float() / case.tp).to(torch.bfloat16)
        if case.inputs == "adversarial" and len(order):
            rows = _make_adversarial(rows, case, rank)
            # A route whose K-partials cancel exactly: +x on even ranks, -x on odd ones (and -0.0 at tp odd).
            cancel = _random_rows(case, -2, 1)[0]
            rows[len(order) - 1] = cancel if rank % 2 == 0 else -cancel
            if case.tp % 2 and rank == case.tp - 1:
                rows[len(order) - 1] = torch.full_like(cancel, -0.0)
        per_rank.append(UnfinalizedMoEOutput(rows.contiguous(), weights.clone(), index.clone()))
    return per_rank


def make_tail_inputs(case: TailCase) -> TailInputs:
    """Every rank's input for `case`, deterministic in the case (seed included)."""
    experts, weights = _routes(case)
    g = _generator(case, "gamma")
    norm_weight = (torch.randn(case.width, generator=g) * 0.1).to(torch.bfloat16)
    per_rank = _ep_inputs(case, experts, weights) if case.mode == "ep" else _tp_inputs(case, experts, weights)
    return TailInputs(tuple(per_rank), norm_weight)


def tail_cases(
    *,
    modes: tuple[str, ...],
    tp: int,
    tokens: tuple[int, ...],
    weight_dtypes: tuple[str, ...],
    norms: tuple[str, ...],
    inputs: tuple[str, ...],
    seeds: tuple[int, ...],
) -> list[TailCase]:
    """The cross product, in a stable order (mode, inputs, weight dtype, norm, tokens, seed)."""
    return [
        TailCase(mode=mode, tp=tp, tokens=m, weight_dtype=w, norm=n, inputs=family, seed=seed)
        for mode in modes
        for family in inputs
        for w in weight_dtypes
        for n in norms
        for m in tokens
        for seed in seeds
    ]
