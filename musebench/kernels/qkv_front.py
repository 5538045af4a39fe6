"""qkv_front: the QKV + o-gate projection of 1 to 16 tokens fused with the stock's qk-norm, RoPE
and KV-cache insert, in one launch (sm_90a and sm_100a: warp-level `mma.sync` BF16, no UMMA).

What it computes (the contract of `musebench.cute_ops.launch_qkv_front`): out = x W^T, x bf16
[T, 8192], W bf16 [N, 8192], N = 1152 kv (rows [q | k | v | gate], 64 per head), FP32
accumulation, one BF16 rounding; then on every q and k head the stock's arithmetic
(`musebench.stock.qkv_front`, bitwise: fma sum of squares in 8 lanes of 8, butterfly xor 4, 2, 1,
`rsqrt.approx.f32(fma(ss, 1/64, eps))`, `mul.rn`, RoPE with `fma.rn` / `mul.rn`, one cvt.rn.bf16);
k and v of tokens with 0 <= slot < pages x 16 go into kv_cache [pages, kv, 16, 128] (K | V); gate
and v columns stay as projected.

Bounds (device values the host cannot check without reading them): a slot < 0 or >= pages x 16
(`slot_limit`) inserts nothing; a position outside [0, max_pos) reads row 0 or row max_pos - 1 of
the table (clamped), so no position reads outside cos_sin_cache and no slot writes outside
kv_cache. `stock.qkv_front.qkv_epilogue_reference` models both.

Geometry. One cluster of SPLIT = 8 CTAs per head of 64 output columns at every N: grid (8, N / 64),
clusters (8, 1, 1), 128 threads (4 warps) per CTA: 144, 288, 576 CTAs for N = 1152, 2304, 4608,
every one resident at once (STAGES[kv] ring stages keep the shared memory of 2, 3, 5 CTAs within
one SM). CTA r of the cluster reduces the K slice [1024 r, 1024 (r + 1)); warp w of it the head's
columns 16 w .. 16 w + 15 (n-tiles 2 w, 2 w + 1) over the whole slice. The tokens are padded to
M = 16 (rows >= T are zero-filled in shared memory, never read from x, never stored).

Streaming. The slice goes through a ring of STAGES stages of STAGE_K = 64 k in shared memory, filled
by `cp.async.cg` (16 bytes, through L2 only): a stage is the head's 64 weight rows x 128 bytes
(8 KB) and x's 16 rows x 128 bytes; each thread issues 4 + 1 copies per stage, a row's 8 chunks
by 8 consecutive lanes (128 contiguous bytes). STAGES - 1 stages are in flight while one is
consumed: 56 / 48 / 24 KB of weight per CTA, 112 / 144 / 120 KB per SM. Chunk c of row r lies at
chunk c ^ 4 (r & 1) of its 128-byte line, so the fragment reads below (rows r, r + 1 in one phase
of 8 lanes) hit disjoint banks.

Projection, one warp-step of 32 k (lane = 4 g + t): the lane reads 16 bytes of weight rows
16 w + g and 16 w + 8 + g at k + 8t .. k + 8t + 7, and of x rows g and g + 8 at the same k. Two
m16n8k16 MMAs per n-tile consume them: the MMA's logical k pair (2t, 2t+1) / (2t+8, 2t+9) is the
physical pair (8t, 8t+1) / (8t+2, 8t+3) in the first and (8t+4, 8t+5) / (8t+6, 8t+7) in the
second; A and B use the same permutation, so the product is x W^T over the step's 32 k. Each
accumulator is one chain of MMAs over the slice's k in increasing order.

Reduction, fixed order (bitwise repeatable; an output element never depends on another token's
row, so neither on T's padding nor on the rank, and with SPLIT fixed not on N either: a head's
bits are the same at tp 4, 8, 16): after a cluster barrier (every CTA done with its ring), CTAs
1..7 store their FP32 accumulators into CTA 0's ring (`mapa` + `st.shared::cluster`, slot r - 1);
after a second barrier CTA 0 adds rank 1, 2, .., 7 to its own in rank order (add.rn) and rounds
once to BF16 (`cvt.rn.bf16x2.f32`). With TAP the BF16 projection is also written to `tap` before
the epilogue.

PDL (`enable_pdl`, default True; launched with programmatic dependent launch): the weight is
static, so each thread issues the weight copies of the first STAGES - 1 stages (one commit group
per stage, as without PDL) before `griddepcontrol.wait`; x, positions, slots and the table may be
the preceding kernel's outputs, so they are read after it, and nothing is written before it. The
prologue's x rows go through registers (`ld.global.cg` 16 bytes, zero past the tokens,
`st.shared`), since a cp.async group committed after the wait would complete only after every
weight group before it. From stage STAGES - 1 on, the loop is the same as without PDL, and so is
every MMA chain and the reduction: the bits do not depend on `enable_pdl`. Dependents are
released (`griddepcontrol.launch_dependents`) after the stream, before the cluster's reduction:
their own wait still waits for this grid's end, and every CTA of ours is resident already.

Balance (built, measured, not kept). N = 1152 puts 144 CTAs of equal work on 132 SMs (12 SMs
stream twice the weight). Branch `front-balance` (merged at ad89434, reverted after) built the
balanced plan: units of (head, k-slice, column group) in CTAs of 1 to 4 warps, each warp this
kernel's MMA chain over its slice, the partials summed in rank order by the last arriver of a
self-re-arming counter (busiest SM 3 % over the mean at every N instead of 1.83 / 1.38 / 1.15x).
On the H200 it gave this kernel's bits exactly (121 GPU tests) and was slower at every N and token
count (`bench front`, same run, records/2026-12-01-h200-ad89434-bench-front.summary.json):
N = 1152 7.96-8.36 us against 7.08-7.21, 2304 12.68-13.90 against 9.82-10.16, 4608 22.97-23.86
against 21.88-22.77. The stream is bound by HBM, not by the busiest SM (an SM pulls its two CTAs'
256 KB from L2 in about 2 us, inside the 4.5 us of the whole read); the finer units add L2 round
trips and a longer tail than the imbalance costs.

Against the read floor (`stock.read_floor`: a plain read of the weight's bytes, `bench front`'s
`read floor` columns, same run; records/2026-12-02-h200-fb41107-bench-front.summary.json): cold
weights N = 1152 / 2304 / 4608 8.25-8.36 / 12.44-12.94 / 22.80-23.75 us against a plain read's
6.47-7.01 / 10.74-11.03 / 19.20-19.62 (1.2-1.3 x); the stream without the MMAs (`loads_only`,
Nsight Compute) is 1-2 us shorter than the kernel. The issue's 1.1 x the weight-read roofline
(4.9 / 9.9 / 19.8 us) is below what a plain read of the weight takes as these benches time it at
N 1152 and 2304, so no kernel meets it there.

Epilogue (CTA 0, 16 rows x 8 lanes of 8 consecutive columns: the stock's thread program):
q and k heads are normed and rotated and written back into `out`; a k head also into the cache's
K of its slot, a v head its raw words into the cache's V; a slot outside [0, pages x 16) writes
nothing. Every CTA reads its thread's position, slot and cos / sin words before the main loop
(after the PDL wait), so their latency hides behind the stream.

Memory: the host owns everything; pointers are passed as Int64 addresses (16-byte aligned,
contiguous: `cute_ops.qkv_front_unsupported` checks before launch). No workspace, no counters:
a launch is graph-capturable and allocates nothing.

Cluster placement (measured, nothing kept): the trace (below) shows the cluster launch packing CTAs
of one launch onto fewer SMs than it could use: at N 1152 about 119 of the 144 CTAs share their SM
with another (stream 4.0 us median against 3.2 alone), at N 2304 most run three an SM (6.4 against
4.5 alone), at N 4608 five. A launch asking the driver to spread each cluster over distinct SMs
(the cluster scheduling policy Spread, added to CuTe DSL 4.8's launch config through its
launch-config op) changed neither the packing nor the time (records/2026-12-01-h200-50ccdea-*-front-
spread*: cold-weight medians within -0.6 .. +0.3 us, the trace's SM loads the same), so it was
removed again.

Trace (compile-time `trace`, an experiment: `launch(..., trace=buffer)`, `scripts/trace-qkv-front.py`;
no deployment builds it): thread 0 of every CTA writes TRACE_WORDS int64 to row `head x 8 + rank`
of an int64 [CTAS, TRACE_WORDS] buffer after its last store: its SM, %globaltimer at entry and at
the end (ns, one clock for every SM), and %clock64 (the SM's cycles) at entry, right after the PDL
wait (without PDL: after the prologue's copies are issued), after the stream (every copy landed and every
MMA issued), after the cluster's reduction barrier, and at the end (`TRACE_FIELDS`). Every thread
reads the clocks (no branch in the stream); only the writes are thread 0's. The bits of `out`,
`tap` and the cache are the untraced build's: the trace adds reads of special registers and
stores to its own buffer only.
"""

