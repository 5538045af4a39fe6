"""The TP tail kernel compiles for sm_90a and sm_100a (no GPU needed), and its PTX says so.

Every variant is compiled with fake tensors and its PTX read back (the PTX reader is the EP
tail test's). What the PTX must show, per variant:

- bounded waits: every loop holding an `ld.volatile` reads `%globaltimer`; the route polls are
  8 * tp 16-byte volatile loads (the own rank's row included), the token poll 1 (BF16 copy) or 2
  (FP32 copy); one `atom.cas` per poll site claims the fault record;
- PDL: `griddepcontrol.wait` and `.launch_dependents` once each exactly when enabled;
- rounding: every binary32 add/mul/fma is the explicit `.rn` form, nothing is `.ftz` (the only
  approximate instruction is `rsqrt.approx.f32`, the TP stock's, subnormals kept), no packed f32x2;
- the arithmetic, counted: rank sums 64 * tp adds in chains of tp from +0.0 in rank order, traced
  to the polled mailbox slots; the sum of squares 8 chains of 8 `fma` from +0.0; the butterfly and
  the band combine of split S; the rsqrt argument `fma(Q, 2^-12, f32(eps))`; and the combine:
  fma-chain 8 chains of 8 `fma` from +0.0, rounded-products 64 `mul` + 64 `add` in chains of 8
  from +0.0 and no combine `fma`, owner-partials 8 * 8 / KO chains of KO `fma` then chains of
  8 / KO `add` from +0.0;
- distributed shared memory (`mapa.shared::cluster`, `st.shared::cluster`, cluster barriers)
  exactly when S > 1;
- transport: 8 pushes (`st.relaxed.sys`) and (tp - 1) publishes of 1 or 2 vectors (unicast), or
  1 or 2 `multimem.st` (`.v4.bf16x2` scrubbed BF16 rows, `.v4.f32` FP32 rows) and no peer-address
  load (multicast), `multimem` nowhere else; the re-arm stores exactly what the polls read; the
  generation is advanced once (`atom.acq_rel` counter);
- the same bits on both transports: the multicast and unicast kernels of a variant have the same
  arithmetic trace (the EP test's `arithmetic_trace`), only the publishing stores differ.

Compile times (this CPU host, 2 cores, CuTe DSL 4.8.1): 0.5-1 s per variant for tp <= 8, about
4 s at tp 32. The grid below: the core matrix (every split x combine x tp on one target, both
norm orders alternating), the stock's decode paths on both targets with both weight dtypes and
norm orders, and PDL off.
"""

from __future__ import annotations

import functools
import tempfile

import pytest

from tests._ptxas import assemble, assert_no_spills
import torch

pytest.importorskip("cutlass")

from musebench.comm import protocol  # noqa: E402
from musebench.kernels import ptx as ptx_module  # noqa: E402
from musebench.kernels import tp_tail  # noqa: E402
from musebench.stock import tp as stock_tp  # noqa: E402
from tests.kernels.test_ep_tail_compile import (  # noqa: E402
    Origins,
    _operands,
    _ptx_text,
    arithmetic_trace,
    assert_bounded_polling,
    assert_rounding_is_explicit,
    chains,
    count,
    instructions,
    loops,
    opcodes,
)

ARCHS = ("sm_90a", "sm_100a")
TPS = (2, 3, 4, 8, 32)  # smallest, odd (extension), the stock's 4 and 8, the largest
SPLITS = tp_tail.SPLITS
CAPACITY = 8
NSM = 132  # H200
H, K, VEC = tp_tail.H_DIM, tp_tail.TOP_K, tp_tail.VEC
EPS_BITS, INV_WIDTH_BITS, ONE_BITS = 0x322BCC77, 0x39800000, 0x3F800000
SENTINEL_I32 = protocol.SENTINEL_BF16X2  # how Origins reads the immediate back (32-bit)
ROUTE_STRIDE = H * 2
SOURCE_STRIDE = CAPACITY * K * H * 2

_DUMP = tempfile.mkdtemp(prefix="musebench-tp-ptx-")


def variant_for(m: int, tp: int, nsm: int = NSM) -> tp_tail.TpVariant:
    """The kernel's knobs for the stock's path at (m, tp, nsm): the host helper the harness uses."""
    return tp_tail.TpVariant.from_path(stock_tp.tp_stock_path(m, tp, nsm))


