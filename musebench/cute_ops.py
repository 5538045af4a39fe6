"""The seeds' runtime entry points and deployment checks (`../shared/seeds/cute_ops.txt`).

What a model executor calls besides the MoE tail (`musebench.kernels.tail`):

- `MuseRouting(router)`: one MoE layer's routing for 1 to 8 tokens, bound to its router's
  correction bias and route scale; a call writes the ids and weights (and, given a
  `RoutingMetadata`, the routed MoE GEMMs' metadata of this rank's experts) with one launch of
  `musebench.kernels.routing.route`. `unsupported_router(router)` says why a router cannot be
  reproduced, before anything is built.
- `sm100_family()` / `unavailable(kernel)`: whether this GPU is of the SM100 family the seeds'
  kernels target, and the refusal line for a deployment whose GPUs are not. musebench's own
  kernels also run on SM90 (H200); these answer the seeds' question, not musebench's.
- `split_qkv(qkv, num_kv_heads)`: the q and gate views of the attention front's output rows.

- qkv_front (`supports_call`, `unsupported_projection`, `launch_qkv_front`, with `supports_shape`
  and `hidden_rows_ok`): the QKV + o-gate projection of 1 to 16 tokens fused with the qk-norm,
  RoPE and the KV-cache insert (`musebench.kernels.qkv_front`), checked once per call eagerly.
  The seeds fix supports_call's and unsupported_projection's signatures; launch_qkv_front's
  call site is not in the vLLM 0.33.0 wheel (no specialized_decode there), so its signature is
  supports_call's with `out` required.
- attn2 (issue 15): the verify step's paged attention fused with the o-norm and sigmoid gate.
  `attn2_window`, `attn2_splits`, `attn2_workspace_bytes` size a deployment,
  `unsupported_attn2(layer)` refuses a layer before anything is built, `prepare_attn2` compiles
  (before capture), `launch_attn2` launches (`musebench.kernels.attn2`). vLLM 0.33.0 ships no Muse
  Spark specialized-decode runtime, so the launch is named after the seeds' `launch_qkv_front`.

Importing this module needs torch only; CuTe DSL is imported when a `MuseRouting` is built.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

from musebench import attn2_layout, config, routing_metadata

__all__ = [
    "ATTN2_EPS",
    "MAX_SPLITS",
    "QUERY_LEN",
    "ROW_GROUPS",
    "SHORT_MAX_LEN",
    "SM_SCALE",
    "SPLIT_TARGET_CLUSTERS",
    "attn2_splits",
    "attn2_window",
    "attn2_workspace_bytes",
    "launch_attn2",
    "prepare_attn2",
    "unsupported_attn2",
    "MuseRouting",
    "RoutingMetadata",
    "sm100_family",
    "split_qkv",
    "unavailable",
    "unsupported_router",
]
__all__ += ["hidden_rows_ok", "launch_qkv_front", "supports_call", "supports_shape", "unsupported_projection"]

TOP_K = config.TOP_K
NUM_EXPERTS = config.NUM_EXPERTS
DIVISION_EPS = config.ROUTER_SCORE_DIVISION_EPS
ROUTING_MAX_TOKENS = config.MAX_DECODE_TOKENS
HEAD_DIM = config.HEAD_DIM
HEADS_PER_KV_HEAD = config.NUM_QUERY_HEADS // config.NUM_KV_HEADS  # 8
SM100_MAJOR = 10  # compute capability 10.x: sm_100, sm_103
BIAS_ALIGN_BYTES = 16  # the routing kernel reads the bias in 16-byte vectors

# Word offsets of the metadata fields; the layout module is their one source (the kernel checks
# at import that it bakes the same).
_OFFSETS = routing_metadata.RoutingMetadata(1).offsets
_PADDED_TOKENS = routing_metadata.HEADER_PADDED_ROW_COUNT
_NUM_CTAS = routing_metadata.HEADER_CTA_COUNT


# ---------------------------------------------------------------------------------------------
# Deployment checks.


def sm100_family() -> bool:
    """Whether the current CUDA device is of the SM100 family (compute capability 10.x), which
    the seeds' kernels require; False without a CUDA device."""
    if not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability()
    return major == SM100_MAJOR


