"""A probe of attn2's wgmma building blocks on sm_90a: one page, Q K^T and P V computed twice, with
wgmma (A from registers, B by descriptor: `kernels.gmma`) and with mma.sync reading the same
swizzled shared memory, so a GPU test can compare the two bit for bit.

One CTA of 128 threads (one warpgroup; warp w holds rows 16 w .. 16 w + 15):

1. cp.async moves the page (16 slots x [K 64 BF16 | V 64 BF16], as the cache stores it) into one
   4 KB stage in `gmma.page_offset`'s layout (K and V regions, 128-byte swizzle), waits, then
   `fence.proxy.async.shared::cta` (cp.async writes through the generic proxy, wgmma reads through
   the async proxy) and the CTA barrier.
2. Q (64 x 64 BF16) and the two P terms (64 x 16 BF16 each) from global memory straight into
   A fragments (mma.sync m16n8k16's A layout per warp: wgmma's A layout for M = 64).
3. wgmma: S = 4 chained m64n16k16 steps (k = dims 16 kk ..; K-major K, start + 32 kk), committed
   and waited; P V = m64n64k16 with p_lo, then p_hi on top (V N-major, transpose-b = 1).
   The first step of a chain either uses scale-d = 0 (D = A B) or, with `explicit_zero`,
   accumulates onto +0.0 (what mma.sync does with a zero C): the two differ where every product of
   a dot product is -0.0, and the probe tells which one matches mma.sync.
4. mma.sync m16n8k16 over the same shared memory: K's B fragments are word loads of a key's row,
   V's are two keys' halves of one dim joined by `prmt` (dims 8 t + g: the n-tile layout of
   wgmma's accumulators), the same chains from +0.0.
5. Stores every result as FP32 [rows][columns]: S [64, 16] twice, P V [64, 64] twice.

`fault` (tests only) corrupts the descriptors so the comparison must fail: "sbo" halves the stride
byte offset of both (keys 8-15 read from the wrong rows), "no_swizzle" drops the swizzle mode.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from musebench.kernels import compilation, gmma, ptx
from musebench.kernels.compilation import compiler, cute_flat, fake_flat

__all__ = ["FAULTS", "ProbeResult", "compile_probe", "run_probe"]

ARCH = "sm_90a"
THREADS = 128  # one warpgroup
ROWS = 64  # wgmma's M: the 64 rows of a KV head
HEAD_DIM = 64
KEYS = gmma.PAGE_SLOTS  # 16
K_STEPS = HEAD_DIM // 16  # 4 chained k16 steps of Q K^T
V_TILES = HEAD_DIM // 8  # 8 n-tiles of P V
WORD_BYTES = 4
CHUNK_BYTES = gmma.CHUNK_BYTES
JOIN_LOW, JOIN_HIGH = 0x5410, 0x7632  # prmt: the low halves of two words, the high halves
FAULTS = ("none", "sbo", "no_swizzle")
ALIGN = 16


def _descriptors(fault: str) -> tuple[gmma.SharedDescriptor, gmma.SharedDescriptor]:
    """(K's, V's) descriptor templates, corrupted as `fault` says."""
    k, v = gmma.K_MAJOR_KEYS, gmma.MN_MAJOR_VALUES
    if fault == "sbo":
        return (gmma.SharedDescriptor(k.leading_byte_offset, k.stride_byte_offset // 2, k.layout),
                gmma.SharedDescriptor(v.leading_byte_offset, v.stride_byte_offset // 2, v.layout))
    if fault == "no_swizzle":
        return (gmma.SharedDescriptor(k.leading_byte_offset, k.stride_byte_offset, gmma.LAYOUT_NONE),
                gmma.SharedDescriptor(v.leading_byte_offset, v.stride_byte_offset, gmma.LAYOUT_NONE))
    return k, v


class _GmmaPageProbe:
    """The probe kernel (module docstring): compile-time `fault` and `explicit_zero`."""

    def __init__(self, *, fault: str = "none", explicit_zero: bool = False) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
        self.fault = fault
        self.explicit_zero = bool(explicit_zero)
        k_desc, v_desc = _descriptors(fault)
        self.k_template = k_desc.template_signed()
        self.v_template = v_desc.template_signed()

    @cute.jit
    def __call__(self, page: cute.Tensor, q: cute.Tensor, p_lo: cute.Tensor, p_hi: cute.Tensor, s_wgmma: cute.Tensor,
                 s_mma: cute.Tensor, pv_wgmma: cute.Tensor, pv_mma: cute.Tensor, stream: cuda.CUstream) -> None:
        self.kernel(page, q, p_lo, p_hi, s_wgmma, s_mma, pv_wgmma, pv_mma).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], smem=gmma.PAGE_BYTES + gmma.ATOM_BYTES, stream=stream)

    @cute.jit
    def fragment(self, base: Int64, row_words: cutlass.Constexpr, row0: Int32, word: Int32) -> list:
        """An A fragment from a row-major BF16 matrix in global memory (`row_words` words a row):
        rows row0, row0 + 8, words `word` and `word` + 4 (k 2c.. and 2c + 8..)."""
        row1 = row0 + 8
        return [ptx.ld_global_u32(base + Int64(row0 * row_words + word) * WORD_BYTES),
                ptx.ld_global_u32(base + Int64(row1 * row_words + word) * WORD_BYTES),
                ptx.ld_global_u32(base + Int64(row0 * row_words + word + 4) * WORD_BYTES),
                ptx.ld_global_u32(base + Int64(row1 * row_words + word + 4) * WORD_BYTES)]

    @cute.jit
    def page_word(self, stage: Int32, slot, word) -> Uint32:
        """Word `word` (0..63) of key `slot`'s cache slot, read from the stage's swizzled layout."""
        return ptx.ld_shared_u32(stage + gmma.page_offset(slot, word // 4) + (word % 4) * WORD_BYTES)

    @cute.jit
    def store_tile(self, out: cute.Tensor, columns: cutlass.Constexpr, row0: Int32, c: Int32, d: list) -> None:
        """Accumulators d[4 j + i] (n-tile j; rows row0 / row0 + 8, columns 8 j + 2 c, + 1) into a
        row-major FP32 [64, columns] tensor."""
        base = Int64(out.iterator.toint())
        for j in cutlass.range_constexpr(len(d) // 4):
            for half in cutlass.range_constexpr(2):
                index = (row0 + 8 * half) * columns + 8 * j + 2 * c
                ptx.st_global_v2_u32(base + Int64(index) * WORD_BYTES, ptx.bitcast_f32_to_u32(d[4 * j + 2 * half]),
                                     ptx.bitcast_f32_to_u32(d[4 * j + 2 * half + 1]))

    @cute.jit
    def wgmma_chain(self, n: cutlass.Constexpr, fragments: list, descriptors: list, transpose_b: cutlass.Constexpr
                    ) -> list:
        """One accumulator chain of wgmma steps (fragments[i] with descriptors[i]), committed and
        waited; the first step from zero (scale-d 0) or onto +0.0 (`explicit_zero`)."""
        mma = (ptx.wgmma_mma_async_sync_aligned_m64n16k16_f32_bf16_bf16 if n == 16
               else ptx.wgmma_mma_async_sync_aligned_m64n64k16_f32_bf16_bf16)
        acc = None
        words = [w for fragment in fragments for w in fragment]
        if cutlass.const_expr(self.explicit_zero):
            # the zeros and the A words through the fence: defined before it (ptx's ordering notes)
            fenced = ptx.wgmma_fence_sync_aligned(words + [Float32(0.0) for _ in range(n // 2)])
            acc = fenced[len(words):]
        else:
            fenced = ptx.wgmma_fence_sync_aligned(words)
        fragments = [fenced[4 * i:4 * i + 4] for i in range(len(fragments))]
        for i in cutlass.range_constexpr(len(fragments)):
            if cutlass.const_expr(acc is None):
                acc = mma(fragments[i], descriptors[i], None, 0, transpose_b)
            else:
                acc = mma(fragments[i], descriptors[i], acc, 1, transpose_b)
        ptx.wgmma_commit_group_sync_aligned()
        return ptx.wgmma_wait_group_sync_aligned(0, acc)

    @cute.kernel
    def kernel(self, page: cute.Tensor, q: cute.Tensor, p_lo: cute.Tensor, p_hi: cute.Tensor, s_wgmma: cute.Tensor,
               s_mma: cute.Tensor, pv_wgmma: cute.Tensor, pv_mma: cute.Tensor) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        smem = cutlass.memory.SmemAllocator()
        # 1024-byte aligned: the swizzle is a function of the absolute address (gmma's docstring)
        buffer = smem.allocate_tensor(Uint32, cute.make_layout(gmma.PAGE_BYTES // WORD_BYTES),
                                      byte_alignment=gmma.ATOM_BYTES)
        stage = Int32(buffer.iterator.toint())

        # 1. the page, cache layout -> the swizzled K and V regions
        page_base = Int64(page.iterator.toint())
        for half in cutlass.range_constexpr(2):
            chunk = tidx + half * THREADS
            ptx.cp_async_cg_shared_global_16(stage + gmma.page_offset(chunk // gmma.SLOT_CHUNKS, chunk % gmma.SLOT_CHUNKS),
                                             page_base + Int64(chunk) * CHUNK_BYTES, Int32(CHUNK_BYTES))
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        ptx.fence_proxy_async_shared_cta()  # this thread's copies, visible to wgmma's async-proxy reads
        cute.arch.barrier()

        # 2. A fragments: rows 16 w + g and + 8
        row0 = 16 * warp + g
        q_base = Int64(q.iterator.toint())
        qa = [self.fragment(q_base, HEAD_DIM // 2, row0, kk * 8 + c) for kk in range(K_STEPS)]
        lo = self.fragment(Int64(p_lo.iterator.toint()), KEYS // 2, row0, c)
        hi = self.fragment(Int64(p_hi.iterator.toint()), KEYS // 2, row0, c)

        # 3. wgmma
        k_start = Int64((stage + gmma.K_REGION) >> 4)
        v_start = Int64((stage + gmma.V_REGION) >> 4)
        k_desc = [Int64(self.k_template) | (k_start + Int64(kk * gmma.K_STEP_BYTES // CHUNK_BYTES))
                  for kk in range(K_STEPS)]
        v_desc = Int64(self.v_template) | v_start
        s_w = self.wgmma_chain(16, qa, k_desc, 0)
        pv_w = self.wgmma_chain(64, [lo, hi], [v_desc, v_desc], 1)

        # 4. mma.sync over the same shared memory
        zero = Float32(0.0)
        s_m = []
        for nt in cutlass.range_constexpr(KEYS // 8):
            acc = [zero, zero, zero, zero]
            for kk in cutlass.range_constexpr(K_STEPS):
                b0 = self.page_word(stage, nt * 8 + g, kk * 8 + c)
                b1 = self.page_word(stage, nt * 8 + g, kk * 8 + 4 + c)
                acc = list(ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(*qa[kk], b0, b1, *acc))
            s_m.extend(acc)
        pv_m = []
        odd = (g % 2) == 1
        for t in cutlass.range_constexpr(V_TILES):
            word = HEAD_DIM // 2 + 4 * t + g // 2  # dim 8 t + g of V: its word in the slot, its half g % 2
            v = [self.page_word(stage, key, word) for key in (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)]
            b0 = cutlass.select_(odd, ptx.prmt_b32(v[0], v[1], JOIN_HIGH), ptx.prmt_b32(v[0], v[1], JOIN_LOW))
            b1 = cutlass.select_(odd, ptx.prmt_b32(v[2], v[3], JOIN_HIGH), ptx.prmt_b32(v[2], v[3], JOIN_LOW))
            acc = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(*lo, b0, b1, zero, zero, zero, zero)
            acc = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(*hi, b0, b1, *acc)
            pv_m.extend(acc)

        # 5. results
        self.store_tile(s_wgmma, KEYS, row0, c, s_w)
        self.store_tile(s_mma, KEYS, row0, c, s_m)
        self.store_tile(pv_wgmma, HEAD_DIM, row0, c, pv_w)
        self.store_tile(pv_mma, HEAD_DIM, row0, c, pv_m)


def compile_probe(*, fault: str = "none", explicit_zero: bool = False, ptx_dir: str | None = None):
    """The compiled probe for sm_90a (no GPU needed to compile; the one compile cache)."""
    knobs = dict(fault=str(fault), explicit_zero=bool(explicit_zero))
    kernel = _GmmaPageProbe(**knobs)  # ValueError for an unknown fault, before compiling
    bf16 = cutlass.BFloat16

    def build():
        return compiler(ARCH, ptx_dir)(
            kernel,
            fake_flat(bf16, gmma.PAGE_BYTES // 2, ALIGN),  # page
            fake_flat(bf16, 8, ALIGN),  # q
            fake_flat(bf16, 8, ALIGN),  # p_lo
            fake_flat(bf16, 8, ALIGN),  # p_hi
            *(fake_flat(Float32, 4, ALIGN) for _ in range(4)),  # s_wgmma, s_mma, pv_wgmma, pv_mma
            cuda.CUstream(0),
        )

    key = compilation.kernel_key(_GmmaPageProbe, arch=ARCH, ptx_dir=ptx_dir, **knobs)
    return compilation.compiled(key, build, what="the wgmma page probe")


class ProbeResult(dict):
    """FP32 results by name: "s_wgmma", "s_mma" [64, 16], "pv_wgmma", "pv_mma" [64, 64] (CPU)."""


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.bfloat16 or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cuda":
        raise ValueError(f"{name} must be a contiguous CUDA bf16 tensor of shape {shape}, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    if t.data_ptr() % ALIGN:
        raise ValueError(f"{name} must be 16-byte aligned")


def run_probe(page: torch.Tensor, q: torch.Tensor, p_lo: torch.Tensor, p_hi: torch.Tensor, *, fault: str = "none",
              explicit_zero: bool = False) -> ProbeResult:
    """Run the probe on the current GPU (sm_90 only) and return its four results (outputs start as
    NaN, so an element never written shows). `page`: bf16 [16, 128] (a cache page: K | V per
    key); `q`: bf16 [64, 64]; `p_lo`, `p_hi`: bf16 [64, 16]. Synchronizes."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise RuntimeError("the wgmma probe runs on sm_90 (H100 / H200) only")
    _check("page", page, (KEYS, 2 * HEAD_DIM))
    _check("q", q, (ROWS, HEAD_DIM))
    _check("p_lo", p_lo, (ROWS, KEYS))
    _check("p_hi", p_hi, (ROWS, KEYS))
    compiled = compile_probe(fault=fault, explicit_zero=explicit_zero)
    out = ProbeResult(
        s_wgmma=torch.full((ROWS, KEYS), float("nan"), device=q.device),
        s_mma=torch.full((ROWS, KEYS), float("nan"), device=q.device),
        pv_wgmma=torch.full((ROWS, HEAD_DIM), float("nan"), device=q.device),
        pv_mma=torch.full((ROWS, HEAD_DIM), float("nan"), device=q.device),
    )
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled(cute_flat(page, ALIGN, gmma.PAGE_BYTES // 2), cute_flat(q, ALIGN, 8), cute_flat(p_lo, ALIGN, 8),
             cute_flat(p_hi, ALIGN, 8), *(cute_flat(out[name], ALIGN, 4) for name in ("s_wgmma", "s_mma", "pv_wgmma",
                                                                                    "pv_mma")), stream)
    torch.cuda.synchronize()
    return ProbeResult({name: t.cpu() for name, t in out.items()})
