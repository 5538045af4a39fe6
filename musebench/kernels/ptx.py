"""One PTX instruction per function, for the CuTe DSL kernels of musebench.

Every floating-point operation a kernel performs on the contract's path goes through one of these
wrappers, so the rounding of each step is spelled in the PTX itself (`add.rn.f32`, `mul.rn.f32`,
`fma.rn.f32`) and nothing is left for NVVM or ptxas to contract or reassociate: an explicit `.rn`
forbids contraction, and an inline-asm result is opaque to LLVM's folding (`0.0 + x` survives).

Names carry op, semantics, scope, state space and type, in PTX order; a combination this module
does not define does not exist. Addresses are generic 64-bit `Int64` values (global memory, or a
multicast address for `multimem`).

Memory wrappers are marked as having side effects: LLVM must neither hoist a load above
`griddepcontrol.wait` nor merge two polls of the same word, and it treats an inline asm without
side effects as a pure function of its operands. Arithmetic wrappers are pure.

The helpers at the end (`scrub_negative_zero_u32`, `has_negative_zero_u32`, `bf16x2_*_bits`) are
integer arithmetic, not asm: the same function runs on DSL `Uint32` values inside a kernel and on
Python ints in a unit test. The sentinels they test and scrub are `musebench.comm.protocol`'s.
"""

from __future__ import annotations

import cutlass.cute as cute  # the DSL must be initialised before dsl_user_op use; vote_sync_all_pred
from cutlass import Float32, Int32, Int64, Numeric, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from musebench.comm.protocol import SENTINEL_BF16, SENTINEL_BF16X2

BF16_HALF_MASK = 0xFFFF
BF16_HIGH_MASK = 0xFFFF0000
U32_MASK = 0xFFFFFFFF
LOW_HALF_ONES = 0x00010001


def _asm(result_type, operands, text: str, constraints: str, *, side_effects: bool, loc=None, ip=None):
    return llvm.inline_asm(
        result_type,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _ir(value, loc=None, ip=None):
    return value.ir_value(loc=loc, ip=ip)


def _four_u32(struct, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(4))  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Global memory.


@dsl_user_op
def ld_global_v4_u32(address: Int64, *, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """`ld.global.v4.u32`: 16 bytes, weak (data another kernel finished writing)."""
    struct = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_ir(Int64(address), loc, ip)],
        "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        side_effects=True,
        loc=loc,
        ip=ip,
    )
    return _four_u32(struct, loc, ip)


@dsl_user_op
def ld_volatile_global_v4_u32(address: Int64, *, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """`ld.volatile.global.v4.u32`: 16 bytes, re-read from memory every time (a Lamport poll)."""
    struct = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_ir(Int64(address), loc, ip)],
        "ld.volatile.global.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        side_effects=True,
        loc=loc,
        ip=ip,
    )
    return _four_u32(struct, loc, ip)


@dsl_user_op
def ld_volatile_global_u32(address: Int64, *, loc=None, ip=None) -> Uint32:
    """`ld.volatile.global.u32`: one word (a stage word)."""
    return Uint32(
        _asm(T.i32(), [_ir(Int64(address), loc, ip)], "ld.volatile.global.u32 $0, [$1];", "=r,l", side_effects=True, loc=loc, ip=ip)
    )


