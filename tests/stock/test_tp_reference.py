"""The TP tail stock reference (musebench.stock.tp): dispatch, combines, trees, signed zeros, extension.

The oracle here is a scalar model written from the contract (docs/contract-tp.md) with Python
integers: every binary32 operation is the exact rational result rounded once to nearest-even by
integer arithmetic, so it shares no arithmetic with torch or with musebench.numerics (only the
injected rsqrt stand-in, which is an approximation object, not a reduction).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from musebench.layout import UnfinalizedMoEOutput
from musebench.numerics import MIN_EPS, PRECISE
from musebench.stock.tp import (
    EXPERT_OWNER,
    EXTENSION,
    TOKEN_OWNER,
    TOKEN_OWNER_CHUNKED,
    TpStockPath,
    sum_of_squares,
    token_crossover,
    tp_rank_output,
    tp_split,
    tp_stock_path,
    tp_tail_reference,
)

H = 4096
K = 8

# ---------------------------------------------------------------------------------------------
# Scalar binary32 model (exact rationals, one rounding per operation).


def _round_f32(num: int, k: int) -> float:
    """num * 2**-k rounded to binary32, nearest-even, subnormals and overflow included."""
    if num == 0:
        return 0.0
    neg = num < 0
    n = -num if neg else num
    e = n.bit_length() - 1 - k
    q = max(e, -126) - 23  # exponent of one unit in the last place
    shift = k + q
    if shift <= 0:
        mant = n << -shift
    else:
        mant = n >> shift
        rem = n - (mant << shift)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and mant & 1):
            mant += 1
    if mant == 0:
        return -0.0 if neg else 0.0
    if mant.bit_length() + q > 128:
        return -math.inf if neg else math.inf
    value = math.ldexp(mant, q)
    return -value if neg else value


def _ratio(x: float) -> tuple[int, int]:
    n, d = x.as_integer_ratio()
    return n, d.bit_length() - 1  # d is a power of two


def _exact_sum(a: float, b: float) -> float:
    (na, ka), (nb, kb) = _ratio(a), _ratio(b)
    k = max(ka, kb)
    return _round_f32((na << (k - ka)) + (nb << (k - kb)), k)


def s_add(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return a + b
    if a == 0 and b == 0:
        return -0.0 if (math.copysign(1, a) < 0 and math.copysign(1, b) < 0) else 0.0
    return _exact_sum(a, b)  # an exact zero sum of nonzero terms is +0.0 (_round_f32(0, k))


def s_mul(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return a * b
    p = a * b  # two binary32 values: the product is exact in binary64
    if p == 0:
        return p
    n, k = _ratio(p)
    return _round_f32(n, k)


def s_fma(a: float, b: float, c: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)):
        return a * b + c
    p = a * b  # exact
    if p == 0 and c == 0:
        return -0.0 if (math.copysign(1, p) < 0 and math.copysign(1, c) < 0) else 0.0
    if p == 0:
        return c
    (n_p, k_p), (n_c, k_c) = _ratio(p), _ratio(c)
    k = max(k_p, k_c)
    total = (n_p << (k - k_p)) + (n_c << (k - k_c))
    if total == 0:
        return 0.0
    return _round_f32(total, k)


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def s_bf16_bits(x: float) -> int:
    """binary32 -> bfloat16 bits, nearest-even (x must already be a binary32 value)."""
    if math.isnan(x):
        return 0x7FC0
    b = f32_bits(x)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def s_bf16(x: float) -> float:
    return bits_f32(s_bf16_bits(x) << 16)


def s_f32(x: float) -> float:
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def s_rsqrt(x: float) -> float:
    return float(PRECISE.rsqrt(torch.tensor([x], dtype=torch.float32))[0])


def s_sum_of_squares(u: list[float], split: int) -> float:
    threads = []
    for t in range(H // 8):
        s = 0.0
        for e in range(8):
            v = u[8 * t + e]
            s = s_fma(v, v, s)
        threads.append(s)

    def butterfly(lanes: list[float]) -> float:
        for off in (1, 2, 4, 8, 16):
            lanes = [s_add(lanes[i], lanes[i ^ off]) for i in range(32)]
        return lanes[0]

    warps = [butterfly(threads[32 * w : 32 * w + 32]) for w in range(16)]
    if split == 1:
        return butterfly(warps + [0.0] * 16)
    per = 16 // split
    ctas = []
    for b in range(split):
        v = 0.0
        for w in range(per):
            v = s_add(v, warps[b * per + w])
        ctas.append(v)
    total = 0.0
    for v in ctas:
        total = s_add(total, v)
    return total


def scalar_tail_token(
    rank_rows: list[list[list[float] | None]],  # [rank][route] -> 4096 widened BF16 values, or None
    weights: list[float],
    gamma: list[float],
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    path: TpStockPath,
) -> list[int]:
    """One token's output BF16 bits, from the contract alone."""
    tp = len(rank_rows)
    gain = [s_add(g, s_f32(gain_center)) for g in gamma]
    ys = []
    for k in range(K):
        x = []
        for c in range(H):
            acc = 0.0
            for r in range(tp):
                row = rank_rows[r][k]
                acc = s_add(acc, 0.0 if row is None else row[c])
            x.append(s_bf16(acc))
        u = [s_mul(x[c], gain[c]) for c in range(H)] if weight_before_norm else x
        q = s_sum_of_squares(u, path.split)
        rs = s_rsqrt(s_fma(q, 2.0**-12, s_f32(eps)))
        if weight_before_norm:
            ys.append([s_mul(u[c], rs) for c in range(H)])
        else:
            ys.append([s_mul(s_mul(x[c], rs), gain[c]) for c in range(H)])
    out = []
    for c in range(H):
        if path.combine == "owner-partials":
            ko = K // tp
            total = 0.0
            for owner in range(tp):
                part = 0.0
                for k in range(owner * ko, (owner + 1) * ko):
                    part = s_fma(weights[k], ys[k][c], part)
                if part == 0:
                    part = 0.0  # the FP32 hop scrubs -0.0
                total = s_add(total, part)
        elif path.combine == "rounded-products":
            total = 0.0
            for k in range(K):
                total = s_add(total, s_mul(ys[k][c], weights[k]))
        else:
            total = 0.0
            for k in range(K):
                total = s_fma(weights[k], ys[k][c], total)
        out.append(s_bf16_bits(total))
    return out


