"""The stock QKV epilogue (qk-norm, RoPE, KV-cache insert) as a Triton kernel written by musebench:
the second half of the unfused path `musebench bench front` times beside the fused kernel.

The unfused path a deployment runs without the fused front is the projection (torch BF16 matmul,
i.e. cuBLAS, into qkv [T, N]) followed by vLLM 0.33.0's `fused_muse_spark_qknorm_rope_kv_insert`
on qkv in place. That kernel is CUDA and not importable here, so `triton_qkv_epilogue` is a
Triton kernel with its arithmetic (the facts in `musebench.stock.qkv_front`'s docstring, spelled
out operation by operation; nothing is copied from vLLM):

- grid (T, ceil((q + 2 kv heads) / HEADS)); a program holds HEADS heads x 8 lanes of 8 elements
  of one token (the stock's thread program: lane l owns columns 8 l .. 8 l + 7);
- ss_l = fma chain from +0.0 over the lane's 8 elements in order;
- the butterfly xor 4, 2, 1 as ((ss0 + ss4) + (ss2 + ss6)) + ((ss1 + ss5) + (ss3 + ss7)), each
  ss_l pulled out of the lane axis exactly (a sum of it and seven +0.0: ss_l >= +0);
- r = `rsqrt.approx.f32(fma(ss, 1/64, eps))` (not flushed, as the stock's MUFU.RSQ path),
  y = x * r;
- every fma, add and mul above and below is inline PTX (`fma.rn.f32`, `add.rn.f32`, `mul.rn.f32`):
  nothing fused, reassociated or flushed by the compiler;
- RoPE on pair (2j, 2j+1), j = 4 l + p: c = cs[pos, j], s = cs[pos, 32 + j],
  o_even = fma(c, y_even, -(s * y_odd)), o_odd = fma(s, y_even, c * y_odd); NoPE: o = y;
- one BF16 rounding (round to nearest even) of o into the q and k columns of qkv (in place) and,
  for a token whose slot >= 0, into the cache's K; V's raw words into the cache's V.

Contract: qkv bf16 [T, N] contiguous, N = 1152 kv (rows [q | k | v | gate]); positions and
slot_mapping int64 [T]; cos_sin_cache fp32 [max_pos, 64] contiguous or None (NoPE);
kv_cache bf16 [pages, kv, 16, 128] contiguous. Bitwise equal to
`musebench.stock.qkv_front.qkv_epilogue_reference` with the GPU's rsqrt.approx (GPU test:
tests/stock/test_triton_qkv_epilogue.py). Reads no device data on the host (graph-capturable);
Triton compiles on the first call of each specialization: call once eagerly before a capture.
Triton is imported inside the functions: this module imports on a host without Triton.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from musebench import config

HEAD_DIM = config.HEAD_DIM
HEADS_PER_KV_HEAD = config.NUM_QUERY_HEADS // config.NUM_KV_HEADS  # 8
COLUMNS_PER_KV_HEAD = 2 * (HEADS_PER_KV_HEAD + 1) * HEAD_DIM  # 1152
HEADS_PER_PROGRAM = 8
WARPS = 2


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    """Define the Triton kernel on first use (Triton is imported lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _mul_rn(a, b):
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _fma_rn(a, b, c):
        return tl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _add_rn(a, b):
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _neg(a):
        # `-a` in Triton is 0 - a: +0.0 for a = +0.0, where the stock's negation gives -0.0
        return tl.inline_asm_elementwise("neg.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _rsqrt_approx(a):
        return tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True,
                                         pack=1)

    @triton.jit
    def _lane(ss, lane, which: tl.constexpr):
        return tl.sum(tl.where(lane[None, :] == which, ss, 0.0), axis=1)

    @triton.jit
    def _rope_pair(y_even, y_odd, table, lane, p: tl.constexpr, ROTARY: tl.constexpr, HEADS: tl.constexpr):
        c = tl.broadcast_to(tl.load(table + lane * 4 + p)[None, :], [HEADS, 8])
        s = tl.broadcast_to(tl.load(table + ROTARY + lane * 4 + p)[None, :], [HEADS, 8])
        return _fma_rn(c, y_even, _neg(_mul_rn(s, y_odd))), _fma_rn(s, y_even, _mul_rn(c, y_odd))

    @triton.jit
    def _store(qkv_row, cache_cell, offsets, value, is_qk, to_cache, e: tl.constexpr):
        out = value.to(tl.bfloat16)
        tl.store(qkv_row + offsets + e, out, mask=is_qk)
        tl.store(cache_cell + e, out, mask=to_cache)

    @triton.jit
    def _qkv_epilogue_kernel(qkv_ptr, positions_ptr, cos_sin_ptr, slots_ptr, cache_ptr, n_columns, q_heads,
                             kv_heads, eps, HEADS: tl.constexpr, ROPE: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        lane = tl.arange(0, 8)
        qk_heads = q_heads + kv_heads
        live = (head < qk_heads + kv_heads)[:, None] & (lane[None, :] >= 0)  # q, k and v heads
        is_qk = (head < qk_heads)[:, None] & live
        is_k = (head >= q_heads)[:, None] & is_qk
        is_v = (head >= qk_heads)[:, None] & live
        qkv_row = qkv_ptr + token.to(tl.int64) * n_columns
        offsets = head[:, None] * 64 + lane[None, :] * 8
        raw0 = tl.load(qkv_row + offsets + 0, mask=live, other=0.0)
        raw1 = tl.load(qkv_row + offsets + 1, mask=live, other=0.0)
        raw2 = tl.load(qkv_row + offsets + 2, mask=live, other=0.0)
        raw3 = tl.load(qkv_row + offsets + 3, mask=live, other=0.0)
        raw4 = tl.load(qkv_row + offsets + 4, mask=live, other=0.0)
        raw5 = tl.load(qkv_row + offsets + 5, mask=live, other=0.0)
        raw6 = tl.load(qkv_row + offsets + 6, mask=live, other=0.0)
        raw7 = tl.load(qkv_row + offsets + 7, mask=live, other=0.0)
        x0, x1, x2, x3 = raw0.to(tl.float32), raw1.to(tl.float32), raw2.to(tl.float32), raw3.to(tl.float32)
        x4, x5, x6, x7 = raw4.to(tl.float32), raw5.to(tl.float32), raw6.to(tl.float32), raw7.to(tl.float32)
        ss = tl.zeros([HEADS, 8], dtype=tl.float32)
        ss = _fma_rn(x0, x0, ss)
        ss = _fma_rn(x1, x1, ss)
        ss = _fma_rn(x2, x2, ss)
        ss = _fma_rn(x3, x3, ss)
        ss = _fma_rn(x4, x4, ss)
        ss = _fma_rn(x5, x5, ss)
        ss = _fma_rn(x6, x6, ss)
        ss = _fma_rn(x7, x7, ss)
        low = _add_rn(_add_rn(_lane(ss, lane, 0), _lane(ss, lane, 4)), _add_rn(_lane(ss, lane, 2), _lane(ss, lane, 6)))
        high = _add_rn(_add_rn(_lane(ss, lane, 1), _lane(ss, lane, 5)), _add_rn(_lane(ss, lane, 3), _lane(ss, lane, 7)))
        inv_head_dim = tl.full([HEADS], 0.015625, tl.float32)
        eps_vector = tl.zeros([HEADS], dtype=tl.float32) + eps  # exact: eps > 0
        r = tl.broadcast_to(_rsqrt_approx(_fma_rn(_add_rn(low, high), inv_head_dim, eps_vector))[:, None], [HEADS, 8])
        y0, y1, y2, y3 = _mul_rn(x0, r), _mul_rn(x1, r), _mul_rn(x2, r), _mul_rn(x3, r)
        y4, y5, y6, y7 = _mul_rn(x4, r), _mul_rn(x5, r), _mul_rn(x6, r), _mul_rn(x7, r)
        if ROPE:
            position = tl.load(positions_ptr + token)
            table = cos_sin_ptr + position * 64
            y0, y1 = _rope_pair(y0, y1, table, lane, 0, 32, HEADS)
            y2, y3 = _rope_pair(y2, y3, table, lane, 1, 32, HEADS)
            y4, y5 = _rope_pair(y4, y5, table, lane, 2, 32, HEADS)
            y6, y7 = _rope_pair(y6, y7, table, lane, 3, 32, HEADS)
        slot = tl.load(slots_ptr + token)
        inserted = slot >= 0
        slot = tl.maximum(slot, 0)
        kv_head = tl.where(head >= qk_heads, head - qk_heads, head - q_heads)
        half = tl.where(head >= qk_heads, 64, 0)
        cell = ((slot // 16 * kv_heads + kv_head) * 16 + slot % 16) * 128 + half
        cache_cell = cache_ptr + cell[:, None] + lane[None, :] * 8
        to_cache = is_k & inserted
        _store(qkv_row, cache_cell, offsets, y0, is_qk, to_cache, 0)
        _store(qkv_row, cache_cell, offsets, y1, is_qk, to_cache, 1)
        _store(qkv_row, cache_cell, offsets, y2, is_qk, to_cache, 2)
        _store(qkv_row, cache_cell, offsets, y3, is_qk, to_cache, 3)
        _store(qkv_row, cache_cell, offsets, y4, is_qk, to_cache, 4)
        _store(qkv_row, cache_cell, offsets, y5, is_qk, to_cache, 5)
        _store(qkv_row, cache_cell, offsets, y6, is_qk, to_cache, 6)
        _store(qkv_row, cache_cell, offsets, y7, is_qk, to_cache, 7)
        v_to_cache = is_v & inserted
        tl.store(cache_cell + 0, raw0, mask=v_to_cache)
        tl.store(cache_cell + 1, raw1, mask=v_to_cache)
        tl.store(cache_cell + 2, raw2, mask=v_to_cache)
        tl.store(cache_cell + 3, raw3, mask=v_to_cache)
        tl.store(cache_cell + 4, raw4, mask=v_to_cache)
        tl.store(cache_cell + 5, raw5, mask=v_to_cache)
        tl.store(cache_cell + 6, raw6, mask=v_to_cache)
        tl.store(cache_cell + 7, raw7, mask=v_to_cache)

    return _qkv_epilogue_kernel


def check_inputs(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None,
                 slot_mapping: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """The KV heads of the call (kv_cache.shape[1]) after checking metadata only; ValueError."""
    if qkv.dtype != torch.bfloat16 or qkv.dim() != 2 or not qkv.is_contiguous():
        raise ValueError(f"qkv must be a contiguous bf16 [T, N] tensor, got {qkv.dtype} {tuple(qkv.shape)}")
    if kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 4 or not kv_cache.is_contiguous() \
            or tuple(kv_cache.shape[2:]) != (16, 2 * HEAD_DIM):
        raise ValueError(f"kv_cache must be a contiguous bf16 [pages, kv, 16, 128] tensor, got {tuple(kv_cache.shape)}")
    kv = kv_cache.shape[1]
    tokens = qkv.shape[0]
    if qkv.shape[1] != COLUMNS_PER_KV_HEAD * kv:
        raise ValueError(f"qkv must have {COLUMNS_PER_KV_HEAD * kv} columns for {kv} KV heads, got {qkv.shape[1]}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.dtype != torch.int64 or tuple(t.shape) != (tokens,):
            raise ValueError(f"{name} must be int64 [{tokens}], got {t.dtype} {tuple(t.shape)}")
    if cos_sin_cache is not None and (cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2
                                      or cos_sin_cache.shape[1] != HEAD_DIM or not cos_sin_cache.is_contiguous()):
        raise ValueError(f"cos_sin_cache must be a contiguous fp32 [max_pos, 64] tensor, got "
                         f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    tensors = [qkv, positions, slot_mapping, kv_cache] + ([cos_sin_cache] if cos_sin_cache is not None else [])
    if qkv.device.type != "cuda" or any(t.device != qkv.device for t in tensors):
        raise ValueError(f"all tensors must be on one CUDA device, got {sorted({str(t.device) for t in tensors})}")
    return kv


def triton_qkv_epilogue(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None,
                        slot_mapping: torch.Tensor, kv_cache: torch.Tensor, *,
                        eps: float = config.RMS_NORM_EPS) -> None:
    """The stock epilogue on `qkv` in place and into `kv_cache` (module docstring), on the
    current stream. ValueError on bad metadata, before launch."""
    kv = check_inputs(qkv, positions, cos_sin_cache, slot_mapping, kv_cache)
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    q_heads = HEADS_PER_KV_HEAD * kv
    grid = (tokens, -(-(q_heads + 2 * kv) // HEADS_PER_PROGRAM))
    table = cos_sin_cache if cos_sin_cache is not None else qkv  # never read without RoPE
    _kernel()[grid](qkv, positions, table, slot_mapping, kv_cache, qkv.shape[1], q_heads, kv, float(eps),
                    HEADS=HEADS_PER_PROGRAM, ROPE=cos_sin_cache is not None, num_warps=WARPS)
