"""TP tail stock reference: flashinfer 0.7.2.post1 `tp_moe_finalize_rmsnorm`, modelled bit for bit in torch.

Scope. The stock (`flashinfer/comm/tp_moe_finalize_rmsnorm.py`) takes, on each of P tensor-parallel
ranks, that rank's K-partial GEMM2 rows (`UnfinalizedMoEOutput`, TP layout) and writes, on every
rank, the BF16 output `[m, 4096]` of: per route, sum the K-partials over ranks, RMS-normalize with
a gain, weight by the router, combine the eight routes. This module reproduces the stock's bits
for every path the stock can take, picks the path with the stock's host rule, and reports which
path a case took (`TpStockPath`). docs/contract-tp.md is the long form of this record.

Provenance of the facts. Everything below was read from the stock source and then checked against
the code the stock's kernels compile to: the kernel factory `_make_program` was compiled here for
sm_100a (CuTe DSL 4.8.1, PTX kept) for the expert-owner path (S = 1, 2, 16; both norm modes; gain
centre 1.0 and 0.0), the chunked token-owner path, and the single-launch token-owner path
(XP = 1 and XP = P; BF16 and FP32 route weights); the PTX was assembled with ptxas 13.0 for
sm_100a and the SASS read back. Confirmed there: which multiply-adds are fused (`fma.rn.f32` in
PTX, FFMA in SASS), that no `mul.f32`/`add.f32` pair is fused later by ptxas, that every `+ 0.0`
accumulator start survives (an `add.f32 x, 0f00000000` / `FADD RZ, x`), that nothing is flushed
to zero (no `.ftz`), the butterfly-shuffle and shared-memory sum orders, the baked constants
(1/4096 = 0f39800000, eps and gain centre rounded once to binary32), and that the only
approximate instruction on the path is `rsqrt.approx.f32` (SASS: MUFU.RSQ with the usual
subnormal pre/post scaling, i.e. the instruction's own semantics).

Notation: all arithmetic binary32 round-to-nearest-even unless said; `add`, `mul`, `fma` are
`musebench.numerics` (one rounding each, `fma` a single rounding of a*b + c); `bf16(x)` is
`cvt.rn.bf16.f32`; `rsqrt` is `Approximations.rsqrt` (the stock's `cute.rsqrt`, i.e.
`rsqrt.approx.f32`); H = 4096 columns, K = 8 routes, P = tp ranks.

Phase 1 -- route rows (stock `sum_ranks`, then `pack8`). For token t, route k and column c:
    x[t,k,c] = bf16( (((0.0 + p_0) + p_1) + ...) + p_{P-1} )
where p_r is rank r's K-partial (BF16 widened exactly), looked up through rank r's own
`expanded_idx_to_permuted_idx`; an index < 0 or >= rows gives the literal word 0 (+0.0) without
reading the row (stock `finalize_tile` / `single_kernel`: `is_valid`). Ranks in rank order, from
+0.0, every path. The sentinel scrub applied to loaded rows (-0.0,-0.0 word -> +0.0,+0.0) cannot
change this sum (it starts at +0.0), so it is not modelled here.

Phase 2 -- gains and normalization (`decode_gains`, `warp_ssq`, `rms_finish`, `norm_row`).
    g[c] = add(f32(norm_weight[c]), f32(gain_center))            (kept even for gain_center = 0.0)
    weight_before_norm=True  (stock mode 1): u = mul(x, g); y = mul(u, r)
    weight_before_norm=False (stock mode 0): u = x;         y = mul(mul(x, r), g)
    r[t,k] = rsqrt( fma(Q[t,k], 2^-12, f32(eps)) )
Both modes exist in the stock (`mode = int(weight_before_norm)` in `_program_key`), so both are
stock behaviour here, not extensions. Q is the sum of squares of u over the 4096 columns, with the
tree fixed by the launch geometry for band split S (S in {1,2,4,8,16}; S CTAs of 512/S threads, a
thread owns 8 consecutive columns, a warp 256, a CTA the band of 4096/S; global warp
w = c // 256, lane = (c // 8) % 32, element = c % 8):
    thread:  s = fma(u7,u7, fma(u6,u6, ... fma(u0,u0, 0.0)))          (columns in order)
    warp:    5 butterfly levels, s = s + shfl_xor(s, 1, 2, 4, 8, 16): the balanced binary tree
             over lanes 0..31 (IEEE addition is commutative, so every lane holds the same bits)
    S == 1:  the 16 warp sums go to lanes 0..15 of one warp, lanes 16..31 hold +0.0, and the same
             5-level butterfly runs: balanced tree over warps 0..15, then one `+ 0.0`
    S  > 1:  per CTA, a chain from +0.0 over its 16/S warps in order; the per-CTA values are
             exchanged through distributed shared memory and every CTA forms the same chain from
             +0.0 over bands 0..S-1 in order.

Phase 3 -- combine over the 8 routes, by path (w[t,k] = route weight widened to binary32):
  expert-owner (`fused_kernel`, m < 64 // P): rank o owns routes [o*KO, (o+1)*KO), KO = 8/P, and
      forms the FP32 partial  a_o = fma(w_k, y_k, ...) chained from +0.0 over its routes in order;
      a_o has -0.0 scrubbed to +0.0 and is multicast; every rank then forms
      out = bf16( ((0.0 + a_0) + a_1) + ... + a_{P-1} )   -- bit-identical on every rank.
  token-owner, single launch (`single_kernel`), XP = 1: the owner rank t % P chains
      acc = fma(w_k, y_k, acc) from +0.0 over k = 0..7; out = bf16(acc).
  token-owner, single launch, XP = P: CTA d reduces routes d, d+P, ...; each weighted product is
      rounded alone, z_k = mul(y_k, w_k), parked in a local FP32 scratch, and the last-arriving
      CTA forms out = bf16( ((0.0 + z_0) + z_1) + ... + z_7 ).
  token-owner, chunked (`stage_kernel`/`fused_kernel`/`copy_kernel`, S = 1): as XP = 1.
The FMA chain and the rounded products differ in general (one rounding per route vs two), and
also in the sign of zero: a chain whose products all underflow negative ends at -0.0, the
rounded-product sum starting at +0.0 cannot.

Delivery. The expert-owner and chunked token-owner paths deliver identical bits to every rank.
The single-launch token-owner path does not quite: the owner writes its own BF16 row directly, but
the copy it multicasts to the other ranks is sentinel-scrubbed per 32-bit word, so a pair of
adjacent columns (2i, 2i+1) that is (-0.0, -0.0) arrives as (+0.0, +0.0) on the other ranks. The
reference returns the owner's (unscrubbed) bits; `tp_rank_output` gives a given rank's bits.

Host dispatch (`_select_path`, `_config`, `_pick_split`, `_single_xpar`, `_peer_batch`,
`_single_ctas`, `_token_crossover`; nsm = the group's minimum SM count, all-reduced MIN at init):
    pick_split(n): S = 1; while S < 16 and n*S*2 <= nsm: S *= 2
    m < max(1, 64 // P)                       -> expert-owner,  S = pick_split(m)
    else ceil(m/P)*P > nsm                    -> token-owner-chunked, S = 1
    else                                      -> token-owner (single launch),
                                                 S = pick_split(ceil(m/P)*P),
                                                 XP = 1 if peer_batch(P) == 8 and m <= 12*P else P
    peer_batch(P) = max(1, min(8, 32 // max(1, P-1)))     (8 for P = 2, 4; 4 for P = 8)
When the cooperative grid of the expert-owner or single-launch path does not fit (a runtime
occupancy query, `_grid_fits`), every rank falls back to the chunked token-owner path with S = 1;
`tp_stock_path(..., grid_fits=False)` models that. Note the stock itself only initializes on
SM100/103/107 with nsm <= 256 (`NSLOT`); nsm = 132 (H200) is modelled by the same rule.

Extension (no stock path). The stock requires P > 1 and P | 8 (`init_tp_moe_finalize_rmsnorm`):
P = 2, 4, 8. For every other P in 2..32 this module defines the natural extension: the token-owner
computation, which is the one stock layout that needs no divisibility (one owner per token holds
all 8 routes): phase 1 and 2 as above, the FMA chain over k = 0..7, S = pick_split(ceil(m/P)*P)
when ceil(m/P)*P <= nsm (single-launch geometry and delivery) else S = 1 (chunked geometry and
delivery). The expert-owner branch and XP = P both divide the 8 routes by P and are not extended.
Such paths have name "extension", `stock=False`, and `describe()` says "no stock path; extension".

NaN. FP32 NaN payloads inside the computation differ between torch and the GPU, but every BF16
the stock writes comes out of `cvt.rn.bf16x2.f32`, which returns the canonical NaN 0x7FFF for any
NaN, and `to_bf16` does the same: NaN outputs compare bitwise.

Not modelled: timing; the transport, which moves bits unchanged apart from the output-copy scrub
described under Delivery (`tp_rank_output`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from musebench.layout import UnfinalizedMoEOutput
from musebench.numerics import PRECISE, Approximations, add, check_eps, f32, fma, mul, scrub_negative_zero, to_bf16
from musebench.tp_dispatch import (  # noqa: F401  (the dispatch, re-exported for the reference's readers)
    _SPLITS, EMPTY, EXPERT_OWNER, EXTENSION, H_DIM, K_EXPERTS, MAX_SPLIT, NSLOT, TOKEN_OWNER, TOKEN_OWNER_CHUNKED,
    TpStockPath, single_launch_ctas, stock_supports_tp, token_crossover, tp_split, tp_stock_path,
)

VEC = 8  # columns per thread
WARP = 32
WARPS_TOTAL = H_DIM // (VEC * WARP)  # 16 warps of 256 columns cover the row, whatever S


# ---------------------------------------------------------------------------------------------
# Arithmetic


def _butterfly(s: torch.Tensor) -> torch.Tensor:
    """The 5-level xor-shuffle sum over the last dim (32 lanes); returns lane 0's value."""
    lanes = torch.arange(WARP, device=s.device)
    for offset in (1, 2, 4, 8, 16):
        s = add(s, s[..., lanes ^ offset])
    return s[..., 0]