@dsl_user_op
def st_global_u32(address: Int64, value: Uint32, *, loc=None, ip=None) -> None:
    """`st.global.u32`: one word, weak."""
    _asm(
        None,
        [_ir(Int64(address), loc, ip), _ir(Uint32(value), loc, ip)],
        "st.global.u32 [$0], $1;",
        "l,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_u64(address: Int64, value: Int64, *, loc=None, ip=None) -> None:
    """`st.global.u64`: one 64-bit word, weak."""
    _asm(
        None,
        [_ir(Int64(address), loc, ip), _ir(Int64(value), loc, ip)],
        "st.global.u64 [$0], $1;",
        "l,l",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_global_v4_u32(address: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, loc=None, ip=None) -> None:
    """`st.global.v4.u32`: 16 bytes, weak (own memory: outputs, re-arming)."""
    _asm(
        None,
        [_ir(Int64(address), loc, ip), *(_ir(Uint32(w), loc, ip) for w in (w0, w1, w2, w3))],
        "st.global.v4.u32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_relaxed_sys_global_v4_u32(address: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, loc=None, ip=None) -> None:
    """`st.relaxed.sys.global.v4.u32`: 16 bytes to a peer's memory, morally strong at system scope.

    A peer polls these words with volatile (relaxed, system-scope) loads; a strong store keeps the
    pair free of data races in the PTX memory model.
    """
    _asm(
        None,
        [_ir(Int64(address), loc, ip), *(_ir(Uint32(w), loc, ip) for w in (w0, w1, w2, w3))],
        "st.relaxed.sys.global.v4.u32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def multimem_st_relaxed_sys_global_v4_bf16x2(
    address: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, loc=None, ip=None
) -> None:
    """`multimem.st.relaxed.sys.global.v4.bf16x2`: 16 bytes to every rank bound to a multicast address.

    A plain store replicated by the switch: no arithmetic on the payload. Needs an NVLink
    multicast object (sm_90+; exercised on GB200 only).
    """
    _asm(
        None,
        [_ir(Int64(address), loc, ip), *(_ir(Uint32(w), loc, ip) for w in (w0, w1, w2, w3))],
        "multimem.st.relaxed.sys.global.v4.bf16x2 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def multimem_st_relaxed_sys_global_v4_f32(
    address: Int64, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, loc=None, ip=None
) -> None:
    """`multimem.st.relaxed.sys.global.v4.f32`: 16 bytes (four binary32 words, as bits) to every
    rank bound to a multicast address. A plain store replicated by the switch, no arithmetic:
    the words land as given (the TP tail's FP32 rows). Needs an NVLink multicast object (sm_90+;
    exercised on GB200 only)."""
    _asm(
        None,
        [_ir(Int64(address), loc, ip), *(_ir(Uint32(w), loc, ip) for w in (w0, w1, w2, w3))],
        "multimem.st.relaxed.sys.global.v4.f32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def fence_proxy_alias(*, loc=None, ip=None) -> None:
    """`fence.proxy.alias`: orders this thread's accesses through one virtual address (a multicast
    mapping) with its later accesses through another that aliases the same memory (the unicast
    mapping of its own words)."""
    _asm(None, [], "fence.proxy.alias;", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def atom_cas_relaxed_gpu_global_b32(address: Int64, compare: Int32, value: Int32, *, loc=None, ip=None) -> Int32:
    """`atom.relaxed.gpu.global.cas.b32`: store `value` if the word equals `compare`; returns the old word."""
    return Int32(
        _asm(
            T.i32(),
            [_ir(Int64(address), loc, ip), _ir(Int32(compare), loc, ip), _ir(Int32(value), loc, ip)],
            "atom.relaxed.gpu.global.cas.b32 $0, [$1], $2, $3;",
            "=r,l,r,r",
            side_effects=True,
            loc=loc,
            ip=ip,
        )
    )


# ---------------------------------------------------------------------------------------------
# Special registers.


@dsl_user_op
def read_globaltimer_u64(*, loc=None, ip=None) -> Int64:
    """`mov.u64 %globaltimer`: the global nanosecond timer (bounds every spin-wait).

    Side effects keep LLVM from hoisting the read out of a polling loop.
    """
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def read_clock64_u64(*, loc=None, ip=None) -> Int64:
    """`mov.u64 %clock64`: the SM's cycle counter (per SM, not synchronised across SMs: a duration
    within one CTA). Side effects keep each read where the kernel places it."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %clock64;", "=l", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def read_smid_u32(*, loc=None, ip=None) -> Uint32:
    """`mov.u32 %smid`: the SM this CTA runs on (a trace's label; may differ between launches)."""
    return Uint32(_asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", side_effects=True, loc=loc, ip=ip))


# ---------------------------------------------------------------------------------------------
# Binary32 arithmetic, rounded to nearest even, subnormals kept (no .ftz).


@dsl_user_op
def add_rn_f32(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """`add.rn.f32`: a + b, one rounding, never contracted."""
    return Float32(
        _asm(T.f32(), [_ir(Float32(a), loc, ip), _ir(Float32(b), loc, ip)], "add.rn.f32 $0, $1, $2;", "=f,f,f", side_effects=False, loc=loc, ip=ip)
    )


@dsl_user_op
def mul_rn_f32(a: Float32, b: Float32, *, pinned: bool = False, loc=None, ip=None) -> Float32:
    """`mul.rn.f32`: a * b, one rounding, never contracted. `pinned`: marked as having side
    effects, so LLVM keeps it inside the branch it is written in (a pure asm may be hoisted above
    a branch and selected after it, which ptxas then issues predicated on every path)."""
    return Float32(
        _asm(T.f32(), [_ir(Float32(a), loc, ip), _ir(Float32(b), loc, ip)], "mul.rn.f32 $0, $1, $2;", "=f,f,f",
             side_effects=bool(pinned), loc=loc, ip=ip)
    )


@dsl_user_op
def fma_rn_f32(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """`fma.rn.f32`: a * b + c with one rounding."""
    return Float32(
        _asm(
            T.f32(),
            [_ir(Float32(a), loc, ip), _ir(Float32(b), loc, ip), _ir(Float32(c), loc, ip)],
            "fma.rn.f32 $0, $1, $2, $3;",
            "=f,f,f,f",
            side_effects=False,
            loc=loc,
            ip=ip,
        )
    )


# ---------------------------------------------------------------------------------------------
# Approximate instructions (not correctly rounded; their bits are the hardware's).


@dsl_user_op
def rsqrt_approx_ftz_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """`rsqrt.approx.ftz.f32`: the EP stock's inverse RMS (MUFU.RSQ, subnormal input flushed)."""
    return Float32(_asm(T.f32(), [_ir(Float32(x), loc, ip)], "rsqrt.approx.ftz.f32 $0, $1;", "=f,f", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def rsqrt_approx_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """`rsqrt.approx.f32`: the TP stock's inverse RMS (subnormals kept)."""
    return Float32(_asm(T.f32(), [_ir(Float32(x), loc, ip)], "rsqrt.approx.f32 $0, $1;", "=f,f", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def ex2_approx_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """`ex2.approx.f32`: 2^x, approximate (MUFU.EX2 with range reduction)."""
    return Float32(_asm(T.f32(), [_ir(Float32(x), loc, ip)], "ex2.approx.f32 $0, $1;", "=f,f", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def ex2_approx_ftz_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """`ex2.approx.ftz.f32`: 2^x, approximate, one MUFU.EX2: a subnormal input counts as 0 and a
    result below 2^-126 is +0.0 (the non-ftz form adds a compare and two predicated multiplies
    around the MUFU to reach the subnormal results)."""
    return Float32(_asm(T.f32(), [_ir(Float32(x), loc, ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f", side_effects=False,
                        loc=loc, ip=ip))


@dsl_user_op
def rcp_approx_ftz_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """`rcp.approx.ftz.f32`: 1 / x, approximate (one MUFU.RCP; a subnormal input counts as 0). The
    seed of `kernels.division`'s correctly rounded quotients."""
    return Float32(_asm(T.f32(), [_ir(Float32(x), loc, ip)], "rcp.approx.ftz.f32 $0, $1;", "=f,f", side_effects=False,
                        loc=loc, ip=ip))


@dsl_user_op
def div_full_f32(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """`div.full.f32`: a / b to about 2 ulp (not IEEE division)."""
    return Float32(
        _asm(T.f32(), [_ir(Float32(a), loc, ip), _ir(Float32(b), loc, ip)], "div.full.f32 $0, $1, $2;", "=f,f,f", side_effects=False, loc=loc, ip=ip)
    )


# ---------------------------------------------------------------------------------------------
# Conversions.


@dsl_user_op
def cvt_rn_bf16x2_f32(high: Float32, low: Float32, *, loc=None, ip=None) -> Uint32:
    """`cvt.rn.bf16x2.f32 d, a, b`: d = bf16(a) << 16 | bf16(b), nearest even, subnormals kept.

    Operand order is PTX's: the FIRST operand lands in the HIGH half. A fragment's element 2j
    (lower address) therefore goes second: `cvt_rn_bf16x2_f32(v[2j + 1], v[2j])`.
    """
    return Uint32(
        _asm(
            T.i32(),
            [_ir(Float32(high), loc, ip), _ir(Float32(low), loc, ip)],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
            side_effects=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def bitcast_u32_to_f32(bits: Uint32, *, loc=None, ip=None) -> Float32:
    """Reinterpret 32 bits as binary32 (no instruction: a register rename)."""
    return Float32(llvm.bitcast(T.f32(), _ir(Uint32(bits), loc, ip), loc=loc, ip=ip))


# ---------------------------------------------------------------------------------------------
# Pure integer helpers (DSL Uint32 in a kernel, Python int in a test; results fit in 32 bits).


def _like(word, value: int):
    """`value` as the type of `word` when that is a DSL numeric, so a Uint32 expression stays
    32-bit (a Python int above 2^31 would promote it to Int64); otherwise the plain int (Python
    ints, or int64 torch tensors in tests, where every intermediate fits)."""
    return type(word)(value) if isinstance(word, Numeric) else value


def bf16x2_low_bits(word):
    """binary32 bits of the BF16 in the low half (element 2j): exact widening."""
    return (word & _like(word, BF16_HALF_MASK)) << _like(word, 16)


def bf16x2_high_bits(word):
    """binary32 bits of the BF16 in the high half (element 2j + 1): exact widening."""
    return word & _like(word, BF16_HIGH_MASK)


def has_negative_zero_u32(word):
    """Nonzero if either 16-bit half of `word` is 0x8000 (BF16 -0.0, the sentinel), else 0.

    SWAR zero-half test on x = word ^ 0x80008000 (three integer ops): a zero half sets its top bit
    in (x - 0x00010001) & ~x; a borrow out of a zero low half can also flag the high half, which
    only matters when the answer is already yes. Exact as a yes/no, not per half.
    """
    x = word ^ _like(word, SENTINEL_BF16X2)
    return (x - _like(word, LOW_HALF_ONES)) & (x ^ _like(word, U32_MASK)) & _like(word, SENTINEL_BF16X2)


def _half_is_sentinel(half, like):
    """1 if a 16-bit value equals 0x8000, else 0 (branch-free)."""
    difference = half ^ _like(like, SENTINEL_BF16)  # 0 exactly when the half is the sentinel
    return _like(like, 1) - ((difference + _like(like, BF16_HALF_MASK)) >> _like(like, 16))


def scrub_negative_zero_u32(word):
    """Clear each 16-bit half equal to 0x8000 (-0.0 -> +0.0); every other half unchanged."""
    low = _half_is_sentinel(word & _like(word, BF16_HALF_MASK), word)
    high = _half_is_sentinel(word >> _like(word, 16), word)
    clear = low * _like(word, BF16_HALF_MASK) + high * _like(word, BF16_HIGH_MASK)
    return word & (clear ^ _like(word, U32_MASK))


# ---------------------------------------------------------------------------------------------
# Routing additions (appended): the subtraction the stock's sigmoid starts with, and the
# register rename back from binary32.


@dsl_user_op
def sub_rn_f32(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """`sub.rn.f32`: a - b, one rounding, never contracted (`0 - x` is Triton's unary minus)."""
    return Float32(
        _asm(T.f32(), [_ir(Float32(a), loc, ip), _ir(Float32(b), loc, ip)], "sub.rn.f32 $0, $1, $2;", "=f,f,f", side_effects=False, loc=loc, ip=ip)
    )


@dsl_user_op
def bitcast_f32_to_u32(value: Float32, *, loc=None, ip=None) -> Uint32:
    """Reinterpret binary32 as 32 bits (no instruction: a register rename)."""
    return Uint32(llvm.bitcast(T.i32(), _ir(Float32(value), loc, ip), loc=loc, ip=ip))


# ---------------------------------------------------------------------------------------------
# TP tail additions (appended): cluster shared memory, the done counter, and the TP protocol's
# 32-bit-word sentinel (a word equal to 0x80008000 is "not arrived"; a lone -0.0 half is data).

F32_NEGATIVE_ZERO_BITS = 0x80000000
SENTINEL_TO_F32_NEGATIVE_ZERO = SENTINEL_BF16X2 ^ F32_NEGATIVE_ZERO_BITS  # 0x00008000


@dsl_user_op
def mapa_shared_cluster_u32(address: Int32, cta_rank: Int32, *, loc=None, ip=None) -> Int32:
    """`mapa.shared::cluster.u32`: the shared::cluster address of this CTA's shared-memory
    `address` in the cluster's CTA `cta_rank` (distributed shared memory, sm_90+)."""
    return Int32(
        _asm(
            T.i32(),
            [_ir(Int32(address), loc, ip), _ir(Int32(cta_rank), loc, ip)],
            "mapa.shared::cluster.u32 $0, $1, $2;",
            "=r,r,r",
            side_effects=False,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def st_shared_cluster_f32(address: Int32, value: Float32, *, loc=None, ip=None) -> None:
    """`st.shared::cluster.f32`: one binary32 into a cluster peer's shared memory (address from `mapa`)."""
    _asm(
        None,
        [_ir(Int32(address), loc, ip), _ir(Float32(value), loc, ip)],
        "st.shared::cluster.f32 [$0], $1;",
        "r,f",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def st_shared_cluster_u32(address: Int32, value: Uint32, *, loc=None, ip=None) -> None:
    """`st.shared::cluster.u32`: one word into a cluster peer's shared memory (address from `mapa`)."""
    _asm(
        None,
        [_ir(Int32(address), loc, ip), _ir(Uint32(value), loc, ip)],
        "st.shared::cluster.u32 [$0], $1;",
        "r,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


ATOMIC_ADD_ORDERS = ("acq_rel", "release")


@dsl_user_op
def atom_add_gpu_global_u32(address: Int64, value: Uint32, order: str, *, loc=None, ip=None) -> Uint32:
    """`atom.<order>.gpu.global.add.u32`: add, returning the old word; this thread's earlier
    accesses are ordered before it and, with `acq_rel`, its later ones after it (a done counter
    whose result the thread acts on at once). `release` leaves the later ones free: an arrival
    whose count only the last arriver acts on, later, behind `fence_acq_rel_gpu`."""
    if order not in ATOMIC_ADD_ORDERS:
        raise ValueError(f"order must be one of {ATOMIC_ADD_ORDERS}, got {order!r}")
    return Uint32(
        _asm(
            T.i32(),
            [_ir(Int64(address), loc, ip), _ir(Uint32(value), loc, ip)],
            f"atom.{order}.gpu.global.add.u32 $0, [$1], $2;",
            "=r,l,r",
            side_effects=True,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def fence_acq_rel_gpu(*, loc=None, ip=None) -> None:
    """`fence.acq_rel.gpu`: after a read that observed other threads' releases (an atomic's
    result), orders this thread's later accesses after everything those releases ordered."""
    _asm(None, [], "fence.acq_rel.gpu;", "", side_effects=True, loc=loc, ip=ip)


def is_sentinel_word_u32(word):
    """1 if the 32-bit word is the TP sentinel 0x80008000 (two BF16 -0.0), else 0 (branch-free:
    d | -d has its top bit set exactly when d != 0)."""
    difference = word ^ _like(word, SENTINEL_BF16X2)
    negated = (_like(word, U32_MASK) - difference + _like(word, 1)) & _like(word, U32_MASK)
    return _like(word, 1) - ((difference | negated) >> _like(word, 31))


def scrub_sentinel_word_u32(word):
    """0 where the word is the TP sentinel 0x80008000, the word itself otherwise (BF16 pairs)."""
    return word ^ (is_sentinel_word_u32(word) * _like(word, SENTINEL_BF16X2))


def encode_sentinel_word_f32(word):
    """binary32 bits safe to publish under the TP sentinel: 0x80008000 (-2^-134) becomes -0.0
    (0x80000000), every other word is unchanged. Both round to BF16 -0.0 (`cvt.rn.bf16.f32`:
    -2^-134 is the tie between -0.0 and -2^-133 and goes to the even -0.0), so a reader that
    rounds gets the publisher's BF16 bits."""
    return word ^ (is_sentinel_word_u32(word) * _like(word, SENTINEL_TO_F32_NEGATIVE_ZERO))


# ---------------------------------------------------------------------------------------------
# The attention front (attn2, qkv_front): warp mma, cp.async, shared and L2-only loads, exact
# division and square root.


@dsl_user_op
def mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
    a0: Uint32, a1: Uint32, a2: Uint32, a3: Uint32, b0: Uint32, b1: Uint32,
    c0: Float32, c1: Float32, c2: Float32, c3: Float32, *, loc=None, ip=None,
) -> tuple[Float32, Float32, Float32, Float32]:
    """`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: D = A B + C for one warp, A 16x16
    BF16 (row), B 16x8 BF16 (col), C and D 16x8 FP32. Fragments (lane = 4 g + t): a0 (row g,
    k 2t..2t+1), a1 (row g + 8, same k), a2 (row g, k 2t + 8..2t + 9), a3 (row g + 8, those k);
    b0 (k 2t..2t+1, column g), b1 (k 2t + 8..2t + 9, column g); c0, c1 (row g, columns 2t, 2t + 1),
    c2, c3 (row g + 8, the same columns); the lower k of a pair in the low 16 bits."""
    operands = [_ir(Uint32(v), loc, ip) for v in (a0, a1, a2, a3, b0, b1)]
    operands += [_ir(Float32(v), loc, ip) for v in (c0, c1, c2, c3)]
    struct = _asm(
        llvm.StructType.get_literal([T.f32()] * 4),
        operands,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        side_effects=False,
        loc=loc,
        ip=ip,
    )
    return tuple(Float32(llvm.extractvalue(T.f32(), struct, [i], loc=loc, ip=ip)) for i in range(4))  # type: ignore[return-value]


@dsl_user_op
def cp_async_bulk_prefetch_l2_global(global_address: Int64, size: int, *, loc=None, ip=None) -> None:
    """`cp.async.bulk.prefetch.L2.global [src], size`: a hint to bring `size` bytes (a multiple of
    16, 16-byte aligned) into L2; no data reaches the thread, nothing waits on it (sm_90+)."""
    _asm(
        None,
        [_ir(Int64(global_address), loc, ip)],
        f"cp.async.bulk.prefetch.L2.global [$0], {int(size)};",
        "l",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def cp_async_cg_shared_global_16(shared_address: Int32, global_address: Int64, source_bytes: Int32, *, loc=None,
                                 ip=None) -> None:
    """`cp.async.cg.shared.global [dst], [src], 16, src_size`: copy 16 bytes to shared memory
    through L2 only; bytes past `source_bytes` (0 or 16) are written as zeros and not read."""
    _asm(
        None,
        [_ir(Int32(shared_address), loc, ip), _ir(Int64(global_address), loc, ip), _ir(Int32(source_bytes), loc, ip)],
        "cp.async.cg.shared.global [$0], [$1], 16, $2;",
        "r,l,r",
        side_effects=True,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def ld_shared_u32(shared_address: Int32, *, loc=None, ip=None) -> Uint32:
    """`ld.shared.u32`: one word of this CTA's shared memory."""
    return Uint32(_asm(T.i32(), [_ir(Int32(shared_address), loc, ip)], "ld.shared.u32 $0, [$1];", "=r,r",
                       side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def ldmatrix_sync_aligned_m8n8_x4_shared_b16(shared_address: Int32, *, loc=None, ip=None
                                            ) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """`ldmatrix.sync.aligned.m8n8.x4.shared.b16`: four 8x8 matrices of 16-bit elements, one warp
    (every lane executes it). Lanes 8i .. 8i + 7 give the shared addresses (16-byte aligned) of
    matrix i's rows 0 .. 7, each row 16 contiguous bytes; result i is matrix i's word for this
    lane: row lane // 4, columns 2 (lane % 4) (low 16 bits) and 2 (lane % 4) + 1. Side effects,
    as `ld_shared_v4_u32`: a ring stage is refilled between two reads of one address."""
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_ir(Int32(shared_address), loc, ip)],
                  "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                  side_effects=True, loc=loc, ip=ip)
    return _four_u32(struct, loc, ip)


@dsl_user_op
def ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(shared_address: Int32, *, loc=None, ip=None
                                                  ) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """`ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`: as the non-transposed form (lanes
    8i .. 8i + 7 address matrix i's rows, 16 bytes each), but result i is the transpose's word:
    rows 2 (lane % 4) (low 16 bits) and 2 (lane % 4) + 1 of matrix i, column lane // 4. With
    rows = keys and columns = head dims this is an mma.sync B fragment of V (attn2's P V)."""
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_ir(Int32(shared_address), loc, ip)],
                  "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                  side_effects=True, loc=loc, ip=ip)
    return _four_u32(struct, loc, ip)


@dsl_user_op
def st_shared_u32(shared_address: Int32, value: Uint32, *, loc=None, ip=None) -> None:
    """`st.shared.u32`: one word of this CTA's shared memory."""
    _asm(None, [_ir(Int32(shared_address), loc, ip), _ir(Uint32(value), loc, ip)], "st.shared.u32 [$0], $1;", "r,r",
         side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def brev_b32(value: Uint32, *, loc=None, ip=None) -> Uint32:
    """`brev.b32`: the 32 bits of `value` in reverse order (bit i to bit 31 - i)."""
    return Uint32(_asm(T.i32(), [_ir(Uint32(value), loc, ip)], "brev.b32 $0, $1;", "=r,r", side_effects=False,
                       loc=loc, ip=ip))


@dsl_user_op
def ld_global_u32(address: Int64, *, loc=None, ip=None) -> Uint32:
    """`ld.global.u32`: one word, weak (data a finished kernel wrote)."""
    return Uint32(_asm(T.i32(), [_ir(Int64(address), loc, ip)], "ld.global.u32 $0, [$1];", "=r,l",
                       side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def ld_global_cg_v4_u32(address: Int64, *, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """`ld.global.cg.v4.u32`: 16 bytes from L2, never from this SM's L1 (which may hold a stale
    line of a workspace another CTA rewrote since)."""
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_ir(Int64(address), loc, ip)],
                  "ld.global.cg.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", side_effects=True, loc=loc, ip=ip)
    return _four_u32(struct, loc, ip)


@dsl_user_op
def st_global_v2_u32(address: Int64, w0: Uint32, w1: Uint32, *, loc=None, ip=None) -> None:
    """`st.global.v2.u32`: 8 bytes, weak."""
    _asm(None, [_ir(Int64(address), loc, ip), _ir(Uint32(w0), loc, ip), _ir(Uint32(w1), loc, ip)],
         "st.global.v2.u32 [$0], {$1, $2};", "l,r,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def prmt_b32(a: Uint32, b: Uint32, selector: int, *, loc=None, ip=None) -> Uint32:
    """`prmt.b32 d, a, b, selector`: bytes of d picked from {b, a} (a bytes 0-3, b bytes 4-7);
    0x5410 joins the low halves (a's low), 0x7632 the high halves (a's high low)."""
    return Uint32(_asm(T.i32(), [_ir(Uint32(a), loc, ip), _ir(Uint32(b), loc, ip)],
                       f"prmt.b32 $0, $1, $2, {int(selector):#x};", "=r,r,r", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def max_f32(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """`max.f32`: the larger (-inf loses to everything; no NaN reaches it on the contract's path)."""
    return Float32(_asm(T.f32(), [_ir(Float32(a), loc, ip), _ir(Float32(b), loc, ip)], "max.f32 $0, $1, $2;",
                        "=f,f,f", side_effects=False, loc=loc, ip=ip))


@dsl_user_op
def div_rn_f32(a: Float32, b: Float32, *, pinned: bool = False, loc=None, ip=None) -> Float32:
    """`div.rn.f32`: IEEE division, correctly rounded. `pinned` as `mul_rn_f32`'s: kept inside the
    branch it is written in (ptxas expands the division into a fast path and a call of its slow
    path, which a hoisted copy would run on every path)."""
    return Float32(_asm(T.f32(), [_ir(Float32(a), loc, ip), _ir(Float32(b), loc, ip)], "div.rn.f32 $0, $1, $2;",
                        "=f,f,f", side_effects=bool(pinned), loc=loc, ip=ip))


@dsl_user_op
def sqrt_rn_f32(x: Float32, *, loc=None, ip=None) -> Float32:
    """`sqrt.rn.f32`: IEEE square root, correctly rounded."""
    return Float32(_asm(T.f32(), [_ir(Float32(x), loc, ip)], "sqrt.rn.f32 $0, $1;", "=f,f", side_effects=False,
                        loc=loc, ip=ip))


# ---------------------------------------------------------------------------------------------
# qkv_front's cp.async ring: 16-byte reads of this CTA's shared memory.


@dsl_user_op
def ld_shared_v4_u32(shared_address: Int32, *, loc=None, ip=None) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """`ld.shared.v4.u32`: 16 bytes (16-byte aligned) of this CTA's shared memory. Side effects:
    a ring slot is refilled between two reads of one address, so the reads must neither merge nor
    cross a barrier."""
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_ir(Int32(shared_address), loc, ip)],
                  "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", side_effects=True, loc=loc, ip=ip)
    return _four_u32(struct, loc, ip)


@dsl_user_op
def st_shared_v4_u32(shared_address: Int32, w0: Uint32, w1: Uint32, w2: Uint32, w3: Uint32, *, loc=None,
                     ip=None) -> None:
    """`st.shared.v4.u32`: 16 bytes (16-byte aligned) of this CTA's shared memory (attn2's combine
    tree, the QKV front's prologue x rows under PDL)."""
    _asm(None, [_ir(Int32(shared_address), loc, ip)] + [_ir(Uint32(w), loc, ip) for w in (w0, w1, w2, w3)],
         "st.shared.v4.u32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", side_effects=True, loc=loc, ip=ip)


# ---------------------------------------------------------------------------------------------
# Warp votes.


@dsl_user_op
def vote_sync_all_pred(pred, *, loc=None, ip=None):
    """`vote.sync.all.pred` over the full warp (mask 0xffffffff): True in every lane iff `pred`
    (a DSL Boolean) is True in every lane; every lane of the warp must execute it. attn2 skips
    its warp's rescale of O when every alpha of the warp is exactly 1."""
    return cute.arch.vote_all_sync(pred, loc=loc, ip=ip)


@dsl_user_op
def ld_global_s64(address: Int64, *, loc=None, ip=None) -> Int64:
    """`ld.global.s64`: one int64, weak. Side effects: the load stays where the kernel issues it
    (early, so its latency hides behind later work), never sunk to its first use."""
    return Int64(_asm(T.i64(), [_ir(Int64(address), loc, ip)], "ld.global.s64 $0, [$1];", "=l,l", side_effects=True,
                      loc=loc, ip=ip))


# ---------------------------------------------------------------------------------------------
# wgmma (sm_90a): one warpgroup (4 warps, 128 threads) issues one asynchronous MMA, M = 64.
#
# Ordering. A wgmma reads its A registers and its accumulators when it is issued, writes the
# accumulators at some point before the `wgmma.wait_group` that covers its commit group, and reads
# B from shared memory through the async proxy. What keeps each step in place:
# - LLVM: every wrapper here has side effects, so none moves across another, across a barrier or
#   across a shared-memory access (the MMAs read shared memory: they must stay after the
#   `fence.proxy.async` and the barrier that publish the operands). The accumulators are outputs
#   of the MMA's asm and of the wait's asm (`wgmma_wait_group_sync_aligned` takes them and gives
#   them back through tied operands): a read of an accumulator is data-dependent on the wait, so
#   LLVM cannot move it above the wait, and an instruction that reads the MMA's outputs only feeds
#   the wait or the next MMA of the chain.
# - ptxas: it knows wgmma's semantics (it inserts its own waits where a register in flight is
#   touched, and warns "wgmma serialization" when it has to); `wgmma.fence.sync.aligned` before the
#   first MMA of a chain orders the earlier register writes (the A fragments, zeroed accumulators)
#   before the MMA's reads. The fence, like the wait, passes the registers it guards through tied
#   operands: LLVM materialises a zeroed accumulator (`mov.b32 %r, 0`) right before its first use,
#   which without the tie is between the fence and the MMA.

WGMMA_SCALE_D = (0, 1)  # 0: D = A B (the accumulators in are not read); 1: D = A B + D
WGMMA_TRANSPOSE_B = (0, 1)  # 0: B K-major; 1: B MN-major (N contiguous)


@dsl_user_op
def wgmma_fence_sync_aligned(values: list = (), *, loc=None, ip=None) -> list:
    """`wgmma.fence.sync.aligned`: orders this warpgroup's earlier register accesses (A fragments,
    accumulators) before the following `wgmma.mma_async`s read them; every thread of the warpgroup
    executes it. `values` (Float32 accumulators, Uint32 A-fragment words; may be empty) pass through
    the asm as tied operands and come back as new values, which the MMAs then take: whatever
    defines them (a zeroed accumulator's `mov`) is emitted before the fence, never between it and
    the MMA (the ISA forbids touching those registers there)."""
    values = list(values)
    text = "wgmma.fence.sync.aligned;"
    if not values:
        _asm(None, [], text, "", side_effects=True, loc=loc, ip=ip)
        return []
    floats = [isinstance(v, Float32) for v in values]
    operands = [_ir(Float32(v) if f else Uint32(v), loc, ip) for v, f in zip(values, floats)]
    constraints = ",".join(["=f" if f else "=r" for f in floats] + [str(i) for i in range(len(values))])
    types = [T.f32() if f else T.i32() for f in floats]
    result = _asm(types[0] if len(values) == 1 else llvm.StructType.get_literal(types), operands, text, constraints,
                  side_effects=True, loc=loc, ip=ip)
    if len(values) == 1:
        return [Float32(result) if floats[0] else Uint32(result)]
    return [(Float32 if f else Uint32)(llvm.extractvalue(t, result, [i], loc=loc, ip=ip))
            for i, (f, t) in enumerate(zip(floats, types))]


@dsl_user_op
def wgmma_commit_group_sync_aligned(*, loc=None, ip=None) -> None:
    """`wgmma.commit_group.sync.aligned`: closes a group of the warpgroup's issued MMAs (the unit
    `wgmma_wait_group_sync_aligned` waits for)."""
    _asm(None, [], "wgmma.commit_group.sync.aligned;", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def wgmma_wait_group_sync_aligned(pending: int, accumulators: list, *, loc=None, ip=None) -> list:
    """`wgmma.wait_group.sync.aligned pending`: waits until at most `pending` commit groups of the
    warpgroup are in flight. `accumulators` (Float32 values, any number, may be empty) pass through
    the asm as tied operands and come back as new values: the only way to read an MMA's result is
    through this wait, so no read of it can be scheduled above it."""
    pending = int(pending)
    if pending < 0 or pending > 7:
        raise ValueError(f"wgmma.wait_group takes 0..7 pending groups, got {pending}")
    text = f"wgmma.wait_group.sync.aligned {pending};"
    n = len(accumulators)
    if n == 0:
        _asm(None, [], text, "", side_effects=True, loc=loc, ip=ip)
        return []
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)])
    result_type = T.f32() if n == 1 else llvm.StructType.get_literal([T.f32()] * n)
    value = _asm(result_type, [_ir(Float32(v), loc, ip) for v in accumulators], text, constraints, side_effects=True,
                 loc=loc, ip=ip)
    if n == 1:
        return [Float32(value)]
    return [Float32(llvm.extractvalue(T.f32(), value, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def fence_proxy_async_shared_cta(*, loc=None, ip=None) -> None:
    """`fence.proxy.async.shared::cta`: this thread's earlier generic-proxy writes to shared memory
    (st.shared, completed cp.async) become visible to later async-proxy reads (wgmma's descriptor
    reads of B). Each writing thread fences, then the CTA barrier publishes to the warpgroup."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "", side_effects=True, loc=loc, ip=ip)


def _wgmma_rs_bf16(n: int, a: tuple, b_descriptor, accumulators, scale_d: int, transpose_b: int, loc, ip) -> list:
    """`wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 d, {a}, b-desc, p, 1, 1, trans-b`
    with A from registers; n / 2 accumulators per thread."""
    if scale_d not in WGMMA_SCALE_D or transpose_b not in WGMMA_TRANSPOSE_B:
        raise ValueError(f"scale_d and transpose_b are 0 or 1, got {scale_d!r}, {transpose_b!r}")
    count = n // 2
    if len(a) != 4:
        raise ValueError(f"an A fragment is 4 words, got {len(a)}")
    d = ", ".join(f"${i}" for i in range(count))
    a_ops = ", ".join(f"${count + i}" for i in range(4))
    desc = f"${count + 4}"
    # scale-d is a predicate operand: fixed at compile time here, set from an immediate
    text = (f"{{\n.reg .pred p;\nsetp.ne.b32 p, {int(scale_d)}, 0;\n"
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{d}}}, {{{a_ops}}}, {desc}, p, 1, 1, "
            f"{int(transpose_b)};\n}}")
    operands = [_ir(Uint32(w), loc, ip) for w in a] + [_ir(Int64(b_descriptor), loc, ip)]
    constraints = ["=f"] * count + ["r"] * 4 + ["l"]
    if scale_d:
        if len(accumulators) != count:
            raise ValueError(f"m64n{n}k16 takes {count} accumulators, got {len(accumulators)}")
        operands += [_ir(Float32(v), loc, ip) for v in accumulators]
        constraints += [str(i) for i in range(count)]  # tied: D is read and written in place
    elif accumulators is not None:
        raise ValueError("scale_d = 0 reads no accumulators: pass None")
    struct = _asm(llvm.StructType.get_literal([T.f32()] * count), operands, text, ",".join(constraints),
                  side_effects=True, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), struct, [i], loc=loc, ip=ip)) for i in range(count)]


@dsl_user_op
def wgmma_mma_async_sync_aligned_m64n16k16_f32_bf16_bf16(
    a: tuple, b_descriptor: Int64, accumulators, scale_d: int, transpose_b: int, *, loc=None, ip=None,
) -> list:
    """`wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16`, A from registers: D (64 x 16 FP32) =
    A (64 x 16 BF16) B (16 x 16 BF16, shared memory by `b_descriptor`, `kernels.gmma`) [+ D].

    Warp w of the warpgroup holds rows 16 w .. 16 w + 15; within the warp A is mma.sync
    m16n8k16's A fragment (`a` = a0..a3, lane 4 g + t: a0 row g k 2t.., a1 row g + 8, a2 row g
    k 2t + 8.., a3 row g + 8) and the 8 accumulators are two m16n8 C fragments: d[4 j + i] for
    columns 8 j .. 8 j + 7 (i = 0, 1: row g, columns 8 j + 2t, + 1; i = 2, 3: row g + 8).
    `scale_d` 0: D = A B (`accumulators` None); 1: D = A B + `accumulators`. `transpose_b`
    (compile time): 0 K-major B, 1 N-major. Asynchronous: the results are defined only after the
    commit and `wgmma_wait_group_sync_aligned` (through which they must be read)."""
    return _wgmma_rs_bf16(16, tuple(a), b_descriptor, accumulators, scale_d, transpose_b, loc, ip)


@dsl_user_op
def wgmma_mma_async_sync_aligned_m64n72k16_f32_bf16_bf16(
    a: tuple, b_descriptor: Int64, accumulators, scale_d: int, transpose_b: int, *, loc=None, ip=None,
) -> list:
    """`wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16`, A from registers: D (64 x 72 FP32) =
    A (64 x 16 BF16) B (16 x 72 BF16 by `b_descriptor`) [+ D], 36 accumulators: d[4 j + i] for
    columns 8 j .. 8 j + 7, j = 0 .. 8 (attn2: V's 64 dims, then an n-tile of ones)."""
    return _wgmma_rs_bf16(72, tuple(a), b_descriptor, accumulators, scale_d, transpose_b, loc, ip)


@dsl_user_op
def wgmma_mma_async_sync_aligned_m64n64k16_f32_bf16_bf16(
    a: tuple, b_descriptor: Int64, accumulators, scale_d: int, transpose_b: int, *, loc=None, ip=None,
) -> list:
    """`wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16`, A from registers: D (64 x 64 FP32) =
    A (64 x 16 BF16) B (16 x 64 BF16 by `b_descriptor`) [+ D]. The fragments as for m64n16k16, with
    32 accumulators: d[4 j + i] for columns 8 j .. 8 j + 7, j = 0 .. 7."""
    return _wgmma_rs_bf16(64, tuple(a), b_descriptor, accumulators, scale_d, transpose_b, loc, ip)
