"""Correctly rounded float32 quotients without a branch per quotient (device code, inlined into the
kernels that call it).

`div.rn.f32` (and `rcp.rn.f32`) compile, on sm_90a and sm_100a, to a fast path (MUFU.RCP, one
Newton step for the reciprocal, the quotient and one residual correction: five FFMA), an FCHK of
the operands, and a branch around a call of a slow path taken where the operands' exponents make
the fast path unsafe (zeros, subnormals, infinities, NaN, quotients near the ends of the range).
Each division is then a branch of its own, and a row of 16 divisions runs one after another: in
attn2's epilogue (16 quotients O / l and 16 sigmoids 1 / (1 + e) a lane) that serial chain is most
of the combine's last phase.

`quotients_rn` runs the same fast path for a whole list, branch free, when every operand's biased
exponent lies in [FAST_EXPONENT_MIN, FAST_EXPONENT_MAX] (|x| in [2^-60, 2^61): no zero, subnormal,
infinity or NaN, and every quotient, reciprocal and residual far from overflow and underflow),
and otherwise `div.rn.f32` for every element, in one branch for the list. Either way each result
is the bits of `div.rn.f32` of its operands: the fast path is the instruction sequence ptxas
emits for `div.rn.f32` and keeps where FCHK passes, which it does on that range; the GPU test
`tests/kernels/test_division_gpu.py` holds it to torch's IEEE division bit for bit over random
and structured operands of the range and its edges. Callers' CPU models keep modelling IEEE
division.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32

from musebench.kernels import ptx

EXPONENT_BIAS = 127
FAST_EXPONENT_MIN = EXPONENT_BIAS - 60  # |x| >= 2^-60
FAST_EXPONENT_MAX = EXPONENT_BIAS + 60  # |x| < 2^61


@cute.jit
def in_fast_range(x: Float32):
    """Whether x's biased exponent lies in [FAST_EXPONENT_MIN, FAST_EXPONENT_MAX] (a DSL Boolean)."""
    exponent = (ptx.bitcast_f32_to_u32(x) >> Uint32(23)) & Uint32(0xFF)
    return (exponent >= Uint32(FAST_EXPONENT_MIN)) & (exponent <= Uint32(FAST_EXPONENT_MAX))


@cute.jit
def fast_reciprocal(b: Float32) -> Float32:
    """The fast path's reciprocal of b: MUFU.RCP refined by one Newton step (two FFMA)."""
    r0 = ptx.rcp_approx_ftz_f32(b)
    residual = ptx.fma_rn_f32(r0, -b, Float32(1.0))
    return ptx.fma_rn_f32(r0, residual, r0)


@cute.jit
def fast_quotient(a: Float32, b: Float32, reciprocal: Float32) -> Float32:
    """The fast path's a / b from `fast_reciprocal(b)`: the product, its residual a - q b (exact,
    one FFMA) and the corrected quotient (one FFMA)."""
    q = ptx.fma_rn_f32(a, reciprocal, Float32(0.0))
    residual = ptx.fma_rn_f32(q, -b, a)
    return ptx.fma_rn_f32(reciprocal, residual, q)


@cute.jit
def quotients_rn(nums: list, dens: list) -> list:
    """[div.rn.f32(nums[k], dens[k])] bit for bit (two lists of Float32 of one length; a
    denominator used twice is refined once if the same object is passed): branch free when every
    operand is `in_fast_range`, else `div.rn.f32` each (one branch for the list)."""
    inside = None
    for x in nums + dens:
        if cutlass.const_expr(isinstance(x, float)):
            continue
        fits = in_fast_range(x)
        inside = fits if inside is None else inside & fits
    reciprocals = {}
    quotients = []
    for a, b in zip(nums, dens):
        if cutlass.const_expr(id(b) not in reciprocals):
            reciprocals[id(b)] = fast_reciprocal(Float32(b))
        quotients.append(fast_quotient(Float32(a), Float32(b), reciprocals[id(b)]))
    if cutlass.const_expr(inside is not None):
        if not inside:
            quotients = [ptx.div_rn_f32(Float32(a), Float32(b), pinned=True) for a, b in zip(nums, dens)]
    return quotients
