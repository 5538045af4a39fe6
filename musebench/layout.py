"""The tails' input as the stock takes it, and the two ways it is laid out across ranks.

`UnfinalizedMoEOutput` is what the grouped GEMM2 leaves behind for one rank, before the finalize:

- `gemm2_permuted` BF16 [num_rows, width], row-major, 16-byte aligned rows: one row per
  (token, route) this rank computed, in the permuted order the expert GEMM used;
- `route_weights` BF16 or FP32 [m, top_k]: the router's weight of each route;
- `expanded_idx_to_permuted_idx` int32 [m, top_k]: row of `gemm2_permuted` holding route
  (t, k), or -1 where this rank holds no row for it (another rank's expert).

EP layout: experts are sharded over ranks (expert e lives on rank e // (experts / tp)); each
route has a row on exactly one rank, -1 elsewhere. The tail sums each rank's routes locally
(the partial) and all-reduces the partials.

TP layout: every rank holds every expert with its intermediate dimension sharded, so every rank
has a row for every route, holding that rank's K-partial of GEMM2; the route's true row is the
sum of the K-partials over ranks. The index map and the route weights are the same on all ranks.

Two stand-ins for the vLLM modules the seeds' API reads (`musebench.kernels.tail`,
`musebench.cute_ops`), holding exactly the attributes read there, so a case can build them
without vLLM: `PostExpertNorm` (a layer's post-expert RMSNorm, `MuseSpark1xRMSNorm`) and
`MuseRouter` (a layer's router, `MuseSpark1xRouter`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from musebench import config


@dataclass(frozen=True)
class UnfinalizedMoEOutput:
    gemm2_permuted: torch.Tensor
    route_weights: torch.Tensor
    expanded_idx_to_permuted_idx: torch.Tensor

    @property
    def expert_weights(self) -> torch.Tensor:
        """`route_weights` under the name the seeds' API reads (vLLM's field name)."""
        return self.route_weights

    @property
    def tokens(self) -> int:
        return int(self.route_weights.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.route_weights.shape[1])

    @property
    def width(self) -> int:
        return int(self.gemm2_permuted.shape[1])

    def validate(self) -> None:
        """ValueError unless shapes, dtypes and indices satisfy the contract above."""
        rows, weights, index = self.gemm2_permuted, self.route_weights, self.expanded_idx_to_permuted_idx
        if rows.dtype != torch.bfloat16 or rows.dim() != 2 or not rows.is_contiguous():
            raise ValueError(f"gemm2_permuted must be a contiguous 2-D bfloat16 tensor, got {rows.dtype} {tuple(rows.shape)}")
        if weights.dtype not in (torch.bfloat16, torch.float32) or weights.dim() != 2:
            raise ValueError(f"route_weights must be 2-D bfloat16 or float32, got {weights.dtype} {tuple(weights.shape)}")
        if index.dtype != torch.int32 or tuple(index.shape) != tuple(weights.shape):
            raise ValueError(
                f"expanded_idx_to_permuted_idx must be int32 {tuple(weights.shape)}, got {index.dtype} {tuple(index.shape)}"
            )
        if rows.shape[1] % 8:
            raise ValueError(f"width {rows.shape[1]} is not a multiple of 8 (16-byte fragments)")
        if index.numel() and (int(index.min()) < -1 or int(index.max()) >= rows.shape[0]):
            raise ValueError("expanded_idx_to_permuted_idx holds a row outside gemm2_permuted")

    def to(self, device: torch.device | str) -> UnfinalizedMoEOutput:
        return UnfinalizedMoEOutput(
            self.gemm2_permuted.to(device), self.route_weights.to(device), self.expanded_idx_to_permuted_idx.to(device)
        )


@dataclass(frozen=True, eq=False)
class PostExpertNorm:
    """A MoE layer's post-expert RMSNorm as `kernels.tail.tail_constants` / `tail_weight` read it.

    hidden_size: the columns it spans (the tails take the pooled width); variance_size_override:
    None, or the leading columns the variance is taken over (the tails refuse anything but
    None); variance_epsilon: eps; fused_gain_center: added to the weight in FP32 (1.0 for Muse
    Spark's zero-centred gamma); applies_weight_before_norm: x * (gamma + center) is normalized
    (Muse Spark) rather than normalized then scaled; has_weight / weight: the gamma, BF16 or any
    float dtype [hidden_size] (ones where has_weight is False). eq=False: tensors compare by
    identity here.
    """

    hidden_size: int
    variance_epsilon: float
    fused_gain_center: float
    applies_weight_before_norm: bool
    weight: torch.Tensor | None = None
    has_weight: bool = True
    variance_size_override: int | None = None


@dataclass(frozen=True, eq=False)
class MuseRouter:
    """A MoE layer's router as `cute_ops.unsupported_router` / `MuseRouting` read it.

    expert_bias: the correction bias added for selection only (float32 [experts], contiguous,
    16-byte aligned for the kernel); route_scale: the weights' scale; the rest describe the
    scoring the kernel must reproduce (defaults: Muse Spark's, `musebench.config`). eq=False:
    tensors compare by identity here.
    """

    expert_bias: torch.Tensor
    route_scale: float = config.ROUTE_SCALE_DEFAULT
    top_k: int = config.TOP_K
    global_num_experts: int = config.NUM_EXPERTS
    router_score_normalization: str = config.ROUTER_SCORE_NORMALIZATION
    router_score_division_eps: float = config.ROUTER_SCORE_DIVISION_EPS
    router_output_multiplier: float | None = None
