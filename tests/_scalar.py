"""A scalar, exact-rational model of binary32 arithmetic for cross-checking the torch references."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

F32_MAX = struct.unpack("f", struct.pack("I", 0x7F7FFFFF))[0]


def round_f32(value: Fraction) -> float:
    """Exact rational -> binary32, round to nearest even, subnormals and overflow included."""
    if value == 0:
        return 0.0
    sign = -1.0 if value < 0 else 1.0
    magnitude = abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    if Fraction(2) ** exponent > magnitude:
        exponent -= 1
    exponent = max(exponent, -126)
    quantum = Fraction(2) ** (exponent - 23)
    scaled = magnitude / quantum
    floor = scaled.numerator // scaled.denominator
    rest = scaled - floor
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and floor % 2 == 1):
        floor += 1
    result = float(floor * quantum)
    if result > F32_MAX:
        return sign * math.inf
    return sign * result


def add(a: float, b: float) -> float:
    if math.isinf(a) or math.isinf(b):
        return a + b
    if a == 0 and b == 0:
        return a + b  # IEEE signed-zero rules, exact in binary64
    return round_f32(Fraction(a) + Fraction(b))


def mul(a: float, b: float) -> float:
    if math.isinf(a) or math.isinf(b) or a == 0 or b == 0:
        return float(struct.unpack("f", struct.pack("f", a * b))[0])
    return round_f32(Fraction(a) * Fraction(b))


def fma(a: float, b: float, c: float) -> float:
    if math.isinf(a) or math.isinf(b) or math.isinf(c):
        return a * b + c
    product = Fraction(a) * Fraction(b)
    if product == 0:
        return add(a * b, c)
    return round_f32(product + Fraction(c))


def rsqrt_precise(x: float) -> float:
    if math.isinf(x):
        return 0.0
    return struct.unpack("f", struct.pack("f", 1.0 / math.sqrt(x)))[0]


def to_bf16_bits(x: float) -> int:
    bits = struct.unpack("I", struct.pack("f", x))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:
        return (bits >> 16) | 0x40
    rounding = 0x7FFF + ((bits >> 16) & 1)
    return ((bits + rounding) >> 16) & 0xFFFF


def bf16_bits_to_float(bits: int) -> float:
    return struct.unpack("f", struct.pack("I", (bits & 0xFFFF) << 16))[0]


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]
