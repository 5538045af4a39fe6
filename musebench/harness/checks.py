"""Bitwise checks: raw-bit comparison with the first mismatch and the max ULP distance, digests.

`compare_bits(got, want)` never looks at values through float equality: it compares the integer
views (`int16` for BF16, `int32` for FP32/int32), so -0.0 vs +0.0 and NaN payloads count.
"""

from __future__ import annotations

import hashlib

import torch

from musebench import numerics as nx
from musebench.harness.results import Mismatch

POISON_BF16_BITS = 0x7FBF  # a NaN no kernel produces: an unwritten element reads as a mismatch


def digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes (dtype and shape included)."""
    data = tensor.detach().contiguous().cpu()
    h = hashlib.sha256(f"{data.dtype}{tuple(data.shape)}".encode())
    h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """Fill an output with the poison pattern before a run (in place)."""
    if tensor.dtype == torch.bfloat16:
        tensor.view(torch.int16).fill_(POISON_BF16_BITS)
    elif tensor.dtype == torch.float32:
        tensor.view(torch.int32).fill_(0x7FBFFFFF)
    else:
        tensor.fill_(-0x5A5A5A5B if tensor.dtype == torch.int32 else 0)
    return tensor


def still_poisoned(tensor: torch.Tensor) -> bool:
    """Whether every element still holds `poison`'s pattern: nothing wrote the output."""
    if tensor.numel() == 0:
        return False
    expected = poison(torch.empty_like(tensor, device="cpu"))
    return bool((nx.bits(tensor.detach().cpu()) == nx.bits(expected)).all())


def compare_bits(got: torch.Tensor, want: torch.Tensor, *, rank: int = 0) -> tuple[int, int, Mismatch | None]:
    """(mismatched elements, max ULP distance, first mismatch) of got vs want, on raw bits."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(f"cannot compare {got.dtype}{tuple(got.shape)} with {want.dtype}{tuple(want.shape)}")
    got, want = got.detach().cpu(), want.detach().cpu()
    got_bits, want_bits = nx.bits(got), nx.bits(want)
    differs = got_bits != want_bits
    count = int(differs.sum())
    if count == 0:
        return 0, 0, None
    first = tuple(int(i) for i in differs.nonzero()[0].tolist())
    if got.dtype in (torch.bfloat16, torch.float32):
        max_ulp = int(nx.ulp_distance(got[differs], want[differs]).max())
        got_value, want_value = float(got[first]), float(want[first])
    else:
        max_ulp = int((got_bits[differs].long() - want_bits[differs].long()).abs().max())
        got_value, want_value = float(got[first]), float(want[first])
    mask = (1 << (got.element_size() * 8)) - 1
    mismatch = Mismatch(
        rank=rank, index=first, got_bits=int(got_bits[first]) & mask, want_bits=int(want_bits[first]) & mask,
        got=got_value, want=want_value,
    )
    return count, max_ulp, mismatch


def flip_one_bit(tensor: torch.Tensor, index: int = 0, bit: int = 0) -> None:
    """Fault injection: flip one bit of element `index` (flat) in place."""
    flat = nx.bits(tensor).view(-1)
    flat[index] ^= 1 << bit
