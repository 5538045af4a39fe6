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
- `edge`: the random draw with what the stock's contract allows and a model easily gets wrong,
  token t by its role t % 4 (m = 1 has role 0 only):
  0. missing routes and rounding ties. TP: routes 1 and 6 have index -1 on every rank, route 3
     on rank 1 only, and route 0's K-partials are v on rank 0, +-half an ULP of v on rank 1 and
     +0.0 elsewhere, so their sum is a tie at every column (both directions). EP: route 2 is held
     by no rank, route 0's row is +-1 with weight 1 and the others weigh 0, so with the weight
     after the norm its partial is gamma + 1 rounded once to BF16 (ties where gamma allows).
     Token 4: every route missing on every rank.
  1. NaN rows: one route's row holds NaNs of both signs, quiet and signalling, with varied
     payloads (TP: one rank's K-partial).
  2. huge values: a row at a quarter of the BF16 maximum in every 7th column (squares overflow
     FP32; TP: ranks 0 and 1 at three quarters, so the K-sum overflows to inf), a row at 2^100,
     and a weight of 2^120 (FP32) or the BF16 maximum.
  3. weights: a NaN weight (varied payloads) on a route no rank holds (EP: never read; TP: the
     stock weighs its zero row, NaN), a -0.0 weight; token 7 also a NaN weight on a held route.
  Every rank's rows end with two unreferenced rows of NaN (what index -1 read as the last row
  would see), and every route with index -1 everywhere has its row overwritten with NaN too. TP
  rows are wider than the 4096 columns the kernels read (`EDGE_EXTRA_COLUMNS` of NaN, +-inf and
  sentinel words 0x80008000 beyond; the TP kernel and the stock take a row stride of the rows'
  width). EP rows keep the case's width: musebench's EP kernel takes rows of exactly its width
  (the stock's publisher takes a wider `row_stride`; the reference and CPU model do too, tested
  in tests/stock and tests/cpu).
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
INPUT_FAMILIES = ("random", "adversarial", "edge")
ROUTING_INPUT_FAMILIES = ("random", "adversarial")  # the routing cases' draws (harness.routing); no edge family
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
    def family(self) -> str:
        """The case family (`musebench.cases.FAMILIES`) that runs it."""
        return f"{self.mode}_tail"

    @property
    def weight_before_norm(self) -> bool:
        return self.norm == "before"

    def label(self) -> str:
        return f"{self.family} tp={self.tp} m={self.tokens} w={self.weight_dtype} norm={self.norm} {self.inputs} seed={self.seed}"

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
    weights = weights.to(WEIGHT_DTYPES[case.weight_dtype])
    if case.inputs == "edge":
        _edge_weights(case, weights)
    return experts, weights


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
        if case.inputs == "edge":
            rows = _edge_ep_rows(case, rank, rows, index)
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
        rank_index = index.clone()
        if case.inputs == "edge":
            rows = _edge_tp_rows(case, rank, rows, rank_index)
        per_rank.append(UnfinalizedMoEOutput(rows.contiguous(), weights.clone(), rank_index))
    return per_rank


EDGE_EXTRA_COLUMNS = 40  # TP edge rows: columns beyond the 4096 the kernels read (a multiple of 8)
EDGE_PADDING_ROWS = 2  # unreferenced NaN rows after the last permuted row
# NaN words: both signs, quiet and signalling (BF16 0x7F81: payload 1), low and high payloads
BF16_NAN_BITS = (0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFD3)
FP32_NAN_BITS = (0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA5A5A5, 0xFFBFFFFF)
BF16_MAX = 3.3895313892515355e38
_EDGE_TIE, _EDGE_NAN_ROW, _EDGE_HUGE, _EDGE_WEIGHTS = range(4)  # token roles: t % 4
_EDGE_ALL_MISSING_TOKEN = 4
_EDGE_MISSING_EVERYWHERE = {_EDGE_TIE: (1, 6), _EDGE_WEIGHTS: (5,)}  # TP routes; EP drops route 2 of role 0
_EDGE_EP_DROPPED = {_EDGE_TIE: (2,), _EDGE_WEIGHTS: (5,)}


def _as_int(bits: int, width: int) -> int:
    """An unsigned bit pattern as the signed integer torch stores."""
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def _bf16_words(words: list[int]) -> torch.Tensor:
    return torch.tensor([_as_int(w, 16) for w in words], dtype=torch.int16).view(torch.bfloat16)


def _nan_row(width: int, offset: int = 0) -> torch.Tensor:
    """A BF16 row of NaNs cycling through BF16_NAN_BITS."""
    return _bf16_words([BF16_NAN_BITS[(offset + c) % len(BF16_NAN_BITS)] for c in range(width)])


def _garbage_columns(rows: int) -> torch.Tensor:
    """[rows, EDGE_EXTRA_COLUMNS] that no kernel may read: NaNs, +-inf, -0.0 pairs (the sentinel word)."""
    pattern = list(BF16_NAN_BITS) + [0x7F80, 0xFF80, 0x8000, 0x8000]
    words = [pattern[c % len(pattern)] for c in range(EDGE_EXTRA_COLUMNS)]
    return _bf16_words(words).reshape(1, -1).expand(rows, -1).clone()


def _edge_missing_everywhere(case: TailCase, t: int) -> tuple[int, ...]:
    """Routes of token t that no rank holds (index -1 on every rank)."""
    if t == _EDGE_ALL_MISSING_TOKEN:
        return tuple(range(case.top_k))
    table = _EDGE_EP_DROPPED if case.mode == "ep" else _EDGE_MISSING_EVERYWHERE
    return table.get(t % 4, ())