def sum_of_squares(u: torch.Tensor, split: int) -> torch.Tensor:
    """Q over the last dim (4096 columns, float32) with the stock's tree for band split S."""
    if u.shape[-1] != H_DIM or u.dtype != torch.float32:
        raise ValueError(f"expected float32 [..., {H_DIM}], got {u.dtype} {tuple(u.shape)}")
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split}")
    lead = u.shape[:-1]
    v = u.reshape(*lead, WARPS_TOTAL, WARP, VEC).movedim(-1, 0).contiguous()  # [8, ..., 16, 32]
    s = torch.zeros(v.shape[1:], dtype=torch.float32, device=u.device)
    for e in range(VEC):  # thread: FMA chain over its 8 columns, from +0.0
        s = fma(v[e], v[e], s)
    warp_sums = _butterfly(s)  # [..., 16]
    if split == 1:
        padded = torch.cat([warp_sums, torch.zeros_like(warp_sums)], dim=-1)  # lanes 16..31 = +0.0
        return _butterfly(padded)
    per_cta = warp_sums.reshape(*lead, split, WARPS_TOTAL // split)
    cta = torch.zeros(per_cta.shape[:-1], dtype=torch.float32, device=u.device)
    for w in range(per_cta.shape[-1]):  # CTA: chain over its warps, from +0.0
        cta = add(cta, per_cta[..., w])
    total = torch.zeros(lead, dtype=torch.float32, device=u.device)
    for b in range(split):  # cluster: chain over bands, from +0.0
        total = add(total, cta[..., b])
    return total


def _route_rows(partials: Sequence[UnfinalizedMoEOutput]) -> torch.Tensor:
    """x[t, k, :]: the K-partials summed over ranks in rank order from +0.0, rounded to BF16 (f32)."""
    m = partials[0].tokens
    device = partials[0].gemm2_permuted.device
    acc = torch.zeros(m, K_EXPERTS, H_DIM, dtype=torch.float32, device=device)
    for part in partials:  # rank order
        rows = part.gemm2_permuted[:, :H_DIM]
        index = part.expanded_idx_to_permuted_idx.long()
        valid = (index >= 0) & (index < rows.shape[0])
        if rows.shape[0]:
            picked = rows[index.clamp(0, rows.shape[0] - 1)].float()
            picked = torch.where(valid[..., None], picked, torch.zeros((), dtype=torch.float32, device=device))
        else:
            picked = torch.zeros(m, K_EXPERTS, H_DIM, dtype=torch.float32, device=device)
        acc = add(acc, picked)
    return to_bf16(acc).float()


def _validate(partials: Sequence[UnfinalizedMoEOutput], norm_weight: torch.Tensor) -> None:
    if len(partials) < 2:
        raise ValueError(f"the TP tail needs >= 2 ranks' partials, got {len(partials)}")
    first = partials[0]
    for rank, part in enumerate(partials):
        part.validate()
        if part.top_k != K_EXPERTS:
            raise ValueError(f"rank {rank}: top_k must be {K_EXPERTS}, got {part.top_k}")
        if part.width < H_DIM:
            raise ValueError(f"rank {rank}: width must be >= {H_DIM}, got {part.width}")
        if part.tokens != first.tokens:
            raise ValueError(f"rank {rank}: {part.tokens} tokens, rank 0 has {first.tokens}")
        same = part.route_weights.dtype == first.route_weights.dtype and torch.equal(
            part.route_weights.view(torch.int16 if part.route_weights.dtype == torch.bfloat16 else torch.int32).cpu(),
            first.route_weights.view(torch.int16 if first.route_weights.dtype == torch.bfloat16 else torch.int32).cpu(),
        )
        if not same:
            raise ValueError(f"rank {rank}: route weights differ from rank 0's (the TP layout shares them)")
    if norm_weight.dtype != torch.bfloat16 or tuple(norm_weight.shape) != (H_DIM,):
        raise ValueError(f"norm_weight must be bfloat16 [{H_DIM}], got {norm_weight.dtype} {tuple(norm_weight.shape)}")


def tp_tail_reference(
    partials: Sequence[UnfinalizedMoEOutput],
    norm_weight: torch.Tensor,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    nsm: int,
    approximations: Approximations = PRECISE,
    path: TpStockPath | None = None,
) -> tuple[torch.Tensor, TpStockPath]:
    """The stock TP tail's BF16 output [m, 4096] and the path that produced it.

    partials[r] is rank r's input (TP layout). The output is the owner's bits, which every rank
    holds except on the single-launch token-owner path, where `tp_rank_output` gives the other
    ranks' (scrubbed) copy. path=None picks the stock's path (`tp_stock_path`); a given path forces
    one (e.g. the occupancy fallback, or a combine to compare against).
    """
    check_eps(eps)
    _validate(partials, norm_weight)
    tp = len(partials)
    m = partials[0].tokens
    device = partials[0].gemm2_permuted.device
    if path is None:
        path = tp_stock_path(m, tp, nsm)
    elif path.tp != tp:
        raise ValueError(f"path is for tp={path.tp}, the partials come from {tp} ranks")
    if m == 0:
        return torch.empty(0, H_DIM, dtype=torch.bfloat16, device=device), path
    if path.name == EMPTY:
        raise ValueError("the 'empty' path only applies to m = 0")

    x = _route_rows(partials)  # [m, 8, 4096]
    gain = add(norm_weight.to(device).float(), f32(gain_center, device))  # [4096]
    u = mul(x, gain) if weight_before_norm else x
    q = sum_of_squares(u, path.split)  # [m, 8]
    r = approximations.rsqrt(fma(q, f32(1.0 / H_DIM, device), f32(eps, device)))[..., None]
    y = mul(u, r) if weight_before_norm else mul(mul(x, r), gain)
    w = partials[0].route_weights.to(device).float()[..., None]  # [m, 8, 1], exact widening

    zero = torch.zeros(m, H_DIM, dtype=torch.float32, device=device)
    combine = path.combine
    if combine == "owner-partials":
        ko = path.experts_per_owner
        out = zero
        for owner in range(tp):  # every rank sums the owners' FP32 partials in rank order
            part = zero
            for k in range(owner * ko, (owner + 1) * ko):
                part = fma(w[:, k], y[:, k], part)
            out = add(out, scrub_negative_zero(part))
    elif combine == "rounded-products":
        out = zero
        for k in range(K_EXPERTS):
            out = add(out, mul(y[:, k], w[:, k]))
    else:
        out = zero
        for k in range(K_EXPERTS):
            out = fma(w[:, k], y[:, k], out)
    return to_bf16(out), path


def tp_rank_output(reference: torch.Tensor, path: TpStockPath, rank: int) -> torch.Tensor:
    """The bits rank `rank` ends up with, given the reference (owner) output of `path`.

    Only the single-launch token-owner layout differs: token t's row reaches every rank except its
    owner (t % tp) through the multicast copy, scrubbed per 32-bit word, so a (-0.0, -0.0) pair of
    columns (2i, 2i+1) reads (+0.0, +0.0) there.
    """
    if reference.dtype != torch.bfloat16 or reference.dim() != 2 or reference.shape[1] != H_DIM:
        raise ValueError(f"expected bfloat16 [m, {H_DIM}], got {reference.dtype} {tuple(reference.shape)}")
    if not 0 <= rank < path.tp:
        raise ValueError(f"rank {rank} outside 0..{path.tp - 1}")
    out = reference.clone()
    if not path.scrubbed_copies or reference.shape[0] == 0:
        return out
    words = out.contiguous().view(torch.int32)  # [m, 2048]: one word per column pair
    sentinel = torch.tensor(0x80008000 - (1 << 32), dtype=torch.int32, device=out.device)
    copied = (torch.arange(out.shape[0], device=out.device) % path.tp) != rank
    scrub = copied[:, None] & (words == sentinel)
    return torch.where(scrub, torch.zeros_like(words), words).view(torch.bfloat16)
