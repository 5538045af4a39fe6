"""Stock routing, bit for bit: the vLLM Triton router and the TRT-LLM-gen routing metadata.

Design record
=============

Sources read (facts only; nothing here is copied from them):

- vLLM 0.33.0 `vllm/models/muse_spark/common/ops/fused_routing.py`: `_routing_kernel`,
  `_select_one`, `_normalized_scores`, launcher `fused_musespark1x_routing`.
- vLLM 0.33.0 `vllm/models/muse_spark/common/moe.py`: `MuseSpark1xRouter` (`routing_method_type`
  is built with `renormalize=True`; `_compute_routing_native` is the torch recipe).
- vLLM 0.33.0 `vllm/models/muse_spark/nvidia/model.py`: the MoE block builds the router with
  `router_score_normalization="sigmoid"`, `router_score_division_eps=1e-15`, and calls the fused
  router with `is_padding`; `fold_router_output_multiplier` folds the output multiplier into the
  router weight at load, so the kernel runs with `HAS_MULTIPLIER=False`.
- Triton `python/triton/language/standard.py`: `sigmoid` is `1 / (1 + exp(-x))`; `argmax` reduces
  with `_argmax_combine` (tie_break_left=True by default). Triton's NVIDIA backend
  `ElementwiseOpToLLVM.cpp`, `ExpOpConversionApprox`: fp32 `exp(x)` is `exp2(x * log2e)` with
  `log2e = 1.4426950408889634` materialized as an f32 constant.
- FlashInfer (the TRT-LLM-gen routing) `include/flashinfer/trtllm/fused_moe/RoutingKernel.cuh` and
  `csrc/fused_moe/trtllm_backend/trtllm_fused_moe_routing_custom.cu` (`routingIndicesBlockKernel`,
  `routingIndicesDynBlockKernel`), `trtllm_fused_moe_routing_runner.cu` (`Routing::Runner::run`:
  `MiniMax2` goes to `routingCustom`), and `flashinfer/fused_moe/trtllm_gen_routing.py`
  (`TrtllmGenRoutingResult`, `_max_num_ctas_in_batch_dim`). The FlashInfer 0.7.2.post1 wheel
  ships only Python; the CUDA was read from the FlashInfer repository sources.

Router arithmetic (one token; all FP32; measured on the H200 with Triton 3.6 for the PTX):

1. `neg = 0 - x` (Triton lowers unary minus to a subtraction from zero: -0.0 and +0.0 both give
   +0.0; exact otherwise).
2. `t = neg * f32(log2 e)`, mul.rn.f32; the constant is binary32 0x3FB8AA3B
   (1.44269502162933349609375), i.e. `math.log2(math.e)` rounded once to binary32.
3. `e = ex2.approx.f32(t)` (injected: `approximations.ex2`).
4. `d = 1.0 + e`, add.rn.f32.
5. `score = div.full.f32(1.0, d)` (injected: `approximations.div_full`). score is in [+0, 1]:
   logit +inf -> exactly 1.0, logit -inf -> +0.0.
6. `key = score + bias`, add.rn.f32; the bias steers the selection only.
7. Eight selection rounds: every already chosen expert's key is replaced by -inf, and the expert
   with the largest key wins. Triton's `_argmax_combine` keeps the left operand when
   `v1 > v2` or (`v1 == v2` and `i1 < i2`); both are ordered IEEE compares (`cmpf ogt/oeq`), so
   among equal keys the lowest index wins, -0.0 and +0.0 are equal (lowest index wins again), and
   -inf keys tie with each other. Consequence reproduced here: once only -inf keys remain (e.g.
   -inf biases), the lowest index among *all* -inf entries wins even if it was already chosen,
   so an expert can appear twice in a row of ids. NaN never compares true, so where a NaN lands
   depends on the order of the reduction tree; NaN keys are outside this contract (ValueError).
8. The chosen expert's *unbiased* score is gathered as a sum of it and +0.0 lanes (exact; a
   -0.0 would become +0.0, but scores are never -0.0).
9. `sum = 0.0`, then `sum = sum + score_k` for k = 0..7 in selection order (add.rn.f32, a
   sequential chain), then `sum = sum + f32(division_eps)` when an eps is configured.
10. `inv = div.full.f32(f32(route_scale), sum)`. Python float arguments reach the kernel as
    fp32, so route_scale and eps are rounded once to binary32.
11. Padding tokens (`is_padding`): ids become -1 and `inv` becomes 0.0.
12. `weight_k = score_k * inv`, mul.rn.f32. No multiply-add contraction is possible anywhere in
    this chain (no product feeds an add).

With no eps and a zero sum (all eight scores +0.0) the stock divides by zero: inv = +inf and
the weights are 0 * inf = NaN; this reference reproduces that.

`renormalize=False`: the stock has no such mode (the router always renormalizes, and vLLM
classifies it with `renormalize=True`). musebench defines it as `weight = score * route_scale`
(one mul.rn.f32 with the binary32 route_scale; eps unused; padding tokens multiply by 0.0).

Validated on the H200 against vLLM's kernel itself (Triton 3.6), with ex2.approx.f32 and
div.full.f32 injected from inline PTX: ids and weight bits identical on 15 x 8192 random tokens,
b = 1..8, and the special rows above (ties, +-inf logits, -inf biases with repeats, signed-zero
keys, no-eps NaN, padding). The CPU stand-ins differ from the hardware by a few ULP.

Only the Muse Spark configuration is modeled: sigmoid scores, no output multiplier (folded at
load), a power-of-two expert count >= 8 (so the stock's padded expert lanes do not exist).

Routing metadata (TRT-LLM-gen definitions, for the small-batch kernels the stock dispatches to:
`routingIndicesBlockKernel` up to 4 tokens, `routingIndicesDynBlockKernel` up to 16 tokens and
512 experts; both take precomputed top-k ids):

- A route (t, k) is local when `offset <= id < offset + num_local_experts`. Ids outside
  [0, num_experts) (the router's -1 for padding tokens) and non-local ids map to -1.
- count[e] = local routes of expert e; tiles[e] = ceil(count[e] / tile_n).
- Experts are laid out in ascending expert index; expert e's rows start at tile_n times the
  exclusive prefix sum of tiles (so every expert's range is a whole number of tiles).
- Inside an expert, routes are ordered by token (the block kernels count, per expert, the tokens
  before the current one). The cluster / cooperative kernels for larger batches use shared-memory
  atomics instead and give no fixed order; musebench pins token order.
- cta_count = sum of tiles; padded_row_count = cta_count * tile_n.
- Tile j of expert e (global tile c = first_tile[e] + j): cta_to_expert[c] = e - offset (the local
  index); cta_row_limit[c] = min((c + 1) * tile_n, first_tile[e] * tile_n + count[e]).
- permuted_to_token[row] = token of the route in that row; padding rows (inside an expert's
  range, past its routes) hold -1. The stock routing kernels write only the routed rows; the -1
  on padding rows is FlashInfer's documented contract for that buffer
  (`TrtllmGenRoutingResult`), established outside the routing kernels.
- A token holding the same expert twice is undefined in the stock (two lanes write one shared
  slot); `routing_metadata_reference` rejects such rows.
"""

