"""The bitwise reference of musebench's one-shot all-reduce (`musebench.kernels.oneshot_allreduce`).

`rank_order_sum(parts)`: every rank's vector (`parts[r]`, BF16 or FP32, one shape) summed in
binary32 from +0.0 in rank order 0, 1, ..., tp - 1 (`add.rn.f32`, one rounding per add), the
result in the parts' dtype (BF16: `cvt.rn.bf16.f32`, round to nearest even, every NaN 0x7FFF).
Every rank of the kernel gets these bits, whatever order its peers' words land in.

What the kernel's Lamport scrub does to a payload is applied first, so the reference equals the
kernel's bits on every input: a BF16 -0.0 travels as +0.0, which changes no sum from +0.0; an
FP32 word equal to the 32-bit sentinel 0x80008000 (-2^-134, a subnormal) travels as -0.0 (the
one value the kernel changes; `musebench.comm.protocol`). An FP32 NaN's payload is the
hardware's (canonical on the GPU, propagated on the CPU): compare FP32 NaNs as NaNs.

Not imported by any kernel; the bench's one-shot rows (`musebench.cases.tail`) and the tests
check the kernel against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from musebench import numerics as nx
from musebench.comm.protocol import SENTINEL_WORD32_BITS

F32_NEGATIVE_ZERO_INT32 = -(2**31)  # 0x80000000 as int32


def scrub_f32_sentinel(part: torch.Tensor) -> torch.Tensor:
    """An FP32 vector as the one-shot kernel publishes it: words equal to 0x80008000 become -0.0."""
    bits = part.contiguous().view(torch.int32)
    sentinel = torch.tensor(SENTINEL_WORD32_BITS, dtype=torch.int32, device=part.device)
    negative_zero = torch.tensor(F32_NEGATIVE_ZERO_INT32, dtype=torch.int32, device=part.device)
    return torch.where(bits == sentinel, negative_zero, bits).view(torch.float32)


def rank_order_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The one-shot all-reduce's result for `parts` (one tensor per rank, rank order; see the
    module docstring), on the parts' device. ValueError for no parts, mixed shapes or dtypes, or
    a dtype other than BF16 and FP32."""
    if not parts:
        raise ValueError("rank_order_sum needs one part per rank, got none")
    dtype, shape = parts[0].dtype, tuple(parts[0].shape)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the one-shot all-reduce sums bfloat16 or float32, got {dtype}")
    if any(p.dtype != dtype or tuple(p.shape) != shape for p in parts):
        raise ValueError("every rank's part must have the same dtype and shape")
    total = torch.zeros(shape, dtype=torch.float32, device=parts[0].device)
    for part in parts:
        widened = nx.bf16_to_f32(part) if dtype == torch.bfloat16 else scrub_f32_sentinel(part)
        total = nx.add(total, widened)
    return nx.to_bf16(total) if dtype == torch.bfloat16 else total


def mismatches(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int | None]:
    """(words whose raw bits differ, the flat index of the first), FP32 NaNs equal to NaNs
    (the GPU's canonical payload against the host's propagated one); (0, None) when equal."""
    if got.dtype != want.dtype or got.shape != want.shape:
        raise ValueError(f"cannot compare {got.dtype} {tuple(got.shape)} with {want.dtype} {tuple(want.shape)}")
    view = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    differ = got.contiguous().view(view) != want.contiguous().view(view)
    if got.dtype == torch.float32:
        differ &= ~(torch.isnan(got) & torch.isnan(want))
    flat = differ.reshape(-1).nonzero()
    return int(flat.numel()), (int(flat[0]) if flat.numel() else None)
