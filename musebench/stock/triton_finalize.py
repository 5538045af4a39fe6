"""The stock post-expert MoE finalize (no communication) as a Triton kernel written by musebench.

What a user runs today for the Muse Spark MoE tail is vLLM's finalize on each rank, then an NCCL
all-reduce of the BF16 partial. The benches time that path as the "stock finalize" baseline;
`triton_finalize` is its first half, written here from the facts of vLLM 0.33.0's
`vllm/models/muse_spark/common/ops/fused_finalize.py::fused_post_expert_finalize` (nothing is
copied from vLLM). For Muse Spark (top_k = 8, width = 4096) the stock takes its tiled variant, and
so does this module, with the same Triton operations in the same order so Triton lowers them alike:

- one program per token (grid (m,)), `num_warps` 8 (4 when BLOCK_K * BLOCK_H < 4096), the whole
  [BLOCK_K, BLOCK_H] tile in registers as FP32 (BLOCK_* the next powers of two of top_k, width);
- row of route (t, k) = `expanded_idx_to_permuted_idx[t, k]`; a -1 route is a masked load, i.e.
  an all-zero row, which adds a zero to every column;
- w = f32(gamma) + gain_center; x = x * w first when the weight goes before the norm;
- scale_k = `tl.rsqrt(tl.sum(x * x, axis=1) / width + eps) * route_weight_k`;
- acc = `tl.sum(x * scale[:, None], axis=0)`, then acc * w when the weight goes after the norm;
- store acc rounded to BF16 (round to nearest even).

Widths the tiled variant does not take (BLOCK_K * BLOCK_H > 65536; the stock then switches to a
per-route loop kernel) are refused with ValueError rather than run with different arithmetic.

How it is compared (tests/stock/test_triton_finalize.py, GPU):

- against `vllm_finalize` (vLLM's own kernel, where vLLM imports): bit for bit;
- against `finalize_reference`, a float64 model rounded once to BF16: within an error bound, not
  bitwise. Triton does not specify the order of its reductions (it follows the register layout
  the compiler picks), `tl.rsqrt` is `rsqrt.approx`, and fp32 `/` is approximate, so no torch
  model reproduces the bits. The bound: at most 1 BF16 ULP wherever the fp32 error cannot reach
  a sixteenth of a BF16 ULP, and |got - want| <= ULP + 2^-16 * sum_k |term_k| everywhere (the
  fp32 pipeline's error scales with the absolute sum of the route terms, not with the result).
  The bound needs a finite fp32 sum of squares: a row with |x| >~ 2^57 (width 4096) squares to
  inf, rsqrt(inf) = 0, and the stock drops the route, where the float64 model does not.

`triton_finalize` is graph-capturable and allocates nothing; it validates only metadata (never
reads device data), so the row indices are the caller's promise (`UnfinalizedMoEOutput.validate`
checks them, with a device sync). Triton compiles on the first call for each specialization:
call once eagerly before capturing (a capture of a combination never launched is refused).

Triton is imported inside the functions: this module imports on a CPU-only host without Triton.
GPU tests: H200, 2026-11-29, commit 302d270, 69 passed (vLLM's own kernel skipped: no vLLM there;
records/2026-11-29-2xh200-pytest-gpu.summary.json).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from musebench.layout import UnfinalizedMoEOutput

FRAGMENT = 8  # BF16 elements per 16-byte row fragment: rows start on 16-byte boundaries
ALIGNMENT_BYTES = 16
MAX_BLOCK_H = 16384  # the stock's widest single-tile row
MAX_TILE = 65536  # BLOCK_K * BLOCK_H up to which the stock keeps the whole tile in registers
WIDE_TILE = 4096  # tiles this large get WIDE_WARPS, smaller ones NARROW_WARPS (the stock's rule)
WIDE_WARPS = 8
NARROW_WARPS = 4
_VLLM_MODULE = "vllm.models.muse_spark.common.ops.fused_finalize"

# Launch specializations already compiled in this process: capture refuses the others.
_launched: set[tuple] = set()


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    """Define the Triton kernel on first use (Triton is imported lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _muse_finalize_kernel(
        rows_ptr,
        gamma_ptr,
        route_weights_ptr,
        out_ptr,
        index_ptr,
        index_stride,
        top_k,
        width,
        eps,
        gain_center,
        rows_stride,
        route_weights_stride,
        out_stride,
        BLOCK_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        WEIGHT_BEFORE_NORM: tl.constexpr,
    ):
        token = tl.program_id(0)
        routes = tl.arange(0, BLOCK_K)
        columns = tl.arange(0, BLOCK_H)
        route_in = routes < top_k
        column_in = columns < width
        route_weight = tl.load(route_weights_ptr + token * route_weights_stride + routes, mask=route_in, other=0.0).to(tl.float32)
        row = tl.load(index_ptr + token * index_stride + routes, mask=route_in, other=-1)
        held = route_in & (row >= 0)
        # int64 before the multiply: row * stride can pass 2^31 on large permuted buffers
        row_ptrs = rows_ptr + row.to(tl.int64)[:, None] * rows_stride + columns[None, :]
        x = tl.load(row_ptrs, mask=held[:, None] & column_in[None, :], other=0.0).to(tl.float32)
        gamma = tl.load(gamma_ptr + columns, mask=column_in, other=0.0).to(tl.float32) + gain_center
        if WEIGHT_BEFORE_NORM:
            x = x * gamma[None, :]
        scale = tl.rsqrt(tl.sum(x * x, axis=1) / width + eps) * route_weight
        acc = tl.sum(x * scale[:, None], axis=0)
        if not WEIGHT_BEFORE_NORM:
            acc = acc * gamma
        tl.store(out_ptr + token * out_stride + columns, acc.to(out_ptr.dtype.element_ty), mask=column_in)

    return _muse_finalize_kernel


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _aligned_rows(name: str, t: torch.Tensor) -> None:
    """ValueError unless every row of the 2-D BF16 tensor starts on a 16-byte boundary."""
    if t.stride(1) != 1 or t.stride(0) % FRAGMENT or t.data_ptr() % ALIGNMENT_BYTES:
        raise ValueError(
            f"{name} must have unit column stride and 16-byte aligned rows (row stride a multiple of "
            f"{FRAGMENT}, base 16-byte aligned), got strides {t.stride()} at {t.data_ptr():#x}"
        )


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_inputs(
    unfinalized: UnfinalizedMoEOutput, norm_weight: torch.Tensor, eps: object, gain_center: object, weight_before_norm: object
) -> tuple[int, int, int]:
    """(m, top_k, width) after checking the inputs' metadata (never their values); ValueError."""
    if not isinstance(unfinalized, UnfinalizedMoEOutput):
        raise ValueError(f"unfinalized must be an UnfinalizedMoEOutput, got {type(unfinalized).__name__}")
    rows, weights, index = unfinalized.gemm2_permuted, unfinalized.route_weights, unfinalized.expanded_idx_to_permuted_idx
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bfloat16 or rows.dim() != 2:
        raise ValueError(f"gemm2_permuted must be a 2-D bfloat16 tensor, got {getattr(rows, 'dtype', rows)} {tuple(getattr(rows, 'shape', ()))}")
    width = rows.shape[1]
    if width < FRAGMENT or width % FRAGMENT:
        raise ValueError(f"width {width} must be a positive multiple of {FRAGMENT} (16-byte fragments)")
    _aligned_rows("gemm2_permuted", rows)
    if not isinstance(weights, torch.Tensor) or weights.dtype not in (torch.bfloat16, torch.float32) or weights.dim() != 2:
        raise ValueError(f"route_weights must be a 2-D bfloat16 or float32 tensor, got {getattr(weights, 'dtype', weights)}")
    m, top_k = weights.shape
    if top_k < 1 or weights.stride(1) != 1:
        raise ValueError(f"route_weights must be [m, top_k >= 1] with unit column stride, got {tuple(weights.shape)} strides {weights.stride()}")
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int32 or tuple(index.shape) != (m, top_k) or index.stride(1) != 1:
        raise ValueError(
            f"expanded_idx_to_permuted_idx must be int32 {(m, top_k)} with unit column stride, "
            f"got {getattr(index, 'dtype', index)} {tuple(getattr(index, 'shape', ()))}"
        )
    gamma = norm_weight
    if not isinstance(gamma, torch.Tensor) or gamma.dtype != torch.bfloat16 or tuple(gamma.shape) != (width,) or not gamma.is_contiguous():
        raise ValueError(
            f"norm_weight must be a contiguous bfloat16 tensor ({width},), got {getattr(gamma, 'dtype', gamma)} {tuple(getattr(gamma, 'shape', ()))}"
        )
    _finite("eps", eps)
    _finite("gain_center", gain_center)
    if not isinstance(weight_before_norm, bool):
        raise ValueError(f"weight_before_norm must be a bool, got {weight_before_norm!r}")
    return m, top_k, width


def _check_launch(unfinalized: UnfinalizedMoEOutput, norm_weight: torch.Tensor, out: torch.Tensor, m: int, top_k: int, width: int) -> None:
    """ValueError unless `out`, the tile size and the devices fit the kernel."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != (m, width):
        raise ValueError(f"out must be a bfloat16 tensor {(m, width)}, got {getattr(out, 'dtype', out)} {tuple(getattr(out, 'shape', ()))}")
    _aligned_rows("out", out)
    block_h, block_k = _next_power_of_two(width), _next_power_of_two(top_k)
    if block_h > MAX_BLOCK_H or block_k * block_h > MAX_TILE:
        raise ValueError(
            f"top_k {top_k} x width {width} does not fit the stock's single-tile finalize "
            f"(BLOCK_H <= {MAX_BLOCK_H}, BLOCK_K * BLOCK_H <= {MAX_TILE}); the stock's loop variant is not reproduced"
        )
    tensors = (unfinalized.gemm2_permuted, unfinalized.route_weights, unfinalized.expanded_idx_to_permuted_idx, norm_weight, out)
    device = out.device
    if device.type != "cuda" or any(t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on one CUDA device, got {sorted({str(t.device) for t in tensors})}")


def triton_finalize(
    unfinalized: UnfinalizedMoEOutput,
    norm_weight: torch.Tensor,
    out: torch.Tensor,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
) -> torch.Tensor:
    """Write the stock finalize of one rank's routes into `out` (BF16 [m, width]) and return it.

    Contract: `unfinalized` as `musebench.layout` describes it (gemm2_permuted BF16 [rows, width]
    with 16-byte aligned rows, width a multiple of 8; route_weights BF16 or FP32 [m, top_k];
    expanded_idx_to_permuted_idx int32 [m, top_k], each entry -1 or a row of gemm2_permuted,
    unchecked); norm_weight BF16 [width] zero-centred gamma (the kernel adds gain_center);
    out BF16 [m, width] with 16-byte aligned rows; all on one CUDA device; top_k and width within
    the stock's single tile. Not collective. m = 0 launches nothing.

    Graph-capturable and allocates nothing; call once eagerly per specialization before capture.
    Same bits as `vllm_finalize`; within the module docstring's bound of `finalize_reference`.
    ValueError on a violation, before any launch; ImportError without Triton.
    """
    m, top_k, width = _check_inputs(unfinalized, norm_weight, eps, gain_center, weight_before_norm)
    _check_launch(unfinalized, norm_weight, out, m, top_k, width)
    if m == 0:
        return out
    rows, weights, index = unfinalized.gemm2_permuted, unfinalized.route_weights, unfinalized.expanded_idx_to_permuted_idx
    block_h, block_k = _next_power_of_two(width), _next_power_of_two(top_k)
    # Triton specializes on dtypes, constexprs and each pointer's / integer's 16-divisibility;
    # the exact integers are a finer key, so capture never meets a compile.
    key = (
        out.device, weights.dtype, weight_before_norm, top_k, width, rows.stride(0), weights.stride(0), index.stride(0), out.stride(0),
        tuple(t.data_ptr() % ALIGNMENT_BYTES == 0 for t in (weights, index, norm_weight)),
    )
    if torch.cuda.is_current_stream_capturing() and key not in _launched:
        raise RuntimeError("triton_finalize: this specialization was never launched; call it once eagerly before CUDA-graph capture")
    with torch.cuda.device(out.device):
        _kernel()[(m,)](
            rows,
            norm_weight,
            weights,
            out,
            index,
            index.stride(0),
            top_k,
            width,
            float(eps),
            float(gain_center),
            rows.stride(0),
            weights.stride(0),
            out.stride(0),
            BLOCK_K=block_k,
            BLOCK_H=block_h,
            WEIGHT_BEFORE_NORM=weight_before_norm,
            num_warps=WIDE_WARPS if block_k * block_h >= WIDE_TILE else NARROW_WARPS,
        )
    _launched.add(key)
    return out


def vllm_finalize(
    unfinalized: UnfinalizedMoEOutput,
    norm_weight: torch.Tensor,
    out: torch.Tensor,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
) -> torch.Tensor:
    """vLLM's own `fused_post_expert_finalize` on the same arguments as `triton_finalize`; returns `out`.

    Called with permuted_idx = expanded_idx_to_permuted_idx, weight = norm_weight and
    weight_first = weight_before_norm; the contract is `triton_finalize`'s (checked the same way).
    ImportError with the reason when vLLM's Muse Spark finalize is not importable.
    """
    try:
        from vllm.models.muse_spark.common.ops.fused_finalize import fused_post_expert_finalize
    except ImportError as error:
        raise ImportError(f"vllm_finalize needs vLLM with Muse Spark support ({_VLLM_MODULE}.fused_post_expert_finalize): {error}") from error
    m, top_k, width = _check_inputs(unfinalized, norm_weight, eps, gain_center, weight_before_norm)
    _check_launch(unfinalized, norm_weight, out, m, top_k, width)
    fused_post_expert_finalize(
        unfinalized.gemm2_permuted,
        norm_weight,
        unfinalized.route_weights,
        float(eps),
        float(gain_center),
        weight_before_norm,
        out,
        permuted_idx=unfinalized.expanded_idx_to_permuted_idx,
    )
    return out


def _float64_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bfloat16 with one rounding (nearest even).

    torch rounds float64 -> float32 -> bfloat16, twice to nearest, which can land one BF16 ULP
    off at a near-tie; rounding to float32 *to odd* first keeps the second rounding exact
    (24 >= 8 + 2 bits).
    """
    nearest = x.to(torch.float32)
    wide = nearest.to(torch.float64)
    inexact = wide != x
    truncated = torch.where(wide.abs() > x.abs(), torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    odd = torch.where(inexact, (truncated.view(torch.int32) | 1).view(torch.float32), nearest)
    return odd.to(torch.bfloat16)


def finalize_reference(
    unfinalized: UnfinalizedMoEOutput,
    norm_weight: torch.Tensor,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
) -> torch.Tensor:
    """The finalize in float64, rounded once to BF16 [m, width], on the inputs' device.

    out[t] = sum over held routes k of r_k * s_k / sqrt(mean(s_k^2) + eps), then * w when the
    weight goes after the norm; s_k = x_k * w (weight before the norm) or x_k, w = gamma +
    gain_center, x_k the BF16 row of route k, r_k its route weight; a -1 route adds nothing.
    float64 is within ~2^-45 relative of real arithmetic here, far below BF16 resolution.

    Not bitwise comparable to `triton_finalize` (Triton's reduction order is unspecified and its
    rsqrt and division are approximate); compare within the bound the module docstring states.
    Zero results are +0.0. A -1 route still multiplies its zero row by its scale, as in the stock,
    so eps = 0 (scale inf) or a NaN / infinite weight there makes the token NaN. Checks indices
    (device sync): ValueError.
    """
    m, top_k, width = _check_inputs(unfinalized, norm_weight, eps, gain_center, weight_before_norm)
    unfinalized.validate()
    rows, index = unfinalized.gemm2_permuted, unfinalized.expanded_idx_to_permuted_idx.long()
    held = index >= 0
    if rows.shape[0]:
        x = torch.where(held[..., None], rows[index.clamp(min=0)].to(torch.float64), 0.0)
    else:
        x = torch.zeros(m, top_k, width, dtype=torch.float64, device=rows.device)
    w = norm_weight.to(torch.float64) + float(gain_center)
    s = x * w if weight_before_norm else x
    scale = unfinalized.route_weights.to(torch.float64) / torch.sqrt((s * s).mean(dim=-1) + float(eps))
    acc = (s * scale[..., None]).sum(dim=1)
    if not weight_before_norm:
        acc = acc * w
    return _float64_to_bf16(acc + 0.0)  # + 0.0 turns -0.0 into +0.0