def unavailable(kernel: str) -> str:
    """The line that refuses a deployment whose GPUs cannot run `kernel` (they are not SM100)."""
    return f"{kernel} needs SM100-family GPUs (compute capability 10.x); these are not"


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _router_attr(router: object, *names: str, default: object = None) -> object:
    for name in names:
        if hasattr(router, name):
            return getattr(router, name)
    return default


def unsupported_router(router: object) -> str | None:
    """Why `MuseRouting` cannot reproduce this router bit for bit, or None if it can.

    Reads vLLM `MuseSpark1xRouter`'s attributes (`musebench.layout.MuseRouter` holds the same):
    top_k, global_num_experts (or num_experts), expert_bias (or e_score_correction_bias),
    route_scale, router_output_multiplier, router_score_normalization,
    router_score_division_eps (missing optional attributes take the router's defaults: no
    multiplier, sigmoid, no eps). Supported: sigmoid scores, top-8 of 256, the multiplier folded
    into the router weight (None, or exactly 1.0, which changes no bit), eps equal to 1e-15 in
    binary32, a finite route scale, and a contiguous float32 [256] bias, 16-byte aligned. Reads
    no device memory.
    """
    normalization = _router_attr(router, "router_score_normalization", default="sigmoid")
    if normalization != "sigmoid":
        return f"router scores {normalization!r}: only sigmoid is reproduced"
    top_k = _router_attr(router, "top_k")
    if isinstance(top_k, bool) or top_k != TOP_K:
        return f"top_k {top_k!r}: only top-{TOP_K} is reproduced"
    num_experts = _router_attr(router, "global_num_experts", "num_experts")
    if isinstance(num_experts, bool) or num_experts != NUM_EXPERTS:
        return f"{num_experts!r} experts: only {NUM_EXPERTS} are reproduced"
    multiplier = _router_attr(router, "router_output_multiplier")
    if multiplier is not None and not (not isinstance(multiplier, bool) and isinstance(multiplier, (int, float)) and float(multiplier) == 1.0):
        return f"router_output_multiplier {multiplier!r} is not folded into the router weight (fold_router_output_multiplier)"
    eps = _router_attr(router, "router_score_division_eps")
    if eps is None or isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(float(eps)):
        return f"router_score_division_eps {eps!r}: only {DIVISION_EPS} is reproduced"
    if _f32_bits(float(eps)) != _f32_bits(DIVISION_EPS):
        return f"router_score_division_eps {eps!r}: only {DIVISION_EPS} (binary32) is reproduced"
    route_scale = _router_attr(router, "route_scale")
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)) or not math.isfinite(float(route_scale)):
        return f"route_scale {route_scale!r} is not a finite number"
    bias = _router_attr(router, "expert_bias", "e_score_correction_bias")
    if not isinstance(bias, torch.Tensor):
        return "the router has no expert bias tensor (expert_bias / e_score_correction_bias)"
    if bias.dtype != torch.float32:
        return f"expert bias is {bias.dtype}: only float32 is reproduced (a conversion would allocate per call)"
    if tuple(bias.shape) != (NUM_EXPERTS,):
        return f"expert bias has shape {tuple(bias.shape)}, not ({NUM_EXPERTS},)"
    if not bias.is_contiguous():
        return "expert bias is not contiguous"
    if bias.data_ptr() % BIAS_ALIGN_BYTES:
        return f"expert bias is not {BIAS_ALIGN_BYTES}-byte aligned"
    return None


# ---------------------------------------------------------------------------------------------
# Routing.


