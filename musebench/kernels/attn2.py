"""attn2 in CuTe DSL: the verify step's paged attention (8 query rows, head_dim 64, 8 query heads
per KV head) fused with the o-norm and sigmoid gate, for sm_90a and sm_100a.

Public API (behind `musebench.cute_ops`): `prepare`, `launch`, `compile_attn2`. The algorithm is
`musebench.cpu.attn2`'s, step for step (its docstring lists what is the same and what is not);
the geometry and the split plan are `musebench.attn2_layout`'s.

One CTA of 128 threads per (KV head, split, request). Warp w computes rows of heads 2w, 2w + 1
(mma rows g and g + 8, g = lane // 4 the token) with `mma.sync.m16n8k16` BF16 -> FP32, so the same
code runs on Hopper and Blackwell (no wgmma / UMMA / TMEM):

1. `griddepcontrol.wait` (PDL), then the Q fragments straight from global memory (16 words).
2. The split's pages, ascending, through a PIPELINE_STAGES-deep cp.async ring in shared memory
   (one 4 KB page of K | V per stage; 16-byte chunks XOR-swizzled by slot so the fragment reads
   are bank-conflict free). Slots at and past L are zero-filled by cp.async's src-size 0 (never
   read: other requests' data or poison may sit there); pages past L are never touched.
3. Per page: S = Q K^T (8 mma), scores times fp32(scale log2 e), the causal and window mask (the
   same for both rows of a thread), the online softmax with m_use = 0 while a row has seen
   nothing (a masked page is an exact no-op), P = p_hi + p_lo as two BF16 terms, l += the lane
   order sum, then per n-tile P V = p_hi V + (p_lo V) in a fresh accumulator (16 mma: a page's
   products are truncated at the page's scale, never into the running O) and O = O alpha + P V
   with FP32 round-to-nearest. V's B fragments come from
   word loads joined by `prmt`: n-tile 2p carries the even dims of the word pairs, 2p + 1 the
   odd ones, so a thread ends with dims 16p + 4c .. 16p + 4c + 3 of its rows.
4. With one split: the epilogue. Otherwise the partial (O, m, l) goes to the workspace and the
   CTA climbs the merge tree (`attn2_layout`): per level one `atom.acq_rel.gpu.add` by thread 0
   after a `fence.acq_rel.gpu` by every thread and a CTA barrier; the first child to arrive
   leaves, the second re-arms the counter, reads its sibling through L2 (`ld.global.cg`) and
   merges (left child first). No CTA ever waits for another: nothing to bound.
5. Epilogue: o = O / l (div.rn) rounded to BF16, sum of squares in lane order, rstd =
   1 / sqrt(ss / 64 + eps) (IEEE), sigmoid(g) = 1 / (1 + 2^(-g log2 e)), out = bf16(o rstd sig),
   8-byte stores.

Memory ordering: PDL: every global read follows `griddepcontrol.wait` (Q, the gate and the cache
are the QKV front's outputs); dependents are released after the main loop. The merge's
release/acquire is the atomic's acq_rel plus the fences around it; partials are read with
`.cg` loads, so no stale L1 line of an earlier launch is seen.

Not measured yet: compiled for sm_90a and sm_100a here (tests/kernels/test_attn2_compile.py);
the GPU tests and the bench are the lead's to run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from musebench import attn2_layout as lay
from musebench import config
from musebench.kernels import compilation, ptx
from musebench.kernels.compilation import compiler, cute_flat, fake_flat

__all__ = ["Attn2Build", "compile_attn2", "launch", "prepare"]

LOG2_E = 1.4426950408889634
SCALE_LOG2 = config.ATTN_SCALE * LOG2_E  # rounded to binary32 once, when the kernel is built
NEG_INF = float("-inf")
BF16_BYTES = 2
WORD_BYTES = 4
VECTOR_BYTES = 16
SLOT_BYTES = lay.SLOT_WIDTH * BF16_BYTES  # 256
CHUNKS_PER_SLOT = SLOT_BYTES // VECTOR_BYTES  # 16
SWIZZLE_MASK = 7  # chunk ^ (slot & 7): K stays in chunks 0-7, V in 8-15
K_TILES = lay.HEAD_DIM // 16  # 4 k-steps of Q K^T
V_TILE_PAIRS = lay.HEAD_DIM // 16  # 4 pairs of n-tiles of P V
V_WORD0 = lay.HEAD_DIM // 2  # V's first word in a slot
JOIN_LOW, JOIN_HIGH = 0x5410, 0x7632
ALIGN = 16


@dataclass(frozen=True)
class Attn2Build:
    """Compile-time knobs besides the deployment: PDL, the target (default: CUTE_DSL_ARCH or the
    current GPU) and a folder for the PTX (tests)."""

    enable_pdl: bool = True
    arch: str | None = None
    ptx_dir: str | None = None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class _Attn2Kernel:
    """One attn2 variant: `num_kv_heads` KV heads per launch, `num_splits` splits, `max_pages`
    page-table entries per request, `window` (0: none)."""

    def __init__(self, *, num_kv_heads: int, num_splits: int, max_pages: int, max_model_len: int, window: int,
                 eps: float, enable_pdl: bool) -> None:
        _require(num_kv_heads >= 1 and lay.is_power_of_two(num_splits), "bad attn2 configuration")
        self.num_kv_heads = num_kv_heads
        self.num_splits = num_splits
        self.levels = int(math.log2(num_splits))
        self.max_pages = max_pages
        self.max_model_len = max_model_len
        self.window = window
        self.eps = eps
        self.enable_pdl = enable_pdl

    @cute.jit
    def __call__(self, q: cute.Tensor, gate: cute.Tensor, kv_cache: cute.Tensor, page_table: cute.Tensor,
                 seq_lens: cute.Tensor, out: cute.Tensor, workspace: cute.Tensor, q_row_words: Int32,
                 gate_row_words: Int32, num_reqs: Int32, stream: cuda.CUstream) -> None:
        self.kernel(q, gate, kv_cache, page_table, seq_lens, out, workspace, q_row_words, gate_row_words).launch(
            grid=[self.num_kv_heads, self.num_splits, num_reqs],
            block=[lay.CTA_THREADS, 1, 1],
            smem=lay.PIPELINE_STAGES * lay.PAGE_BYTES + VECTOR_BYTES,
            stream=stream,
            use_pdl=self.enable_pdl,
        )

    @cute.jit
    def page_load(self, smem_stage: Int32, cache_base: Int64, table_base: Int64, page: Int32, kv_head: Int32,
                  seq_len: Int32, tidx: Int32) -> None:
        physical = Int32(ptx.ld_global_u32(table_base + Int64(page) * WORD_BYTES))
        page_base = cache_base + (Int64(physical) * self.num_kv_heads + Int64(kv_head)) * lay.PAGE_BYTES
        for half in cutlass.range_constexpr(2):
            chunk = tidx + half * lay.CTA_THREADS
            slot = chunk // CHUNKS_PER_SLOT
            column = chunk % CHUNKS_PER_SLOT
            live = page * lay.PAGE_TOKENS + slot < seq_len
            source = page_base + Int64(chunk) * VECTOR_BYTES
            dest = smem_stage + slot * SLOT_BYTES + (column ^ (slot & SWIZZLE_MASK)) * VECTOR_BYTES
            # past L: zero fill, the source not read (it stays a valid address of this page)
            ptx.cp_async_cg_shared_global_16(dest, cutlass.select_(live, source, page_base),
                                             cutlass.select_(live, Int32(VECTOR_BYTES), Int32(0)))

    @cute.jit
    def slot_word(self, stage: Int32, slot, word) -> Uint32:
        chunk = word // 4
        return ptx.ld_shared_u32(stage + slot * SLOT_BYTES + ((chunk ^ (slot & SWIZZLE_MASK)) * VECTOR_BYTES)
                                 + (word % 4) * WORD_BYTES)

    @cute.kernel
    def kernel(self, q: cute.Tensor, gate: cute.Tensor, kv_cache: cute.Tensor, page_table: cute.Tensor,
               seq_lens: cute.Tensor, out: cute.Tensor, workspace: cute.Tensor, q_row_words: Int32,
               gate_row_words: Int32) -> None:
        kv_head, split, req = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane // 4
        c = lane % 4
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint32, cute.make_layout(lay.PIPELINE_STAGES * lay.PAGE_BYTES // WORD_BYTES),
                                    byte_alignment=128)
        flag = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        ring_base = Int32(ring.iterator.toint())
        flag_base = Int32(flag.iterator.toint())

        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_wait()

        seq_len = Int32(ptx.ld_global_u32(Int64(seq_lens.iterator.toint()) + Int64(req) * WORD_BYTES))
        seq_len = cutlass.max(cutlass.min(seq_len, Int32(self.max_model_len)), Int32(lay.QUERY_LEN))
        first_key = Int32(0)
        if cutlass.const_expr(self.window > 0):
            first_key = cutlass.max(seq_len - (lay.QUERY_LEN - 1 + self.window), Int32(0))
        first_page = first_key // lay.PAGE_TOKENS
        end_page = (seq_len + lay.PAGE_TOKENS - 1) // lay.PAGE_TOKENS
        start = first_page + ((split - first_page) & (self.num_splits - 1))
        pages = cutlass.max(end_page - start + (self.num_splits - 1), Int32(0)) // self.num_splits

        # Q fragments: row g of the tile is (token g, head 2 warp), row g + 8 (token g, head 2 warp + 1).
        head0 = kv_head * lay.HEADS_PER_KV_HEAD + 2 * warp
        row = req * lay.QUERY_LEN + g
        q_base = Int64(q.iterator.toint()) + Int64(row) * Int64(q_row_words) * WORD_BYTES
        a = []
        for kk in cutlass.range_constexpr(K_TILES):
            w_lo = kk * 8 + c
            w_hi = kk * 8 + 4 + c
            r0 = q_base + Int64(head0 * (lay.HEAD_DIM // 2) + w_lo) * WORD_BYTES
            r1 = q_base + Int64((head0 + 1) * (lay.HEAD_DIM // 2) + w_lo) * WORD_BYTES
            r2 = q_base + Int64(head0 * (lay.HEAD_DIM // 2) + w_hi) * WORD_BYTES
            r3 = q_base + Int64((head0 + 1) * (lay.HEAD_DIM // 2) + w_hi) * WORD_BYTES
            a.append([ptx.ld_global_u32(r0), ptx.ld_global_u32(r1), ptx.ld_global_u32(r2), ptx.ld_global_u32(r3)])

        own_key = seq_len - lay.QUERY_LEN + g  # both rows of this thread are token g
        low_key = Int32(0)
        if cutlass.const_expr(self.window > 0):
            low_key = own_key - (self.window - 1)
        scale_log2 = Float32(SCALE_LOG2)
        m = [Float32(NEG_INF), Float32(NEG_INF)]
        lsum = [Float32(0.0), Float32(0.0)]
        o = [Float32(0.0) for _ in range(32)]  # o[4 t + j]: n-tile t, fragment element j

        cache_base = Int64(kv_cache.iterator.toint())
        table_base = Int64(page_table.iterator.toint()) + Int64(req) * (self.max_pages * WORD_BYTES)
        for st in cutlass.range_constexpr(lay.PIPELINE_STAGES - 1):
            if st < pages:
                self.page_load(ring_base + st * lay.PAGE_BYTES, cache_base, table_base, start + st * self.num_splits,
                               kv_head, seq_len, tidx)
            cute.arch.cp_async_commit_group()

        for i in cutlass.range(pages, unroll=1):
            ahead = i + (lay.PIPELINE_STAGES - 1)
            if ahead < pages:
                self.page_load(ring_base + (ahead % lay.PIPELINE_STAGES) * lay.PAGE_BYTES, cache_base, table_base,
                               start + ahead * self.num_splits, kv_head, seq_len, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(lay.PIPELINE_STAGES - 1)
            cute.arch.barrier()
            stage = ring_base + (i % lay.PIPELINE_STAGES) * lay.PAGE_BYTES
            page_key = (start + i * self.num_splits) * lay.PAGE_TOKENS

            # S = Q K^T: s[4 nt + j]
            s = []
            for nt in cutlass.range_constexpr(2):
                sacc = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
                for kk in cutlass.range_constexpr(K_TILES):
                    kb0 = self.slot_word(stage, nt * 8 + g, kk * 8 + c)
                    kb1 = self.slot_word(stage, nt * 8 + g, kk * 8 + 4 + c)
                    sacc = list(ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                        a[kk][0], a[kk][1], a[kk][2], a[kk][3], kb0, kb1, sacc[0], sacc[1], sacc[2], sacc[3]))
                for j in cutlass.range_constexpr(4):
                    key = page_key + nt * 8 + 2 * c + (j % 2)
                    visible = (key <= own_key) & (key >= low_key)
                    s.append(cutlass.select_(visible, ptx.mul_rn_f32(sacc[j], scale_log2), Float32(NEG_INF)))

            alpha = []
            p_hi = []
            p_lo = []
            for half in cutlass.range_constexpr(2):  # row g (elements 0, 1), row g + 8 (2, 3)
                e = [s[2 * half], s[2 * half + 1], s[4 + 2 * half], s[4 + 2 * half + 1]]
                top = ptx.max_f32(ptx.max_f32(e[0], e[1]), ptx.max_f32(e[2], e[3]))
                top = ptx.max_f32(top, cute.arch.shuffle_sync_bfly(top, offset=1))
                top = ptx.max_f32(top, cute.arch.shuffle_sync_bfly(top, offset=2))
                m_new = ptx.max_f32(m[half], top)
                m_use = cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new)
                alpha.append(ptx.ex2_approx_f32(ptx.sub_rn_f32(m[half], m_use)))
                m[half] = m_new
                hi = []
                lo = []
                for k in cutlass.range_constexpr(2):  # keys (2c, 2c + 1), then (8 + 2c, 9 + 2c)
                    px0 = ptx.ex2_approx_f32(ptx.sub_rn_f32(e[2 * k], m_use))
                    px1 = ptx.ex2_approx_f32(ptx.sub_rn_f32(e[2 * k + 1], m_use))
                    pword = ptx.cvt_rn_bf16x2_f32(px1, px0)
                    h0 = ptx.bitcast_u32_to_f32(pword << 16)
                    h1 = ptx.bitcast_u32_to_f32(pword & Uint32(0xFFFF0000))
                    rem0 = ptx.sub_rn_f32(px0, h0)
                    rem1 = ptx.sub_rn_f32(px1, h1)
                    lword = ptx.cvt_rn_bf16x2_f32(rem1, rem0)
                    l0 = ptx.bitcast_u32_to_f32(lword << 16)
                    l1 = ptx.bitcast_u32_to_f32(lword & Uint32(0xFFFF0000))
                    hi.append(pword)
                    lo.append(lword)
                    pair = ptx.add_rn_f32(ptx.add_rn_f32(h0, l0), ptx.add_rn_f32(h1, l1))
                    if cutlass.const_expr(k == 0):
                        local = pair
                    else:
                        local = ptx.add_rn_f32(local, pair)
                local = ptx.add_rn_f32(local, cute.arch.shuffle_sync_bfly(local, offset=1))
                local = ptx.add_rn_f32(local, cute.arch.shuffle_sync_bfly(local, offset=2))
                lsum[half] = ptx.add_rn_f32(ptx.mul_rn_f32(lsum[half], alpha[half]), local)
                p_hi.append(hi)
                p_lo.append(lo)
            # A fragments of P: a0 row g keys 2c.., a1 row g + 8 keys 2c.., a2 row g keys 8 + 2c.., a3 row g + 8.
            ah = [p_hi[0][0], p_hi[1][0], p_hi[0][1], p_hi[1][1]]
            al = [p_lo[0][0], p_lo[1][0], p_lo[0][1], p_lo[1][1]]
            for pp in cutlass.range_constexpr(V_TILE_PAIRS):
                vword = V_WORD0 + 8 * pp + g
                vx0 = self.slot_word(stage, 2 * c, vword)
                vx1 = self.slot_word(stage, 2 * c + 1, vword)
                vx2 = self.slot_word(stage, 2 * c + 8, vword)
                vx3 = self.slot_word(stage, 2 * c + 9, vword)
                for odd in cutlass.range_constexpr(2):
                    sel = JOIN_HIGH if odd else JOIN_LOW
                    vb0 = ptx.prmt_b32(vx0, vx1, sel)
                    vb1 = ptx.prmt_b32(vx2, vx3, sel)
                    t = 2 * pp + odd
                    # this page's P V in a fresh accumulator, p_lo first (the tensor cores truncate:
                    # a long chain into O would drift toward zero), then O = O alpha + P V in FP32
                    zero = Float32(0.0)
                    pv = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                        al[0], al[1], al[2], al[3], vb0, vb1, zero, zero, zero, zero)
                    pv = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                        ah[0], ah[1], ah[2], ah[3], vb0, vb1, pv[0], pv[1], pv[2], pv[3])
                    for j in cutlass.range_constexpr(4):
                        o[4 * t + j] = ptx.add_rn_f32(ptx.mul_rn_f32(o[4 * t + j], alpha[j // 2]), pv[j])
            cute.arch.barrier()  # the stage is refilled next iteration

        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_launch_dependents()

        # Thread's values in dims order: vec[2 pp + half] = row (g | g + 8) dims 16 pp + 4 c + 0..3.
        vec = []
        for pp in cutlass.range_constexpr(V_TILE_PAIRS):
            for half in cutlass.range_constexpr(2):
                vec.append([o[4 * (2 * pp) + 2 * half], o[4 * (2 * pp + 1) + 2 * half],
                            o[4 * (2 * pp) + 2 * half + 1], o[4 * (2 * pp + 1) + 2 * half + 1]])
        active = Int32(1)
        if cutlass.const_expr(self.num_splits > 1):
            ws = Int64(workspace.iterator.toint())
            counters = ws + Int64((req * self.num_kv_heads + kv_head) * self.num_splits) * WORD_BYTES
            counter_count = Int32(seq_lens.shape[0]) * (self.num_kv_heads * self.num_splits)
            align_words = lay.COUNTER_ALIGN // WORD_BYTES
            partials = ws + Int64((counter_count + (align_words - 1)) // align_words * align_words) * WORD_BYTES
            group = partials + Int64((req * self.num_kv_heads + kv_head) * self.num_splits) * lay.PARTIAL_BYTES
            for level in cutlass.range_constexpr(1, self.levels + 1):
                if active != 0:
                    node = split >> (level - 1)
                    slot = group + Int64(node << (level - 1)) * lay.PARTIAL_BYTES
                    for v in cutlass.range_constexpr(8):
                        ptx.st_global_v4_u32(slot + Int64(v * lay.CTA_THREADS + tidx) * VECTOR_BYTES,
                                             *[ptx.bitcast_f32_to_u32(x) for x in vec[v]])
                    ptx.st_global_v4_u32(slot + Int64(8 * lay.CTA_THREADS + tidx) * VECTOR_BYTES,
                                         ptx.bitcast_f32_to_u32(m[0]), ptx.bitcast_f32_to_u32(m[1]),
                                         ptx.bitcast_f32_to_u32(lsum[0]), ptx.bitcast_f32_to_u32(lsum[1]))
                    ptx.fence_acq_rel_gpu()  # this thread's partial before thread 0's arrival
                    cute.arch.barrier()
                    if tidx == 0:
                        heap = (self.num_splits >> level) + (split >> level)
                        old = ptx.atom_add_gpu_global_u32(counters + Int64(heap) * WORD_BYTES, Uint32(1), "acq_rel")
                        if old != Uint32(0):
                            ptx.st_global_u32(counters + Int64(heap) * WORD_BYTES, Uint32(0))  # re-arm for the next call
                        ptx.st_shared_u32(flag_base, old)
                    cute.arch.barrier()
                    second = ptx.ld_shared_u32(flag_base) != Uint32(0)
                    cute.arch.barrier()  # the flag is rewritten at the next level
                    if second:
                        ptx.fence_acq_rel_gpu()  # the sibling's partial after its arrival
                        other = group + Int64((node ^ 1) << (level - 1)) * lay.PARTIAL_BYTES
                        ov = []
                        for v in cutlass.range_constexpr(9):
                            loaded = ptx.ld_global_cg_v4_u32(other + Int64(v * lay.CTA_THREADS + tidx) * VECTOR_BYTES)
                            ov.append([ptx.bitcast_u32_to_f32(w) for w in loaded])
                        mine_left = (node & 1) == 0
                        for half in cutlass.range_constexpr(2):
                            m_l = cutlass.select_(mine_left, m[half], ov[8][half])
                            m_r = cutlass.select_(mine_left, ov[8][half], m[half])
                            l_l = cutlass.select_(mine_left, lsum[half], ov[8][2 + half])
                            l_r = cutlass.select_(mine_left, ov[8][2 + half], lsum[half])
                            top = ptx.max_f32(m_l, m_r)
                            use = cutlass.select_(top == Float32(NEG_INF), Float32(0.0), top)
                            w_l = ptx.ex2_approx_f32(ptx.sub_rn_f32(m_l, use))
                            w_r = ptx.ex2_approx_f32(ptx.sub_rn_f32(m_r, use))
                            m[half] = top
                            lsum[half] = ptx.add_rn_f32(ptx.mul_rn_f32(l_l, w_l), ptx.mul_rn_f32(l_r, w_r))
                            for pp in cutlass.range_constexpr(V_TILE_PAIRS):
                                v = 2 * pp + half
                                for j in cutlass.range_constexpr(4):
                                    x_l = cutlass.select_(mine_left, vec[v][j], ov[v][j])
                                    x_r = cutlass.select_(mine_left, ov[v][j], vec[v][j])
                                    vec[v][j] = ptx.add_rn_f32(ptx.mul_rn_f32(x_l, w_l), ptx.mul_rn_f32(x_r, w_r))
                    else:
                        active = Int32(0)

        if active != 0:
            self.epilogue(vec, lsum, gate, out, req, kv_head, warp, g, c, gate_row_words)

    @cute.jit
    def epilogue(self, vec, lsum, gate: cute.Tensor, out: cute.Tensor, req: Int32, kv_head: Int32, warp: Int32,
                 g: Int32, c: Int32, gate_row_words: Int32) -> None:
        row = req * lay.QUERY_LEN + g
        out_row_words = self.num_kv_heads * lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM // 2
        for half in cutlass.range_constexpr(2):
            head = kv_head * lay.HEADS_PER_KV_HEAD + 2 * warp + half
            xs = []
            ss = Float32(0.0)
            for pp in cutlass.range_constexpr(V_TILE_PAIRS):
                quad = []
                for j in cutlass.range_constexpr(4):
                    ratio = ptx.div_rn_f32(vec[2 * pp + half][j], lsum[half])
                    word = ptx.cvt_rn_bf16x2_f32(Float32(0.0), ratio)
                    x = ptx.bitcast_u32_to_f32(word << 16)
                    ss = ptx.add_rn_f32(ss, ptx.mul_rn_f32(x, x))
                    quad.append(x)
                xs.append(quad)
            ss = ptx.add_rn_f32(ss, cute.arch.shuffle_sync_bfly(ss, offset=1))
            ss = ptx.add_rn_f32(ss, cute.arch.shuffle_sync_bfly(ss, offset=2))
            mean = ptx.add_rn_f32(ptx.mul_rn_f32(ss, Float32(1.0 / lay.HEAD_DIM)), Float32(self.eps))
            rstd = ptx.div_rn_f32(Float32(1.0), ptx.sqrt_rn_f32(mean))
            gate_base = Int64(gate.iterator.toint()) + Int64(row) * Int64(gate_row_words) * WORD_BYTES
            out_base = Int64(out.iterator.toint()) + Int64(row) * (out_row_words * WORD_BYTES)
            for pp in cutlass.range_constexpr(V_TILE_PAIRS):
                dim_word = (head * lay.HEAD_DIM + 16 * pp + 4 * c) // 2
                gw = ptx.ld_global_v2_u32(gate_base + Int64(dim_word) * WORD_BYTES)
                gates = [ptx.bitcast_u32_to_f32(gw[0] << 16), ptx.bitcast_u32_to_f32(gw[0] & Uint32(0xFFFF0000)),
                         ptx.bitcast_u32_to_f32(gw[1] << 16), ptx.bitcast_u32_to_f32(gw[1] & Uint32(0xFFFF0000))]
                ys = []
                for j in cutlass.range_constexpr(4):
                    e = ptx.ex2_approx_f32(ptx.mul_rn_f32(gates[j], Float32(-LOG2_E)))
                    sig = ptx.div_rn_f32(Float32(1.0), ptx.add_rn_f32(Float32(1.0), e))
                    ys.append(ptx.mul_rn_f32(ptx.mul_rn_f32(xs[pp][j], rstd), sig))
                ptx.st_global_v2_u32(out_base + Int64(dim_word) * WORD_BYTES, ptx.cvt_rn_bf16x2_f32(ys[1], ys[0]),
                                     ptx.cvt_rn_bf16x2_f32(ys[3], ys[2]))


# ---------------------------------------------------------------------------------------------
# Host side.


def _variant(num_kv_heads: int, max_model_len: int, window: int) -> dict[str, Any]:
    _require(not isinstance(num_kv_heads, bool) and isinstance(num_kv_heads, int) and num_kv_heads >= 1,
             f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    _require(not isinstance(max_model_len, bool) and isinstance(max_model_len, int) and max_model_len >= lay.QUERY_LEN,
             f"max_model_len must be an int >= {lay.QUERY_LEN}, got {max_model_len!r}")
    _require(not isinstance(window, bool) and isinstance(window, int) and 0 <= window < max_model_len
             or window == 0, f"window must be 0 or an int in [1, max_model_len), got {window!r} (cute_ops.attn2_window)")
    return dict(num_kv_heads=num_kv_heads, num_splits=lay.splits(max_model_len, window, num_kv_heads),
                max_pages=lay.max_pages(max_model_len), max_model_len=max_model_len, window=window,
                eps=float(config.RMS_NORM_EPS))


def compile_attn2(num_kv_heads: int, max_model_len: int, window: int, build: Attn2Build = Attn2Build()) -> Any:
    """The compiled attn2 variant of a deployment (one compile per process: the one cache).
    Compiles from fake tensors, so no GPU is needed for an explicit target; RuntimeError during
    CUDA-graph capture; ValueError outside the contract."""
    knobs = _variant(num_kv_heads, max_model_len, window)
    knobs["enable_pdl"] = bool(build.enable_pdl)

    def compile_variant() -> Any:
        bf16 = cutlass.BFloat16
        return compiler(build.arch or os.environ.get("CUTE_DSL_ARCH"), build.ptx_dir)(
            _Attn2Kernel(**knobs),
            fake_flat(bf16, 8, ALIGN),  # q (strided rows: the row stride is a runtime argument)
            fake_flat(bf16, 8, ALIGN),  # gate
            fake_flat(bf16, lay.PAGE_BYTES // BF16_BYTES, ALIGN),  # kv_cache
            fake_flat(Int32, 1, ALIGN),  # page_table
            fake_flat(Int32, 1, 4),  # seq_lens (its length is the request count)
            fake_flat(bf16, 8, ALIGN),  # out
            fake_flat(cutlass.Uint8, 16, ALIGN),  # workspace
            Int32(1), Int32(1), Int32(1),
            cuda.CUstream(0),
        )

    key = compilation.kernel_key(_Attn2Kernel, arch=build.arch, ptx_dir=build.ptx_dir, **knobs)
    return compilation.compiled(key, compile_variant, what="attn2 (musebench.cute_ops.prepare_attn2)")


def prepare(*, num_kv_heads: int, max_model_len: int, window: int, enable_pdl: bool = True) -> None:
    """Compile a deployment's variant before capture (`cute_ops.prepare_attn2`)."""
    compile_attn2(num_kv_heads, max_model_len, window, Attn2Build(enable_pdl=enable_pdl))


