"""Exact FP32/BF16 arithmetic in torch: the rounding points the kernels and the stock share.

Everything here works elementwise on float32 tensors (CPU or CUDA) and is bit-exact:

- `add`, `mul`, `div_rn`: one IEEE-754 binary32 operation, round-to-nearest-even, no contraction
  (torch's elementwise float32 kernels neither fuse nor reassociate).
- `fma`: fused multiply-add with one rounding, emulated exactly: the product of two binary32
  values is exact in binary64, the sum is formed in binary64 with round-to-odd (TwoSum plus a
  sticky bit), and the final binary64 -> binary32 conversion rounds to nearest even. Round-to-odd
  with 53 >= 2*24 + 2 bits makes that double rounding innocuous.
- `to_bf16`: binary32 -> bfloat16, round-to-nearest-even (PTX `cvt.rn.bf16.f32`), subnormals kept,
  every NaN the canonical 0x7FFF.
- `scrub_negative_zero`: -0.0 -> +0.0, as the Lamport publishers sanitize payload words.

Approximate hardware instructions (`rsqrt.approx.f32`, `ex2.approx.f32`, `div.full.f32`) are
injectable: `Approximations` carries one callable per instruction. This module holds the type and
the correctly rounded stand-ins (`PRECISE`, the CPU default); the functions that produce the
instructions' own bits on a CUDA device are device code and live above, in
`musebench.kernels.approx.hardware_approximations()`, which the harness and the GPU tests pass in.
The same reference code therefore yields the stock's bits wherever the approximations are the
hardware's, and nothing here (nor in the references, musebench.stock) imports musebench.kernels.

Bit helpers (`bits16`, `ulp_distance_bf16`, `ulp_distance_f32`) compare raw bits: an ordered
integer mapping makes the ULP distance between two finite values of the same format exact.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

BF16_NEGATIVE_ZERO_BITS = 0x8000
BF16_CANONICAL_NAN_BITS = 0x7FFF  # what cvt.rn.bf16{x2}.f32 returns for any NaN (CUDART_NAN_BF16)
F32_NEGATIVE_ZERO_BITS = 0x80000000
LOG2_E = 1.4426950408889634  # rounded to binary32 where it is used as a multiplier
MIN_EPS = 2.0**-126  # the smallest normal binary32
FP32_MAX = 3.4028234663852886e38  # the largest finite binary32



def check_eps(eps: float) -> float:
    """The tails' RMSNorm eps as a float, or ValueError: the one eps rule of references, CPU model
    and kernels.

    eps must be a real number (not a bool) with MIN_EPS = 2^-126 <= eps <= FP32_MAX. The kernels
    and the stock bake f32(eps) and take `rsqrt(fma(Q, 1/width, f32(eps)))` with Q >= +0.0 (a sum
    of squares from +0.0) or NaN, so the argument is >= eps: never a subnormal. That is where the
    instructions differ: the EP stock's `rsqrt.approx.ftz.f32` flushes a subnormal argument to 0
    (a zero row gives rsqrt(0) = inf and 0 * inf = NaN), the TP stock's `rsqrt.approx.f32` and the
    references' rsqrt keep it (a finite result). On normal, infinite and NaN arguments the three
    agree, so under this rule the references need no flush. FlashInfer itself checks no eps;
    Muse Spark's is 1e-8.
    """
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ValueError(f"eps must be a real number, got {eps!r}")
    if not MIN_EPS <= eps <= FP32_MAX:  # NaN fails both comparisons
        raise ValueError(
            f"eps must be in [2^-126, FP32 max] (a normal binary32: below 2^-126 the EP stock's "
            f"rsqrt.approx.ftz.f32 flushes the argument of a zero row), got {eps!r}"
        )
    return float(eps)


def _f32(x: torch.Tensor | float, like: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.float32:
            raise TypeError(f"expected a float32 tensor, got {x.dtype}")
        return x
    device = like.device if like is not None else None
    return torch.tensor(x, dtype=torch.float32, device=device)


def f32(value: float, device: torch.device | str | None = None) -> torch.Tensor:
    """A Python float rounded once to binary32 (how a kernel bakes a constant)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`add.rn.f32`: one rounding."""
    return torch.add(_f32(a), _f32(b, a))


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`mul.rn.f32`: one rounding."""
    return torch.mul(_f32(a), _f32(b, a))


