"""Muse Spark router in CuTe DSL: top-8 of 256 sigmoid experts, and optionally the TRT-LLM-gen
routing metadata of one rank, in one launch.

Public API (the seeds' routing module, `../shared/seeds/routing.txt`): `route`, `prepare`,
`compile_routing`, `compiled_routing`, `metadata_size` and the `META_*` offsets. The router-bound
entry point (`MuseRouting`, `RoutingMetadata`) and the deployment check (`unsupported_router`)
live in `musebench.cute_ops`. Where musebench differs from the seed: the metadata layout is
`musebench.routing_metadata`'s (the seed's fields at musebench's offsets, plus two header words:
the batch and the tile it was written for); `compile_routing` keeps its compile-time knobs (PDL,
target, PTX folder) in an internal keyword, `build`; the compiled object takes CuTe views and
the batch size (`route` is how to call it); `route` also refuses non-contiguous logits and
metadata knobs given without a buffer.

What it computes (bit for bit, docs/contract-routing.md; torch reference
`musebench.stock.routing.routing_reference` with the hardware's ex2 / div.full): for each of the
b <= 8 tokens, the ids of its 8 experts in selection order and their route weights; with a
metadata buffer, the grouped-GEMM bookkeeping of the local experts [offset, offset + count) for
tile `tile_n`, packed as `musebench.routing_metadata.RoutingMetadata` lays it out (equal word for
word, on the live words, to `pack_metadata(routing_metadata_reference(ids, ...))`).

One CTA of 256 threads, one warp per token (warps b..7 only join the metadata phase):

1. Lane l owns experts 8l .. 8l + 7 and reads their bias (two 16-byte loads) *before*
   `griddepcontrol.wait`: the bias is a parameter, not something the preceding kernel writes.
   After the wait it reads its 8 logits (two 16-byte loads).
2. Scores, every step one inline-PTX instruction as the stock Triton kernel emits it (nothing
   for NVVM or ptxas to contract or reorder): `n = sub.rn(0, x)`, `t = mul.rn(n, 0x3FB8AA3B)`,
   `e = ex2.approx(t)`, `d = add.rn(1, e)`, `s = div.full(1, d)`; `key = add.rn(s, bias)`.
3. Each lane sorts its 8 (key, score, slot) triples once, by `ordered_key_u32(key)` descending,
   with an odd-even transposition network (28 adjacent compare-exchanges that swap only on a
   strict inversion, hence stable: among equal keys the lower expert stays first). The ordered
   key maps binary32 to uint32 monotonically with -0.0 and +0.0 on one value, so IEEE `==`
   between keys is integer `==`.
4. Eight rounds: `redux.sync.max.u32` of the lane heads, `vote.ballot` of the lanes holding that
   maximum, the lowest such lane wins (its experts are the lowest indices; its own sort put the
   lowest index first), `shfl` broadcasts its slot and score, it pops its head. This is the
   stock's argmax with ties to the lowest index. When the maximum is the key of -inf only -inf
   keys remain, and the stock's argmax over the masked row (chosen experts are -inf too) returns
   expert 0 whether or not it was chosen: the round then takes expert 0 and its score, as the
   reference does (repeated ids, -inf biases only).
5. `sum = add.rn(...add.rn(add.rn(0, s_0), s_1)..., s_7)` in selection order, `add.rn(sum,
   f32(1e-15))`, `inv = div.full(f32(scale), sum)`, `w_k = mul.rn(s_k, inv)`
   (renormalize=False: `w_k = mul.rn(s_k, f32(scale))`). Lane 0 stores the row with two 16-byte
   stores each for ids and weights.
6. Metadata (compile-time variant), four CTA barriers: lane 0 of every warp parks its 8 ids in
   shared memory (-1 for warps past b); thread r < 64 takes route r = token * 8 + k, and in each
   of the two route warps one `match.any` finds the lanes of the same expert: the lanes below r
   are its rank among them (route order = token order, the block kernels' order), and the lowest
   of them parks their number for its warp, so thread e's count of expert e is the two warps'
   parked numbers and a route of warp 1 adds warp 0's number to its rank (no loop over the
   tokens: the first H200 bench, a pass over the b * 8 ids, cost about 0.065 µs per token); a CTA
   scan of
   tiles = ceil(count / tile_n) gives each expert's first tile; thread e writes its CTA table
   entries, the CTA fills permuted_to_token[0, padded) with -1, then thread r writes its
   expanded_to_permuted word and its row's token. Only live words are written (header,
   b * 8 expanded words, cta_count table words, padded_row_count rows): a word past them, e.g. a
   guard element after the buffer, is never touched. Repeated ids (the -inf quirk; undefined in
   the stock) still get distinct rows, so every write stays inside the layout's bounds.

Memory ordering: PDL only. Everything this kernel writes is written after `griddepcontrol.wait`,
so it never races a predecessor still reading the old ids / weights / metadata. The bias is read
before the wait, so the kernel launched just before must not write it (a weight update in
place needs a launch in between or a sync). It triggers its dependents right after the wait;
a dependent's own `griddepcontrol.wait` still waits for this whole grid to complete and flush. Inside the CTA, `bar.sync` orders the -1 fill before the row
scatter (both global) and the shared-memory phases.

NaN logits or bias are outside the contract (as in the reference): the kernel stays in bounds but
the ids are unspecified.

Numbers measured: compile (CPU host, CuTe DSL 4.8.1, no GPU, 2026-11-29) 0.1-0.15 s per
routing-only variant and 0.2-0.25 s with metadata, sm_90a and sm_100a alike
(tests/kernels/test_routing_compile.py). ptxas 13.0 -v (sm_90a): 40 registers, no stack, no
spills, every variant; SASS (nvdisasm) of the routing-only variant: no FFMA (8 MUFU.EX2, 9 MUFU.RCP
from div.full, FADD / FMUL only), 8 REDUX.MAX. H200, 2026-11-29 (commit 13f0ff6): tests/kernels/test_routing_gpu.py and
tests/stock/test_triton_routing.py passed (bitwise ids and weights vs the reference with the
hardware's ex2 / div.full and vs the project's Triton stock, b = 1..8, renormalize on and off,
random and adversarial rows, 16 seeds; metadata in a guarded buffer for fixed and random ranges
and tiles; graph capture and replay). Timed on the H200 (commit 7ba8f5d, records/2026-11-29-h200-
bench-routing.summary.json, CUDA graphs of 20 calls, median of 30 replays, empty launch 1.12 µs), with the
token loop in the metadata phase: routing 1.53-2.01 µs, with metadata 2.26-3.22 µs, the Triton
stock 2.90-3.03 µs (b = 1..8). The match.any counting replaced that loop after this and is
compile-tested only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor

from musebench import config
from musebench.kernels import compilation, ptx
from musebench.kernels.compilation import compiler, cute_flat, fake_flat
from musebench.numerics import LOG2_E
from musebench.routing_metadata import (
    HEADER_CTA_COUNT,
    HEADER_NUM_TOKENS,
    HEADER_PADDED_ROW_COUNT,
    HEADER_TILE_N,
    HEADER_WORDS,
    TILE_N_MAX,
    RoutingMetadata,
)

__all__ = [
    "META_CTA_BATCH",
    "META_CTA_LIMIT",
    "META_EXPANDED_TO_PERMUTED",
    "META_NUM_CTAS",
    "META_PADDED_TOKENS",
    "META_PERMUTED_TO_TOKEN",
    "compile_routing",
    "compiled_routing",
    "metadata_size",
    "prepare",
    "route",
]

NUM_EXPERTS = config.NUM_EXPERTS  # 256
TOP_K = config.TOP_K  # 8
MAX_TOKENS = config.MAX_DECODE_TOKENS  # 8
DIVISION_EPS = config.ROUTER_SCORE_DIVISION_EPS  # 1e-15, added in binary32
WARP = 32
EXPERTS_PER_LANE = NUM_EXPERTS // WARP  # 8: two 16-byte vectors per lane
THREADS = MAX_TOKENS * WARP  # 256: one warp per token
ROUTES_MAX = MAX_TOKENS * TOP_K  # 64
ROUTE_WARPS = ROUTES_MAX // WARP  # warps whose threads hold one route each in the metadata phase
VECTOR_WORDS = 4
VECTOR_BYTES = 16
WORD_BYTES = 4
ALIGN_BYTES = 16  # every tensor is read or written with 16-byte vectors
SORT_PHASES = EXPERTS_PER_LANE  # odd-even transposition sort: n phases sort n values
NOT_LOCAL = -1  # expanded_to_permuted of a route on another rank; permuted_to_token of padding
NO_ROUTE = -1  # shared-memory id of a route past the batch

# Order-preserving uint32 image of binary32 (`ordered_key_u32`).
F32_SIGN_BIT = 0x80000000
F32_MAGNITUDE_MASK = 0x7FFFFFFF
U32_MASK = 0xFFFFFFFF
F32_NEG_INF_BITS = 0xFF800000
EMPTY_KEY = 0  # a lane with no expert left: below every key (the ordered -inf is 0x00800000)

if THREADS != NUM_EXPERTS or ROUTES_MAX > THREADS or NUM_EXPERTS % (WARP * VECTOR_WORDS):
    raise ImportError("the routing kernel assumes one thread per expert and per route, 256 experts")

# The section offsets depend on tile_n only through the CTA bound min(E, R) + (R - min(E, R)) //
# tile_n, constant when R = 8 * 8 <= E = 256; the kernel bakes them, this checks the premise.
_LAYOUTS = {tile: RoutingMetadata(tile) for tile in range(1, TILE_N_MAX + 1)}
OFFSETS = _LAYOUTS[1].offsets
if any(layout.offsets != OFFSETS for layout in _LAYOUTS.values()):
    raise ImportError("routing metadata offsets depend on tile_n; the kernel bakes them")
EXPANDED_OFFSET = OFFSETS["expanded_to_permuted"]
CTA_TO_EXPERT_OFFSET = OFFSETS["cta_to_expert"]
CTA_ROW_LIMIT_OFFSET = OFFSETS["cta_row_limit"]
PERMUTED_TO_TOKEN_OFFSET = OFFSETS["permuted_to_token"]
if HEADER_WORDS != VECTOR_WORDS or (HEADER_PADDED_ROW_COUNT, HEADER_CTA_COUNT, HEADER_NUM_TOKENS, HEADER_TILE_N) != (0, 1, 2, 3):
    raise ImportError("the kernel writes the metadata header as one 16-byte vector in layout order")
if PERMUTED_TO_TOKEN_OFFSET % VECTOR_WORDS:
    raise ImportError("permuted_to_token must start on a 16-byte boundary (vector fill)")

# The seeds' names for the metadata fields (int32 word offsets into the buffer; the routed MoE
# op's names in `musebench.cute_ops.RoutingMetadata.fields`).
META_PADDED_TOKENS = HEADER_PADDED_ROW_COUNT  # total_num_padded_tokens
META_NUM_CTAS = HEADER_CTA_COUNT  # num_non_exiting_ctas
META_EXPANDED_TO_PERMUTED = EXPANDED_OFFSET  # expanded_idx_to_permuted_idx
META_CTA_BATCH = CTA_TO_EXPERT_OFFSET  # cta_idx_xy_to_batch_idx: the local expert of a CTA
META_CTA_LIMIT = CTA_ROW_LIMIT_OFFSET  # cta_idx_xy_to_mn_limit
META_PERMUTED_TO_TOKEN = PERMUTED_TO_TOKEN_OFFSET  # permuted_idx_to_token_idx
MAX_TILE = TILE_N_MAX
MAX_CTAS = ROUTES_MAX  # one CTA per route at most: 8 tokens x top-8 <= 256 experts
GUARD_WORDS = 1  # metadata_size's element past the layout: a GEMM may read it, nothing writes it
if any(layout.size != META_PERMUTED_TO_TOKEN + MAX_CTAS * tile for tile, layout in _LAYOUTS.items()):
    raise ImportError("the metadata layout ends with MAX_CTAS tiles of permuted rows; metadata_size assumes it")


def _like(word, value: int):
    return type(word)(value) if isinstance(word, cutlass.Numeric) else value


def ordered_key_u32(bits):
    """Monotone uint32 image of a binary32's bits: a < b as floats iff key(a) < key(b).

    -0.0 and +0.0 share the key 0x80000000 (IEEE equal), -inf is 0x00800000, +inf 0xFF800000;
    NaNs land outside [key(-inf), key(+inf)]. Integer arithmetic only: the same function runs on
    a DSL `Uint32` in the kernel and on a Python int (or int64 tensor of 32-bit values) in a test.
    key = 2^31 + magnitude for a positive sign, 2^31 - magnitude for a negative one (mod 2^32).
    """
    sign = bits >> _like(bits, 31)
    magnitude = bits & _like(bits, F32_MAGNITUDE_MASK)
    negative_part = magnitude & (_like(bits, 0) - sign)  # magnitude if the sign is set, else 0
    key = _like(bits, F32_SIGN_BIT) + magnitude - (negative_part << _like(bits, 1))
    return key & _like(bits, U32_MASK)


ORDERED_NEG_INF = ordered_key_u32(F32_NEG_INF_BITS)


def _select(condition, if_true, if_false):
    kind = type(if_true) if isinstance(if_true, cutlass.Numeric) else type(if_false)
    return kind(cutlass.select_(condition, if_true, if_false))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---------------------------------------------------------------------------------------------
# Device code.


class _RoutingKernel:
    """Top-8 routing of b <= 8 tokens (+ the routing metadata), one CTA of 256 threads."""

    def __init__(self, *, metadata: bool, renormalize: bool, enable_pdl: bool, division_eps: float = DIVISION_EPS) -> None:
        _require(isinstance(metadata, bool), f"metadata must be a bool, got {metadata!r}")
        _require(isinstance(renormalize, bool), f"renormalize must be a bool, got {renormalize!r}")
        _require(isinstance(enable_pdl, bool), f"enable_pdl must be a bool, got {enable_pdl!r}")
        _require(isinstance(division_eps, float) and math.isfinite(division_eps) and division_eps >= 0,
                 f"division_eps must be a finite float >= 0, got {division_eps!r}")
        self.metadata = metadata
        self.renormalize = renormalize
        self.enable_pdl = enable_pdl
        self.division_eps = division_eps
        # ids of every route, the tiles of each warp, each expert's first tile, each route warp's
        # count of every expert (int32 words).
        self.smem_bytes = (ROUTES_MAX + MAX_TOKENS + NUM_EXPERTS + ROUTE_WARPS * NUM_EXPERTS) * WORD_BYTES if metadata else 0

    @cute.jit
    def __call__(
        self,
        logits: cute.Tensor,
        bias: cute.Tensor,
        ids: cute.Tensor,
        weights: cute.Tensor,
        metadata: cute.Tensor,
        num_tokens: Int32,
        local_expert_offset: Int32,
        num_local_experts: Int32,
        tile_n: Int32,
        scale: Float32,
        stream: cuda.CUstream,
    ) -> None:
        self.kernel(logits, bias, ids, weights, metadata, num_tokens, local_expert_offset, num_local_experts, tile_n, scale).launch(
            grid=(1, 1, 1),
            block=(THREADS, 1, 1),
            smem=self.smem_bytes,
            stream=stream,
            use_pdl=self.enable_pdl,
        )

    @cute.kernel
    def kernel(
        self,
        logits: cute.Tensor,
        bias: cute.Tensor,
        ids: cute.Tensor,
        weights: cute.Tensor,
        metadata: cute.Tensor,
        num_tokens: Int32,
        local_expert_offset: Int32,
        num_local_experts: Int32,
        tile_n: Int32,
        scale: Float32,
    ) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        lane_bytes = Int64(lane) * (EXPERTS_PER_LANE * WORD_BYTES)

        # The bias is a router parameter, never written by the preceding kernel.
        bias_address = Int64(bias.iterator.toint()) + lane_bytes
        bias_words = [*ptx.ld_global_v4_u32(bias_address), *ptx.ld_global_v4_u32(bias_address + VECTOR_BYTES)]

        # Logits come from the router GEMM, and every output may still be read by the previous
        # consumer: all of it happens after the wait.
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_wait()
            # Dependents may start their prologue; their own wait covers this whole grid.
            cute.arch.griddepcontrol_launch_dependents()

        if cutlass.const_expr(self.metadata):
            smem = cutlass.memory.SmemAllocator()
            route_ids = smem.allocate_tensor(Int32, cute.make_layout(ROUTES_MAX), byte_alignment=16)
            warp_tiles = smem.allocate_tensor(Int32, cute.make_layout(MAX_TOKENS), byte_alignment=16)
            first_tiles = smem.allocate_tensor(Int32, cute.make_layout(NUM_EXPERTS), byte_alignment=16)
            # routes of each expert in each route warp's 32 routes; zero before the ids are parked
            warp_counts = smem.allocate_tensor(Int32, cute.make_layout(ROUTE_WARPS * NUM_EXPERTS), byte_alignment=16)
            for w in cutlass.range_constexpr(ROUTE_WARPS):
                warp_counts[w * NUM_EXPERTS + tidx] = Int32(0)

        if warp < num_tokens:
            logits_address = Int64(logits.iterator.toint()) + Int64(warp) * (NUM_EXPERTS * WORD_BYTES) + lane_bytes
            logit_words = [*ptx.ld_global_v4_u32(logits_address), *ptx.ld_global_v4_u32(logits_address + VECTOR_BYTES)]

            # Scores and selection keys: the stock's instructions, one inline asm each.
            scores = []
            keys = []
            for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
                x = ptx.bitcast_u32_to_f32(logit_words[j])
                t = ptx.mul_rn_f32(ptx.sub_rn_f32(Float32(0.0), x), Float32(LOG2_E))
                d = ptx.add_rn_f32(Float32(1.0), ptx.ex2_approx_f32(t))
                score = ptx.div_full_f32(Float32(1.0), d)
                key = ptx.add_rn_f32(score, ptx.bitcast_u32_to_f32(bias_words[j]))
                scores.append(score)
                keys.append(ordered_key_u32(ptx.bitcast_f32_to_u32(key)))
            # Expert 0's score, for rounds where only -inf keys remain (the stock then picks 0).
            expert0_score = cute.arch.shuffle_sync(scores[0], 0)

            # Sort once: stable odd-even transposition (swap on a strict inversion only).
            slots = [Int32(j) for j in range(EXPERTS_PER_LANE)]
            for phase in cutlass.range_constexpr(SORT_PHASES):
                for j in cutlass.range_constexpr(phase % 2, EXPERTS_PER_LANE - 1, 2):
                    swap = keys[j + 1] > keys[j]
                    keys[j], keys[j + 1] = _select(swap, keys[j + 1], keys[j]), _select(swap, keys[j], keys[j + 1])
                    scores[j], scores[j + 1] = _select(swap, scores[j + 1], scores[j]), _select(swap, scores[j], scores[j + 1])
                    slots[j], slots[j + 1] = _select(swap, slots[j + 1], slots[j]), _select(swap, slots[j], slots[j + 1])

            chosen_ids = []
            chosen_scores = []
            for _ in cutlass.range_constexpr(TOP_K):
                best = Uint32(cute.arch.warp_redux_sync(keys[0], "umax"))
                holders = Uint32(cute.arch.vote_ballot_sync(keys[0] == best))
                winner = Int32(cute.arch.clz(cute.arch.brev(holders)))  # the lowest lane holding it
                slot = Int32(cute.arch.shuffle_sync(slots[0], winner))
                score = Float32(cute.arch.shuffle_sync(scores[0], winner))
                only_minus_inf = best == Uint32(ORDERED_NEG_INF)
                chosen_ids.append(_select(only_minus_inf, Int32(0), winner * EXPERTS_PER_LANE + slot))
                chosen_scores.append(_select(only_minus_inf, expert0_score, score))
                # The winner pops its head.
                pop = lane == winner
                for j in cutlass.range_constexpr(EXPERTS_PER_LANE - 1):
                    keys[j] = _select(pop, keys[j + 1], keys[j])
                    scores[j] = _select(pop, scores[j + 1], scores[j])
                    slots[j] = _select(pop, slots[j + 1], slots[j])
                last = EXPERTS_PER_LANE - 1
                keys[last] = _select(pop, Uint32(EMPTY_KEY), keys[last])
                scores[last] = _select(pop, Float32(0.0), scores[last])
                slots[last] = _select(pop, Int32(0), slots[last])

            scale_f32 = Float32(scale)
            factor = scale_f32
            if cutlass.const_expr(self.renormalize):
                total = Float32(0.0)
                for k in cutlass.range_constexpr(TOP_K):
                    total = ptx.add_rn_f32(total, chosen_scores[k])
                total = ptx.add_rn_f32(total, Float32(self.division_eps))
                factor = ptx.div_full_f32(scale_f32, total)
            weight_words = [ptx.bitcast_f32_to_u32(ptx.mul_rn_f32(chosen_scores[k], factor)) for k in range(TOP_K)]
            id_words = [Uint32(chosen_ids[k]) for k in range(TOP_K)]

            if lane == 0:
                row_bytes = Int64(warp) * (TOP_K * WORD_BYTES)
                ids_address = Int64(ids.iterator.toint()) + row_bytes
                weights_address = Int64(weights.iterator.toint()) + row_bytes
                for half in cutlass.range_constexpr(TOP_K // VECTOR_WORDS):
                    w = id_words[half * VECTOR_WORDS : (half + 1) * VECTOR_WORDS]
                    ptx.st_global_v4_u32(ids_address + half * VECTOR_BYTES, w[0], w[1], w[2], w[3])
                    w = weight_words[half * VECTOR_WORDS : (half + 1) * VECTOR_WORDS]
                    ptx.st_global_v4_u32(weights_address + half * VECTOR_BYTES, w[0], w[1], w[2], w[3])
                if cutlass.const_expr(self.metadata):
                    for k in cutlass.range_constexpr(TOP_K):
                        route_ids[warp * TOP_K + k] = chosen_ids[k]
        else:
            if cutlass.const_expr(self.metadata):
                if lane == 0:
                    for k in cutlass.range_constexpr(TOP_K):
                        route_ids[warp * TOP_K + k] = Int32(NO_ROUTE)

        if cutlass.const_expr(self.metadata):
            # ---- metadata: thread e is expert e; thread r < 64 is route r = token * 8 + k.
            cute.arch.barrier()
            expert = Int32(tidx)
            route = Int32(tidx)
            route_expert = Int32(route_ids[_select(route < ROUTES_MAX, route, Int32(0))])
            local_end = local_expert_offset + num_local_experts
            # Route warps (threads r < 64): the lanes holding the same expert (`match.any`); a
            # route's rank among them is the lanes below it (index order = token order), and the
            # lowest such lane parks their number for its warp. Past-the-batch routes (NO_ROUTE)
            # match each other and park nothing.
            rank = Int32(0)  # routes of the same expert before this one: token order
            if warp < ROUTE_WARPS:
                same = Uint32(cute.arch.match_sync(Uint32(U32_MASK), route_expert, "any"))
                below = same & Uint32(cute.arch.lanemask_lt())
                rank = Int32(cute.arch.popc(below))
                if (below == Uint32(0)) & (route_expert >= 0):
                    warp_counts[warp * NUM_EXPERTS + route_expert] = Int32(cute.arch.popc(same))
            cute.arch.barrier()
            count = Int32(0)
            for w in cutlass.range_constexpr(ROUTE_WARPS):
                count = count + Int32(warp_counts[w * NUM_EXPERTS + expert])
            parked = _select(route_expert >= 0, route_expert, Int32(0))
            for w in cutlass.range_constexpr(ROUTE_WARPS - 1):  # the same expert in earlier route warps
                if warp > w:
                    rank = rank + Int32(warp_counts[w * NUM_EXPERTS + parked])
            is_local = (expert >= local_expert_offset) & (expert < local_end)
            count = _select(is_local, count, Int32(0))
            tiles = (count + tile_n - 1) // tile_n

            # Exclusive scan of tiles over the 256 experts: warp scan, then the warp totals.
            inclusive = tiles
            for step in (1, 2, 4, 8, 16):
                below = Int32(cute.arch.shuffle_sync_up(inclusive, offset=step))
                inclusive = inclusive + _select(lane >= step, below, Int32(0))
            if lane == WARP - 1:
                warp_tiles[warp] = inclusive
            cute.arch.barrier()
            before = Int32(0)
            cta_count = Int32(0)
            for w in cutlass.range_constexpr(MAX_TOKENS):
                total_w = Int32(warp_tiles[w])
                before = before + _select(warp > w, total_w, Int32(0))
                cta_count = cta_count + total_w
            first_tile = before + inclusive - tiles
            first_tiles[expert] = first_tile
            padded_rows = cta_count * tile_n

            metadata_address = Int64(metadata.iterator.toint())
            if tidx == 0:
                ptx.st_global_v4_u32(metadata_address, Uint32(padded_rows), Uint32(cta_count), Uint32(num_tokens), Uint32(tile_n))
            first_row = first_tile * tile_n
            for j in cutlass.range(tiles):
                tile = first_tile + j
                limit = cutlass.min((tile + 1) * tile_n, first_row + count)
                ptx.st_global_u32(metadata_address + Int64(CTA_TO_EXPERT_OFFSET + tile) * WORD_BYTES, Uint32(expert - local_expert_offset))
                ptx.st_global_u32(metadata_address + Int64(CTA_ROW_LIMIT_OFFSET + tile) * WORD_BYTES, Uint32(limit))

            # Every row of the padded space starts as padding; routed rows are overwritten after
            # the barrier (bar.sync orders the two global writes).
            rows_address = metadata_address + PERMUTED_TO_TOKEN_OFFSET * WORD_BYTES
            padding = Uint32(U32_MASK)  # -1
            for start in cutlass.range(Int32(tidx) * VECTOR_WORDS, padded_rows, THREADS * VECTOR_WORDS):
                if start + VECTOR_WORDS <= padded_rows:
                    ptx.st_global_v4_u32(rows_address + Int64(start) * WORD_BYTES, padding, padding, padding, padding)
                else:
                    for row in cutlass.range(start, padded_rows):
                        ptx.st_global_u32(rows_address + Int64(row) * WORD_BYTES, padding)
            cute.arch.barrier()

            if route < num_tokens * TOP_K:
                route_is_local = (route_expert >= local_expert_offset) & (route_expert < local_end)
                row = Int32(first_tiles[route_expert]) * tile_n + rank
                permuted = _select(route_is_local, row, Int32(NOT_LOCAL))
                ptx.st_global_u32(metadata_address + Int64(EXPANDED_OFFSET + route) * WORD_BYTES, Uint32(permuted))
                if route_is_local:
                    ptx.st_global_u32(rows_address + Int64(row) * WORD_BYTES, Uint32(route // TOP_K))


# ---------------------------------------------------------------------------------------------
# Compilation (fake tensors; `kernels.compilation`'s cache, keyed by the exact compile-time values).


@dataclass(frozen=True)
class RoutingOptions:
    """Compile options: PDL on or off, the target (default: CUTE_DSL_ARCH or the current GPU), a
    folder to keep the PTX in (`compiled.artifacts.PTX`). Part of the cache key."""

    enable_pdl: bool = True
    arch: str | None = None
    ptx_dir: str | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.enable_pdl, bool), f"enable_pdl must be a bool, got {self.enable_pdl!r}")
        _require(self.arch is None or isinstance(self.arch, str), f"arch must be a string or None, got {self.arch!r}")
        _require(self.ptx_dir is None or isinstance(self.ptx_dir, str), f"ptx_dir must be a string or None, got {self.ptx_dir!r}")


DEFAULT_OPTIONS = RoutingOptions()

def _option_string(build: RoutingOptions, options: str) -> str:
    """`options` after the target and PTX folder of `build`, in the DSL's string form. A string
    replaces the DSL's option objects, so this compile keeps no cubin (routing needs no
    occupancy query)."""
    words = []
    if build.arch is not None:
        words.append(f"--gpu-arch {build.arch}")
    if build.ptx_dir is not None:
        words.append(f"--keep-ptx --dump-dir {build.ptx_dir}")
    return " ".join([*words, options])


def compile_routing(metadata: bool, renormalize: bool, options: str = "", *,
                    build: RoutingOptions = DEFAULT_OPTIONS) -> Any:
    """Compile the routing kernel for one (metadata, renormalize) variant; cached per process
    (`compilation.compiled`, keyed by every compile-time value).

    `options`: extra CuTe DSL compile options in the DSL's string form (e.g. `--opt-level 2`),
    part of the cache key. `build` (musebench's, internal): PDL on or off, the target (default:
    CUTE_DSL_ARCH or the current GPU) and a folder for the PTX, also part of the key. Compiles
    from fake tensors, so no GPU is needed for an explicit target. The result launches on the
    stream it is given; `route` is how to call it. RuntimeError during CUDA-graph capture (call
    `prepare` first); ValueError on knobs of the wrong type.
    """
    _require(isinstance(metadata, bool), f"metadata must be a bool, got {metadata!r}")
    _require(isinstance(renormalize, bool), f"renormalize must be a bool, got {renormalize!r}")
    _require(isinstance(options, str), f"options must be a string of compile options, got {options!r}")
    _require(isinstance(build, RoutingOptions), f"build must be RoutingOptions, got {build!r}")
    extra = options.strip()
    knobs = dict(metadata=metadata, renormalize=renormalize, enable_pdl=build.enable_pdl)

    def compile_variant() -> Any:
        string = {"options": _option_string(build, extra)} if extra else {}
        return compiler(build.arch, build.ptx_dir)(
            _RoutingKernel(**knobs),
            fake_flat(Float32, NUM_EXPERTS, ALIGN_BYTES),
            make_fake_compact_tensor(Float32, (NUM_EXPERTS,), assumed_align=ALIGN_BYTES),
            fake_flat(Int32, TOP_K, ALIGN_BYTES),
            fake_flat(Float32, TOP_K, ALIGN_BYTES),
            fake_flat(Int32, 1, ALIGN_BYTES) if metadata else None,  # any length >= size: a guard word may follow
            Int32(1),
            Int32(0),
            Int32(1),
            Int32(1),
            Float32(1.0),
            cuda.CUstream(0),
            **string,
        )

    key = compilation.kernel_key(_RoutingKernel, arch=build.arch, ptx_dir=build.ptx_dir, options=extra, **knobs)
    return compilation.compiled(key, compile_variant, what="the routing kernels (musebench.kernels.routing.prepare)")


def compiled_routing(metadata: bool, renormalize: bool) -> Any:
    """`compile_routing(metadata, renormalize)` with the default options, compiled once per process
    (the one compile cache holds it; compile it before CUDA-graph capture: `prepare`)."""
    return compile_routing(metadata, renormalize)


def metadata_size(tile_n: int) -> int:
    """int32 elements a metadata buffer for GEMM tile `tile_n` needs: the layout
    (`musebench.routing_metadata.RoutingMetadata(tile_n).size`, room for MAX_CTAS tiles of
    permuted rows) and one guard element after it, which a GEMM may read and nothing writes.
    ValueError unless 1 <= tile_n <= MAX_TILE."""
    return _layout(tile_n).size + GUARD_WORDS


def _layout(tile_n: int) -> RoutingMetadata:
    if isinstance(tile_n, bool) or not isinstance(tile_n, int) or tile_n not in _LAYOUTS:
        raise ValueError(f"tile_n must be an int in [1, {TILE_N_MAX}], got {tile_n!r}")
    return _LAYOUTS[tile_n]


def prepare(renormalize: bool = True) -> None:
    """Compile the two variants `route` takes for `renormalize` (with and without metadata), before
    CUDA-graph capture."""
    for metadata in (False, True):
        compiled_routing(metadata, bool(renormalize))


# ---------------------------------------------------------------------------------------------
# Host side.




def _check_tensor(name: str, tensor: object, dtype: torch.dtype, shape: tuple[int, ...] | None) -> None:
    """Type, dtype, shape, contiguity and alignment (device-independent checks)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if tensor.data_ptr() % ALIGN_BYTES:
        raise ValueError(f"{name} must be {ALIGN_BYTES}-byte aligned")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share a byte (by address; no device access)."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    a_end, b_end = a_start + a.numel() * a.element_size(), b_start + b.numel() * b.element_size()
    return a_start < b_end and b_start < a_end and a.numel() > 0 and b.numel() > 0


