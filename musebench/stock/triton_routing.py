"""The stock router as a Triton kernel written by musebench, and an adapter to vLLM's own.

Why a second stock: vLLM is not always importable where the kernels are checked, and the CuTe
DSL router must match the *Triton* arithmetic, not only its torch model. `triton_routing` is
written here from the facts recorded in `musebench.stock.routing` (nothing is copied from vLLM):
one program per token, `num_warps=1` (one warp holds the 256 experts), and the same Triton
operations the stock uses, so Triton lowers them to the same instructions:

- `tl.sigmoid(x)` (Triton: `1 / (1 + exp(-x))`; `-x` is `0 - x`, `exp` is `ex2.approx.f32` of
  `x * f32(log2 e)`, the fp32 `/` is `div.full.f32`);
- `key = score + bias`; eight rounds of `tl.argmax(keys, 0)` (ties to the lowest index) with the
  chosen key replaced by -inf; the chosen score gathered as a masked `tl.sum` (exact);
- `total` from 0.0 in selection order, `+ eps`, `route_scale / total`, `score * inv`.

`renormalize=False` is musebench's own mode (`weight = score * route_scale`), as in the reference.
No padding tokens and no output multiplier (Muse Spark folds it at load).

`vllm_routing` calls vLLM's `fused_musespark1x_routing` itself when vLLM is importable (GPU
machines with vLLM 0.33); it raises ImportError otherwise.

Triton is imported inside the functions: this module imports on a CPU-only host without Triton.
Bit-equality with `routing_reference(..., approximations=hardware_approximations())` is checked
by tests/stock/test_triton_routing.py (GPU): H200, 2026-11-29, commit 06837f0, 38 passed (vLLM's
own kernel skipped: no vLLM there; records/2026-11-29-h200-pytest-gpu-routing.summary.json).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from musebench import config

NUM_WARPS = 1  # one warp per token: 256 experts in one warp's registers, as the stock
_VLLM_MODULE = "vllm.models.muse_spark.common.ops.fused_routing"


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    """Define the Triton kernel on first use (Triton is imported lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _muse_routing_kernel(
        logits_ptr,
        bias_ptr,
        ids_ptr,
        weights_ptr,
        logits_stride,
        route_scale,
        division_eps,
        NUM_EXPERTS: tl.constexpr,
        TOP_K: tl.constexpr,
        HAS_EPS: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        token = tl.program_id(0)
        experts = tl.arange(0, NUM_EXPERTS)
        slots = tl.arange(0, TOP_K)
        bias = tl.load(bias_ptr + experts)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        logits = tl.load(logits_ptr + token * logits_stride + experts)
        scores = tl.sigmoid(logits)
        keys = scores + bias
        total = 0.0  # the sum starts from +0.0 (an fp32 literal in Triton)
        picked = tl.zeros([TOP_K], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            winner = tl.argmax(keys, axis=0)
            score = tl.sum(tl.where(experts == winner, scores, 0.0), axis=0)
            tl.store(ids_ptr + token * TOP_K + k, winner.to(tl.int32))
            picked = tl.where(slots == k, score, picked)
            total = total + score
            keys = tl.where(experts == winner, float("-inf"), keys)
        if RENORMALIZE:
            if HAS_EPS:
                total = total + division_eps
            factor = route_scale / total
        else:
            factor = route_scale
        tl.store(weights_ptr + token * TOP_K + slots, picked * factor)

    return _muse_routing_kernel


def triton_routing(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    route_scale: float,
    renormalize: bool = True,
    division_eps: float | None = config.ROUTER_SCORE_DIVISION_EPS,
    top_k: int = config.TOP_K,
    ids: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    enable_pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock router's (ids int32 [b, top_k], weights fp32 [b, top_k]) from a Triton kernel.

    Contract: logits float32 [b, E] on CUDA (E a power of two >= 8, unit column stride), bias
    float32 [E] contiguous on the same device, route_scale finite, division_eps finite or None,
    top_k a power of two in [1, E] (tl.arange); ids / weights: optional contiguous outputs
    [b, top_k] (given both, the call allocates nothing). b = 0 launches nothing. `enable_pdl`
    waits with `gdc_wait` and launches with PDL (needs a Triton with `tl.extra.cuda.gdc_wait`).
    Same bits as `routing_reference(..., approximations=hardware_approximations())`.
    ValueError on a violation; ImportError without Triton.
    """
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError("logits must be a 2-D float32 tensor [tokens, experts]")
    b, num_experts = logits.shape
    if num_experts < 8 or num_experts & (num_experts - 1) or logits.stride(1) != 1:
        raise ValueError(f"logits must have a power-of-two expert count >= 8 and unit column stride, got {tuple(logits.shape)}")
    if not logits.is_cuda:
        raise ValueError("logits must be on a CUDA device")
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32 or tuple(bias.shape) != (num_experts,) or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous float32 tensor ({num_experts},)")
    if bias.device != logits.device:
        raise ValueError("logits and bias must be on the same device")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts or top_k & (top_k - 1):
        raise ValueError(f"top_k must be a power of two in [1, {num_experts}], got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)) or not math.isfinite(route_scale):
        raise ValueError(f"route_scale must be finite, got {route_scale!r}")
    if division_eps is not None and (isinstance(division_eps, bool) or not isinstance(division_eps, (int, float)) or not math.isfinite(division_eps)):
        raise ValueError(f"division_eps must be finite or None, got {division_eps!r}")
    if ids is None:
        ids = torch.empty(b, top_k, dtype=torch.int32, device=logits.device)
    if weights is None:
        weights = torch.empty(b, top_k, dtype=torch.float32, device=logits.device)
    for name, out, dtype in (("ids", ids, torch.int32), ("weights", weights, torch.float32)):
        if out.dtype != dtype or tuple(out.shape) != (b, top_k) or not out.is_contiguous() or out.device != logits.device:
            raise ValueError(f"{name} must be a contiguous {dtype} tensor {(b, top_k)} on {logits.device}")
    if b == 0:
        return ids, weights
    launch = {"launch_pdl": True} if enable_pdl else {}
    _kernel()[(b,)](
        logits,
        bias,
        ids,
        weights,
        logits.stride(0),
        float(route_scale),
        float(division_eps) if division_eps is not None else 0.0,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        HAS_EPS=division_eps is not None,
        RENORMALIZE=renormalize,
        USE_PDL=enable_pdl,
        num_warps=NUM_WARPS,
        **launch,
    )
    return ids, weights


def vllm_routing(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    route_scale: float,
    division_eps: float | None = config.ROUTER_SCORE_DIVISION_EPS,
    top_k: int = config.TOP_K,
    ids: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own fused router (`fused_musespark1x_routing`): (ids int32, weights fp32) [b, top_k].

    Sigmoid scores, no output multiplier, no padding; always renormalizes (the stock has no other
    mode). ImportError with the reason when vLLM's Muse Spark routing is not importable.
    """
    try:
        from vllm.models.muse_spark.common.ops.fused_routing import fused_musespark1x_routing
    except ImportError as error:
        raise ImportError(
            f"vllm_routing needs vLLM with Muse Spark support ({_VLLM_MODULE}.fused_musespark1x_routing): {error}"
        ) from error
    out_weights, out_ids = fused_musespark1x_routing(
        logits,
        bias,
        top_k,
        route_scale,
        router_output_multiplier=None,
        router_score_normalization="sigmoid",
        router_score_division_eps=division_eps,
        topk_weights=weights,
        topk_ids=ids,
    )
    return out_ids, out_weights
