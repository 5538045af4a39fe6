"""The stock QKV front's arithmetic in torch: the bitwise reference of the qkv_front epilogue.

The unfused path the kernel replaces is the QKV + o-gate projection (a BF16 GEMM with FP32
accumulation, rounded once to BF16: `qkv = x W^T`) followed by vLLM 0.33.0's
`fused_muse_spark_qknorm_rope_kv_insert` on `qkv`. `qkv_epilogue_reference` is that second kernel,
bit for bit, given the projection's BF16 output; `fp64_projection` and `projection_error` are
the yardstick of the projection (not bitwise: a GEMM's FP32 summation order is its own), with
`term_magnitudes` and `projection_error` (errors in BF16 epsilons of sum |x w|).

Layout (Muse Spark, per rank, kv KV heads): qkv [T, N], N = 1152 kv, columns [q | k | v | gate]
with 8 kv q heads, kv k heads, kv v heads and 8 kv gate heads of 64. cos_sin_cache fp32
[max_pos, 64]: cos of pair j in column j, sin in column 32 + j (None: a NoPE layer). kv_cache bf16
[pages, kv, 16, 128], a slot's K in columns 0..63 and V in 64..127; slot s is page s // 16, row
s % 16; a negative slot is not inserted.

The stock's arithmetic, per q or k head of one token (64 elements, 8 threads of 8 consecutive
elements each; every operation binary32 round-to-nearest-even, no flush):

1. ss_i = fma chain from +0.0 over thread i's elements e = 8i .. 8i+7 in order: ss = fma(x_e, x_e, ss);
2. butterfly over xor 4, 2, 1 with adds: every thread ends with
   ((ss0+ss4) + (ss2+ss6)) + ((ss1+ss5) + (ss3+ss7));
3. r = rsqrt.approx.f32(fma(ss, 0.015625, f32(eps))) (subnormals kept; the argument is >= eps);
4. y_e = x_e * r (mul.rn), not rounded;
5. RoPE (interleaved, rotary_dim 64) on pair (2j, 2j+1) with c = cs[pos, j], s = cs[pos, 32 + j]:
   o_even = fma(c, y_even, -(s * y_odd)), o_odd = fma(s, y_even, c * y_odd) (products mul.rn);
   a NoPE layer takes o = y;
6. one cvt.rn.bf16 of o into qkv and, for a k head, into the cache's K; V is copied raw; the gate
   columns are untouched.

Checked against the machine code (2025-12, this session): vLLM 0.33.0's
`vllm/_C_stable_libtorch.abi3.so`, cubin sm_90 (#89 of `cuobjdump -lelf`), disassembled with
`cuobjdump -sass` (nvidia-cuda-cuobjdump / -nvdisasm 13.5): the variants
`fusedMuseSparkQKNormRopeKVInsertKernel<c10::BFloat16, __nv_bfloat16, kAuto, float, 64, 1, ROPE,
INSERT>` (BF16 qkv and cache, fp32 cos_sin, head_dim 64). Seen there: eight `FFMA R, x, x, R`
from RZ over the thread's 8 elements in order; `SHFL.BFLY` 0x4, 0x2, 0x1 each followed by `FADD`;
`FFMA ss, 0.015625, eps`; `MUFU.RSQ` behind the non-ftz guard (|arg| < 2^-126 scaled by 2^24, the
result by 2^12: rsqrt.approx.f32 without .ftz); eight `FMUL x, r`; per pair `FMUL s*y_odd`,
`FMUL c*y_odd`, `FFMA c, y_even, -t`, `FFMA s, y_even, t` with c from a 16-byte load at
cs[pos, 4i..4i+3] and s at cs[pos, 32 + 4i..]; `F2FP.BF16.F32.PACK_AB` (round to nearest even) once;
one 16-byte store of the packed words into qkv and the same words into the cache's K; heads at or
past q + k heads skip the norm (V copied as loaded); the insert is skipped when the slot is
negative. The ROPE=false variant has no RoPE arithmetic (o = y).

The rsqrt is the hardware's: `approximations.rsqrt` (`musebench.numerics.Approximations`, passed in
by the caller: `musebench.kernels.approx.hardware_approximations()` on a GPU, measured there to
give rsqrt.approx.f32's bits; `PRECISE` on CPU, the correctly rounded value). This module never
imports the device code it checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from musebench import config
from musebench import numerics as nx

HEAD_DIM = config.HEAD_DIM
HEADS_PER_KV_HEAD = config.NUM_QUERY_HEADS // config.NUM_KV_HEADS  # 8
THREADS_PER_HEAD = 8
ELEMENTS_PER_THREAD = HEAD_DIM // THREADS_PER_HEAD  # 8
INV_HEAD_DIM = 0.015625  # 1/64, exact in binary32
ROTARY_PAIRS = HEAD_DIM // 2
CACHE_BLOCK = 16
CACHE_WIDTH = 2 * HEAD_DIM


def head_columns(num_kv_heads: int) -> dict[str, tuple[int, int]]:
    """Column ranges [start, stop) of q, k, v and gate in a row of N = 1152 num_kv_heads."""
    q = HEADS_PER_KV_HEAD * num_kv_heads * HEAD_DIM
    kv = num_kv_heads * HEAD_DIM
    return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (q + 2 * kv, 2 * q + 2 * kv)}


def sum_of_squares(heads: torch.Tensor) -> torch.Tensor:
    """The stock's sum of squares of fp32 heads [..., 64] -> [...]: 8 fma chains from +0.0 over
    8 consecutive elements, then the butterfly xor 4, 2, 1 with adds (every lane's value)."""
    lanes = heads.reshape(*heads.shape[:-1], THREADS_PER_HEAD, ELEMENTS_PER_THREAD)
    ss = torch.zeros(lanes.shape[:-1], dtype=torch.float32, device=heads.device)
    for e in range(ELEMENTS_PER_THREAD):
        ss = nx.fma(lanes[..., e], lanes[..., e], ss)
    ss = nx.add(ss[..., 0:4], ss[..., 4:8])  # lane i (+) lane i ^ 4
    ss = nx.add(ss[..., 0:2], ss[..., 2:4])  # xor 2
    return nx.add(ss[..., 0], ss[..., 1])  # xor 1


def norm_rope(heads: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None, eps: float,
              approximations: nx.Approximations) -> torch.Tensor:
    """The stock's weightless RMS norm and interleaved RoPE of BF16 heads [T, H, 64] at
    `positions` int64 [T]: bf16 [T, H, 64], one rounding (steps 1 to 6 of the module docstring)."""
    x = heads.float()
    ss = sum_of_squares(x)
    eps32 = nx.f32(eps, x.device)
    r = approximations.rsqrt(nx.fma(ss, nx.f32(INV_HEAD_DIM, x.device), eps32))
    y = nx.mul(x, r.unsqueeze(-1).expand_as(x).contiguous())
    if cos_sin_cache is None:
        return nx.to_bf16(y)
    table = cos_sin_cache[positions.long()]  # [T, 64]
    c = table[:, :ROTARY_PAIRS].unsqueeze(1).expand(-1, x.shape[1], -1).contiguous()
    s = table[:, ROTARY_PAIRS:].unsqueeze(1).expand(-1, x.shape[1], -1).contiguous()
    y_even, y_odd = y[..., 0::2].contiguous(), y[..., 1::2].contiguous()
    o_even = nx.fma(c, y_even, torch.neg(nx.mul(s, y_odd)))
    o_odd = nx.fma(s, y_even, nx.mul(c, y_odd))
    return nx.to_bf16(torch.stack([o_even, o_odd], dim=-1).reshape(x.shape))


BOUNDS = ("refuse", "kernel")  # qkv_epilogue_reference's handling of indices outside the tables


def _check_tables(tokens: int, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None,
                  slot_mapping: torch.Tensor, kv_cache: torch.Tensor, num_kv_heads: int,
                  bounds: str = "refuse") -> None:
    """ValueError unless the index tensors and the tables they index fit (module docstring);
    with bounds "kernel" the index values are not checked (the caller bounds them)."""
    if bounds not in BOUNDS:
        raise ValueError(f"bounds must be one of {BOUNDS}, got {bounds!r}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.dtype.is_floating_point or t.dtype == torch.bool or tuple(t.shape) != (tokens,):
            raise ValueError(f"{name} must be an int tensor [{tokens}], got {t.dtype} {tuple(t.shape)}")
    if kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (
            num_kv_heads, CACHE_BLOCK, CACHE_WIDTH):
        raise ValueError(f"kv_cache must be bf16 [pages, {num_kv_heads}, {CACHE_BLOCK}, {CACHE_WIDTH}], got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    if cos_sin_cache is not None:
        if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != HEAD_DIM:
            raise ValueError(f"cos_sin_cache must be fp32 [max_pos, {HEAD_DIM}], got {cos_sin_cache.dtype} "
                             f"{tuple(cos_sin_cache.shape)}")
    if bounds == "kernel":
        return
    if cos_sin_cache is not None:
        max_pos = cos_sin_cache.shape[0]
        outside = [int(p) for p in positions.tolist() if not 0 <= p < max_pos]
        if outside:
            raise ValueError(f"positions {outside} outside the rotary table's [0, {max_pos})")
    capacity = kv_cache.shape[0] * CACHE_BLOCK
    past = [int(s) for s in slot_mapping.tolist() if s >= capacity]
    if past:
        raise ValueError(f"slots {past} past the cache's {capacity} slots")


def qkv_epilogue_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    num_kv_heads: int,
    *,
    eps: float = config.RMS_NORM_EPS,
    approximations: nx.Approximations = nx.PRECISE,
    bounds: str = "refuse",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv', kv_cache'): the stock epilogue applied to the BF16 projection `qkv` [T, N], new
    tensors (the inputs are not written), on the inputs' device.

    qkv' holds the q and k heads normed and rotated (one BF16 rounding), v and gate as given;
    kv_cache' is `kv_cache` with, for each token t in order whose slot s >= 0, K of KV head h =
    qkv'[t, k head h] and V = qkv[t, v head h] at [s // 16, h, s % 16]. Two tokens on one slot:
    the later token's bits (the stock's order is undefined; the harness gives such tokens equal
    rows, so both orders agree). Bitwise the stock's where `approximations` are the hardware's.

    positions and slot_mapping: int [T]; cos_sin_cache fp32 [max_pos, 64] or None (NoPE);
    kv_cache bf16 [pages, num_kv_heads, 16, 128]. ValueError (TypeError for qkv's dtype) on
    anything else, and on values the stock would take out of its tables (it checks none): a
    position outside [0, max_pos) with RoPE (torch indexing would wrap -1 to the last row), a slot
    at or past pages * 16. Reads the index values (a device sync on a GPU).

    `bounds` "kernel" models musebench's kernel on such values instead of refusing them (the
    contract of `cute_ops.launch_qkv_front`): a position outside [0, max_pos) is rotated with row
    0 or max_pos - 1 of the table (clamped), a slot at or past pages * 16 inserts nothing, like a
    negative one.
    """
    tokens, n = qkv.shape
    cols = head_columns(num_kv_heads)
    if n != cols["gate"][1]:
        raise ValueError(f"qkv must be [tokens, {cols['gate'][1]}] for {num_kv_heads} KV heads, got {tuple(qkv.shape)}")
    if qkv.dtype != torch.bfloat16:
        raise TypeError(f"qkv must be bf16, got {qkv.dtype}")
    _check_tables(tokens, positions, cos_sin_cache, slot_mapping, kv_cache, num_kv_heads, bounds)
    if bounds == "kernel" and cos_sin_cache is not None:
        positions = positions.clamp(0, cos_sin_cache.shape[0] - 1)
    capacity = kv_cache.shape[0] * CACHE_BLOCK
    out = qkv.clone()
    qk_stop = cols["k"][1]
    heads = qkv[:, :qk_stop].reshape(tokens, -1, HEAD_DIM)
    if tokens:
        out[:, :qk_stop] = norm_rope(heads, positions, cos_sin_cache, eps, approximations).reshape(tokens, qk_stop)
    cache = kv_cache.clone()
    k_start, v_start = cols["k"][0], cols["v"][0]
    for t in range(tokens):
        slot = int(slot_mapping[t])
        if slot < 0 or slot >= capacity:  # past the cache: only with bounds "kernel" (refused otherwise)
            continue
        page, row = divmod(slot, CACHE_BLOCK)
        for h in range(num_kv_heads):
            cache[page, h, row, :HEAD_DIM] = out[t, k_start + h * HEAD_DIM: k_start + (h + 1) * HEAD_DIM]
            cache[page, h, row, HEAD_DIM:] = qkv[t, v_start + h * HEAD_DIM: v_start + (h + 1) * HEAD_DIM]
    return out, cache


def fp64_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in binary64 from the BF16 inputs (exact products, a binary64 sum): [T, N] float64,
    the yardstick both the kernel's and cuBLAS's BF16 projections are measured against."""
    return x.double() @ weight.double().t()


def term_magnitudes(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum_k |x[t, k] W[n, k]| in binary64: [T, N], the scale of each output's dot product."""
    return x.double().abs() @ weight.double().abs().t()


BF16_EPSILON = 2.0 ** -7  # the BF16 spacing at 1


@dataclass(frozen=True)
class ProjectionError:
    """A BF16 projection's error against the FP64 product, element by element in units of
    BF16_EPSILON x sum_k |x w| (the componentwise backward error of a dot product, in BF16
    epsilons): max and mean over the bounded elements; `unbounded` counts the others (a NaN or
    inf output where the product is finite, or a nonzero output where every term is zero),
    never averaged.

    Why this unit (not ULPs of the product, nor absolute): a correctly rounded output is at most
    0.5 |p| / sum|x w| <= 0.5 in it, an FP32 accumulation adds about 2^-17 sqrt(K) of it, so the
    statistics measure rounding plus accumulation and nothing else. Absolute errors are ruled by
    the largest row (a 2^60 activation row made every other row invisible), and ULPs of the
    product by cancellation (an output near 0 has a tiny ULP, so the max ULP error of two equally
    good FP32 summation orders differs by up to 10x at random)."""

    max: float
    mean: float
    unbounded: int

    def __str__(self) -> str:
        extra = f" unbounded {self.unbounded}" if self.unbounded else ""
        return f"max {self.max:.4e} mean {self.mean:.6e}{extra}"


def projection_error(got: torch.Tensor, exact: torch.Tensor, magnitudes: torch.Tensor) -> ProjectionError:
    """`got` (a BF16 projection [T, N]) against `exact` (fp64_projection) scaled by
    `magnitudes` (term_magnitudes of the same inputs)."""
    if got.shape != exact.shape or magnitudes.shape != exact.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)}, {tuple(exact.shape)}, {tuple(magnitudes.shape)}")
    got64, exact64, scale = got.detach().cpu().double(), exact.detach().cpu().double(), magnitudes.detach().cpu().double()
    difference = (got64 - exact64).abs()
    unbounded = ~torch.isfinite(got64) | ((scale == 0) & (difference != 0))
    bounded = ~unbounded
    error = torch.where(scale > 0, difference / (scale.clamp_min(torch.finfo(torch.float64).tiny) * BF16_EPSILON),
                        torch.zeros_like(difference))[bounded]
    if error.numel() == 0:
        return ProjectionError(0.0, 0.0, int(unbounded.sum()))
    return ProjectionError(float(error.max()), float(error.mean()), int(unbounded.sum()))