def test_scalar_model_self_check() -> None:
    assert s_add(1.0, 2.0**-24) == 1.0  # tie to even
    assert s_add(1.0, 2.0**-24 + 2.0**-40) == 1.0 + 2.0**-23
    assert s_add(-0.0, -0.0) == 0 and math.copysign(1, s_add(-0.0, -0.0)) < 0
    assert math.copysign(1, s_add(1.0, -1.0)) > 0
    assert s_mul(2.0**-100, 2.0**-49) == 2.0**-149  # smallest subnormal
    assert s_mul(2.0**-100, 2.0**-50) == 0.0  # tie to even -> 0
    assert math.copysign(1, s_fma(2.0**-40, -(2.0**-120), 0.0)) < 0  # underflow keeps the sign
    assert s_fma(3.0, 2.0**126, 2.0**127) == math.inf
    assert s_fma(-(2.0**64), 2.0**64, 2.0**-100) == -math.inf
    a = 1.0 + 2.0**-12
    assert s_fma(a, a, -1.0) == 2.0**-11 + 2.0**-24 and s_add(s_mul(a, a), -1.0) == 2.0**-11
    assert s_bf16_bits(1.0 + 2.0**-8) == 0x3F80 and s_bf16_bits(1.0 + 2.0**-8 + 2.0**-20) == 0x3F81


# ---------------------------------------------------------------------------------------------
# Input construction


def _bf(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16)


def make_partials(
    route_rows: torch.Tensor,  # f32/bf16 [tp, m, 8, 4096]: each rank's K-partial of each route
    weights: torch.Tensor,  # [m, 8] bf16 or f32
    *,
    seed: int = 0,
    missing: torch.Tensor | None = None,  # bool [tp, m, 8]: index -1 on that rank
) -> list[UnfinalizedMoEOutput]:
    tp, m = route_rows.shape[:2]
    g = torch.Generator().manual_seed(seed)
    parts = []
    for r in range(tp):
        perm = torch.randperm(m * K, generator=g)
        rows = torch.empty(m * K, H, dtype=torch.bfloat16)
        rows[perm] = _bf(route_rows[r].reshape(m * K, H))
        index = perm.to(torch.int32).reshape(m, K)
        if missing is not None:
            index = torch.where(missing[r], torch.full_like(index, -1), index)
        parts.append(UnfinalizedMoEOutput(rows, weights.clone(), index))
    return parts