def _check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if not tensor.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {tensor.device}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the logits on {device}")


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a real number, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    scale: float,
    renormalize: bool = True,
    metadata: torch.Tensor | None = None,
    local_expert_offset: int = 0,
    num_local_experts: int = 0,
    tile_n: int = 0,
) -> None:
    """Route b tokens to their top-8 of 256 experts on the current stream, in one launch.

    Contract:
    - logits: float32 [b, 256], 1 <= b <= 8; bias: float32 [256]; ids: int32 [b, 8] (written, in
      selection order); weights: float32 [b, 8] (written); all on one CUDA device, contiguous,
      16-byte aligned; no NaN in logits or bias (not checked: it would need a sync);
    - bias is read before the PDL wait: the kernel launched just before must not write it;
    - scale: the route scale, finite (used as binary32); renormalize: weights divided by the sum of
      the 8 scores + f32(1e-15) (the stock), or False: weight = score * f32(scale);
    - metadata: None, or a 1-D int32 CUDA buffer of at least `metadata_size(tile_n)` words (the
      layout and its guard element), not aliasing ids or weights, with 1 <= tile_n <= 256,
      1 <= num_local_experts and 0 <= local_expert_offset with offset + num_local_experts <=
      256; only the live words of `musebench.routing_metadata.RoutingMetadata(tile_n)` are
      written (the seeds' fields: `musebench.cute_ops.RoutingMetadata.fields`). Without metadata,
      offset, count and tile_n must stay 0.
    Bitwise equal to `routing_reference(..., approximations=hardware_approximations())` (ids,
    weights) and to `pack_metadata(routing_metadata_reference(ids, ...))` on the live words.
    ValueError on any violation, before launching. Allocates nothing; graph-capturable once the
    variant is compiled (`prepare`); the first call of a variant compiles it (`compiled_routing`).
    """
    _check_tensor("logits", logits, torch.float32, None)
    if logits.dim() != 2 or logits.shape[1] != NUM_EXPERTS:
        raise ValueError(f"logits must be [b, {NUM_EXPERTS}], got {tuple(logits.shape)}")
    b = logits.shape[0]
    if not 1 <= b <= MAX_TOKENS:
        raise ValueError(f"the batch must be 1..{MAX_TOKENS} tokens, got {b}")
    _check_tensor("bias", bias, torch.float32, (NUM_EXPERTS,))
    _check_tensor("ids", ids, torch.int32, (b, TOP_K))
    _check_tensor("weights", weights, torch.float32, (b, TOP_K))
    scale = _check_scale(scale)
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    if metadata is None:
        if any(isinstance(v, bool) or not isinstance(v, int) or v != 0 for v in (local_expert_offset, num_local_experts, tile_n)):
            raise ValueError("local_expert_offset, num_local_experts and tile_n only go with a metadata buffer (leave them 0)")
    else:
        _check_int("tile_n", tile_n, 1, TILE_N_MAX)
        _check_int("num_local_experts", num_local_experts, 1, NUM_EXPERTS)
        _check_int("local_expert_offset", local_expert_offset, 0, NUM_EXPERTS - 1)
        if local_expert_offset + num_local_experts > NUM_EXPERTS:
            raise ValueError(
                f"local experts [{local_expert_offset}, {local_expert_offset + num_local_experts}) exceed {NUM_EXPERTS} experts"
            )
        _check_tensor("metadata", metadata, torch.int32, None)
        size = metadata_size(tile_n)
        if metadata.dim() != 1 or metadata.numel() < size:
            raise ValueError(f"metadata must be a 1-D buffer of at least metadata_size({tile_n}) = {size} words, got {tuple(metadata.shape)}")
        for name, output in (("ids", ids), ("weights", weights)):
            if _overlap(metadata, output):
                raise ValueError(f"metadata must not alias {name}")
    device = logits.device
    for name, tensor in (("logits", logits), ("bias", bias), ("ids", ids), ("weights", weights), ("metadata", metadata)):
        if tensor is not None:
            _check_device(name, tensor, device)

    compiled = compiled_routing(metadata is not None, renormalize)
    stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
    compiled(
        cute_flat(logits, ALIGN_BYTES, NUM_EXPERTS),
        cute_flat(bias, ALIGN_BYTES, NUM_EXPERTS),
        cute_flat(ids, ALIGN_BYTES, TOP_K),
        cute_flat(weights, ALIGN_BYTES, TOP_K),
        cute_flat(metadata, ALIGN_BYTES, 1) if metadata is not None else None,
        Int32(b),
        Int32(local_expert_offset),
        Int32(num_local_experts),
        Int32(tile_n),
        Float32(scale),
        stream,
    )