def check_launch(q: torch.Tensor, gate: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None, *, max_model_len: int,
                 window: int) -> int:
    """Refuse (ValueError) arguments outside `cute_ops.launch_attn2`'s contract; the split count."""
    variant = _variant(int(kv_cache.shape[1]) if kv_cache.dim() == 4 else -1, max_model_len, window)
    heads = variant["num_kv_heads"]
    bf16 = torch.bfloat16
    _require(kv_cache.dtype == bf16 and kv_cache.dim() == 4 and tuple(kv_cache.shape[2:]) == (lay.PAGE_TOKENS,
             lay.SLOT_WIDTH) and kv_cache.is_contiguous(),
             f"kv_cache must be contiguous bf16 [pages, K, 16, 128], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    _require(kv_cache.data_ptr() % ALIGN == 0, "kv_cache must be 16-byte aligned (cp.async reads it in 16 bytes)")
    _require(seq_lens.dtype == torch.int32 and seq_lens.dim() == 1 and seq_lens.numel() >= 1 and seq_lens.is_contiguous(),
             "seq_lens must be a contiguous int32 [R] (R >= 1)")
    reqs = seq_lens.numel()
    width = heads * lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM
    for name, t in (("q", q), ("gate", gate), ("out", out)):
        _require(t.dtype == bf16 and t.dim() == 2 and tuple(t.shape) == (reqs * lay.QUERY_LEN, width)
                 and t.stride(1) == 1, f"{name} must be bf16 [{reqs * lay.QUERY_LEN}, {width}] with a contiguous last "
                 f"dim, got {t.dtype} {tuple(t.shape)}")
        _require(t.data_ptr() % ALIGN == 0 and (t.stride(0) * BF16_BYTES) % ALIGN == 0,
                 f"{name}'s rows must be 16-byte aligned")
    _require(out.is_contiguous(), "out must be contiguous")
    _require(page_table.dtype == torch.int32 and tuple(page_table.shape) == (reqs, variant["max_pages"])
             and page_table.is_contiguous(),
             f"page_table must be contiguous int32 [{reqs}, {variant['max_pages']}], got {page_table.dtype} "
             f"{tuple(page_table.shape)}")
    devices = {t.device for t in (q, gate, kv_cache, page_table, seq_lens, out)}
    _require(len(devices) == 1 and next(iter(devices)).type == "cuda", "every tensor must be on one CUDA device")
    splits = variant["num_splits"]
    need = lay.workspace_bytes(reqs, heads, splits)
    if need:
        _require(workspace is not None and workspace.dtype == torch.uint8 and workspace.numel() >= need
                 and workspace.is_contiguous() and workspace.data_ptr() % ALIGN == 0 and workspace.device in devices,
                 f"workspace must be a contiguous, 16-byte aligned uint8 tensor of >= {need} bytes on the device")
    return splits


def _rows_span(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view from t's first element to its last, across the row stride (a column view of the
    QKV front's rows is not contiguous; the kernel indexes rows with the stride it is given)."""
    rows, width = t.shape
    return t.as_strided(((rows - 1) * t.stride(0) + width,), (1,))


def launch(q: torch.Tensor, gate: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
           seq_lens: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None, *, max_model_len: int,
           window: int, enable_pdl: bool = True) -> None:
    """`cute_ops.launch_attn2` (its docstring is the contract)."""
    splits = check_launch(q, gate, kv_cache, page_table, seq_lens, out, workspace, max_model_len=max_model_len,
                          window=window)
    compiled = compile_attn2(int(kv_cache.shape[1]), max_model_len, window, Attn2Build(enable_pdl=enable_pdl))
    if workspace is None or splits == 1:
        workspace = out.view(torch.uint8)  # never read with one split: any 16-byte aligned tensor serves
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled(cute_flat(_rows_span(q), ALIGN, 8), cute_flat(_rows_span(gate), ALIGN, 8),
             cute_flat(kv_cache, ALIGN, lay.PAGE_BYTES // BF16_BYTES), cute_flat(page_table, ALIGN, 1),
             cute_flat(seq_lens, 4, 1), cute_flat(out, ALIGN, 8), cute_flat(workspace, ALIGN, 16),
             Int32(q.stride(0) // 2), Int32(gate.stride(0) // 2), Int32(seq_lens.numel()), stream)