def scalar_inputs(parts: list[UnfinalizedMoEOutput], t: int) -> list[list[list[float] | None]]:
    out = []
    for p in parts:
        per_route = []
        for k in range(K):
            i = int(p.expanded_idx_to_permuted_idx[t, k])
            per_route.append(None if i < 0 else p.gemm2_permuted[i].float().tolist())
        out.append(per_route)
    return out


def ref_bits(out: torch.Tensor) -> torch.Tensor:
    return out.view(torch.int16).to(torch.int32) & 0xFFFF


def random_case(tp: int, m: int, seed: int, *, fp32_weights: bool = False) -> tuple[list[UnfinalizedMoEOutput], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(tp, m, K, H, generator=g) * torch.exp(torch.randn(tp, m, K, 1, generator=g))
    weights = torch.rand(m, K, generator=g) / 4
    weights = weights if fp32_weights else _bf(weights)
    gamma = _bf(torch.randn(H, generator=g) * 0.2)
    return make_partials(rows, weights, seed=seed), gamma


# ---------------------------------------------------------------------------------------------
# Dispatch (values derived by hand from the stock's host code)


@pytest.mark.parametrize(
    "m, tp, nsm, want",
    [
        (1, 4, 148, "expert-owner S=16 KO=2"),
        (9, 4, 148, "expert-owner S=16 KO=2"),
        (10, 4, 148, "expert-owner S=8 KO=2"),
        (15, 4, 148, "expert-owner S=8 KO=2"),
        (16, 4, 148, "token-owner S=8 XP=1"),
        (48, 4, 148, "token-owner S=2 XP=1"),
        (49, 4, 148, "token-owner S=2 XP=4"),
        (75, 4, 148, "token-owner S=1 XP=4"),
        (148, 4, 148, "token-owner S=1 XP=4"),
        (149, 4, 148, "token-owner-chunked S=1"),
        (7, 8, 148, "expert-owner S=16 KO=1"),
        (8, 8, 148, "token-owner S=16 XP=8"),
        (9, 8, 148, "token-owner S=8 XP=8"),
        (144, 8, 148, "token-owner S=1 XP=8"),
        (145, 8, 148, "token-owner-chunked S=1"),
        (1, 2, 148, "expert-owner S=16 KO=4"),
        (31, 2, 148, "expert-owner S=4 KO=4"),
        (32, 2, 148, "token-owner S=4 XP=2"),
        (1, 4, 132, "expert-owner S=16 KO=2"),
        (8, 4, 132, "expert-owner S=16 KO=2"),
        (9, 4, 132, "expert-owner S=8 KO=2"),
        (16, 4, 132, "token-owner S=8 XP=1"),
        (132, 4, 132, "token-owner S=1 XP=4"),
        (133, 4, 132, "token-owner-chunked S=1"),
        (8, 8, 132, "token-owner S=16 XP=8"),
    ],
)
def test_dispatch_table(m: int, tp: int, nsm: int, want: str) -> None:
    path = tp_stock_path(m, tp, nsm)
    assert path.describe() == want
    assert path.stock
    assert tp_split(m, tp, nsm) == path.split


def test_dispatch_rules() -> None:
    assert [token_crossover(p) for p in (2, 4, 8)] == [32, 16, 8]
    # below the crossover every m is expert-owner; at it the token-owner paths start
    for tp in (2, 4, 8):
        assert tp_stock_path(token_crossover(tp) - 1, tp, 148).name == EXPERT_OWNER
        assert tp_stock_path(token_crossover(tp), tp, 148).name == TOKEN_OWNER
    # XP = 1 never happens at tp = 2 (token-owner starts at m = 32 > 12 * 2) nor at tp = 8
    assert {tp_stock_path(m, 2, 148).owner_split for m in range(32, 149)} == {2}
    assert {tp_stock_path(m, 8, 148).owner_split for m in range(8, 145)} == {8}
    assert tp_stock_path(0, 4, 148).name == "empty"
    fb = tp_stock_path(1, 4, 148, grid_fits=False)
    assert (fb.name, fb.split, fb.fallback) == (TOKEN_OWNER_CHUNKED, 1, True)
    assert "fallback" in fb.describe()
    assert tp_stock_path(20, 4, 148, grid_fits=False).name == TOKEN_OWNER_CHUNKED
    with pytest.raises(ValueError):
        tp_stock_path(1, 1, 148)
    with pytest.raises(ValueError):
        tp_stock_path(1, 4, 300)


@pytest.mark.parametrize(
    "m, tp, nsm, split, base",
    [
        (1, 3, 148, 16, TOKEN_OWNER),
        (100, 3, 148, 1, TOKEN_OWNER),
        (148, 3, 148, 1, TOKEN_OWNER_CHUNKED),
        (1, 16, 148, 8, TOKEN_OWNER),
        (1, 32, 148, 4, TOKEN_OWNER),
        (5, 32, 132, 4, TOKEN_OWNER),
        (200, 32, 148, 1, TOKEN_OWNER_CHUNKED),
        (1, 6, 132, 16, TOKEN_OWNER),
        (23, 6, 132, 4, TOKEN_OWNER),
    ],
)
def test_extension_dispatch(m: int, tp: int, nsm: int, split: int, base: str) -> None:
    path = tp_stock_path(m, tp, nsm)
    assert path.name == EXTENSION and not path.stock
    assert (path.split, path.owner_split, path.base, path.combine) == (split, 1, base, "fma-chain")
    assert "no stock path; extension" in path.describe()


def test_path_validation() -> None:
    with pytest.raises(ValueError):
        TpStockPath(EXPERT_OWNER, 3, 1)  # the stock has no expert-owner layout at tp=3
    with pytest.raises(ValueError):
        TpStockPath(TOKEN_OWNER, 4, 2, 2)  # XP is 1 or P
    with pytest.raises(ValueError):
        TpStockPath(TOKEN_OWNER_CHUNKED, 4, 2, 1)  # chunked runs with S = 1
    with pytest.raises(ValueError):
        TpStockPath(EXTENSION, 3, 4, 3, base=TOKEN_OWNER)  # the extension keeps XP = 1
    assert TpStockPath(TOKEN_OWNER, 4, 4, 4).combine == "rounded-products"
    assert TpStockPath(TOKEN_OWNER, 4, 4, 1).combine == "fma-chain"
    assert TpStockPath(EXPERT_OWNER, 4, 16).combine == "owner-partials"


# ---------------------------------------------------------------------------------------------
# Combines: constructed so the FMA chain and the rounded products give different BF16 bits.

COL = 100  # the column the construction targets
NW_C = 1.0 + 2.0**-7  # gain at COL (gamma = 2^-7, gain centre 1)


def _find_w_b() -> tuple[float, int, int]:
    """An FP32 weight wB with bf16(fl(fl(wB*g) - g)) != bf16(fl(wB*g - g)), g = NW_C."""
    midpoint = 2.0**-8 + 2.0**-16  # halfway between two BF16 values
    start = s_f32(1.0 + midpoint / NW_C)
    for i in range(4000):
        for w in (start + i * 2.0**-23, start - i * 2.0**-23):
            rounded = s_bf16_bits(s_add(s_mul(w, NW_C), -NW_C))
            chained = s_bf16_bits(s_fma(w, NW_C, -NW_C))
            if rounded != chained:
                return w, rounded, chained
    raise AssertionError("no separating weight found")


def _combine_case(route_b: int) -> tuple[list[UnfinalizedMoEOutput], torch.Tensor, int, int]:
    w_b, rounded, chained = _find_w_b()
    tp, m = 4, 1
    rows = torch.ones(tp, m, K, H)
    rows[1:] = 0.0  # rank 0 holds each route's whole row; the other K-partials are zero
    rows[0, 0, 0, COL] = -1.0  # route 0 is -1 at COL, every other entry is +1: sum of squares 4096
    weights = torch.zeros(m, K, dtype=torch.float32)
    weights[0, 0] = 1.0
    weights[0, route_b] = w_b
    gamma = torch.zeros(H, dtype=torch.bfloat16)
    gamma[COL] = 2.0**-7
    return make_partials(rows, weights), gamma, rounded, chained


def _run(parts, gamma, path=None, *, wbn=False, eps=MIN_EPS, nsm=148):  # the smallest eps: absorbed
    return tp_tail_reference(parts, gamma, eps=eps, gain_center=1.0, weight_before_norm=wbn, nsm=nsm, path=path)


def test_fma_chain_and_rounded_products_differ() -> None:
    parts, gamma, rounded, chained = _combine_case(route_b=1)
    xp1, _ = _run(parts, gamma, TpStockPath(TOKEN_OWNER, 4, 16, 1))
    xp4, _ = _run(parts, gamma, TpStockPath(TOKEN_OWNER, 4, 16, 4))
    chunk, _ = _run(parts, gamma, TpStockPath(TOKEN_OWNER_CHUNKED, 4, 1, 1))
    assert int(ref_bits(xp1)[0, COL]) == chained
    assert int(ref_bits(xp4)[0, COL]) == rounded
    assert int(ref_bits(chunk)[0, COL]) == chained
    assert chained != rounded
    # away from COL nothing is near a tie: the two combines agree there
    assert torch.equal(ref_bits(xp1)[0, :COL], ref_bits(xp4)[0, :COL])


def test_expert_owner_combine_depends_on_ownership() -> None:
    # routes 0 and 1 share owner 0 (KO = 2): one FMA chain inside the owner's partial
    parts, gamma, rounded, chained = _combine_case(route_b=1)
    out, path = _run(parts, gamma)
    assert path.describe() == "expert-owner S=16 KO=2"
    assert int(ref_bits(out)[0, COL]) == chained
    # route 2 belongs to owner 1: two separately rounded partials, summed in rank order
    parts, gamma, rounded, chained = _combine_case(route_b=2)
    out, _ = _run(parts, gamma)
    assert int(ref_bits(out)[0, COL]) == rounded


# ---------------------------------------------------------------------------------------------
# Signed zeros: an FMA chain whose products all underflow negative ends at -0.0.


def _underflow_case(tp: int = 4) -> tuple[list[UnfinalizedMoEOutput], torch.Tensor]:
    rows = torch.zeros(tp, 1, K, H)
    rows[0, 0, :, 0] = 2.0**60  # sum of squares 2^120 -> r = 2^-54 exactly
    rows[0, 0, :, 2] = -(2.0**-66)  # y = -2^-120, times w = 2^-40 underflows to -0.0
    rows[0, 0, :, 3] = -(2.0**-66)
    rows[0, 0, :, 4] = -(2.0**-66)  # pairs with column 5, which stays nonzero
    rows[0, 0, :, 5] = 1.0
    weights = _bf(torch.full((1, K), 2.0**-40))
    return make_partials(rows, weights), torch.zeros(H, dtype=torch.bfloat16)


def test_negative_zero_by_path() -> None:
    parts, gamma = _underflow_case()
    chain_path = TpStockPath(TOKEN_OWNER, 4, 16, 1)
    chain, _ = _run(parts, gamma, chain_path)
    products, _ = _run(parts, gamma, TpStockPath(TOKEN_OWNER, 4, 16, 4))
    expert, path = _run(parts, gamma)
    assert path.name == EXPERT_OWNER
    assert ref_bits(chain)[0, 2:5].tolist() == [0x8000] * 3
    assert ref_bits(products)[0, 2:5].tolist() == [0, 0, 0]
    assert ref_bits(expert)[0, 2:5].tolist() == [0, 0, 0]  # the FP32 hop scrubs -0.0 partials
    # delivery: the owner (rank 0) keeps -0.0; the others get the scrubbed multicast copy, which
    # only clears a word whose two halves are both -0.0 (columns 2, 3), not column 4's
    assert torch.equal(tp_rank_output(chain, chain_path, 0), chain)
    for rank in (1, 2, 3):
        seen = ref_bits(tp_rank_output(chain, chain_path, rank))[0]
        assert seen[2:5].tolist() == [0, 0, 0x8000]
        assert torch.equal(seen[6:], ref_bits(chain)[0, 6:])
    chunk_path = TpStockPath(TOKEN_OWNER_CHUNKED, 4, 1, 1)
    chunk, _ = _run(parts, gamma, chunk_path)
    assert torch.equal(tp_rank_output(chunk, chunk_path, 2), chunk)  # chunked copies are unscrubbed


# ---------------------------------------------------------------------------------------------
# Bit-exact against the scalar model


SCALAR_CASES = [
    # tp, seed, path (None = the stock's pick for m = 1), weight_before_norm, fp32 weights, eps
    (4, 1, None, True, False, 1e-8),  # expert-owner S=16
    (4, 2, TpStockPath(TOKEN_OWNER, 4, 1, 1), False, True, 1e-8),
    (4, 3, TpStockPath(TOKEN_OWNER, 4, 2, 4), True, False, 1e-6),
    (2, 4, TpStockPath(EXPERT_OWNER, 2, 4), False, False, 1e-8),
    (3, 5, None, True, True, 1e-8),  # extension S=16
    (8, 6, TpStockPath(TOKEN_OWNER, 8, 8, 8), True, False, 1e-8),
]


@pytest.mark.parametrize("tp, seed, path, wbn, fp32w, eps", SCALAR_CASES)
def test_matches_scalar_model(tp, seed, path, wbn, fp32w, eps) -> None:
    parts, gamma = random_case(tp, 1, seed, fp32_weights=fp32w)
    out, used = tp_tail_reference(parts, gamma, eps=eps, gain_center=1.0, weight_before_norm=wbn, nsm=148, path=path)
    if tp == 3:
        assert used.name == EXTENSION and used.split == 16
    weights = parts[0].route_weights[0].float().tolist()
    want = scalar_tail_token(
        scalar_inputs(parts, 0), weights, gamma.float().tolist(), eps=eps, gain_center=1.0, weight_before_norm=wbn, path=used
    )
    assert ref_bits(out)[0].tolist() == want


def _special_case(tp: int = 2) -> tuple[list[UnfinalizedMoEOutput], torch.Tensor]:
    """-0.0, BF16 subnormals, huge values, a zero route, a missing index, a cancelling pair."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(tp, 1, K, H, generator=g)
    rows[:, 0, 0] = -0.0  # route 0: every partial -0.0 -> the rank sum is +0.0: a zero row
    rows[:, 0, 1] = torch.randn(tp, H, generator=g) * 2.0**-128  # subnormal BF16 partials
    rows[0, 0, 2, :64] = 3.0e38  # huge: the rank sum overflows to inf in places
    rows[1, 0, 2, :64] = 3.0e38
    rows[:, 0, 3] = torch.randn(tp, H, generator=g) * 1.0e19  # squares near the binary32 limit
    rows[1, 0, 4] = -rows[0, 0, 4].to(torch.bfloat16).float()  # exact cancellation -> +0.0 row
    rows[0, 0, 5, ::3] = -0.0
    missing = torch.zeros(tp, 1, K, dtype=torch.bool)
    missing[1, 0, 6] = True  # rank 1 holds no row for route 6
    weights = _bf(torch.rand(1, K, generator=g))
    gamma = _bf(torch.randn(H, generator=g) * 0.1)
    gamma[::17] = -0.0
    return make_partials(rows, weights, seed=7, missing=missing), gamma


@pytest.mark.parametrize(
    "path, wbn",
    [(TpStockPath(EXPERT_OWNER, 2, 16), True), (TpStockPath(TOKEN_OWNER, 2, 4, 2), False), (TpStockPath(TOKEN_OWNER_CHUNKED, 2, 1, 1), True)],
)
def test_special_values_match_scalar_model(path: TpStockPath, wbn: bool) -> None:
    parts, gamma = _special_case()
    out, _ = tp_tail_reference(parts, gamma, eps=1e-8, gain_center=1.0, weight_before_norm=wbn, nsm=148, path=path)
    weights = parts[0].route_weights[0].float().tolist()
    want = scalar_tail_token(
        scalar_inputs(parts, 0), weights, gamma.float().tolist(), eps=1e-8, gain_center=1.0, weight_before_norm=wbn, path=path
    )
    got = ref_bits(out)[0].tolist()
    nan = [(b & 0x7F80) == 0x7F80 and (b & 0x7F) != 0 for b in want]
    assert any(nan)  # the inf * 0 columns: NaN-ness against the scalar model, whose payloads vary
    assert [(b & 0x7F80) == 0x7F80 and (b & 0x7F) != 0 for b in got] == nan
    assert {b for b, n in zip(got, nan) if n} == {0x7FFF}  # the reference's NaN is the stock's canonical one
    assert [b for b, n in zip(got, nan) if not n] == [b for b, n in zip(want, nan) if not n]


def test_zero_rows_and_the_smallest_eps() -> None:
    rows = torch.zeros(4, 1, K, H)
    parts = make_partials(rows, _bf(torch.ones(1, K)))
    gamma = torch.zeros(H, dtype=torch.bfloat16)
    for eps in (1e-8, MIN_EPS):  # r = rsqrt(eps) is finite, y = 0
        out, _ = _run(parts, gamma, eps=eps)
        assert torch.equal(ref_bits(out), torch.zeros(1, H, dtype=torch.int32))  # +0.0 everywhere
    for eps in (0.0, MIN_EPS / 2):  # r = rsqrt(0) = inf (or of a subnormal the EP stock flushes): refused
        with pytest.raises(ValueError, match="eps"):
            _run(parts, gamma, eps=eps)


# ---------------------------------------------------------------------------------------------
# Structure


def test_sum_of_squares_trees_match_scalar_model() -> None:
    g = torch.Generator().manual_seed(5)
    u = _bf(torch.randn(3, H, generator=g) * torch.exp(2 * torch.randn(3, H, generator=g))).float()
    u[2, ::5] = _bf(torch.randn(H // 5 + 1, generator=g) * 2.0**-130).float()  # subnormal squares
    seen = []
    for split in (1, 2, 4, 8, 16):
        got = sum_of_squares(u, split)
        want = [s_sum_of_squares(u[i].tolist(), split) for i in range(3)]
        assert [f32_bits(float(v)) for v in got] == [f32_bits(v) for v in want]
        seen.append(tuple(want))
    assert len(set(seen)) > 1  # the tree shape changes the bits: S must be the stock's


def test_tokens_are_independent_and_layout_order_free() -> None:
    parts, gamma = random_case(4, 3, seed=11)
    path = TpStockPath(TOKEN_OWNER, 4, 4, 4)
    out, _ = _run(parts, gamma, path, wbn=True, eps=1e-8)
    for t in range(3):
        single = [
            UnfinalizedMoEOutput(
                p.gemm2_permuted[p.expanded_idx_to_permuted_idx[t].long()].contiguous(),
                p.route_weights[t : t + 1].clone(),
                torch.arange(K, dtype=torch.int32)[None],
            )
            for p in parts
        ]
        one, _ = _run(single, gamma, path, wbn=True, eps=1e-8)
        assert torch.equal(ref_bits(one)[0], ref_bits(out)[t])


def test_rank_order_matters() -> None:
    # 2^24, +1, -2^24 in rank order gives bf16(0 + 2^24 + 1 - 2^24) = 0; reordered it is 1
    rows = torch.zeros(3, 1, K, H)
    rows[0, 0, :, 7] = 2.0**24
    rows[1, 0, :, 7] = 1.0
    rows[2, 0, :, 7] = -(2.0**24)
    rows[:, 0, :, 8] = 1.0  # keeps the rows' norm finite and positive
    parts = make_partials(rows, _bf(torch.ones(1, K)))
    gamma = torch.zeros(H, dtype=torch.bfloat16)
    out, path = _run(parts, gamma, eps=1e-8)
    assert path.name == EXTENSION  # tp = 3
    assert int(ref_bits(out)[0, 7]) == 0
    swapped, _ = _run([parts[0], parts[2], parts[1]], gamma, eps=1e-8)
    assert int(ref_bits(swapped)[0, 7]) != 0


def test_no_torch_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("the reference must not reduce with torch.sum")

    monkeypatch.setattr(torch, "sum", boom)
    monkeypatch.setattr(torch.Tensor, "sum", boom)
    parts, gamma = random_case(4, 2, seed=3)
    for path in (None, TpStockPath(TOKEN_OWNER, 4, 1, 4), TpStockPath(TOKEN_OWNER_CHUNKED, 4, 1, 1)):
        _run(parts, gamma, path, eps=1e-8)


def test_input_validation() -> None:
    parts, gamma = random_case(4, 1, seed=0)
    with pytest.raises(ValueError):
        _run(parts, gamma, TpStockPath(TOKEN_OWNER, 2, 4, 1))  # path for another tp
    bad = list(parts)
    bad[2] = UnfinalizedMoEOutput(bad[2].gemm2_permuted, bad[2].route_weights * 2, bad[2].expanded_idx_to_permuted_idx)
    with pytest.raises(ValueError):
        _run(bad, gamma)
    with pytest.raises(ValueError):
        _run(parts[:1], gamma)
    with pytest.raises(ValueError):
        _run(parts, gamma.float())
    empty = [UnfinalizedMoEOutput(torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, K), torch.zeros(0, K, dtype=torch.int32))] * 4
    out, path = _run(empty, gamma)
    assert out.shape == (0, H) and path.name == "empty"