from __future__ import annotations

import math

import torch

from musebench import config
from musebench.numerics import LOG2_E, PRECISE, Approximations, add, f32, mul
from musebench.routing_metadata import (
    HEADER_CTA_COUNT,
    HEADER_NUM_TOKENS,
    HEADER_PADDED_ROW_COUNT,
    HEADER_TILE_N,
    RoutingMetadata,
)

LOG2_E_F32_BITS = 0x3FB8AA3B  # binary32 nearest to log2(e): what the stock multiplies by

METADATA_KEYS = (
    "padded_row_count",
    "cta_count",
    "expanded_to_permuted",
    "cta_to_expert",
    "cta_row_limit",
    "permuted_to_token",
)


# ---------------------------------------------------------------------------------------------
# Router.


def _check_finite_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def sigmoid_scores(logits: torch.Tensor, approximations: Approximations = PRECISE) -> torch.Tensor:
    """The stock's FP32 sigmoid, elementwise: div_full(1, 1 + ex2((0 - x) * f32(log2 e)))."""
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32:
        raise ValueError("logits must be a float32 tensor")
    neg = torch.sub(f32(0.0, logits.device), logits)  # subtraction from +0.0, as Triton lowers -x
    t = mul(neg, f32(LOG2_E, logits.device))
    d = add(approximations.ex2(t), f32(1.0, logits.device))
    return approximations.div_full(torch.ones_like(d), d)