from __future__ import annotations

from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from musebench import config
from musebench.kernels import compilation, ptx
from musebench.numerics import check_eps

HIDDEN = config.HIDDEN_SIZE  # 8192
HEAD_DIM = config.HEAD_DIM  # 64
HEADS_PER_KV_HEAD = config.NUM_QUERY_HEADS // config.NUM_KV_HEADS  # 8
COLUMNS_PER_KV_HEAD = 2 * (HEADS_PER_KV_HEAD + 1) * HEAD_DIM  # 1152
KV_HEADS = (1, 2, 4)
SPLIT = 8  # CTAs per head (cluster size) at every N: the summation order does not depend on N
CTAS = {kv: SPLIT * COLUMNS_PER_KV_HEAD * kv // HEAD_DIM for kv in KV_HEADS}  # 144, 288, 576
# STAGES: ring stages; 2, 3, 5 CTAs per SM fit (every CTA resident at once). 7 is the most for 2 KV
# heads (3 CTAs an SM); against 6 it ran N 2304 at 9.55-10.09 us against 9.89-10.60 (same bits; A/B
# on one lease, records/2026-12-01-h200-548d89e-ab-front-stages.json). For 1 KV head 11 (the most
# for 2 CTAs an SM) ran N 1152 at 7.50-7.72 against 7.10-7.35 with 8 in the same A/B: 8 stays.
STAGES = {1: 8, 2: 7, 4: 4}
SM_SHARED_BYTES = 228 * 1024  # H200 / GB200 shared memory per SM, 1 KB of it reserved per CTA
H200_SMS = 132
MAX_TOKENS = 16  # M of one MMA tile
WARPS = 4
THREADS = WARPS * 32
STEP_K = 32  # k per warp-step: 4 lanes x 8 elements
STAGE_K = 64  # k per ring stage: two warp-steps
K_CTA = HIDDEN // SPLIT  # 1024
STAGES_PER_CTA = K_CTA // STAGE_K  # 16
N_TILES = HEAD_DIM // 8  # 8 n-tiles of 8 columns per head
TILES_PER_WARP = N_TILES // WARPS  # 2
BF16_BYTES = 2
F32_BYTES = 4
CHUNK_BYTES = 16
LINE_BYTES = STAGE_K * BF16_BYTES  # 128: one row of a stage
CHUNKS_PER_LINE = LINE_BYTES // CHUNK_BYTES  # 8
WEIGHT_STAGE_BYTES = HEAD_DIM * LINE_BYTES  # 8192
STAGE_BYTES = WEIGHT_STAGE_BYTES + MAX_TOKENS * LINE_BYTES  # 10240
WEIGHT_COPIES = HEAD_DIM * CHUNKS_PER_LINE // THREADS  # 4 per thread and stage
ROWS_PER_COPY = THREADS // CHUNKS_PER_LINE  # 16
ELEMENTS = MAX_TOKENS * HEAD_DIM  # 1024 FP32 partials per CTA
ACCUMULATORS = 4 * TILES_PER_WARP  # 8 per thread
TILE_BYTES = ELEMENTS * BF16_BYTES
CACHE_BLOCK = 16
CACHE_WIDTH = 2 * HEAD_DIM
INV_HEAD_DIM = 0.015625
ROTARY_PAIRS = HEAD_DIM // 2
TRACE_FIELDS = ("smid", "globaltimer_entry", "globaltimer_end", "clock_entry", "clock_waited", "clock_streamed",
                "clock_reduced", "clock_end")
TRACE_WORDS = len(TRACE_FIELDS)  # int64 words a CTA writes (`trace`)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def smem_bytes(num_kv_heads: int) -> int:
    """Dynamic shared memory of one CTA: the ring (CTA 0 takes the peers' partials into it once
    every CTA is done with its own) and the BF16 tile of the epilogue."""
    _require(num_kv_heads in KV_HEADS, f"num_kv_heads must be one of {KV_HEADS}, got {num_kv_heads!r}")
    ring = STAGES[num_kv_heads] * STAGE_BYTES
    assert ring >= (SPLIT - 1) * ELEMENTS * F32_BYTES
    return ring + TILE_BYTES + 128


def ctas_per_sm(num_kv_heads: int) -> int:
    """CTAs one SM holds by shared memory (1 KB reserved per CTA): at least ceil(CTAS / 132)."""
    return SM_SHARED_BYTES // (smem_bytes(num_kv_heads) + 1024)


class _QkvFrontKernel:
    """The QKV front of one layer shape: grid (8, N / 64), clusters (8, 1, 1), 128 threads."""

    def __init__(self, *, num_kv_heads: int, rope: bool, tap: bool, eps: float, enable_pdl: bool = True,
                 trace: bool = False, loads_only: bool = False) -> None:
        _require(num_kv_heads in KV_HEADS, f"num_kv_heads must be one of {KV_HEADS}, got {num_kv_heads!r}")
        _require(isinstance(enable_pdl, bool), f"enable_pdl must be a bool, got {enable_pdl!r}")
        _require(isinstance(trace, bool), f"trace must be a bool, got {trace!r}")
        _require(isinstance(loads_only, bool), f"loads_only must be a bool, got {loads_only!r}")
        check_eps(eps)
        self.kv = num_kv_heads
        self.rope = bool(rope)
        self.tap = bool(tap)
        self.eps = float(eps)
        self.enable_pdl = enable_pdl
        self.trace = trace
        self.loads_only = loads_only  # a timing probe: the stream without its MMAs (`compile_qkv_front`)
        self.stages = STAGES[num_kv_heads]
        self.n = COLUMNS_PER_KV_HEAD * num_kv_heads
        self.heads = self.n // HEAD_DIM
        self.q_heads = HEADS_PER_KV_HEAD * num_kv_heads

    @cute.jit
    def __call__(self, x: Int64, weight: Int64, positions: Int64, cos_sin: Int64, slots: Int64, kv_cache: Int64,
                 out: Int64, tap: Int64, trace: Int64, tokens: Int32, max_pos: Int64, slot_limit: Int64,
                 stream: cuda.CUstream) -> None:
        self.kernel(x, weight, positions, cos_sin, slots, kv_cache, out, tap, trace, tokens, max_pos, slot_limit).launch(
            grid=(SPLIT, self.heads, 1), block=(THREADS, 1, 1), cluster=(SPLIT, 1, 1),
            smem=smem_bytes(self.kv), stream=stream, use_pdl=self.enable_pdl)

    @cute.kernel
    def kernel(self, x: Int64, weight: Int64, positions: Int64, cos_sin: Int64, slots: Int64, kv_cache: Int64,
               out: Int64, tap: Int64, trace: Int64, tokens: Int32, max_pos: Int64, slot_limit: Int64) -> None:
        clocks = {}
        if cutlass.const_expr(self.trace):
            started = ptx.read_globaltimer_u64()
            clocks["clock_entry"] = ptx.read_clock64_u64()
        rank, head, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane >> 2
        t = lane & 3

        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint32, cute.make_layout(self.stages * STAGE_BYTES // 4), byte_alignment=128)
        tile = smem.allocate_tensor(Uint32, cute.make_layout(ELEMENTS // 2), byte_alignment=16)
        ring_base = Int32(ring.iterator.toint())

        # Copies: thread tidx moves chunk tidx % 8 of rows tidx / 8 + 16 i (weight) and tidx / 8 (x).
        copy_row = tidx >> 3
        copy_chunk = tidx & 7
        swizzled = copy_chunk ^ ((copy_row & 1) << 2)
        k_first = Int64(rank * K_CTA + copy_chunk * 8)
        weight_source = Int64(weight) + (Int64(head * HEAD_DIM + copy_row) * HIDDEN + k_first) * BF16_BYTES
        x_live = copy_row < tokens  # rows past the tokens: zero-filled, x's row 0 named but not read
        x_source = Int64(x) + (Int64(cutlass.select_(x_live, copy_row, Int32(0))) * HIDDEN + k_first) * BF16_BYTES
        x_bytes = cutlass.select_(x_live, Int32(CHUNK_BYTES), Int32(0))
        copy_target = ring_base + copy_row * LINE_BYTES + swizzled * CHUNK_BYTES

        # Fragment reads: weight rows 16 w + 8 jj + g, x rows g and g + 8, chunk 4 s + t (swizzled).
        g_odd = g & 1
        chunk_offset = [((4 * s + t) ^ (g_odd << 2)) * CHUNK_BYTES for s in range(STAGE_K // STEP_K)]
        weight_read = ring_base + (warp * (TILES_PER_WARP * 8) + g) * LINE_BYTES
        x_read = ring_base + WEIGHT_STAGE_BYTES + g * LINE_BYTES

        # The epilogue's row (tidx / 8, row 0 past the tokens).
        epilogue_row = Int64(cutlass.select_((tidx >> 3) < tokens, tidx >> 3, Int32(0)))
        if cutlass.const_expr(self.enable_pdl):
            # PDL: the weight is static (no kernel writes it), so the first STAGES - 1 stages' weight
            # copies go out before griddepcontrol.wait, one commit group per stage as below; x,
            # positions, slots and the table may come from the preceding kernel: every read of them,
            # and every write of this kernel, follows the wait. The prologue's x goes through
            # registers (ld.global.cg, 16 bytes, zero past the tokens, st.shared into the stage's x
            # rows), not cp.async: a cp.async group committed after the wait would complete only
            # after every weight group before it (groups complete in order), so stage 0 would wait
            # for all STAGES - 1 weight stages. The first stage's barrier publishes the stores.
            for st in cutlass.range_constexpr(self.stages - 1):
                self.issue_weight(st, st, weight_source, copy_target)
                cute.arch.cp_async_commit_group()
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(self.trace):
                clocks["clock_waited"] = ptx.read_clock64_u64()
            slot, position = self.slot_and_position(slots, positions, epilogue_row)
            zero = Uint32(0)
            x_words = [ptx.ld_global_cg_v4_u32(x_source + st * LINE_BYTES) for st in range(self.stages - 1)]
            for st in cutlass.range_constexpr(self.stages - 1):
                live = [cutlass.select_(x_live, x_words[st][i], zero) for i in range(4)]
                ptx.st_shared_v4_u32(copy_target + st * STAGE_BYTES + WEIGHT_STAGE_BYTES, live[0], live[1], live[2],
                                     live[3])
        else:
            # Without PDL: the slot and position first, then each stage's weight and x in one group.
            slot, position = self.slot_and_position(slots, positions, epilogue_row)
            for st in cutlass.range_constexpr(self.stages - 1):
                self.issue_stage(st, st, weight_source, x_source, x_bytes, copy_target)
                cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.trace):
                clocks["clock_waited"] = ptx.read_clock64_u64()
        # The cos / sin words of the position, clamped into [0, max_pos) so that no position reads
        # outside the table (the contract: a position outside it rotates by the nearest row); their
        # latency hides behind the stream.
        cos_words = [Uint32(0)] * 4
        sin_words = [Uint32(0)] * 4
        if cutlass.const_expr(self.rope):
            row_of_table = cutlass.select_(position < Int64(0), Int64(0), position)
            row_of_table = cutlass.select_(row_of_table >= max_pos, max_pos - Int64(1), row_of_table)
            table = Int64(cos_sin) + (row_of_table * HEAD_DIM + (tidx & 7) * 4) * F32_BYTES
            cos_words = list(ptx.ld_global_v4_u32(table))
            sin_words = list(ptx.ld_global_v4_u32(table + ROTARY_PAIRS * F32_BYTES))
        epilogue_inputs = (slot, cos_words, sin_words)

        acc = [Float32(0.0) for _ in range(ACCUMULATORS)]
        for st in cutlass.range_constexpr(STAGES_PER_CTA):
            cute.arch.cp_async_wait_group(self.stages - 2)
            cute.arch.barrier()  # stage st landed for every thread; stage st - 1 is consumed
            ahead = st + self.stages - 1
            if cutlass.const_expr(ahead < STAGES_PER_CTA):
                self.issue_stage(ahead, ahead % self.stages, weight_source, x_source, x_bytes, copy_target)
            cute.arch.cp_async_commit_group()
            stage = (st % self.stages) * STAGE_BYTES
            for s in cutlass.range_constexpr(0 if self.loads_only else STAGE_K // STEP_K):
                a_low = ptx.ld_shared_v4_u32(x_read + stage + chunk_offset[s])
                a_high = ptx.ld_shared_v4_u32(x_read + stage + 8 * LINE_BYTES + chunk_offset[s])
                for jj in cutlass.range_constexpr(TILES_PER_WARP):
                    b = ptx.ld_shared_v4_u32(weight_read + stage + jj * 8 * LINE_BYTES + chunk_offset[s])
                    for half in cutlass.range_constexpr(2):
                        d = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                            a_low[2 * half], a_high[2 * half], a_low[2 * half + 1], a_high[2 * half + 1],
                            b[2 * half], b[2 * half + 1],
                            acc[4 * jj], acc[4 * jj + 1], acc[4 * jj + 2], acc[4 * jj + 3],
                        )
                        for i in cutlass.range_constexpr(4):
                            acc[4 * jj + i] = d[i]
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(self.trace):
            clocks["clock_streamed"] = ptx.read_clock64_u64()
        if cutlass.const_expr(self.enable_pdl):
            # Dependents may launch now: the stream is done, what is left is the cluster's
            # reduction and the epilogue (a few µs of latency, little bandwidth). Safe anywhere:
            # a dependent's griddepcontrol.wait still waits for this whole grid to finish and
            # flush; only its pre-wait work (e.g. the next front's weight prefetch) overlaps ours.
            # Every CTA of this grid is resident from the start (`ctas_per_sm`), so a dependent
            # takes no SM a CTA of ours still waits for.
            cute.arch.griddepcontrol_launch_dependents()

        # Every CTA of the cluster is done with its ring (and has started): CTA 0's takes the peers'.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if rank > 0:
            for i in cutlass.range_constexpr(ACCUMULATORS):
                remote = ptx.mapa_shared_cluster_u32(
                    ring_base + ((rank - 1) * ELEMENTS + i * THREADS + tidx) * F32_BYTES, Int32(0))
                ptx.st_shared_cluster_f32(remote, acc[i])
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if cutlass.const_expr(self.trace):
            clocks["clock_reduced"] = ptx.read_clock64_u64()

        if rank == 0:
            self.finish(acc, ring_base, tile, head, warp, g, t, tidx, tokens, epilogue_inputs, kv_cache, out, tap,
                        slot_limit)
        if cutlass.const_expr(self.trace):
            clocks["clock_end"] = ptx.read_clock64_u64()
            ended = ptx.read_globaltimer_u64()
            if tidx == 0:
                words = dict(clocks, smid=Int64(ptx.read_smid_u32()), globaltimer_entry=started, globaltimer_end=ended)
                row = Int64(trace) + Int64(head * SPLIT + rank) * (TRACE_WORDS * 8)
                for i in cutlass.range_constexpr(TRACE_WORDS):
                    ptx.st_global_u64(row + i * 8, words[TRACE_FIELDS[i]])

    @cute.jit
    def slot_and_position(self, slots: Int64, positions: Int64, epilogue_row: Int64):
        """The epilogue row's slot and (with RoPE; else 0) position, int64 each."""
        slot = ptx.ld_global_s64(Int64(slots) + epilogue_row * 8)
        position = Int64(0)
        if cutlass.const_expr(self.rope):
            position = ptx.ld_global_s64(Int64(positions) + epilogue_row * 8)
        return slot, position

    @cute.jit
    def issue_weight(self, st: int, slot: int, weight_source: Int64, copy_target: Int32) -> None:
        """The weight's cp.async copies of stage `st` (k 1024 r + 64 st ..) into ring slot `slot`."""
        k_bytes = st * LINE_BYTES
        target = copy_target + slot * STAGE_BYTES
        for i in cutlass.range_constexpr(WEIGHT_COPIES):
            ptx.cp_async_cg_shared_global_16(
                target + i * ROWS_PER_COPY * LINE_BYTES,
                weight_source + (i * ROWS_PER_COPY * HIDDEN * BF16_BYTES + k_bytes), Int32(CHUNK_BYTES))

    @cute.jit
    def issue_stage(self, st: int, slot: int, weight_source: Int64, x_source: Int64, x_bytes: Int32,
                    copy_target: Int32) -> None:
        """The cp.async copies of stage `st` (k 1024 r + 64 st ..) into ring slot `slot`: weight, then x."""
        self.issue_weight(st, slot, weight_source, copy_target)
        target = copy_target + slot * STAGE_BYTES
        ptx.cp_async_cg_shared_global_16(target + WEIGHT_STAGE_BYTES, x_source + st * LINE_BYTES, x_bytes)

    @cute.jit
    def finish(self, acc, ring_base: Int32, tile, head, warp, g, t, tidx, tokens: Int32, epilogue_inputs,
               kv_cache: Int64, out: Int64, tap: Int64, slot_limit: Int64) -> None:
        """CTA 0: the cluster's sum in rank order, one BF16 rounding, then the stock's epilogue."""
        v = list(acc)
        for i in cutlass.range_constexpr(ACCUMULATORS):
            for r in cutlass.range_constexpr(1, SPLIT):
                peer = ptx.ld_shared_u32(ring_base + ((r - 1) * ELEMENTS + i * THREADS + tidx) * F32_BYTES)
                v[i] = ptx.add_rn_f32(v[i], ptx.bitcast_u32_to_f32(peer))
        # Fragment (jj, half): row g + 8 half, columns 16 w + 8 jj + 2t, + 1 -> one BF16 pair.
        for jj in cutlass.range_constexpr(TILES_PER_WARP):
            for half in cutlass.range_constexpr(2):
                word = ptx.cvt_rn_bf16x2_f32(v[4 * jj + 2 * half + 1], v[4 * jj + 2 * half])
                row = g + 8 * half
                pair = (warp * TILES_PER_WARP + jj) * 4 + t  # column / 2
                tile[row * (HEAD_DIM // 2) + pair] = word
                if cutlass.const_expr(self.tap):
                    if row < tokens:
                        ptx.st_global_u32(Int64(tap) + (Int64(row) * self.n + head * HEAD_DIM + 2 * pair) * BF16_BYTES,
                                          word)
        cute.arch.barrier()

        # The stock's thread program: row = tidx / 8, lane l8 owns columns 8 l8 .. 8 l8 + 7.
        slot, cos_words, sin_words = epilogue_inputs
        row = tidx >> 3
        l8 = tidx & 7
        raw = [tile[row * (HEAD_DIM // 2) + l8 * 4 + i] for i in range(4)]
        values = []
        for i in cutlass.range_constexpr(4):
            values.append(ptx.bitcast_u32_to_f32(ptx.bf16x2_low_bits(raw[i])))
            values.append(ptx.bitcast_u32_to_f32(ptx.bf16x2_high_bits(raw[i])))
        ss = Float32(0.0)
        for e in cutlass.range_constexpr(8):
            ss = ptx.fma_rn_f32(values[e], values[e], ss)
        for offset in cutlass.range_constexpr(3):
            ss = ptx.add_rn_f32(ss, cute.arch.shuffle_sync_bfly(ss, offset=4 >> offset))
        r = ptx.rsqrt_approx_f32(ptx.fma_rn_f32(ss, Float32(INV_HEAD_DIM), Float32(self.eps)))
        y = [ptx.mul_rn_f32(values[e], r) for e in range(8)]
        row_ok = row < tokens
        source_row = Int64(cutlass.select_(row_ok, row, Int32(0)))
        if cutlass.const_expr(self.rope):
            o = []
            for p in cutlass.range_constexpr(4):
                c = ptx.bitcast_u32_to_f32(cos_words[p])
                s = ptx.bitcast_u32_to_f32(sin_words[p])
                o.append(ptx.fma_rn_f32(c, y[2 * p], -ptx.mul_rn_f32(s, y[2 * p + 1])))
                o.append(ptx.fma_rn_f32(s, y[2 * p], ptx.mul_rn_f32(c, y[2 * p + 1])))
            y = o
        normed = [ptx.cvt_rn_bf16x2_f32(y[2 * i + 1], y[2 * i]) for i in range(4)]
        is_qk = head < self.q_heads + self.kv
        words = [cutlass.select_(is_qk, normed[i], raw[i]) for i in range(4)]

        if row_ok:
            destination = Int64(out) + (source_row * self.n + head * HEAD_DIM + l8 * 8) * BF16_BYTES
            ptx.st_global_v4_u32(destination, words[0], words[1], words[2], words[3])
            is_kv = (head >= self.q_heads) & (head < self.q_heads + 2 * self.kv)
            if is_kv:
                if (slot >= Int64(0)) & (slot < slot_limit):
                    is_v = head >= self.q_heads + self.kv
                    kv_head = head - self.q_heads - cutlass.select_(is_v, Int32(self.kv), Int32(0))
                    half = cutlass.select_(is_v, Int32(HEAD_DIM), Int32(0))
                    page = slot >> 4
                    within = slot & Int64(CACHE_BLOCK - 1)
                    cell = ((page * self.kv + Int64(kv_head)) * CACHE_BLOCK + within) * CACHE_WIDTH
                    address = Int64(kv_cache) + (cell + Int64(half + l8 * 8)) * BF16_BYTES
                    ptx.st_global_v4_u32(address, words[0], words[1], words[2], words[3])


def compile_qkv_front(*, num_kv_heads: int, rope: bool, tap: bool, eps: float, enable_pdl: bool = True,
                      trace: bool = False, loads_only: bool = False, arch: str | None = None,
                      ptx_dir: str | None = None) -> Any:
    """The compiled QKV front for these compile-time values (cached; never during capture).

    `enable_pdl` (default True): launched with programmatic dependent launch, the weight's first
    ring stages streamed before `griddepcontrol.wait` (False: the launch without PDL, no griddepcontrol;
    the same bits). `trace` (an experiment, default False): every CTA's clocks into a trace buffer
    (the module docstring's Trace). `loads_only` (a timing probe, default False; never deployed):
    the weight and x stream through the ring, with its waits and barriers, the cluster's reduction
    and the epilogue, but no MMA, so its time is what the stream and the fixed phases cost without
    the arithmetic; its outputs are not the projection. `arch` overrides the target (default: CUTE_DSL_ARCH or the
    current GPU); `ptx_dir` keeps the PTX there. All are in the cache key.
    """
    config_ = dict(num_kv_heads=num_kv_heads, rope=bool(rope), tap=bool(tap), eps=float(eps), enable_pdl=enable_pdl,
                   trace=trace, loads_only=loads_only)

    def build() -> Any:
        kernel = _QkvFrontKernel(**config_)
        address = Int64(0)
        return compilation.compiler(arch, ptx_dir)(
            kernel, address, address, address, address, address, address, address, address, address, Int32(1),
            Int64(1), Int64(1), cuda.CUstream(0))

    _QkvFrontKernel(**config_)  # validate before the cache is touched
    key = compilation.kernel_key(_QkvFrontKernel, arch=arch, ptx_dir=ptx_dir, **config_)
    return compilation.compiled(key, build, what="the QKV front kernel")


def launch(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None,
           slot_mapping: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, *, tap: torch.Tensor | None = None,
           eps: float = config.RMS_NORM_EPS, enable_pdl: bool = True, trace: torch.Tensor | None = None,
           loads_only: bool = False) -> None:
    """One launch on the current stream (arguments checked by `cute_ops.launch_qkv_front`):
    compiles the variant on first use (refused during capture), then passes raw addresses and the
    bounds the kernel keeps: max_pos (the table's rows) and pages x 16 (the cache's slots).
    `trace` (an experiment): an int64 [CTAS[kv], TRACE_WORDS] contiguous tensor on x's device
    (ValueError otherwise, before anything launches) that the traced build fills. `loads_only` (a
    timing probe, `compile_qkv_front`'s): out, tap and the cache get what a projection of zeros
    gives, not the projection."""
    num_kv_heads = kv_cache.shape[1]
    if trace is not None:
        ctas = CTAS.get(num_kv_heads)
        _require(isinstance(trace, torch.Tensor) and trace.dtype == torch.int64 and trace.is_contiguous()
                 and ctas is not None and tuple(trace.shape) == (ctas, TRACE_WORDS) and trace.device == x.device,
                 f"trace must be a contiguous int64 tensor of shape ({ctas}, {TRACE_WORDS}) on {x.device}, got "
                 f"{getattr(trace, 'dtype', type(trace))} {tuple(getattr(trace, 'shape', ()))}")
    compiled = compile_qkv_front(num_kv_heads=num_kv_heads, rope=cos_sin_cache is not None, tap=tap is not None,
                                 eps=eps, enable_pdl=enable_pdl, trace=trace is not None, loads_only=loads_only)
    stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    max_pos = cos_sin_cache.shape[0] if cos_sin_cache is not None else 1
    compiled(
        Int64(x.data_ptr()), Int64(weight.data_ptr()), Int64(positions.data_ptr()),
        Int64(cos_sin_cache.data_ptr() if cos_sin_cache is not None else 0), Int64(slot_mapping.data_ptr()),
        Int64(kv_cache.data_ptr()), Int64(out.data_ptr()), Int64(tap.data_ptr() if tap is not None else 0),
        Int64(trace.data_ptr() if trace is not None else 0), Int32(x.shape[0]), Int64(max_pos), Int64(kv_cache.shape[0] * CACHE_BLOCK), stream,
    )