class RoutingMetadata(NamedTuple):
    """Where one routing call writes the metadata of the local experts
    [local_expert_offset, local_expert_offset + num_local_experts) for GEMM tile `tile_n`:
    `buffer`, a contiguous 16-byte aligned int32 vector of at least
    `musebench.kernels.routing.metadata_size(tile_n)` elements that aliases neither the ids nor
    the weights (musebench's layout: `musebench.routing_metadata`)."""

    buffer: torch.Tensor
    local_expert_offset: int
    num_local_experts: int
    tile_n: int

    def fields(self, num_tokens: int) -> dict[str, torch.Tensor]:
        """1-D int32 views of `buffer` for a batch of `num_tokens` (1 to 8), under the routed MoE
        op's names and at the extents it allocates (R = 8 num_tokens routes, at most one CTA per
        route): total_num_padded_tokens and num_non_exiting_ctas [1];
        expanded_idx_to_permuted_idx [R] (-1 where the expert is another rank's);
        cta_idx_xy_to_batch_idx (the CTA's local expert) and cta_idx_xy_to_mn_limit [R];
        permuted_idx_to_token_idx [R tile_n + 1] (-1 on padding rows; its last element is never
        written, a guard a GEMM may read). Only the words the call used are written (the header
        says how many CTAs and rows). ValueError for a batch outside 1..8 or a buffer too short
        for tile_n."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= ROUTING_MAX_TOKENS:
            raise ValueError(f"num_tokens must be an int from 1 to {ROUTING_MAX_TOKENS}, got {num_tokens!r}")
        tile = self.tile_n
        if isinstance(tile, bool) or not isinstance(tile, int) or not 1 <= tile <= routing_metadata.TILE_N_MAX:
            raise ValueError(f"tile_n must be an int from 1 to {routing_metadata.TILE_N_MAX}, got {tile!r}")
        buffer = self.buffer
        needed = routing_metadata.RoutingMetadata(tile).size + 1  # metadata_size: the layout and its guard
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.int32 or buffer.dim() != 1 or buffer.numel() < needed:
            raise ValueError(f"buffer must be a 1-D int32 tensor of at least {needed} elements for tile_n {tile}")
        routes = num_tokens * TOP_K

        def at(offset: int, length: int) -> torch.Tensor:
            return buffer[offset : offset + length]

        return {
            "total_num_padded_tokens": at(_PADDED_TOKENS, 1),
            "num_non_exiting_ctas": at(_NUM_CTAS, 1),
            "expanded_idx_to_permuted_idx": at(_OFFSETS["expanded_to_permuted"], routes),
            "cta_idx_xy_to_batch_idx": at(_OFFSETS["cta_to_expert"], routes),
            "cta_idx_xy_to_mn_limit": at(_OFFSETS["cta_row_limit"], routes),
            "permuted_idx_to_token_idx": at(_OFFSETS["permuted_to_token"], routes * tile + 1),
        }


class MuseRouting:
    """One MoE layer's routing for 1 to 8 tokens, bound to its router's correction bias and route
    scale when built (which also compiles the kernel's variants: build before CUDA-graph capture).

    Construction refuses (ValueError with `unsupported_router`'s reason) a router the kernel
    cannot reproduce. The bias tensor is held by reference, so in-place weight updates are seen
    (the kernel reads it before its PDL wait: the launch just before must not write it). A call
    is `musebench.kernels.routing.route` with the bound bias and scale and renormalization on:
    graph-capturable, allocates nothing.
    """

    def __init__(self, router: object) -> None:
        reason = unsupported_router(router)
        if reason is not None:
            raise ValueError(f"MuseRouting cannot reproduce this router: {reason}")
        from musebench.kernels import routing  # CuTe DSL: imported when a layer is built

        self.bias: torch.Tensor = _router_attr(router, "expert_bias", "e_score_correction_bias")  # type: ignore[assignment]
        self.route_scale = float(_router_attr(router, "route_scale"))  # type: ignore[arg-type]
        self.top_k = TOP_K
        self.num_experts = NUM_EXPERTS
        self._route = routing.route
        routing.prepare()

    def __call__(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        metadata: RoutingMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Route float32 logits [b, 256] (1 <= b <= 8, contiguous, 16-byte aligned) into `ids`
        (int32 [b, 8], global expert ids in selection order) and `weights` (float32 [b, 8]),
        and with `metadata` the routing metadata of its local experts; returns (ids, weights).
        ValueError, before anything launches, on arguments outside `route`'s contract."""
        if metadata is None:
            self._route(logits, self.bias, ids, weights, self.route_scale)
        else:
            self._route(
                logits, self.bias, ids, weights, self.route_scale,
                metadata=metadata.buffer,
                local_expert_offset=metadata.local_expert_offset,
                num_local_experts=metadata.num_local_experts,
                tile_n=metadata.tile_n,
            )
        return ids, weights


# ---------------------------------------------------------------------------------------------
# Attention front.


def split_qkv(qkv: torch.Tensor, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the q and gate columns of the attention front's output rows, laid out
    [q | k | v | gate] with 8 heads of 64 per KV head in q and gate and one head of 64 per KV
    head in k and v. ValueError unless `qkv` is 2-D with exactly that many columns."""
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    q_columns = HEADS_PER_KV_HEAD * num_kv_heads * HEAD_DIM
    kv_columns = num_kv_heads * HEAD_DIM
    width = 2 * (q_columns + kv_columns)
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [tokens, {width}] for {num_kv_heads} KV heads, got {tuple(qkv.shape)}")
    gate_start = q_columns + 2 * kv_columns
    return qkv[:, :q_columns], qkv[:, gate_start:]


# ---------------------------------------------------------------------------------------------
# qkv_front: the QKV + o-gate projection fused with qk-norm, RoPE and the KV-cache insert.
# (musebench.kernels.qkv_front; the stock's arithmetic: musebench.stock.qkv_front.)

QKV_FRONT_HIDDEN = config.HIDDEN_SIZE  # K of the projection: x [tokens, 8192], weight [N, 8192]
QKV_FRONT_MAX_TOKENS = 16  # the kernel pads the tokens to one MMA tile of M = 16
QKV_FRONT_KV_HEADS = (1, 2, 4)  # tp 16, 8, 4: N = 1152, 2304, 4608
QKV_FRONT_COLUMNS_PER_KV_HEAD = 2 * (HEADS_PER_KV_HEAD + 1) * HEAD_DIM  # q, k, v and gate: 1152
QKV_FRONT_CACHE_BLOCK = 16  # tokens per cache page
QKV_FRONT_CACHE_WIDTH = 2 * HEAD_DIM  # a cache slot's K | V of one KV head
QKV_FRONT_EPS = config.RMS_NORM_EPS  # the qk-norm's eps (MuseSpark1xAttention.qk_norm: rms_norm_eps)
QKV_FRONT_ALIGN = 16  # every tensor the kernel reads or writes in 16-byte vectors
_QKV_FRONT_UNQUANTIZED = "UnquantizedLinearMethod"


def qkv_front_columns(num_kv_heads: int) -> int:
    """N, the projection's output columns for `num_kv_heads` KV heads: [q | k | v | gate]."""
    return QKV_FRONT_COLUMNS_PER_KV_HEAD * num_kv_heads


def supports_shape(n: int, num_kv_heads: int) -> bool:
    """Whether the QKV front is built for N = `n` output columns with `num_kv_heads` KV heads:
    N must be 2 (8 + 1) 64 num_kv_heads and num_kv_heads one of 1, 2, 4 (Muse Spark at tp 16, 8
    and 4). Pure host arithmetic."""
    if isinstance(n, bool) or isinstance(num_kv_heads, bool):
        return False
    if not isinstance(n, int) or not isinstance(num_kv_heads, int):
        return False
    return num_kv_heads in QKV_FRONT_KV_HEADS and n == qkv_front_columns(num_kv_heads)


def hidden_rows_ok(weight: object) -> bool:
    """Whether `weight` is a projection the kernel streams: a 2-D bf16 tensor [N, 8192] with
    contiguous rows (strides (8192, 1)), 16-byte aligned. Reads no device memory."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] == QKV_FRONT_HIDDEN
        and weight.stride() == (QKV_FRONT_HIDDEN, 1)
        and weight.data_ptr() % QKV_FRONT_ALIGN == 0
    )


def _contiguous_aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % QKV_FRONT_ALIGN == 0


def qkv_front_unsupported(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor | None = None,
) -> str | None:
    """Why the QKV front cannot take this call, or None (the seeds' `_front.unsupported`).

    The contract: x bf16 [T, 8192] (1 <= T <= 16), weight bf16 [N, 8192] (`hidden_rows_ok`),
    positions int64 [T], cos_sin_cache None (a NoPE layer) or fp32 [max_pos, 64] (cos in
    columns 0..31, sin in 32..63), slot_mapping int64 [T] (negative: not inserted), kv_cache bf16
    [pages, kv_heads, 16, 128] with N = 1152 kv_heads (`supports_shape`), out None or bf16
    [T, N]; every tensor contiguous, 16-byte aligned, on one CUDA device. Positions and slots are
    device values, not checked here (that would read device memory); the kernel bounds them
    (`launch_qkv_front`: a position outside [0, max_pos) takes the nearest row of the table, a
    slot >= pages * 16 is not inserted). Reads no device memory; CPU tensors are refused (the
    kernel needs a GPU)."""
    tensors = {"x": x, "weight": weight, "positions": positions, "slot_mapping": slot_mapping, "kv_cache": kv_cache}
    if cos_sin_cache is not None:
        tensors["cos_sin_cache"] = cos_sin_cache
    if out is not None:
        tensors["out"] = out
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a tensor"
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != QKV_FRONT_HIDDEN:
        return f"x must be bf16 [tokens, {QKV_FRONT_HIDDEN}], got {x.dtype} {tuple(x.shape)}"
    tokens = x.shape[0]
    if not 1 <= tokens <= QKV_FRONT_MAX_TOKENS:
        return f"{tokens} tokens: the QKV front takes 1 to {QKV_FRONT_MAX_TOKENS}"
    if not hidden_rows_ok(weight):
        return f"a QKV projection other than an unquantized bf16 [N, {QKV_FRONT_HIDDEN}] with contiguous rows"
    if kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 4 or tuple(kv_cache.shape[2:]) != (
            QKV_FRONT_CACHE_BLOCK, QKV_FRONT_CACHE_WIDTH):
        return (f"kv_cache must be bf16 [pages, kv_heads, {QKV_FRONT_CACHE_BLOCK}, {QKV_FRONT_CACHE_WIDTH}], "
                f"got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    n = weight.shape[0]
    if not supports_shape(n, kv_cache.shape[1]):
        return (f"N = {n} for {kv_cache.shape[1]} KV heads: the QKV front is built for N = 1152 kv_heads with "
                f"kv_heads in {QKV_FRONT_KV_HEADS}")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (tokens,):
        return f"positions must be int64 [{tokens}], got {positions.dtype} {tuple(positions.shape)}"
    if slot_mapping.dtype != torch.int64 or tuple(slot_mapping.shape) != (tokens,):
        return f"slot_mapping must be int64 [{tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
    if cos_sin_cache is not None and (
            cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != HEAD_DIM
            or cos_sin_cache.shape[0] < 1):
        return f"a rotary table other than an interleaved fp32 [max_pos, {HEAD_DIM}] one"
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (tokens, n)):
        return f"out must be bf16 [{tokens}, {n}], got {out.dtype} {tuple(out.shape)}"
    for name, t in tensors.items():
        if not _contiguous_aligned(t):
            return f"{name} is not contiguous and {QKV_FRONT_ALIGN}-byte aligned"
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return f"tensors on {sorted(str(d) for d in devices)}: the QKV front needs them on one CUDA device"
    return None


def supports_call(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    num_kv_heads: int,
    out: torch.Tensor | None = None,
) -> bool:
    """Whether the QKV front takes this call of a layer with `num_kv_heads` (with `out`, the full
    check before `launch_qkv_front`); otherwise the caller keeps the unfused path.
    `qkv_front_unsupported` says why not. Called eagerly: reads no device memory."""
    return (
        qkv_front_unsupported(x, weight, positions, cos_sin_cache, slot_mapping, kv_cache, out) is None
        and kv_cache.shape[1] == num_kv_heads
    )


def unsupported_projection(attn: object) -> str | None:
    """Why the QKV front cannot read this Muse Spark attention layer's loaded QKV projection and
    rotary table, or None.

    Reads vLLM `MuseSpark1xAttention`'s attributes: qkv_proj (quant_method, bias, gather_output,
    tp_size, weight), num_heads, num_kv_heads, head_dim, use_rope and rotary_emb (rotary_dim,
    is_neox_style, cos_sin_cache). Supported: an unquantized projection
    (`UnquantizedLinearMethod`, matched by class name) without bias and without a gathered
    output across ranks, N = 2 (heads + kv_heads) head_dim that `supports_shape` takes, a bf16
    weight [N, 8192] `hidden_rows_ok` takes; with RoPE an interleaved (not neox) rotary table
    over the whole head (rotary_dim = head_dim), fp32 [max_pos, head_dim] contiguous; a NoPE layer
    has no rotary table. Reads no device memory.
    """
    proj = attn.qkv_proj
    weight = getattr(proj, "weight", None)
    n = 2 * (attn.num_heads + attn.num_kv_heads) * attn.head_dim
    if not (
        type(getattr(proj, "quant_method", None)).__name__ == _QKV_FRONT_UNQUANTIZED
        and getattr(proj, "bias", None) is None
        and not (getattr(proj, "gather_output", False) and getattr(proj, "tp_size", 1) > 1)
        and attn.head_dim == HEAD_DIM
        and attn.num_heads == HEADS_PER_KV_HEAD * attn.num_kv_heads
        and supports_shape(n, attn.num_kv_heads)
        and weight is not None
        and hidden_rows_ok(weight)
        and weight.shape[0] == n
    ):
        return f"a QKV projection other than an unquantized bf16 [N, {QKV_FRONT_HIDDEN}]"
    emb = getattr(attn, "rotary_emb", None)
    if not attn.use_rope:
        return None if emb is None else "a rotary table on a layer without RoPE"
    cos_sin = getattr(emb, "cos_sin_cache", None)
    if not (
        emb is not None
        and emb.rotary_dim == attn.head_dim
        and not emb.is_neox_style
        and isinstance(cos_sin, torch.Tensor)
        and cos_sin.dtype == torch.float32
        and cos_sin.dim() == 2
        and cos_sin.shape[1] == attn.head_dim
        and cos_sin.is_contiguous()
    ):
        return "a rotary table other than an interleaved fp32 one"
    return None


def launch_qkv_front(
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    kv_cache: torch.Tensor,
    num_kv_heads: int,
    out: torch.Tensor,
    *,
    tap: torch.Tensor | None = None,
    enable_pdl: bool = True,
) -> torch.Tensor:
    """One launch of the QKV front: out = x W^T with the stock's qk-norm and RoPE on the q and k
    heads, k and v inserted into `kv_cache` at `slot_mapping`; returns `out`.

    Arguments as `supports_call` checks them (with `out` bf16 [T, N]); ValueError with
    `qkv_front_unsupported`'s reason, before anything launches, on a call it refuses. Writes
    `out` (q and k heads normed and rotated, v and gate as projected, each one BF16 rounding of the
    FP32 product) and the K | V halves of the slots of tokens with 0 <= slot < pages * 16;
    nothing else.
    Bounds (device values, kept by the kernel, never an error): a slot < 0 or >= pages * 16
    (kv_cache.shape[0] * 16) inserts nothing (its token's out is still written); a position < 0
    or >= max_pos (cos_sin_cache.shape[0]) is rotated with row 0 or row max_pos - 1 of the table
    (clamped: the table is never read outside its rows; such a token's q and k are then those of
    the clamped position). `stock.qkv_front.qkv_epilogue_reference` does the same.
    musebench's extension: `tap` (bf16 [T, N], keyword-only) also receives the kernel's own BF16
    projection before the epilogue (a compile-time variant: the tests' view of the projection).
    `enable_pdl` (default True): programmatic dependent launch, the weight's first ring stages
    streamed before the kernel waits for the preceding kernel on the stream (x, positions, slots,
    the table and every write after the wait); False launches without it. Both give the same bits.
    The first call of a variant compiles it (never during CUDA-graph capture); later calls are
    graph-capturable and allocate nothing. eps is Muse Spark's rms_norm_eps (1e-5), baked in.
    """
    reason = qkv_front_unsupported(x, weight, positions, cos_sin_cache, slot_mapping, kv_cache, out)
    if reason is None and kv_cache.shape[1] != num_kv_heads:
        reason = f"kv_cache holds {kv_cache.shape[1]} KV heads, the layer {num_kv_heads}"
    if reason is None and tap is not None and (
            tap.dtype != torch.bfloat16 or tap.shape != out.shape or not _contiguous_aligned(tap)
            or tap.device != out.device):
        reason = f"tap must be bf16 {tuple(out.shape)}, contiguous, aligned, on {out.device}"
    if reason is None and not isinstance(enable_pdl, bool):
        reason = f"enable_pdl must be a bool, got {enable_pdl!r}"
    if reason is not None:
        raise ValueError(f"the QKV front cannot take this call: {reason}")
    from musebench.kernels import qkv_front  # CuTe DSL: imported at the first launch

    qkv_front.launch(x, weight, positions, cos_sin_cache, slot_mapping, kv_cache, out, tap=tap, eps=QKV_FRONT_EPS,
                     enable_pdl=enable_pdl)
    return out


# attn2: the verify step's attention with the o-norm and sigmoid gate (issue 15).

# Why each value: musebench.attn2_layout (the split plan is shared with the CPU model).
ROW_GROUPS = attn2_layout.ROW_GROUPS  # 1: the 64 rows of a KV head are one M tile, one CTA
SPLIT_TARGET_CLUSTERS = attn2_layout.SPLIT_TARGET_CLUSTERS  # 256: about two split CTAs an SM for one KV head (H200's 132)
MAX_SPLITS = attn2_layout.MAX_SPLITS  # 256: the merge tree's leaves a KV head (a CTA runs two from PAIRED_LEAVES leaves a request)
SHORT_MAX_LEN = attn2_layout.SHORT_MAX_LEN  # 64 (4 pages): up to it one CTA per KV head, no merge
QUERY_LEN = attn2_layout.QUERY_LEN  # 8: 1 + 7 draft tokens per request
# Pages a softmax step takes: 2 for split plans without a window (measured faster at tp 8 and 16,
# taken at every tp: a row's bits follow it), 1 for the window's and the one-split plans; the
# deployment's launch and prepare_attn2 take attn2_layout.pages_per_step's value.
# head_dim^-0.5 * qk_scale_factor, as MuseSpark1xAttention computes it (float64, 0.684125); the
# kernel multiplies scores by fp32(SM_SCALE * log2(e)) and exponentiates in base 2.
SM_SCALE = config.ATTN_SCALE
# The o-norm's eps: the layer's rms_norm_eps (MuseSpark1xTextConfig's default, 1e-5).
ATTN2_EPS = config.RMS_NORM_EPS


def attn2_window(sliding_window: int | None, max_model_len: int) -> int:
    """The window attn2 applies for a layer: 0 (none) when the layer has none or the window
    covers max_model_len (no key is then outside a row's window), else the window (W keys
    including the row's own: FlashInfer's window_left = W - 1). ValueError for a window < 1."""
    attn2_layout._check_positive(max_model_len=max_model_len)
    if sliding_window is None or (not isinstance(sliding_window, bool) and isinstance(sliding_window, int)
                                  and sliding_window >= max_model_len):
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding window {sliding_window!r}: must be None or an int >= 1")
    return sliding_window


def attn2_splits(max_model_len: int, window: int, num_kv_heads: int) -> int:
    """The splits of an attn2 launch for a deployment (a power of two): 1 when max_model_len is
    at most SHORT_MAX_LEN (64 tokens), else the most up to MAX_SPLITS with at least two pages per
    split of those a row can see (the window's, with one): 128 tokens 4, 2048 64, from 8177 256. Depends on max_model_len and the window only: never on a step's
    L, nor on num_kv_heads (a KV head's bits are the same at every tp; the heads are validated). ValueError for a
    non-positive length or head count, or a negative window."""
    return attn2_layout.splits(max_model_len, window, num_kv_heads)


def attn2_workspace_bytes(num_reqs: int, num_kv_heads: int, num_splits: int) -> int:
    """Bytes of the workspace a launch of `num_splits` splits needs for num_reqs requests: one FP32
    partial (O, m, l) per (request, KV head, split CTA), a CTA running
    `attn2_layout.splits_per_cta(num_kv_heads, num_splits)` sibling splits (2 from
    `attn2_layout.PAIRED_LEAVES` leaves a request, tp 4 and 2 at 256 splits: half the partials),
    written by the split kernel and read by the combine kernel of the same launch; 0 with one split
    (nothing to merge). Needs no zeroing. The deployment's launch (`launch_attn2`) needs exactly
    this; an experiment forcing one split a CTA (`kernels.attn2.launch(splits_per_cta=1)`) needs
    `attn2_layout.workspace_bytes(..., per_cta=1)`. ValueError unless every count is positive and
    num_splits a power of two."""
    return attn2_layout.workspace_bytes(num_reqs, num_kv_heads, num_splits)


def _fp32(value: float) -> int:
    return _f32_bits(float(value))


def unsupported_attn2(layer: object) -> str | None:
    """Why attn2 cannot compute this MuseSpark1xAttention layer, or None.

    Reads use_o_norm, use_o_gate, head_dim, num_heads, num_kv_heads (this rank's), scaling and
    rms_norm_eps (`attn2_layout.Attn2Layer` holds the same). Supported: the o-norm with a sigmoid
    o-gate, head_dim 64, 8 query heads per KV head, and scale and eps equal in binary32 to the
    SM_SCALE and ATTN2_EPS the kernel is built for."""
    try:
        o_norm, o_gate = bool(getattr(layer, "use_o_norm")), bool(getattr(layer, "use_o_gate"))
        head_dim, heads, kv_heads = (getattr(layer, n) for n in ("head_dim", "num_heads", "num_kv_heads"))
        scaling, eps = float(getattr(layer, "scaling")), float(getattr(layer, "rms_norm_eps"))
    except (AttributeError, TypeError, ValueError) as error:
        return f"a layer without the attributes attn2 reads ({error})"
    if not (o_norm and o_gate):
        return "the layer has no o-norm with a sigmoid o-gate"
    if head_dim != HEAD_DIM:
        return f"head_dim {head_dim} (the kernel has {HEAD_DIM})"
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        return f"num_kv_heads {kv_heads!r}"
    if heads != HEADS_PER_KV_HEAD * kv_heads:
        return f"{heads} query heads for {kv_heads} KV heads (the kernel has {HEADS_PER_KV_HEAD} per KV head)"
    if not math.isfinite(scaling) or _fp32(scaling) != _fp32(SM_SCALE):
        return f"softmax scale {scaling} (the kernel is built for {SM_SCALE})"
    if not math.isfinite(eps) or _fp32(eps) != _fp32(ATTN2_EPS):
        return f"o-norm eps {eps} (the kernel is built for {ATTN2_EPS})"
    return None


def prepare_attn2(num_kv_heads: int, max_model_len: int, window: int, *, enable_pdl: bool = True) -> None:
    """Compile the attn2 variant of a deployment (this rank's KV heads, max_model_len, the window
    `attn2_window` gives) before CUDA-graph capture; later launches of it compile nothing.
    ValueError for a deployment outside the kernel's contract."""
    from musebench.kernels import attn2  # CuTe DSL: imported when a deployment is prepared

    attn2.prepare(num_kv_heads=num_kv_heads, max_model_len=max_model_len, window=window, enable_pdl=enable_pdl)


def launch_attn2(
    q: torch.Tensor,
    gate: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: torch.Tensor | None,
    *,
    max_model_len: int,
    window: int,
    enable_pdl: bool = True,
) -> torch.Tensor:
    """One attn2 launch on the current stream: for each request r and query head h,
    out[8r + t, 64h : 64h + 64] = bf16(rms_norm(bf16(attention)) * sigmoid(gate)); returns out.

    q, gate: bf16 [8 R, 512 K] (K = this rank's KV heads; rows may be strided views of the QKV
    front's output, `split_qkv`; last dim contiguous, rows 16-byte aligned); kv_cache: bf16
    [pages, K, 16, 128] contiguous, 16-byte aligned (K | V per slot); page_table: int32 [R,
    ceil(max_model_len / 16)] contiguous, whose first ceil(L / 16) entries of row r are pages of
    kv_cache (not checked: that would read device memory; the entries past them may be read, never
    followed);
    seq_lens: int32 [R] on the device, each L in [8, max_model_len] (the kernel clamps to that
    range to stay in bounds; a table entry outside kv_cache reads zeros, never out of bounds); out:
    bf16 [8 R, 512 K] contiguous, 16-byte aligned; workspace: uint8 of at least
    attn2_workspace_bytes(R, K, attn2_splits(...)) bytes, contiguous, 16-byte aligned (None with
    one split). Two kernels with splits (the split kernel, then the combine, PDL between them). Every tensor on one CUDA device. Row t of request r sits at position L - 8 + t and sees keys
    max(0, L - 8 + t - W + 1) .. L - 8 + t. Graph-capturable, allocates nothing (after
    `prepare_attn2`); bitwise deterministic: a row's bits depend only on its keys, its query and
    gate, whatever L, R or the rank's other KV heads. ValueError before launch on anything
    outside this contract."""
    from musebench.kernels import attn2

    attn2.launch(q, gate, kv_cache, page_table, seq_lens, out, workspace, max_model_len=max_model_len,
                 window=window, enable_pdl=enable_pdl)
    return out