def first_argmax(keys: torch.Tensor) -> torch.Tensor:
    """Per row, the lowest index holding the row maximum (ordered compares; NaN-free input).

    -0.0 and +0.0 compare equal; a row of -inf gives index 0. int64 [rows].
    """
    if keys.dim() != 2:
        raise ValueError("keys must be 2-D")
    best = keys.amax(dim=1, keepdim=True)
    lanes = torch.arange(keys.shape[1], device=keys.device).expand_as(keys)
    sentinel = torch.full_like(lanes, keys.shape[1])
    return torch.where(keys == best, lanes, sentinel).amin(dim=1)


def routing_reference(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    route_scale: float,
    renormalize: bool = True,
    division_eps: float | None = config.ROUTER_SCORE_DIVISION_EPS,
    approximations: Approximations = PRECISE,
    top_k: int = config.TOP_K,
    is_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stock router's (ids int32 [b, top_k], weights fp32 [b, top_k]), bit for bit.

    Contract:
    - logits: float32 [b, E] (b >= 0), E a power of two >= 8 (Muse Spark: 256); bias: float32 [E];
      both on one device; no NaN in logits or bias, and none produced in the selection keys;
    - route_scale: finite; division_eps: finite or None (None = the stock's HAS_EPS=False);
    - top_k in [1, E]; is_padding: optional bool [b] (padding tokens: ids -1, weights +0.0);
    - approximations: the ex2 / div.full implementations (PRECISE stand-ins on CPU, the
      hardware's bits on CUDA give the stock's bits);
    - the arithmetic is the one in the module docstring; renormalize=False is musebench's own
      mode: weight = score * f32(route_scale).
    ValueError on any violation.
    """
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError("logits must be a 2-D float32 tensor [tokens, experts]")
    b, num_experts = logits.shape
    if num_experts < 8 or num_experts & (num_experts - 1):
        raise ValueError(f"the expert count must be a power of two >= 8, got {num_experts}")
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32 or tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias must be a float32 tensor of shape ({num_experts},)")
    if bias.device != logits.device:
        raise ValueError("logits and bias must be on the same device")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    route_scale = _check_finite_float("route_scale", route_scale)
    if division_eps is not None:
        division_eps = _check_finite_float("division_eps", division_eps)
    if is_padding is not None:
        if not isinstance(is_padding, torch.Tensor) or is_padding.dtype != torch.bool or tuple(is_padding.shape) != (b,):
            raise ValueError(f"is_padding must be a bool tensor of shape ({b},)")
        is_padding = is_padding.to(logits.device)
    if bool(torch.isnan(logits).any()) or bool(torch.isnan(bias).any()):
        raise ValueError("NaN logits or bias: the stock's choice then depends on its reduction tree")

    device = logits.device
    scores = sigmoid_scores(logits, approximations)
    keys = add(scores, bias.unsqueeze(0).expand_as(scores).contiguous())
    if bool(torch.isnan(keys).any()):
        raise ValueError("a selection key is NaN")

    minus_inf = torch.full_like(keys, float("-inf"))
    chosen = torch.zeros_like(keys, dtype=torch.bool)
    ids = torch.empty(b, top_k, dtype=torch.int32, device=device)
    picked = torch.empty(b, top_k, dtype=torch.float32, device=device)
    score_sum = torch.zeros(b, dtype=torch.float32, device=device)
    rows = torch.arange(b, device=device)
    for k in range(top_k):
        winner = first_argmax(torch.where(chosen, minus_inf, keys))
        score = add(scores[rows, winner], f32(0.0, device))  # the masked-sum gather of one lane
        ids[:, k] = winner.to(torch.int32)
        picked[:, k] = score
        score_sum = add(score_sum, score)
        chosen[rows, winner] = True

    scale = torch.full_like(score_sum, route_scale)  # binary32 route_scale, one per token
    if renormalize:
        if division_eps is not None:
            score_sum = add(score_sum, f32(division_eps, device))
        factor = approximations.div_full(scale, score_sum)
    else:
        factor = scale
    if is_padding is not None:
        ids = torch.where(is_padding.unsqueeze(1), torch.full_like(ids, -1), ids)
        factor = torch.where(is_padding, torch.zeros_like(factor), factor)
    weights = mul(picked, factor.unsqueeze(1).expand_as(picked).contiguous())
    return ids, weights


# ---------------------------------------------------------------------------------------------
# TRT-LLM-gen routing metadata.


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def routing_metadata_reference(
    ids: torch.Tensor,
    *,
    local_expert_offset: int,
    num_local_experts: int,
    tile_n: int,
    num_experts: int = config.NUM_EXPERTS,
) -> dict[str, torch.Tensor]:
    """The TRT-LLM-gen routing metadata of one rank for top-k ids [b, k] (int32/int64), on CPU.

    Returns int32 tensors (definitions in the module docstring and docs/contract-routing.md):
    - padded_row_count [1], cta_count [1];
    - expanded_to_permuted [b, k]: permuted row of route (t, k), -1 if not local or id == -1;
    - cta_to_expert [cta_count], cta_row_limit [cta_count];
    - permuted_to_token [padded_row_count]: token of each row, -1 on padding rows.

    ValueError: ids not a 2-D integer tensor, an id outside [-1, num_experts), an expert twice in
    one token's row, tile_n outside [1, 256], local_expert_offset < 0, num_local_experts < 1, or
    the local range past num_experts.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("ids must be a 2-D int32 or int64 tensor [tokens, top_k]")
    _check_int("tile_n", tile_n, 1, 256)
    _check_int("num_experts", num_experts, 1)
    _check_int("local_expert_offset", local_expert_offset, 0)
    _check_int("num_local_experts", num_local_experts, 1)
    if local_expert_offset + num_local_experts > num_experts:
        raise ValueError(
            f"local experts [{local_expert_offset}, {local_expert_offset + num_local_experts}) exceed {num_experts} experts"
        )
    table = [[int(v) for v in row] for row in ids.cpu().tolist()]
    for t, row in enumerate(table):
        seen = set()
        for e in row:
            if not -1 <= e < num_experts:
                raise ValueError(f"token {t}: expert id {e} outside [-1, {num_experts})")
            if e >= 0:
                if e in seen:
                    raise ValueError(f"token {t}: expert {e} appears twice (undefined in the stock)")
                seen.add(e)

    top_k = ids.shape[1]
    lo, hi = local_expert_offset, local_expert_offset + num_local_experts
    counts = [0] * num_local_experts
    rank_in_expert: dict[tuple[int, int], int] = {}
    for t, row in enumerate(table):  # token order fixes the order inside each expert
        for k, e in enumerate(row):
            if lo <= e < hi:
                rank_in_expert[(t, k)] = counts[e - lo]
                counts[e - lo] += 1

    first_tile = []
    tiles_so_far = 0
    for c in counts:
        first_tile.append(tiles_so_far)
        tiles_so_far += -(-c // tile_n)
    cta_count = tiles_so_far
    padded = cta_count * tile_n

    expanded = torch.full((len(table), top_k), -1, dtype=torch.int32)
    to_token = torch.full((padded,), -1, dtype=torch.int32)
    for (t, k), r in rank_in_expert.items():
        row = first_tile[table[t][k] - lo] * tile_n + r
        expanded[t, k] = row
        to_token[row] = t

    cta_to_expert = torch.empty(cta_count, dtype=torch.int32)
    cta_row_limit = torch.empty(cta_count, dtype=torch.int32)
    for local, c in enumerate(counts):
        start = first_tile[local]
        for j in range(-(-c // tile_n)):
            cta_to_expert[start + j] = local
            cta_row_limit[start + j] = min((start + j + 1) * tile_n, start * tile_n + c)

    return {
        "padded_row_count": torch.tensor([padded], dtype=torch.int32),
        "cta_count": torch.tensor([cta_count], dtype=torch.int32),
        "expanded_to_permuted": expanded,
        "cta_to_expert": cta_to_expert,
        "cta_row_limit": cta_row_limit,
        "permuted_to_token": to_token,
    }


def pack_metadata(
    metadata: dict[str, torch.Tensor],
    *,
    tile_n: int,
    num_tokens_max: int = config.MAX_DECODE_TOKENS,
    num_experts: int = config.NUM_EXPERTS,
    fill: int = -1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write `routing_metadata_reference`'s dict into the flat int32 layout of routing_metadata.

    The layout is `RoutingMetadata(tile_n, num_tokens_max, top_k, num_experts)` with top_k taken
    from expanded_to_permuted. Live words get the metadata; every other word gets `fill` (the
    contract leaves them unspecified). `out`, when given, must be a 1-D int32 tensor of exactly
    `size` words (it may be a view into a larger buffer); nothing outside it is touched.
    Returns the buffer. ValueError on a dict that does not fit the layout.
    """
    missing = [key for key in METADATA_KEYS if key not in metadata]
    if missing:
        raise ValueError(f"metadata lacks {missing}")
    expanded = metadata["expanded_to_permuted"]
    if expanded.dim() != 2:
        raise ValueError("expanded_to_permuted must be 2-D [tokens, top_k]")
    num_tokens, top_k = expanded.shape
    layout = RoutingMetadata(tile_n, num_tokens_max, top_k, num_experts)
    if num_tokens > num_tokens_max:
        raise ValueError(f"{num_tokens} tokens exceed num_tokens_max {num_tokens_max}")
    padded = int(metadata["padded_row_count"].reshape(-1)[0])
    ctas = int(metadata["cta_count"].reshape(-1)[0])
    if padded != ctas * tile_n:
        raise ValueError(f"padded_row_count {padded} != cta_count {ctas} * tile_n {tile_n}")
    if ctas > layout.max_ctas(num_tokens):
        raise ValueError(f"cta_count {ctas} exceeds the layout bound {layout.max_ctas(num_tokens)}")
    if metadata["cta_to_expert"].numel() != ctas or metadata["cta_row_limit"].numel() != ctas:
        raise ValueError("the CTA tables must hold cta_count entries")
    if metadata["permuted_to_token"].numel() != padded:
        raise ValueError("permuted_to_token must hold padded_row_count entries")

    if out is None:
        out = torch.empty(layout.size, dtype=torch.int32)
    elif out.dtype != torch.int32 or out.dim() != 1 or out.numel() != layout.size:
        raise ValueError(f"out must be a 1-D int32 tensor of {layout.size} words")
    out.fill_(fill)
    off = layout.offsets
    header = [0] * 4
    header[HEADER_PADDED_ROW_COUNT] = padded
    header[HEADER_CTA_COUNT] = ctas
    header[HEADER_NUM_TOKENS] = num_tokens
    header[HEADER_TILE_N] = tile_n
    out[:4] = torch.tensor(header, dtype=torch.int32, device=out.device)

    def put(name: str, values: torch.Tensor) -> None:
        flat = values.reshape(-1).to(device=out.device, dtype=torch.int32)
        out[off[name] : off[name] + flat.numel()] = flat

    put("expanded_to_permuted", expanded)
    put("cta_to_expert", metadata["cta_to_expert"])
    put("cta_row_limit", metadata["cta_row_limit"])
    put("permuted_to_token", metadata["permuted_to_token"])
    return out
