"""qkv_front: the QKV + o-gate projection of 1 to 16 tokens fused with the stock's qk-norm, RoPE
and KV-cache insert, in one launch (sm_90a and sm_100a: warp-level `mma.sync` BF16, no UMMA).

What it computes (the contract of `musebench.cute_ops.launch_qkv_front`): out = x W^T, x bf16
[T, 8192], W bf16 [N, 8192], N = 1152 kv (rows [q | k | v | gate], 64 per head), FP32
accumulation, one BF16 rounding; then on every q and k head the stock's arithmetic
(`musebench.stock.qkv_front`, bitwise: fma sum of squares in 8 lanes of 8, butterfly xor 4, 2, 1,
`rsqrt.approx.f32(fma(ss, 1/64, eps))`, `mul.rn`, RoPE with `fma.rn` / `mul.rn`, one cvt.rn.bf16);
k and v of tokens with slot >= 0 go into kv_cache [pages, kv, 16, 128] (K | V); gate and v columns
stay as projected.

Geometry. One cluster of S CTAs per head of 64 output columns: grid (S, N / 64), clusters
(S, 1, 1), 128 threads (4 warps) per CTA, S = SPLITS[kv] (8, 4, 2 for kv = 1, 2, 4: 144 CTAs
for every N, about one per H200 SM). CTA r of the cluster reduces K slice [r 8192 / S, (r + 1)
8192 / S); warp w of it the w-th quarter of that slice, in steps of 32 k. The tokens are padded to
M = 16 (rows >= T read as zeros and are never stored).

Projection, one warp-step (lane = 4 g + t): the lane loads 16 bytes of weight row 8j + g of the
head at k + 8t .. k + 8t + 7 for each of the 8 n-tiles j (a warp reads 64 contiguous bytes of 8
rows: whole sectors), and 16 bytes of x rows g and g + 8 at the same k. Two m16n8k16 MMAs per
n-tile consume them: the MMA's logical k pair (2t, 2t+1) / (2t+8, 2t+9) is the physical pair
(8t, 8t+1) / (8t+2, 8t+3) in the first and (8t+4, 8t+5) / (8t+6, 8t+7) in the second; A and B
use the same permutation, so the product is x W^T over the step's 32 k. The weight loads run
PREFETCH steps ahead of the MMAs.

Reduction, fixed order (bitwise repeatable; an output element never depends on another token's
row, so neither on T's padding nor on the rank): each warp's FP32 accumulator -> shared memory;
per element the CTA sum warp 0 + warp 1 + warp 2 + warp 3 (add.rn, in that order); CTAs 1..S-1
store theirs into CTA 0's shared memory (`mapa` + `st.shared::cluster`, between cluster
barriers); CTA 0 adds rank 1, 2, .., S-1 to its own in rank order and rounds once to BF16
(`cvt.rn.bf16x2.f32`). With TAP the BF16 projection is also written to `tap` before the epilogue.

Epilogue (CTA 0, 16 rows x 8 lanes of 8 consecutive columns: the stock's thread program):
q and k heads are normed and rotated and written back into `out`; a k head also into the cache's
K of its slot, a v head its raw words into the cache's V; a negative slot writes nothing.

Memory: the host owns everything; pointers are passed as Int64 addresses (16-byte aligned,
contiguous: `cute_ops.qkv_front_unsupported` checks before launch). No workspace, no counters:
a launch is graph-capturable and allocates nothing.
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
SPLITS = {1: 8, 2: 4, 4: 2}  # CTAs per head (cluster size): 144 CTAs at every N
MAX_TOKENS = 16  # M of one MMA tile
WARPS = 4
THREADS = WARPS * 32
STEP_K = 32  # k per warp-step: 4 lanes x 8 elements
N_TILES = HEAD_DIM // 8  # 8 n-tiles of 8 columns per head
PREFETCH = 2  # warp-steps of loads in flight ahead of the MMAs
BF16_BYTES = 2
F32_BYTES = 4
ELEMENTS = MAX_TOKENS * HEAD_DIM  # 1024 FP32 partials per CTA
PAIRS_PER_THREAD = ELEMENTS // 2 // THREADS  # 4
LANES_PER_HEAD = 8  # the stock's threads per head
CACHE_BLOCK = 16
CACHE_WIDTH = 2 * HEAD_DIM
INV_HEAD_DIM = 0.015625
ROTARY_PAIRS = HEAD_DIM // 2


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def smem_bytes(split: int) -> int:
    """Shared memory of one CTA: the warps' partials, the peers' partials, the BF16 tile."""
    return WARPS * ELEMENTS * F32_BYTES + max(split - 1, 1) * ELEMENTS * F32_BYTES + ELEMENTS * BF16_BYTES + 64


class _QkvFrontKernel:
    """The QKV front of one layer shape: grid (S, N / 64), clusters (S, 1, 1), 128 threads."""

    def __init__(self, *, num_kv_heads: int, rope: bool, tap: bool, split: int, eps: float) -> None:
        _require(num_kv_heads in KV_HEADS, f"num_kv_heads must be one of {KV_HEADS}, got {num_kv_heads!r}")
        _require(split in (1, 2, 4, 8), f"split must be 1, 2, 4 or 8, got {split!r}")
        check_eps(eps)
        self.kv = num_kv_heads
        self.rope = bool(rope)
        self.tap = bool(tap)
        self.split = split
        self.eps = float(eps)
        self.n = COLUMNS_PER_KV_HEAD * num_kv_heads
        self.heads = self.n // HEAD_DIM
        self.k_cta = HIDDEN // split
        self.k_warp = self.k_cta // WARPS
        self.steps = self.k_warp // STEP_K
        _require(self.steps * STEP_K * WARPS * split == HIDDEN, f"split {split} does not tile K = {HIDDEN}")
        self.q_heads = HEADS_PER_KV_HEAD * num_kv_heads

    @cute.jit
    def __call__(self, x: Int64, weight: Int64, positions: Int64, cos_sin: Int64, slots: Int64, kv_cache: Int64,
                 out: Int64, tap: Int64, tokens: Int32, stream: cuda.CUstream) -> None:
        kernel = self.kernel(x, weight, positions, cos_sin, slots, kv_cache, out, tap, tokens)
        if cutlass.const_expr(self.split > 1):
            kernel.launch(grid=(self.split, self.heads, 1), block=(THREADS, 1, 1), cluster=(self.split, 1, 1),
                          smem=smem_bytes(self.split), stream=stream)
        else:
            kernel.launch(grid=(1, self.heads, 1), block=(THREADS, 1, 1), smem=smem_bytes(1), stream=stream)

    @cute.kernel
    def kernel(self, x: Int64, weight: Int64, positions: Int64, cos_sin: Int64, slots: Int64, kv_cache: Int64,
               out: Int64, tap: Int64, tokens: Int32) -> None:
        rank, head, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane >> 2
        t = lane & 3

        smem = cutlass.memory.SmemAllocator()
        warp_partials = smem.allocate_tensor(Float32, cute.make_layout(WARPS * ELEMENTS), byte_alignment=16)
        peer_partials = smem.allocate_tensor(Float32, cute.make_layout(max(self.split - 1, 1) * ELEMENTS),
                                             byte_alignment=16)
        tile = smem.allocate_tensor(Uint32, cute.make_layout(ELEMENTS // 2), byte_alignment=16)

        if cutlass.const_expr(self.split > 1):
            # Cluster peers must have started before their shared memory is written.
            cute.arch.cluster_arrive_relaxed()

        # Projection: this warp's K range, 8 n-tiles, x rows g and g + 8 (zeros past the tokens).
        k_first = Int64(rank * self.k_cta + warp * self.k_warp + t * 8)
        weight_base = Int64(weight) + (Int64(head * HEAD_DIM + g) * HIDDEN + k_first) * BF16_BYTES
        low_ok = g < tokens
        high_ok = g + 8 < tokens
        x_low = Int64(x) + (Int64(cutlass.select_(low_ok, g, Int32(0))) * HIDDEN + k_first) * BF16_BYTES
        x_high = Int64(x) + (Int64(cutlass.select_(high_ok, g + 8, Int32(0))) * HIDDEN + k_first) * BF16_BYTES
        zero = Uint32(0)

        acc = [Float32(0.0) for _ in range(4 * N_TILES)]
        loaded = []
        for s in cutlass.range_constexpr(min(PREFETCH, self.steps)):
            loaded.append(self.load_step(weight_base, x_low, x_high, low_ok, high_ok, zero, s))
        for s in cutlass.range_constexpr(self.steps):
            if cutlass.const_expr(s + PREFETCH < self.steps):
                loaded.append(self.load_step(weight_base, x_low, x_high, low_ok, high_ok, zero, s + PREFETCH))
            w_words, a_low, a_high = loaded[s]
            for j in cutlass.range_constexpr(N_TILES):
                for half in cutlass.range_constexpr(2):
                    d = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                        a_low[2 * half], a_high[2 * half], a_low[2 * half + 1], a_high[2 * half + 1],
                        w_words[4 * j + 2 * half], w_words[4 * j + 2 * half + 1],
                        acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3],
                    )
                    for i in cutlass.range_constexpr(4):
                        acc[4 * j + i] = d[i]

        # The warp's partials [16, 64] into shared memory (fragment c: rows g, g + 8; columns 2t, 2t + 1).
        warp_base = warp * ELEMENTS
        for j in cutlass.range_constexpr(N_TILES):
            column = j * 8 + t * 2
            warp_partials[warp_base + g * HEAD_DIM + column] = acc[4 * j]
            warp_partials[warp_base + g * HEAD_DIM + column + 1] = acc[4 * j + 1]
            warp_partials[warp_base + (g + 8) * HEAD_DIM + column] = acc[4 * j + 2]
            warp_partials[warp_base + (g + 8) * HEAD_DIM + column + 1] = acc[4 * j + 3]
        cute.arch.barrier()

        # The CTA's sum, warps in order 0..3; element pairs 2p, 2p + 1 for p = tidx + 128 q.
        sums = []
        for q in cutlass.range_constexpr(PAIRS_PER_THREAD):
            for e in cutlass.range_constexpr(2):
                element = (tidx + q * THREADS) * 2 + e
                v = warp_partials[element]
                for w in cutlass.range_constexpr(1, WARPS):
                    v = ptx.add_rn_f32(v, warp_partials[w * ELEMENTS + element])
                sums.append(v)

        if cutlass.const_expr(self.split > 1):
            cute.arch.cluster_wait()
            if rank > 0:
                peers_base = Int32(peer_partials.iterator.toint())
                for q in cutlass.range_constexpr(PAIRS_PER_THREAD):
                    for e in cutlass.range_constexpr(2):
                        element = (tidx + q * THREADS) * 2 + e
                        remote = ptx.mapa_shared_cluster_u32(
                            peers_base + ((rank - 1) * ELEMENTS + element) * F32_BYTES, Int32(0))
                        ptx.st_shared_cluster_f32(remote, sums[2 * q + e])
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

        if rank == 0:
            self.finish(sums, peer_partials, tile, head, tidx, tokens, positions, cos_sin, slots, kv_cache, out, tap)

    @cute.jit
    def load_step(self, weight_base: Int64, x_low: Int64, x_high: Int64, low_ok, high_ok, zero, s: int):
        """One warp-step's loads: 8 n-tiles x 4 weight words, 4 words of x rows g and g + 8."""
        step_bytes = s * STEP_K * BF16_BYTES
        w_words = []
        for j in cutlass.range_constexpr(N_TILES):
            words = ptx.ld_global_nc_L1_no_allocate_v4_u32(weight_base + (j * 8 * HIDDEN * BF16_BYTES + step_bytes))
            w_words.extend(words)
        low = ptx.ld_global_nc_v4_u32(x_low + step_bytes)
        high = ptx.ld_global_nc_v4_u32(x_high + step_bytes)
        a_low = [cutlass.select_(low_ok, w, zero) for w in low]
        a_high = [cutlass.select_(high_ok, w, zero) for w in high]
        return w_words, a_low, a_high

    @cute.jit
    def finish(self, sums, peer_partials, tile, head, tidx, tokens: Int32, positions: Int64, cos_sin: Int64,
               slots: Int64, kv_cache: Int64, out: Int64, tap: Int64) -> None:
        """CTA 0: the cluster's sum in rank order, one BF16 rounding, then the stock's epilogue."""
        for q in cutlass.range_constexpr(PAIRS_PER_THREAD):
            pair = tidx + q * THREADS
            v = [sums[2 * q], sums[2 * q + 1]]
            for e in cutlass.range_constexpr(2):
                for r in cutlass.range_constexpr(1, self.split):
                    v[e] = ptx.add_rn_f32(v[e], peer_partials[(r - 1) * ELEMENTS + pair * 2 + e])
            word = ptx.cvt_rn_bf16x2_f32(v[1], v[0])
            tile[pair] = word
            if cutlass.const_expr(self.tap):
                row = pair // (HEAD_DIM // 2)
                column = (pair % (HEAD_DIM // 2)) * 2
                if row < tokens:
                    ptx.st_global_u32(Int64(tap) + (Int64(row) * self.n + head * HEAD_DIM + column) * BF16_BYTES, word)
        cute.arch.barrier()

        # The stock's thread program: row = tidx / 8, lane l8 owns columns 8 l8 .. 8 l8 + 7.
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
            position = ptx.ld_global_nc_s64(Int64(positions) + source_row * 8)
            table = Int64(cos_sin) + (position * HEAD_DIM + l8 * 4) * F32_BYTES
            cos_words = ptx.ld_global_nc_v4_u32(table)
            sin_words = ptx.ld_global_nc_v4_u32(table + ROTARY_PAIRS * F32_BYTES)
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
                slot = ptx.ld_global_nc_s64(Int64(slots) + source_row * 8)
                if slot >= Int64(0):
                    is_v = head >= self.q_heads + self.kv
                    kv_head = head - self.q_heads - cutlass.select_(is_v, Int32(self.kv), Int32(0))
                    half = cutlass.select_(is_v, Int32(HEAD_DIM), Int32(0))
                    page = slot >> 4
                    within = slot & Int64(CACHE_BLOCK - 1)
                    cell = ((page * self.kv + Int64(kv_head)) * CACHE_BLOCK + within) * CACHE_WIDTH
                    address = Int64(kv_cache) + (cell + Int64(half + l8 * 8)) * BF16_BYTES
                    ptx.st_global_v4_u32(address, words[0], words[1], words[2], words[3])


def split_for(num_kv_heads: int) -> int:
    """The CTAs per head (cluster size) for a layer with `num_kv_heads`."""
    _require(num_kv_heads in KV_HEADS, f"num_kv_heads must be one of {KV_HEADS}, got {num_kv_heads!r}")
    return SPLITS[num_kv_heads]


def compile_qkv_front(*, num_kv_heads: int, rope: bool, tap: bool, eps: float, split: int | None = None,
                      arch: str | None = None, ptx_dir: str | None = None) -> Any:
    """The compiled QKV front for these compile-time values (cached; never during capture).

    `split` defaults to `split_for(num_kv_heads)`; `arch` overrides the target (default:
    CUTE_DSL_ARCH or the current GPU); `ptx_dir` keeps the PTX there. All are in the cache key.
    """
    split = split_for(num_kv_heads) if split is None else split
    config_ = dict(num_kv_heads=num_kv_heads, rope=bool(rope), tap=bool(tap), split=split, eps=float(eps))

    def build() -> Any:
        kernel = _QkvFrontKernel(**config_)
        address = Int64(0)
        return compilation.compiler(arch, ptx_dir)(
            kernel, address, address, address, address, address, address, address, address, Int32(1),
            cuda.CUstream(0))

    _QkvFrontKernel(**config_)  # validate before the cache is touched
    key = compilation.kernel_key(_QkvFrontKernel, arch=arch, ptx_dir=ptx_dir, **config_)
    return compilation.compiled(key, build, what="the QKV front kernel")


def launch(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None,
           slot_mapping: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, *, tap: torch.Tensor | None = None,
           eps: float = config.RMS_NORM_EPS) -> None:
    """One launch on the current stream (arguments checked by `cute_ops.launch_qkv_front`):
    compiles the variant on first use (refused during capture), then passes raw addresses."""
    num_kv_heads = kv_cache.shape[1]
    compiled = compile_qkv_front(num_kv_heads=num_kv_heads, rope=cos_sin_cache is not None, tap=tap is not None,
                                 eps=eps)
    stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    compiled(
        Int64(x.data_ptr()), Int64(weight.data_ptr()), Int64(positions.data_ptr()),
        Int64(cos_sin_cache.data_ptr() if cos_sin_cache is not None else 0), Int64(slot_mapping.data_ptr()),
        Int64(kv_cache.data_ptr()), Int64(out.data_ptr()), Int64(tap.data_ptr() if tap is not None else 0),
        Int32(x.shape[0]), stream,
    )