def div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`div.rn.f32`: IEEE division, one rounding."""
    return torch.div(_f32(a), _f32(b, a))


def _round_to_odd_sum(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """p + c in binary64 rounded to odd (p, c binary64, the sum finite)."""
    s = p + c
    # TwoSum: the exact rounding error of s = fl(p + c).
    bp = s - c
    bc = s - bp
    err = (p - bp) + (c - bc)
    inexact = err != 0
    even = (s.view(torch.int64) & 1) == 0
    towards = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    odd = torch.nextafter(s, towards)
    return torch.where(inexact & even & torch.isfinite(s), odd, s)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """`fma.rn.f32`: a*b + c with a single rounding, bit-exact."""
    a, b, c = _f32(a), _f32(b, a), _f32(c, a)
    a, b, c = torch.broadcast_tensors(a, b, c)
    product = a.double() * b.double()  # exact: 24 + 24 bits of significand
    result = _round_to_odd_sum(product, c.double()).float()
    # Specials and overflow: binary32 semantics of the inputs decide, as hardware does.
    special = ~torch.isfinite(product) | ~torch.isfinite(c) | (product == 0)
    if bool(special.any()):
        # product == 0: fma(a, b, c) = (a*b) + c exactly, including the sign of zero.
        result = torch.where(special, (a.double() * b.double() + c.double()).float(), result)
    return result


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """`cvt.rn.bf16.f32`: round to nearest even, subnormals kept, every NaN -> 0x7FFF.

    The hardware returns the canonical NaN whatever the input's sign and payload; torch's own
    conversion does not (on CPU 0xFFFF from its vectorized path, 0x7FC0 from its scalar one).
    """
    x = _f32(x)
    rounded = x.to(torch.bfloat16).view(torch.int16)
    canonical = torch.tensor(BF16_CANONICAL_NAN_BITS, dtype=torch.int16, device=x.device)
    return torch.where(torch.isnan(x), canonical, rounded).view(torch.bfloat16)


def bf16_to_f32(x: torch.Tensor) -> torch.Tensor:
    """Exact widening."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {x.dtype}")
    return x.to(torch.float32)


def scrub_negative_zero(x: torch.Tensor) -> torch.Tensor:
    """-0.0 -> +0.0 on the raw bits (BF16 or FP32); every other word unchanged."""
    if x.dtype == torch.bfloat16:
        bits = x.view(torch.int16)
        return torch.where(bits == torch.tensor(-32768, dtype=torch.int16, device=x.device), torch.zeros_like(bits), bits).view(torch.bfloat16)
    if x.dtype == torch.float32:
        bits = x.view(torch.int32)
        neg_zero = torch.tensor(-(2**31), dtype=torch.int32, device=x.device)
        return torch.where(bits == neg_zero, torch.zeros_like(bits), bits).view(torch.float32)
    raise TypeError(f"scrub_negative_zero takes bfloat16 or float32, got {x.dtype}")


# ---------------------------------------------------------------------------------------------
# Approximate instructions, injectable.


def _rsqrt_correctly_rounded(x: torch.Tensor) -> torch.Tensor:
    return (1.0 / torch.sqrt(x.double())).float()


def _ex2_correctly_rounded(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(x.double()).float()


def _div_full_correctly_rounded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.div(a, b)


@dataclass(frozen=True)
class Approximations:
    """One callable per approximate PTX instruction; float32 in, float32 out."""

    name: str
    rsqrt: Callable[[torch.Tensor], torch.Tensor]
    ex2: Callable[[torch.Tensor], torch.Tensor]
    div_full: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


PRECISE = Approximations(
    name="precise",
    rsqrt=_rsqrt_correctly_rounded,
    ex2=_ex2_correctly_rounded,
    div_full=_div_full_correctly_rounded,
)



# ---------------------------------------------------------------------------------------------
# Raw-bit comparison.


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits as a signed integer tensor of the same width."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.view(torch.int16)
    if x.dtype == torch.float32:
        return x.view(torch.int32)
    if x.dtype in (torch.int32, torch.int16, torch.int64, torch.uint8, torch.int8, torch.bool):
        return x
    raise TypeError(f"no raw-bit view for {x.dtype}")


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Monotone integer image of a float's bits: adjacent floats differ by 1 (-0.0 == +0.0 - 1)."""
    if x.dtype == torch.bfloat16:
        raw = x.view(torch.int16).to(torch.int64)
        return torch.where(raw < 0, -(raw & 0x7FFF) - 1, raw)
    if x.dtype == torch.float32:
        raw = x.view(torch.int32).to(torch.int64)
        return torch.where(raw < 0, -(raw & 0x7FFFFFFF) - 1, raw)
    raise TypeError(f"no ULP distance for {x.dtype}")


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|ordered(a) - ordered(b)| elementwise (int64); 1 between -0.0 and +0.0."""
    if a.dtype != b.dtype:
        raise TypeError(f"dtype mismatch: {a.dtype} vs {b.dtype}")
    return (_ordered(a) - _ordered(b)).abs()
