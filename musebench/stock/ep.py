"""EP tail reference: FlashInfer's LL MoE finalize + norm + all-reduce, bit for bit, in torch.

Stock: flashinfer 0.7.2.post1, `flashinfer/comm/mnnvl_cutedsl/kernel_ll/moe_finalize_norm_all_reduce.py`
(`_NormFinalizePublishDeviceKernel`, `LLMoEFinalizeNormAllReduce`) and the sum of
`kernel_ll/device_kernels.py::_LamportResidualRMSNormDeviceKernel` with the norm off.

Per rank (the publisher, one CTA of `PUBLISHER_THREADS` threads per token):

1. gamma = f32(norm_weight) + gain_center (add.rn.f32), once per column.
2. For each route k = 0..7 of the token, in order, whose permuted row is on this rank:
   s = x (weight after the norm) or s = x * gamma (mul.rn.f32, weight before the norm);
   sum_of_squares: every thread folds the squares of its 32 columns into one FP32 value with the
   per-thread chain of `thread_sum_of_squares`; the warp adds its lanes with a butterfly
   (xor 16, 8, 4, 2, 1; each lane adds its partner's value); the four warp sums are added from
   0.0 in warp order; inv_rms = rsqrt.approx(fma(total, 1/width, eps));
   y = s * inv_rms (mul), then * gamma (mul) when the weight comes after the norm;
   acc = fma(y, route_weight, acc), acc starting at +0.0.
   Thread t owns columns 8*(t + 128*trip) .. +7 for trip 0..3 (16-byte fragments).
3. partial = bf16_rn(acc), -0.0 scrubbed to +0.0 (the Lamport sentinel), published to slot
   [stage, rank] of every rank's mailbox.

All ranks (the reduction): out = bf16_rn(((0.0 + p_0) + p_1) + ... + p_{tp-1}) in FP32, rank order.

The per-thread chain of the sum of squares and the contraction points are read off the PTX the
stock compiles to (CuTe DSL 4.8.1, sm_90a and sm_100a; see docs/contract.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from musebench import numerics as nx
from musebench.layout import UnfinalizedMoEOutput

PUBLISHER_THREADS = 128
FRAGMENT = 8  # BF16 elements per 16-byte fragment
WARP = 32


def _thread_columns(width: int) -> tuple[int, int]:
    """(threads, trips) of the publisher for a row of `width` columns."""
    if width % (PUBLISHER_THREADS * FRAGMENT):
        raise ValueError(f"width {width} must be a multiple of {PUBLISHER_THREADS * FRAGMENT}")
    return PUBLISHER_THREADS, width // (PUBLISHER_THREADS * FRAGMENT)


def _per_thread(values: torch.Tensor) -> torch.Tensor:
    """[..., width] -> [..., threads, 8 * trips]: each thread's columns in CuTe coordinate order.

    Thread t holds column 8 * (t + threads * trip) + element in a (trips, 8) register fragment;
    CuTe enumerates its coordinates with the first mode fastest, so the order is element-major,
    trip-minor: (trip 0, e 0), (trip 1, e 0), ..., (trip 3, e 7).
    """
    threads, trips = _thread_columns(values.shape[-1])
    shaped = values.reshape(*values.shape[:-1], trips, threads, FRAGMENT)  # [.., trip, thread, element]
    ordered = shaped.movedim(-3, -1)  # [.., thread, element, trip]
    return ordered.reshape(*values.shape[:-1], threads, FRAGMENT * trips)


def thread_sum_of_squares(per_thread: torch.Tensor) -> torch.Tensor:
    """One thread's sum of squares of its register values [..., n] -> [...].

    The stock's `(scaled * scaled).reduce(ADD, init 0.0)` is an ordered `vector.reduction <add>`
    that compiles to a chain of 32 fma.rn.f32 from +0.0 in `_per_thread` order (PTX and SASS,
    sm_90a and sm_100a, CuTe DSL 4.8.1): no tree, no reassociation, no .ftz.
    """
    acc = torch.zeros(per_thread.shape[:-1], dtype=torch.float32, device=per_thread.device)
    for i in range(per_thread.shape[-1]):
        value = per_thread[..., i]
        acc = nx.fma(value, value, acc)
    return acc


def block_sum(per_thread_sums: torch.Tensor) -> torch.Tensor:
    """[..., threads] -> [...]: butterfly within each warp, then warp sums from 0.0 in warp order."""
    threads = per_thread_sums.shape[-1]
    lanes = per_thread_sums.reshape(*per_thread_sums.shape[:-1], threads // WARP, WARP)
    for offset in (16, 8, 4, 2, 1):
        partner = lanes[..., torch.arange(WARP, device=lanes.device) ^ offset]
        lanes = nx.add(lanes, partner)
    total = torch.zeros(per_thread_sums.shape[:-1], dtype=torch.float32, device=per_thread_sums.device)
    for warp in range(threads // WARP):
        total = nx.add(total, lanes[..., warp, 0])
    return total


def inverse_rms(sum_of_squares: torch.Tensor, width: int, eps: float, approximations: nx.Approximations) -> torch.Tensor:
    """rsqrt.approx(fma(sum_of_squares, 1/width, eps))."""
    device = sum_of_squares.device
    return approximations.rsqrt(nx.fma(sum_of_squares, nx.f32(1.0 / width, device), nx.f32(eps, device)))


def ep_partial(
    unfinalized: UnfinalizedMoEOutput,
    norm_weight: torch.Tensor,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    approximations: nx.Approximations = nx.PRECISE,
) -> torch.Tensor:
    """One rank's BF16 partial [m, width] as the stock publisher writes it (-0.0 scrubbed).

    width is the norm's (`norm_weight` BF16 [width], a multiple of 1024); the rows may be wider:
    as the stock (`hidden` columns at a `row_stride` of the rows' width), only their first width
    columns are read.
    """
    nx.check_eps(eps)
    unfinalized.validate()
    rows = unfinalized.gemm2_permuted
    device = rows.device
    m, top_k = unfinalized.tokens, unfinalized.top_k
    if norm_weight.dtype != torch.bfloat16 or norm_weight.dim() != 1:
        raise ValueError(f"norm_weight must be 1-D bfloat16, got {norm_weight.dtype} {tuple(norm_weight.shape)}")
    width = norm_weight.shape[0]
    _thread_columns(width)
    if unfinalized.width < width:
        raise ValueError(f"rows of {unfinalized.width} columns are narrower than the norm's {width}")
    rows = rows[:, :width]
    gamma = nx.add(nx.bf16_to_f32(norm_weight), nx.f32(gain_center, device))
    index = unfinalized.expanded_idx_to_permuted_idx.long()
    local = (index >= 0) & (index < rows.shape[0])
    weights = unfinalized.route_weights.to(torch.float32)
    # All routes at once [m, k, width]; a route that is not local never touches acc.
    x = nx.bf16_to_f32(rows[index.clamp(min=0)]) if rows.shape[0] else torch.zeros(m, top_k, width, device=device)
    s = nx.mul(x, gamma) if weight_before_norm else x
    total = block_sum(thread_sum_of_squares(_per_thread(s)))
    inv = inverse_rms(total, width, eps, approximations)
    y = nx.mul(s, inv[..., None])
    if not weight_before_norm:
        y = nx.mul(y, gamma)
    acc = torch.zeros(m, width, dtype=torch.float32, device=device)
    for k in range(top_k):
        updated = nx.fma(y[:, k], weights[:, k : k + 1], acc)
        acc = torch.where(local[:, k : k + 1], updated, acc)
    return nx.scrub_negative_zero(nx.to_bf16(acc))


def rank_order_sum(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """bf16_rn(((0.0 + p_0) + p_1) + ...) in FP32: the LL reduction over ranks."""
    total = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for partial in partials:
        total = nx.add(total, nx.bf16_to_f32(partial))
    return nx.to_bf16(total)


def ep_tail_reference(
    per_rank: Sequence[UnfinalizedMoEOutput],
    norm_weight: torch.Tensor,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    approximations: nx.Approximations = nx.PRECISE,
) -> torch.Tensor:
    """The EP tail's output BF16 [m, width], the same on every rank: partials summed in rank order."""
    if len(per_rank) < 1:
        raise ValueError("need at least one rank")
    partials = [
        ep_partial(
            u, norm_weight, eps=eps, gain_center=gain_center, weight_before_norm=weight_before_norm, approximations=approximations
        )
        for u in per_rank
    ]
    return rank_order_sum(partials)