@functools.lru_cache(maxsize=None)
def tp_ptx(arch: str, tp: int, variant: tp_tail.TpVariant, weight_dtype: str, before: bool, pdl: bool = True,
           transport: str = tp_tail.UNICAST) -> str:
    compiled = tp_tail.compile_tp_tail(
        tp=tp, capacity=CAPACITY, token_width=2 * H, variant=variant, weight_before_norm=before,
        weight_dtype=weight_dtype, eps=1e-8, gain_center=1.0, timeout_ns=1_000_000_000, enable_pdl=pdl,
        transport=transport, arch=arch, ptx_dir=_DUMP,
    )
    return _ptx_text(compiled)


def _variants_of(tp: int) -> list[tp_tail.TpVariant]:
    """Every combine this tp can take, at every split: the stock's where tp | 8, else the extension."""
    found = []
    for split in SPLITS:
        found.append(tp_tail.TpVariant(split, tp_tail.FMA_CHAIN, 0, tp_tail.SCRUBBED))  # single launch / extension
        if K % tp == 0:
            found.append(tp_tail.TpVariant(split, tp_tail.OWNER_PARTIALS, K // tp, tp_tail.EXACT))
            found.append(tp_tail.TpVariant(split, tp_tail.ROUNDED_PRODUCTS, 0, tp_tail.SCRUBBED))
    found.append(tp_tail.TpVariant(1, tp_tail.FMA_CHAIN, 0, tp_tail.EXACT))  # chunked delivery
    return found


def _label(v: tp_tail.TpVariant) -> str:
    group = f"-ko{v.group}" if v.group else ""
    return f"S{v.split}-{v.combine}{group}-{v.delivery}"


# Core matrix: every (tp, split, combine) on one target, norm order alternating; sm_90a (H200,
# where it runs) and sm_100a (the stock's target) take the tp values in turn.
CORE = [
    pytest.param(ARCHS[i % 2], tp, v, "bf16", bool(j % 2), id=f"{ARCHS[i % 2]}-tp{tp}-{_label(v)}")
    for i, tp in enumerate(TPS)
    for j, v in enumerate(_variants_of(tp))
]

# The stock's decode paths (H200, nsm 132): expert-owner S16 KO 4/2/1, token-owner XP = P, the
# extension at tp 3, on both targets, both weight dtypes and norm orders.
DECODE = [(2, 1), (4, 8), (4, 9), (8, 7), (8, 8), (3, 4)]
DECODE_GRID = [
    pytest.param(arch, tp, variant_for(m, tp), dtype, before,
                 id=f"{arch}-tp{tp}-m{m}-{_label(variant_for(m, tp))}-{dtype}-{'before' if before else 'after'}")
    for arch in ARCHS
    for tp, m in DECODE
    for dtype in ("bf16", "fp32")
    for before in (True, False)
]


def _f32_ops(ptx: str, opcode: str) -> list[list[str]]:
    return [_operands(line) for line in instructions(ptx) if not line.endswith(":") and line.split()[0] == opcode]


def check_variant(ptx: str, tp: int, v: tp_tail.TpVariant, before: bool, transport: str = tp_tail.UNICAST) -> None:
    ops = opcodes(ptx)
    multicast = transport == tp_tail.MULTICAST
    origins = Origins(ptx)
    exact = v.delivery == tp_tail.EXACT
    copy_vectors = 2 if exact else 1
    batches = len(tp_tail.poll_batches(tp, v.split))

    # PDL, once each.
    assert count(ptx, "griddepcontrol.wait") == 1 and count(ptx, "griddepcontrol.launch_dependents") == 1

    # Bounded waits: every polling loop reads the timer; one loop per route batch and the token poll.
    assert_bounded_polling(ptx)
    polling = [body for body in loops(ptx) if any("ld.volatile" in line for line in body)]
    assert len(polling) == batches + 1
    assert count(ptx, "ld.volatile.global.v4.u32") == K * tp + copy_vectors
    assert count(ptx, "ld.volatile.global.u32") == 1  # the generation word
    assert count(ptx, "atom.relaxed.gpu.global.cas.b32") == batches + 1
    assert count(ptx, "atom.acq_rel.gpu.global.add.u32") == 1

    # Latency: the 8 route rows are loaded (gamma's, 16 bytes, first) before the first push, the
    # route weights before the first poll, and the tp - 1 peer addresses in one batch before the
    # first publish (not one load per route or peer in front of each store).
    first_push = ops.index("st.relaxed.sys.global.v4.u32")
    assert ops[:first_push].count("ld.global.v4.u32") == 1 + K and ops.count("ld.global.v4.u32") == 1 + K
    first_poll = ops.index("ld.volatile.global.v4.u32")
    scalar_loads = ("ld.global.b16", "ld.global.b32")  # route indices (b32) and weights (b16 or b32)
    assert sum(ops[:first_poll].count(op) for op in scalar_loads) == 2 * K == sum(ops.count(op) for op in scalar_loads)
    pushes = [i for i, op in enumerate(ops) if op == "st.relaxed.sys.global.v4.u32"]
    if multicast:  # the owner's route-mailbox address alone; the token peer table is not read
        assert len(pushes) == K and count(ptx, "ld.global.b64") == 1
    else:
        first_publish = pushes[K]
        peer_loads = [i for i, op in enumerate(ops) if op == "ld.global.b64" and pushes[K - 1] < i < first_publish]
        assert len(peer_loads) >= tp - 1, "every peer's address is loaded before the first publish"

    # Transport: 8 pushes, tp - 1 publishes or 1 multicast store per vector; re-arm exactly the
    # words polled.
    multimem = "multimem.st.relaxed.sys.global.v4." + ("f32" if exact else "bf16x2")
    if multicast:
        assert count(ptx, "st.relaxed.sys.global.v4.u32") == K and count(ptx, multimem) == copy_vectors
        assert {op for op in ops if op.startswith("multimem")} == {multimem}
        assert ops.index(multimem) > max(pushes) and ops.index(multimem) > ops.index("cvt.rn.bf16x2.f32")
    else:
        assert count(ptx, "st.relaxed.sys.global.v4.u32") == K + (tp - 1) * copy_vectors
        assert not any(op.startswith("multimem") for op in ops)
    assert not any(op.startswith("fence.proxy") for op in ops)  # nothing on the owner reads its own row
    rearm = [line for line in instructions(ptx) if line.startswith("st.global.v4.u32")
             and all(origins.value(reg.strip()) == SENTINEL_I32 for reg in _operands(line)[1].strip("{}").split(","))]
    assert len(rearm) == K * tp + copy_vectors

    # Rounding points.
    assert_rounding_is_explicit(ptx, approximate={"rsqrt.approx.f32"})
    assert not any(".ftz" in op for op in ops)
    assert count(ptx, "rsqrt.approx.f32") == 1
    assert not any(op.startswith(("div.", "rcp.", "ex2.", "sqrt.")) for op in ops)

    # Distributed shared memory exactly when the row is split over a cluster.
    dsmem = {op for op in ops if "shared::cluster" in op or op.startswith("barrier.cluster")}
    if v.split == 1:
        assert dsmem == set()
    else:
        assert count(ptx, "mapa.shared::cluster.u32") == 2 * v.split
        assert count(ptx, "st.shared::cluster.f32") == v.split and count(ptx, "st.shared::cluster.u32") == v.split
        assert {"barrier.cluster.arrive.relaxed", "barrier.cluster.arrive", "barrier.cluster.wait"} <= dsmem

    # Counts of every rounding step (one thread: 8 columns, 8 routes).
    combine_fma = {tp_tail.FMA_CHAIN: 64, tp_tail.OWNER_PARTIALS: 64, tp_tail.ROUNDED_PRODUCTS: 0}[v.combine]
    combine_mul = 64 if v.combine == tp_tail.ROUNDED_PRODUCTS else 0
    combine_add = {tp_tail.FMA_CHAIN: 0, tp_tail.ROUNDED_PRODUCTS: 64,
                   tp_tail.OWNER_PARTIALS: VEC * (K // max(v.group, 1))}[v.combine]
    finish = 5 if v.split == 1 else 16 // v.split + v.split  # S = 1: butterfly over warps; else warp chain + band chain
    assert count(ptx, "fma.rn.f32") == 64 + 1 + combine_fma
    assert count(ptx, "mul.rn.f32") == 128 + combine_mul
    assert count(ptx, "add.rn.f32") == VEC + 64 * tp + 40 + finish + combine_add
    assert count(ptx, "cvt.rn.bf16x2.f32") == 32 + 4 + (4 if exact else 0)

    # Gains: f32(gamma) + 1.0, one add per column.
    adds = _f32_ops(ptx, "add.rn.f32")
    assert sum(1 for a in adds if origins.value(a[2]) == ONE_BITS) == VEC

    # The rsqrt argument: fma(Q, 2^-12, f32(1e-8)).
    fmas = _f32_ops(ptx, "fma.rn.f32")
    inv = [a for a in fmas if origins.value(a[2]) == INV_WIDTH_BITS and origins.value(a[3]) == EPS_BITS]
    assert len(inv) == 1

    # Rank sums: 64 chains of tp adds from +0.0, rank order, one element and route each.
    sums = chains(ptx, "add.rn.f32", link=1, where=lambda a: a[2] in origins.half)
    assert len(sums) == 64
    seen = set()
    for chain in sums:
        assert len(chain) == tp and origins.value(chain[0][1]) == 0, "a rank sum starts from +0.0"
        placed = [origins.half[a[2]] for a in chain]
        offsets = [offset for _, offset, _, _ in placed]
        route = offsets[0] // ROUTE_STRIDE
        assert offsets == [route * ROUTE_STRIDE + s * SOURCE_STRIDE for s in range(tp)], "ranks must be added in order"
        elements = {2 * word + half for _, _, word, half in placed}
        assert len(elements) == 1
        seen.add((route, elements.pop()))
    assert seen == {(k, e) for k in range(K) for e in range(VEC)}

    # Sum of squares: 8 chains of 8 fma from +0.0.
    squares = chains(ptx, "fma.rn.f32", link=3, where=lambda a: a[1] == a[2])
    assert len(squares) == K
    assert all(len(c) == VEC and origins.value(c[0][3]) == 0 for c in squares)

    # The combine's shape.
    weighted = chains(ptx, "fma.rn.f32", link=3, where=lambda a: a[1] != a[2] and a not in inv)
    if v.combine == tp_tail.FMA_CHAIN:
        assert len(weighted) == VEC and all(len(c) == K and origins.value(c[0][3]) == 0 for c in weighted)
        assert len({tuple(a[1] for a in c) for c in weighted}) == 1, "every column weighs routes 0..7 in one order"
    elif v.combine == tp_tail.OWNER_PARTIALS:
        assert len(weighted) == VEC * K // v.group and all(len(c) == v.group and origins.value(c[0][3]) == 0 for c in weighted)
        ends = {c[-1][0] for c in weighted}
        owner_sums = chains(ptx, "add.rn.f32", link=1, where=lambda a: a[2] in ends)
        assert len(owner_sums) == VEC and all(len(c) == K // v.group and origins.value(c[0][1]) == 0 for c in owner_sums)
    else:
        assert weighted == []
        products = {a[0] for a in _f32_ops(ptx, "mul.rn.f32")}
        combine = chains(ptx, "add.rn.f32", link=1, where=lambda a: a[2] in products)
        assert len(combine) == VEC and all(len(c) == K and origins.value(c[0][1]) == 0 for c in combine)


@pytest.mark.parametrize("arch, tp, variant, weight_dtype, before", CORE)
def test_core_variants(arch, tp, variant, weight_dtype, before):
    check_variant(tp_ptx(arch, tp, variant, weight_dtype, before), tp, variant, before)


@pytest.mark.parametrize("arch, tp, variant, weight_dtype, before", DECODE_GRID)
def test_stock_decode_paths(arch, tp, variant, weight_dtype, before):
    ptx = tp_ptx(arch, tp, variant, weight_dtype, before)
    check_variant(ptx, tp, variant, before)
    weight_loads = count(ptx, "ld.global.b16") if weight_dtype == "bf16" else count(ptx, "ld.global.b32")
    assert weight_loads >= K  # the route weights, read by the owner in its own dtype
    if weight_dtype == "bf16":
        assert count(ptx, "cvt.f32.bf16") == K  # exact widening


def test_decode_paths_are_the_stock_dispatch():
    """The decode grid covers expert-owner KO 4/2/1, token-owner XP = P and the extension."""
    labels = {(tp, m): _label(variant_for(m, tp)) for tp, m in DECODE}
    assert labels == {
        (2, 1): "S16-owner-partials-ko4-exact",
        (4, 8): "S16-owner-partials-ko2-exact",
        (4, 9): "S8-owner-partials-ko2-exact",
        (8, 7): "S16-owner-partials-ko1-exact",
        (8, 8): "S16-rounded-products-scrubbed",
        (3, 4): "S16-fma-chain-scrubbed",
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_combines_differ_in_instruction_counts(arch):
    fma_chain = tp_ptx(arch, 8, tp_tail.TpVariant(16, tp_tail.FMA_CHAIN, 0, tp_tail.SCRUBBED), "bf16", True)
    rounded = tp_ptx(arch, 8, tp_tail.TpVariant(16, tp_tail.ROUNDED_PRODUCTS, 0, tp_tail.SCRUBBED), "bf16", True)
    assert count(fma_chain, "fma.rn.f32") - count(rounded, "fma.rn.f32") == 64
    assert count(rounded, "mul.rn.f32") - count(fma_chain, "mul.rn.f32") == 64
    assert count(rounded, "add.rn.f32") - count(fma_chain, "add.rn.f32") == 64


@pytest.mark.parametrize("arch", ARCHS)
def test_without_pdl_there_is_no_griddepcontrol(arch):
    ptx = tp_ptx(arch, 4, variant_for(3, 4), "bf16", True, pdl=False)
    assert not any(op.startswith("griddepcontrol") for op in opcodes(ptx))
    assert_bounded_polling(ptx)


@pytest.mark.parametrize("transport", [tp_tail.UNICAST, tp_tail.MULTICAST])
@pytest.mark.parametrize("tp, variant", [
    (32, tp_tail.TpVariant(1, tp_tail.FMA_CHAIN, 0, tp_tail.EXACT)),  # 512 threads: at most 128 registers
    (8, tp_tail.TpVariant(2, tp_tail.ROUNDED_PRODUCTS, 0, tp_tail.SCRUBBED)),
    (2, variant_for(1, 2)),
], ids=["tp32-S1", "tp8-S2", "tp2-S16"])
def test_ptxas_assembles_without_spills(tp, variant, transport, tmp_path):
    assert_no_spills(assemble(tp_ptx("sm_90a", tp, variant, "bf16", False, transport=transport), "sm_90a", tmp_path,
                              "tp_tail"))


# Multicast: the stock's decode paths (both deliveries, every combine) and the S = 1 chunked
# delivery, on both targets.
MULTICAST_GRID = [
    pytest.param(arch, tp, v, dtype, before, id=f"{arch}-tp{tp}-{_label(v)}-{dtype}-{'before' if before else 'after'}")
    for arch in ARCHS
    for (tp, v), dtype, before in [
        ((2, variant_for(1, 2)), "bf16", True),  # expert-owner KO 4, EXACT
        ((4, variant_for(9, 4)), "fp32", False),  # expert-owner KO 2 at S 8
        ((8, variant_for(8, 8)), "bf16", False),  # token-owner XP = P, SCRUBBED
        ((3, variant_for(4, 3)), "fp32", True),  # the extension: fma chain, SCRUBBED
        ((32, tp_tail.TpVariant(1, tp_tail.FMA_CHAIN, 0, tp_tail.EXACT)), "bf16", True),  # chunked
    ]
]


@pytest.mark.parametrize("arch, tp, variant, weight_dtype, before", MULTICAST_GRID)
def test_multicast_variants(arch, tp, variant, weight_dtype, before):
    """Every check of the unicast kernel holds, with one multimem store per vector for the publish."""
    multicast = tp_ptx(arch, tp, variant, weight_dtype, before, transport=tp_tail.MULTICAST)
    check_variant(multicast, tp, variant, before, transport=tp_tail.MULTICAST)


@pytest.mark.parametrize("arch, tp, variant, weight_dtype, before", MULTICAST_GRID)
def test_multicast_and_unicast_compute_the_same_and_differ_in_the_stores(arch, tp, variant, weight_dtype, before):
    """The bitwise argument in the emitted code: the same arithmetic on the same operands in the
    same order, the same payloads published (once by multicast, to every peer by unicast)."""
    unicast = tp_ptx(arch, tp, variant, weight_dtype, before)
    multicast = tp_ptx(arch, tp, variant, weight_dtype, before, transport=tp_tail.MULTICAST)
    trace = arithmetic_trace(unicast)
    publishes = sum(entry.startswith("publish ") for entry in trace)
    assert publishes == K + (2 if variant.delivery == tp_tail.EXACT else 1)  # the route pushes, the row
    assert arithmetic_trace(multicast) == trace


def test_the_transport_is_a_compile_time_knob_of_its_own():
    with pytest.raises(ValueError, match="transport must be one of"):
        tp_tail._TpTailKernel(tp=2, capacity=8, token_width=2 * H, split=16, combine=tp_tail.FMA_CHAIN, group=0,
                              delivery=tp_tail.SCRUBBED, weight_before_norm=True, weight_dtype="bf16", eps=1e-8,
                              gain_center=1.0, timeout_ns=1000, enable_pdl=True, transport="nvshmem")
    v = variant_for(8, 8)
    knobs = dict(tp=8, capacity=CAPACITY, token_width=2 * H, variant=v, weight_before_norm=True, weight_dtype="bf16",
                 eps=1e-8, gain_center=1.0, arch="sm_90a")
    assert tp_tail.compile_tp_tail(**knobs) is not tp_tail.compile_tp_tail(**knobs, transport=tp_tail.MULTICAST)


# ---------------------------------------------------------------------------------------------
# Host-side pieces (no compilation).


def test_variant_from_every_stock_path():
    for tp in (2, 3, 4, 8, 16, 32):
        for m in range(1, 300):
            path = stock_tp.tp_stock_path(m, tp, NSM)
            v = tp_tail.TpVariant.from_path(path)
            assert v.split == path.split and v.combine == path.combine
            assert v.delivery == (tp_tail.SCRUBBED if path.scrubbed_copies else tp_tail.EXACT)
            assert v.group == (path.experts_per_owner if path.combine == tp_tail.OWNER_PARTIALS else 0)


def test_variant_validation():
    with pytest.raises(ValueError, match="split"):
        tp_tail.TpVariant(3, tp_tail.FMA_CHAIN)
    with pytest.raises(ValueError, match="group"):
        tp_tail.TpVariant(4, tp_tail.OWNER_PARTIALS, 3, tp_tail.EXACT)
    with pytest.raises(ValueError, match="group"):
        tp_tail.TpVariant(4, tp_tail.FMA_CHAIN, 2)
    with pytest.raises(ValueError, match="delivery"):
        tp_tail.TpVariant(4, tp_tail.FMA_CHAIN, 0, "multicast")


def test_poll_batches_cover_every_route_and_source_in_sum_order():
    for tp in (2, 3, 8, 32):
        for split in (1, 16):
            flat = [item for batch in tp_tail.poll_batches(tp, split) for item in batch]
            assert flat == [(k, s) for k in range(K) for s in range(tp)]


def test_fault_record_decodes():
    assert tp_tail.decode_fault([-1, -1, -1, -1]) is None
    route = tp_tail.decode_fault([2, 1, 5 * protocol.FAULT_SLOTS + 3, 1])
    assert (route.rank, route.peer, route.token, route.route, route.generation) == (2, 1, 5, 3, 1)
    token = tp_tail.decode_fault([0, 3, 7 * protocol.FAULT_SLOTS + protocol.TOKEN_SLOT, 2])
    assert token.route is None and token.token == 7
    assert "rank 0 timed out waiting for rank 3" in token.message()


# The 32-bit-word helpers of musebench.kernels.ptx (the same Python functions the kernel traces).
_HALVES = torch.arange(1 << 16, dtype=torch.int64)
_PARTNERS = (0x8000, 0x0000, 0x7FFF, 0x8001, 0xFFFF, 0x0001, 0x3F80, 0x7FC1, 0x807F)


def _words() -> torch.Tensor:
    return torch.cat([torch.cat([(p << 16) | _HALVES, (_HALVES << 16) | p]) for p in _PARTNERS])


def test_word_sentinel_helpers_are_exact():
    words = _words()
    sentinel = words == protocol.SENTINEL_BF16X2
    assert bool(sentinel.any())
    assert torch.equal(ptx_module.is_sentinel_word_u32(words) != 0, sentinel)
    scrubbed = ptx_module.scrub_sentinel_word_u32(words)
    assert torch.equal(scrubbed, torch.where(sentinel, torch.zeros_like(words), words))  # a lone -0.0 half is data
    encoded = ptx_module.encode_sentinel_word_f32(words)
    assert torch.equal(encoded, torch.where(sentinel, torch.full_like(words, 0x80000000), words))
    assert not bool((ptx_module.is_sentinel_word_u32(encoded) != 0).any())


def test_encoding_keeps_the_bf16_rounding():
    words = _words()
    as_f32 = lambda w: (w - ((w >> 31) << 32)).to(torch.int32).view(torch.float32)  # noqa: E731
    before = as_f32(words).to(torch.bfloat16).view(torch.int16)
    after = as_f32(ptx_module.encode_sentinel_word_f32(words)).to(torch.bfloat16).view(torch.int16)
    nan = torch.isnan(as_f32(words))
    assert torch.equal(before[~nan], after[~nan])