def _edge_weights(case: TailCase, weights: torch.Tensor) -> None:
    """The edge family's route weights, in place (dtype kept; NaN payloads written as bits)."""
    fp32 = weights.dtype == torch.float32
    bits = weights.view(torch.int32 if fp32 else torch.int16)
    nans = FP32_NAN_BITS if fp32 else tuple(b << 16 for b in BF16_NAN_BITS)
    for t in range(case.tokens):
        role = t % 4
        if role == _EDGE_TIE and case.mode == "ep" and t != _EDGE_ALL_MISSING_TOKEN:
            weights[t] = 0.0  # only route 0 contributes: its partial is its own rounding
            weights[t, 0] = 1.0
        elif role == _EDGE_HUGE:
            weights[t, 3] = 2.0**120 if fp32 else BF16_MAX
        elif role == _EDGE_WEIGHTS:
            nan = nans[t % len(nans)]
            bits[t, 5] = _as_int(nan if fp32 else nan >> 16, 32 if fp32 else 16)  # on a route no rank holds
            weights[t, 0] = -0.0
            if t == 7:  # a NaN weight on a held route
                other = nans[(t + 3) % len(nans)]
                bits[t, 1] = _as_int(other if fp32 else other >> 16, 32 if fp32 else 16)


def _edge_pad(rows: torch.Tensor) -> torch.Tensor:
    """rows followed by EDGE_PADDING_ROWS unreferenced NaN rows."""
    padding = torch.stack([_nan_row(rows.shape[1], offset=i) for i in range(EDGE_PADDING_ROWS)])
    return torch.cat([rows, padding])


def _edge_ep_rows(case: TailCase, rank: int, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One EP rank's edge rows (and index, in place): see the module docstring."""
    g = _generator(case, "edge", rank)
    width = case.width
    for t in range(case.tokens):
        role = t % 4
        held = index[t]
        for k in _edge_missing_everywhere(case, t):
            if held[k] >= 0:
                rows[held[k]] = _nan_row(width, offset=t + k)  # the dropped route's row: never read
                held[k] = -1
        if t == _EDGE_ALL_MISSING_TOKEN:
            continue
        if role == _EDGE_TIE and held[0] >= 0:
            signs = torch.where(torch.rand(width, generator=g) < 0.5, -1.0, 1.0)
            rows[held[0]] = signs.to(torch.bfloat16)
        elif role == _EDGE_NAN_ROW:
            k = int(torch.nonzero(held >= 0)[0]) if bool((held >= 0).any()) else None
            if k is not None:
                columns = torch.randperm(width, generator=g)[: len(BF16_NAN_BITS)]
                rows[held[k], columns] = _nan_row(len(BF16_NAN_BITS), offset=t)
        elif role == _EDGE_HUGE:
            if held[1] >= 0:
                signs = torch.where(torch.rand(width, generator=g) < 0.5, -1.0, 1.0)
                rows[held[1], ::7] = (signs[::7] * BF16_MAX / 4).to(torch.bfloat16)
            if held[2] >= 0:
                rows[held[2]] = (torch.randn(width, generator=g) * 2.0**100).to(torch.bfloat16)
    return _edge_pad(rows)


def _half_ulp(v: torch.Tensor) -> torch.Tensor:
    """BF16 +-2^(e - 8) for normal BF16 v of exponent e: v + it is a tie between two BF16 values."""
    exponent = (v.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    half = torch.exp2((exponent - 127 - 8).float())
    return (half * torch.sign(v.float())).to(torch.bfloat16)


def _edge_tp_rows(case: TailCase, rank: int, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One TP rank's edge rows (wider than the case's width) and index (in place)."""
    g = _generator(case, "edge", rank)
    width = case.width
    for t in range(case.tokens):
        role = t % 4
        routes = index[t]
        if t != _EDGE_ALL_MISSING_TOKEN and role == _EDGE_TIE:
            tie = _generator(case, "edge-tie", t)  # the same draw on every rank
            v = torch.randn(width, generator=tie).to(torch.bfloat16)
            v = torch.where(v.float().abs() < 2.0**-100, torch.ones_like(v), v)
            flip = torch.where(torch.rand(width, generator=tie) < 0.5, -1.0, 1.0).to(torch.bfloat16)
            part = v if rank == 0 else _half_ulp(v) * flip if rank == 1 else torch.zeros_like(v)
            rows[routes[0]] = part
            if rank == 1 % case.tp:
                routes[3] = -1  # one rank's K-partial missing
        elif role == _EDGE_NAN_ROW and rank == t % case.tp:
            columns = torch.randperm(width, generator=g)[: len(BF16_NAN_BITS)]
            rows[routes[2], columns] = _nan_row(len(BF16_NAN_BITS), offset=t)
        elif role == _EDGE_HUGE:
            signs = torch.where(torch.rand(width, generator=_generator(case, "edge-huge", t)) < 0.5, -1.0, 1.0)
            scale = 0.75 if rank < 2 else 0.25  # ranks 0 and 1 together overflow the K-sum
            rows[routes[1], ::7] = (signs[::7] * BF16_MAX * scale).to(torch.bfloat16)
            rows[routes[2]] = (torch.randn(width, generator=g) * 2.0**100).to(torch.bfloat16)
        for k in _edge_missing_everywhere(case, t):
            rows[routes[k]] = _nan_row(width, offset=t + k)  # the dropped route's row: never read
            routes[k] = -1
    rows = _edge_pad(rows)
    return torch.cat([rows, _garbage_columns(rows.shape[0])], dim=1)


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
