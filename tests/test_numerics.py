"""musebench.numerics: every primitive bit-exact against an exact rational model."""

from __future__ import annotations

import struct
from fractions import Fraction

import pytest
import torch

from musebench import numerics as nx
from tests._scalar import round_f32 as _f32_round


def _exact_fma(a: float, b: float, c: float) -> float:
    return _f32_round(Fraction(a) * Fraction(b) + Fraction(c))


def _random_f32(generator: torch.Generator, n: int) -> torch.Tensor:
    # wide exponents, including subnormals and values that cancel
    mantissa = torch.rand(n, generator=generator) * 2 - 1
    exponent = torch.randint(-140, 60, (n,), generator=generator).float()
    return (mantissa * torch.exp2(exponent)).float()


def test_fma_matches_exact_rational_on_random_operands():
    g = torch.Generator().manual_seed(1)
    a, b = _random_f32(g, 3000), _random_f32(g, 3000)
    # c near -a*b makes the cancellation (and the double-rounding trap) frequent
    c = torch.where(torch.rand(3000, generator=g) < 0.5, -(a.double() * b.double()).float(), _random_f32(g, 3000))
    got = nx.fma(a, b, c)
    want = torch.tensor([_exact_fma(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_fma_differs_from_mul_then_add_where_it_must():
    # (1 + 2^-12)^2 - 1 - 2^-11: the exact product's low bits survive only in the fused form
    a = torch.tensor([1.0 + 2.0**-12], dtype=torch.float32)
    c = torch.tensor([-(1.0 + 2.0**-11)], dtype=torch.float32)
    fused = nx.fma(a, a, c)
    separate = nx.add(nx.mul(a, a), c)
    assert float(fused) == 2.0**-24
    assert float(separate) == 0.0


def test_fma_double_rounding_case():
    # a*b + c lands exactly between two binary32 values after a binary64 rounding: round-to-odd keeps it right
    a = torch.tensor([1.0 + 2.0**-23], dtype=torch.float32)
    b = torch.tensor([1.0 + 2.0**-23], dtype=torch.float32)
    c = torch.tensor([2.0**-24 * 0], dtype=torch.float32)
    assert float(nx.fma(a, b, c)) == _exact_fma(float(a), float(b), float(c))


def test_fma_signed_zero():
    zero, neg = torch.tensor([0.0]), torch.tensor([-0.0])
    assert nx.bits(nx.fma(neg, torch.tensor([1.0]), neg)).item() == nx.bits(torch.tensor([-0.0])).item()
    assert nx.bits(nx.fma(neg, torch.tensor([1.0]), zero)).item() == 0


def test_to_bf16_rounds_to_nearest_even_and_keeps_subnormals():
    values = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 2.0**-130, -(2.0**-133)], dtype=torch.float32)
    got = nx.to_bf16(values).view(torch.int16).tolist()
    assert got[0] == 0x3F80  # tie to even: down
    assert got[1] == 0x3F82  # tie to even: up
    assert got[2] == 0x0008  # 2^-130 = 8 quanta of 2^-133: a BF16 subnormal
    assert got[3] & 0xFFFF == 0x8001


# NaN inputs of both signs, quiet and signalling, with low, high and all-ones payloads; the
# vectorized (n > 16) and scalar (n = 1) torch conversion paths differ (0xffff vs 0x7fc0).
_F32_NANS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0xFFBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF,
             0x7F808000, 0xFFFF8000]


@pytest.mark.parametrize("n", [1, 64])
def test_to_bf16_gives_the_canonical_nan_for_every_nan(n):
    """`cvt.rn.bf16x2.f32` returns the canonical BF16 NaN 0x7FFF whatever the sign and payload."""
    words = torch.tensor(_F32_NANS * n, dtype=torch.int64).to(torch.int32)
    got = nx.to_bf16(words.view(torch.float32)).view(torch.int16)
    assert got.tolist() == [0x7FFF] * len(words)
    # the neighbours of NaN keep their rounding: +-inf and the largest finite values
    edges = torch.tensor([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F7FFF], dtype=torch.int64).to(torch.int32)
    got = [v & 0xFFFF for v in nx.to_bf16(edges.view(torch.float32)).view(torch.int16).tolist()]
    assert got == [0x7F80, 0xFF80, 0x7F80, 0x7F7F]


def test_scrub_negative_zero_touches_only_negative_zero():
    x = torch.tensor([-0.0, 0.0, -1.0, -(2.0**-133)], dtype=torch.bfloat16)
    got = nx.scrub_negative_zero(x).view(torch.int16)
    want = x.view(torch.int16).clone()
    want[0] = 0
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "a, b, ulps",
    [(1.0, 1.0, 0), (0.0, -0.0, 1), (1.0, 1.0078125, 1), (-1.0, 1.0, 2 * 0x3F80 + 1)],
)
def test_ulp_distance_bf16(a, b, ulps):
    x, y = torch.tensor([a], dtype=torch.bfloat16), torch.tensor([b], dtype=torch.bfloat16)
    assert int(nx.ulp_distance(x, y)) == ulps


def test_precise_rsqrt_is_correctly_rounded():
    x = torch.tensor([4.0, 2.0, 1e-8], dtype=torch.float32)
    got = nx.PRECISE.rsqrt(x)
    assert float(got[0]) == 0.5
    # 1/sqrt(2) rounded once: the binary32 nearest to 0.70710678118654752...
    assert float(got[1]) == struct.unpack("f", struct.pack("f", 0.7071067811865476))[0]
