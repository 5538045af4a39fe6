"""The EP tail kernels compile for sm_90a and sm_100a (no GPU needed), and their PTX says so.

Every variant is compiled here with fake tensors and its PTX read back. The assertions are the
contract's, checked in the emitted code rather than the source:

- transport: `multimem.st` only in the multicast publisher (both forms; never in the reduction),
  one `st.relaxed.sys` per peer and trip only in the unicast one; the multicast single launch
  fences its multicast stores from its unicast polls (`fence.proxy.alias`, once, between them);
- the same bits on both transports: the two publishers' PTX have the same arithmetic trace
  (`arithmetic_trace`: every floating-point operation and conversion in program order, registers
  renamed by first use, and the payload of each publishing store): only the stores differ;
- PDL: `griddepcontrol.wait` and `.launch_dependents` exactly when enabled;
- rounding: every binary32 add/mul/fma is the explicit `.rn` form, none is `.ftz`, no packed
  `f32x2` arithmetic is left for ptxas to contract; the only approximate instruction is
  `rsqrt.approx.ftz.f32`, once per route, and the publisher has no division;
- the publisher's sum of squares is 8 chains (one per route) of 32 `fma.rn.f32` from +0.0, each
  in the contract's order (trip fastest, then element), traced from the loads in the PTX; its
  total `fma.rn.f32` count is 8 * (32 + 1 + 32);
- the reduction is 8 chains of tp `add.rn.f32` from +0.0 in rank order, traced to the polled
  slots, and no fma;
- bounded waits: every loop of either kernel that holds an `ld.volatile` also reads
  `%globaltimer`; the publisher has no loop at all; the reduction re-arms exactly tp fragments;
- the rank is a runtime argument: one compiled variant serves every rank (no rank in any key).

Compile times (this CPU host, CuTe DSL 4.8.1): publisher about 0.3-0.5 s (tp 32: about 1 s),
reduction about 0.1-0.3 s per variant.
"""

from __future__ import annotations

import functools
import re
import tempfile

import pytest

from tests._ptxas import assemble, assert_no_spills

pytest.importorskip("cutlass")

from musebench.comm import protocol  # noqa: E402
from musebench.kernels import ep_tail as tail  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")
TPS = (2, 3, 8, 32)  # smallest, odd (peer wrap not a power of two), the H200 node, the largest
WIDTH, TOP_K, THREADS, CAPACITY = 4096, 8, 128, 8
TRIPS = WIDTH // (THREADS * 8)
VALUES = TRIPS * 8
TRIP_BYTES = THREADS * 16
EPS_BITS, INV_WIDTH_BITS, ONE_BITS = 0x322BCC77, 0x39800000, 0x3F800000
SENTINEL_I32 = protocol.SENTINEL_BF16X2 - (1 << 32)  # how PTX prints 0x80008000

_DUMP = tempfile.mkdtemp(prefix="musebench-ptx-")


@functools.lru_cache(maxsize=None)
def publisher_ptx(arch: str, tp: int, weight_dtype: str, before: bool, transport: str, pdl: bool,
                  single_launch: bool = False) -> str:
    compiled = tail.compile_publisher(
        width=WIDTH, top_k=TOP_K, tp=tp, capacity=CAPACITY, threads=THREADS,
        weight_before_norm=before, weight_dtype=weight_dtype, eps=1e-8, gain_center=1.0,
        transport=transport, enable_pdl=pdl, single_launch=single_launch, timeout_ns=1_000_000_000,
        arch=arch, ptx_dir=_DUMP,
    )
    return _ptx_text(compiled)


@functools.lru_cache(maxsize=None)
def reduce_ptx(arch: str, tp: int, pdl: bool) -> str:
    compiled = tail.compile_reduce(
        width=WIDTH, tp=tp, capacity=CAPACITY, threads=THREADS, enable_pdl=pdl,
        timeout_ns=1_000_000_000, arch=arch, ptx_dir=_DUMP,
    )
    return _ptx_text(compiled)


def _ptx_text(compiled) -> str:
    ptx = compiled.artifacts.PTX
    if "\n" not in ptx:  # some DSL versions hand back the dump's path
        with open(ptx) as handle:
            ptx = handle.read()
    assert ".entry" in ptx, "no kernel in the PTX"
    return ptx


# ---------------------------------------------------------------------------------------------
# A small PTX reader: instructions, loops, constants, register origins.


def instructions(ptx: str) -> list[str]:
    lines = []
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if line and not line.startswith(".") and line not in ("{", "}", ")"):
            lines.append(line)
    return lines


def _opcode(line: str) -> str:
    words = line.split()
    return (words[1] if words[0].startswith("@") else words[0]).rstrip(";")


def opcodes(ptx: str) -> list[str]:
    return [_opcode(line) for line in instructions(ptx) if not line.endswith(":")]


def count(ptx: str, opcode: str) -> int:
    return sum(1 for op in opcodes(ptx) if op == opcode)


def loops(ptx: str) -> list[list[str]]:
    """Instruction ranges [label .. backward branch]: every loop of the kernel."""
    lines = instructions(ptx)
    labels = {line[:-1]: i for i, line in enumerate(lines) if line.endswith(":")}
    found = []
    for i, line in enumerate(lines):
        match = re.search(r"\bbra(?:\.uni)?\s+(\$\S+);", line)
        if match and labels.get(match.group(1), i + 1) <= i:
            found.append(lines[labels[match.group(1)] : i + 1])
    return found


def _operands(line: str) -> list[str]:
    parts = line.split(None, 1)
    if len(parts) < 2:
        return []
    body = parts[1].rstrip(";")
    return [part.strip() for part in re.split(r",(?![^{]*})", body)]


class Origins:
    """Where registers come from: 16-byte loads (root address, byte offset, word) and the
    BF16 widening of a word's half (`shl 16`: element 2j, `and -65536`: element 2j + 1)."""

    def __init__(self, ptx: str):
        self.offset: dict[str, tuple[str, int]] = {}
        self.word: dict[str, tuple[str, int, int]] = {}
        self.half: dict[str, tuple[str, int, int, int]] = {}
        self.mul: dict[str, tuple[str, str]] = {}
        self.const: dict[str, int] = {}
        for line in instructions(ptx):
            if line.startswith("@") or line.endswith(":"):
                continue
            op = _opcode(line)
            args = _operands(line)
            if not args:
                continue
            if op == "add.s64" and re.fullmatch(r"-?\d+", args[2]):
                root, base = self.address(args[1])
                self.offset[args[0]] = (root, base + int(args[2]))
            elif op in ("ld.global.v4.u32", "ld.volatile.global.v4.u32"):
                root, base = self.address(args[1].strip("[]"))
                for j, reg in enumerate(args[0].strip("{}").split(",")):
                    self.word[reg.strip()] = (root, base, j)
            elif op == "shl.b32" and args[2] == "16" and args[1] in self.word:
                self.half[args[0]] = (*self.word[args[1]], 0)
            elif op == "and.b32" and args[2] == "-65536" and args[1] in self.word:
                self.half[args[0]] = (*self.word[args[1]], 1)
            elif op == "mul.rn.f32":
                self.mul[args[0]] = (args[1], args[2])
            elif op in ("mov.b32", "mov.f32"):
                value = _literal(args[1])
                if value is not None:
                    self.const[args[0]] = value

    def address(self, reg: str) -> tuple[str, int]:
        return self.offset.get(reg, (reg, 0))

    def value(self, reg: str) -> int | None:
        literal = _literal(reg)
        return literal if literal is not None else self.const.get(reg)

    def element(self, reg: str, *, through_mul: bool) -> tuple[str, int, int]:
        """(root, byte offset, element 0..7) of a widened BF16 (or of x in mul(x, gamma))."""
        if through_mul:
            reg = self.mul[reg][0]
        root, offset, word, half = self.half[reg]
        return root, offset, 2 * word + half


def _literal(text: str) -> int | None:
    if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", text):
        return int(text[2:], 16)
    if re.fullmatch(r"-?\d+", text):
        return int(text) & 0xFFFFFFFF
    return None


def chains(ptx: str, opcode: str, *, link: int, where=lambda args: True) -> list[list[list[str]]]:
    """Maximal dependency chains of `opcode` (those lines `where` accepts) through operand `link`."""
    lines = [_operands(line) for line in instructions(ptx) if not line.endswith(":") and _opcode(line) == opcode]
    lines = [args for args in lines if where(args)]
    produced = {args[0]: args for args in lines}
    consumed = {args[link] for args in lines}
    found = []
    for args in lines:
        if args[link] in produced:
            continue
        chain = [args]
        while chain[-1][0] in consumed:
            successors = [a for a in lines if a[link] == chain[-1][0]]
            assert len(successors) == 1, f"accumulator {chain[-1][0]} feeds {len(successors)} {opcode}"
            chain.append(successors[0])
        found.append(chain)
    return found


PUBLISHING_STORES = ("st.relaxed.sys.global.v4.u32", "multimem.st.relaxed.sys.global.v4.bf16x2",
                     "multimem.st.relaxed.sys.global.v4.f32")
_REGISTER = re.compile(r"%[a-z]+\d+")


def arithmetic_trace(ptx: str) -> list[str]:
    """What a kernel computes, independent of how it stores it: every floating-point arithmetic
    instruction and conversion in program order with its operands, registers renamed in order of
    first use (two compilations number their registers apart), and each distinct payload stored to
    a peer or multicast address ("publish" and its four registers; the address and the store's
    opcode dropped, a payload stored to several peers listed once)."""
    names: dict[str, str] = {}

    def canonical(text: str) -> str:
        return _REGISTER.sub(lambda match: names.setdefault(match.group(0), f"v{len(names)}"), text)

    trace: list[str] = []
    published: set[str] = set()
    for line in instructions(ptx):
        if line.endswith(":"):
            continue
        body = line.split(None, 1)[1] if line.startswith("@") else line
        op = _opcode(line)
        args = _operands(body)
        if op in PUBLISHING_STORES:
            entry = "publish " + canonical(args[1])
            if entry not in published:
                published.add(entry)
                trace.append(entry)
        elif op in float_arithmetic(body) or (op.startswith("cvt.") and re.search(r"\.f32|\.bf16", op)):
            trace.append(op + " " + canonical(", ".join(args)))
    return trace


def float_arithmetic(ptx: str) -> list[str]:
    return [op for op in opcodes(ptx) if re.match(r"(add|sub|mul|fma|div|rcp|sqrt|rsqrt|ex2|lg2|min|max|neg|abs)\.", op)
            and re.search(r"\.f32|\.f16|\.bf16", op)]


def assert_rounding_is_explicit(ptx: str, *, approximate: set[str]) -> None:
    for op in float_arithmetic(ptx):
        if op in approximate:
            continue
        assert ".rn." in op + ".", f"{op}: binary32 arithmetic without an explicit .rn"
        assert ".ftz" not in op and "x2" not in op.split(".")[-1], f"{op}: flushes subnormals or is packed"
    assert not any(".sat" in op or ".relu" in op for op in opcodes(ptx) if op.startswith("cvt."))


def assert_bounded_polling(ptx: str) -> None:
    for body in loops(ptx):
        if any("ld.volatile" in line for line in body):
            assert any("%globaltimer" in line for line in body), "a polling loop without a %globaltimer read"


# ---------------------------------------------------------------------------------------------
# Publisher.

PUBLISHER_GRID = [
    pytest.param(arch, tp, dtype, before, transport, id=f"{arch}-tp{tp}-{dtype}-{'before' if before else 'after'}-{transport}")
    for arch in ARCHS
    for tp in TPS
    for dtype in ("bf16", "fp32")
    for before in (True, False)
    for transport in ("unicast", "multicast")
]


@pytest.mark.parametrize("arch, tp, weight_dtype, before, transport", PUBLISHER_GRID)
def test_publisher_ptx(arch, tp, weight_dtype, before, transport):
    ptx = publisher_ptx(arch, tp, weight_dtype, before, transport, True)
    ops = opcodes(ptx)

    # Transport: one multicast store per trip, or one strong store per peer and trip.
    multicast = count(ptx, "multimem.st.relaxed.sys.global.v4.bf16x2")
    unicast = count(ptx, "st.relaxed.sys.global.v4.u32")
    assert (multicast, unicast) == ((TRIPS, 0) if transport == "multicast" else (0, tp * TRIPS))
    assert not any(op.startswith("multimem") for op in ops if op != "multimem.st.relaxed.sys.global.v4.bf16x2")
    assert count(ptx, "fence.proxy.alias") == 0  # the two-launch publisher polls nothing

    # PDL, once each, the reduction let launch right after the wait (before any row is read); the
    # stage word is the only volatile load; no loop, so no spin.
    assert count(ptx, "griddepcontrol.wait") == 1 and count(ptx, "griddepcontrol.launch_dependents") == 1
    wait, trigger = ops.index("griddepcontrol.wait"), ops.index("griddepcontrol.launch_dependents")
    assert wait < trigger < ops.index("ld.global.v4.u32", wait)
    assert count(ptx, "ld.volatile.global.u32") == 1 and not any(op.startswith("ld.volatile.global.v") for op in ops)
    assert loops(ptx) == []

    # Rounding points.
    assert_rounding_is_explicit(ptx, approximate={"rsqrt.approx.ftz.f32"})
    assert count(ptx, "rsqrt.approx.ftz.f32") == TOP_K
    assert not any(op.startswith(("div.", "rcp.", "ex2.")) for op in ops)
    assert count(ptx, "fma.rn.f32") == TOP_K * (VALUES + 1 + VALUES)
    # y*gamma (after) or s*gamma (before: computed for the sum of squares and again for y, the
    # same operands, so the same bits), and s*inv
    assert count(ptx, "mul.rn.f32") == TOP_K * VALUES * (3 if before else 2)
    assert count(ptx, "add.rn.f32") == VALUES + TOP_K * (5 + THREADS // 32)  # gamma, butterfly, warp sums
    assert count(ptx, "cvt.rn.bf16x2.f32") == VALUES // 2

    origins = Origins(ptx)
    # gamma = f32(norm_weight) + 1.0, one add per column, no contraction possible.
    gamma_adds = [_operands(line) for line in instructions(ptx) if line.startswith("add.rn.f32")]
    assert sum(1 for args in gamma_adds if origins.value(args[2]) == ONE_BITS) == VALUES

    # inv_rms argument: fma(total, 2^-12, f32(1e-8)), once per route.
    fmas = [_operands(line) for line in instructions(ptx) if line.startswith("fma.rn.f32")]
    inv = [args for args in fmas if origins.value(args[2]) == INV_WIDTH_BITS and origins.value(args[3]) == EPS_BITS]
    assert len(inv) == TOP_K

    # Sum of squares: one chain of 32 per route, from +0.0, in the contract's order.
    squares = chains(ptx, "fma.rn.f32", link=3, where=lambda args: args[1] == args[2])
    assert len(squares) == TOP_K
    expected = [(trip, e) for e in range(8) for trip in range(TRIPS)]
    for chain in squares:
        assert len(chain) == VALUES and all(args[1] == args[2] for args in chain)
        assert origins.value(chain[0][3]) == 0, "the sum of squares must start from +0.0"
        placed = [origins.element(args[1], through_mul=before) for args in chain]
        roots = {root for root, _, _ in placed}
        assert len(roots) == 1, f"one route's values come from one row: {roots}"
        order = [(offset // TRIP_BYTES, e) for _, offset, e in placed]
        assert order == expected, f"sum-of-squares order {order[:6]}... is not the contract's"

    # Route accumulation: acc = fma(y, w, acc) from +0.0, 32 values x 8 routes, no other shape.
    accumulate = [args for args in fmas if args[1] != args[2] and args not in inv]
    assert len(accumulate) == TOP_K * VALUES
    if before:  # every s*gamma twice, with the same two operands
        products = [(origins.half[args[1]], args[2])  # (row word and half, gamma register)
                    for args in (_operands(line) for line in instructions(ptx) if line.startswith("mul.rn.f32"))
                    if args[1] in origins.half]
        assert len(products) == 2 * TOP_K * VALUES and all(products.count(p) == 2 for p in products)

    # Latency: one barrier, and every vector load (gamma, then every route's rows) is issued before
    # the first arithmetic, not a chain of row loads and arithmetic per route.
    assert ops.count("bar.sync") == 1
    first_arithmetic = ops.index("fma.rn.f32")
    loads = TRIPS + TOP_K * TRIPS  # gamma, then the rows
    assert ops[:first_arithmetic].count("ld.global.v4.u32") == ops.count("ld.global.v4.u32") == loads


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("transport", ["unicast", "multicast"])
def test_the_two_launch_publisher_touches_no_stage_word_but_reads_the_generation(arch, transport):
    """It reads NEXT_STAGE once and writes no stage word: the reduction reads the generation
    itself and advances it (no ACTIVE_STAGE hand-over)."""
    ops = opcodes(publisher_ptx(arch, 8, "bf16", True, transport, True))
    assert ops.count("ld.volatile.global.u32") == 1
    assert not any(op == "st.global.u32" or op.startswith(("atom.", "fence.")) for op in ops)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("transport", ["unicast", "multicast"])
def test_publisher_without_pdl_has_no_griddepcontrol(arch, transport):
    ptx = publisher_ptx(arch, 8, "bf16", True, transport, False)
    assert not any(op.startswith("griddepcontrol") for op in opcodes(ptx))


# ---------------------------------------------------------------------------------------------
# Reduction.


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "nopdl"])
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("arch", ARCHS)
def test_reduce_ptx(arch, tp, pdl):
    ptx = reduce_ptx(arch, tp, pdl)
    ops = opcodes(ptx)
    assert not any(op.startswith("multimem") or op.startswith("fence.proxy") for op in ops)  # one kernel, both transports
    assert count(ptx, "griddepcontrol.wait") == count(ptx, "griddepcontrol.launch_dependents") == int(pdl)
    if pdl:  # the next call's publisher may launch only after every store of this call
        last_store = max(i for i, op in enumerate(ops) if op.startswith("st."))
        assert ops.index("griddepcontrol.launch_dependents") > last_store

    # Bounded polling: one loop, tp volatile 16-byte loads and a %globaltimer read inside it.
    assert_bounded_polling(ptx)
    polling = [body for body in loops(ptx) if any("ld.volatile" in line for line in body)]
    assert len(polling) == 1
    assert sum(1 for line in polling[0] if line.startswith("ld.volatile.global.v4.u32")) == tp
    assert count(ptx, "ld.volatile.global.v4.u32") == tp

    # The generation: thread 0 reads NEXT_STAGE and arrives (a release) before the barrier that
    # shares it, ahead of the polls; the polls, sums, output and re-arms all come before
    # griddepcontrol.wait (the slots carry their own completeness, so they run while the
    # publisher does); the wait guards only the last arriver's advance (fence, NEXT_STAGE, count).
    assert count(ptx, "ld.volatile.global.u32") == 1
    assert count(ptx, "atom.release.gpu.global.add.u32") == 1 and count(ptx, "fence.acq_rel.gpu") == 1
    read, arrival, barrier = (ops.index(op) for op in ("ld.volatile.global.u32", "atom.release.gpu.global.add.u32", "bar.sync"))
    first_poll = ops.index("ld.volatile.global.v4.u32")
    assert read < arrival < barrier < first_poll and ops.count("bar.sync") == 1
    fence = ops.index("fence.acq_rel.gpu")
    assert fence > max(i for i, op in enumerate(ops) if op.startswith(("ld.volatile", "st.global.v4", "atom.relaxed")))
    assert [op for op in ops[fence:] if op.startswith("st.")] == ["st.global.u32", "st.global.u32"]
    if pdl:
        assert fence > ops.index("griddepcontrol.wait") > max(i for i, op in enumerate(ops) if op.startswith("st.global.v4"))

    # Rank-order sum from +0.0, add.rn only, then one bf16x2 conversion per word.
    assert_rounding_is_explicit(ptx, approximate=set())
    assert not any(op.startswith(("fma.", "mul.rn", "rsqrt", "div.")) for op in ops if ".f32" in op)
    assert count(ptx, "add.rn.f32") == 8 * tp
    assert count(ptx, "cvt.rn.bf16x2.f32") == 4
    origins = Origins(ptx)
    sums = chains(ptx, "add.rn.f32", link=1)
    assert len(sums) == 8
    slot_bytes = CAPACITY * WIDTH * 2
    elements = set()
    for chain in sums:
        assert len(chain) == tp and origins.value(chain[0][1]) == 0, "each element's sum starts from +0.0"
        placed = [origins.element(args[2], through_mul=False) for args in chain]
        assert [offset // slot_bytes for _, offset, _ in placed] == list(range(tp)), "ranks must be added in order"
        assert len({e for _, _, e in placed}) == 1
        elements.add(placed[0][2])
    assert elements == set(range(8))

    # Fault record and re-arm: one CAS; exactly the tp fragments read get the sentinel back.
    assert count(ptx, "atom.relaxed.gpu.global.cas.b32") == 1
    rearm = [line for line in instructions(ptx) if line.startswith("st.global.v4.u32")
             and all(origins.value(reg.strip()) == SENTINEL_I32 & 0xFFFFFFFF for reg in _operands(line)[1].strip("{}").split(","))]
    assert len(rearm) == tp


# ---------------------------------------------------------------------------------------------
# Single launch: the publisher, then its token's reduction in the same CTA.


@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "nopdl"])
@pytest.mark.parametrize("transport", ["unicast", "multicast"])
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("arch", ARCHS)
def test_single_launch_ptx(arch, tp, transport, pdl):
    ptx = publisher_ptx(arch, tp, "bf16", True, transport, pdl, single_launch=True)
    alone = publisher_ptx(arch, tp, "bf16", True, transport, pdl)
    ops = opcodes(ptx)
    assert count(ptx, "griddepcontrol.wait") == count(ptx, "griddepcontrol.launch_dependents") == int(pdl)
    if pdl:  # the next call's publisher may launch only after every store of this call
        last_store = max(i for i, op in enumerate(ops) if op.startswith("st."))
        assert ops.index("griddepcontrol.launch_dependents") > last_store

    # The publisher's arithmetic and stores are unchanged.
    for opcode in ("fma.rn.f32", "mul.rn.f32", "rsqrt.approx.ftz.f32", "multimem.st.relaxed.sys.global.v4.bf16x2",
                   "st.relaxed.sys.global.v4.u32"):
        assert count(ptx, opcode) == count(alone, opcode), opcode
    assert_rounding_is_explicit(ptx, approximate={"rsqrt.approx.ftz.f32"})

    # Multicast: one proxy fence, after the last multicast store and before the first poll of
    # the own words through their unicast mapping; none with unicast stores.
    assert count(ptx, "fence.proxy.alias") == (1 if transport == "multicast" else 0)
    if transport == "multicast":
        fence_at = ops.index("fence.proxy.alias")
        last_multicast = max(i for i, op in enumerate(ops) if op.startswith("multimem.st"))
        assert last_multicast < fence_at < ops.index("ld.volatile.global.v4.u32")

    # The generation: thread 0 reads NEXT_STAGE once and arrives once (a release, not waited
    # for), both after every row load is issued, and shares it through shared memory behind the
    # routes' own barrier (no barrier of its own: no round trip before the loads); the last
    # arriver advances it at the very end, behind an acq_rel fence.
    assert count(ptx, "ld.volatile.global.u32") == 1
    assert count(ptx, "atom.release.gpu.global.add.u32") == 1 and count(ptx, "fence.acq_rel.gpu") == 1
    assert not any(op.startswith("atom.acq_rel") for op in ops)
    assert count(ptx, "bar.sync") == count(alone, "bar.sync")
    read, arrival = ops.index("ld.volatile.global.u32"), ops.index("atom.release.gpu.global.add.u32")
    last_load = max(i for i, op in enumerate(ops) if op == "ld.global.v4.u32")  # gamma and the rows
    assert last_load < read < arrival < ops.index("bar.sync")
    fence = ops.index("fence.acq_rel.gpu")
    assert fence > max(i for i, op in enumerate(ops) if op.startswith("st.global.v4") or op.startswith("atom.relaxed"))
    assert [op for op in ops[fence:] if op.startswith("st.")] == ["st.global.u32", "st.global.u32"]

    # Its token's reduction: one bounded poll of every trip's tp slots where they fit in
    # registers (tp * trips <= 32 vectors), else one per trip; then per trip tp adds from +0.0
    # per element in rank order, a fault CAS and tp re-arm stores.
    assert_bounded_polling(ptx)
    polling = [body for body in loops(ptx) if any("ld.volatile" in line for line in body)]
    together = TRIPS if tp * TRIPS <= tail.SINGLE_LAUNCH_POLL_VECTORS else 1
    assert len(polling) == TRIPS // together
    assert all(sum(1 for line in body if line.startswith("ld.volatile.global.v4.u32")) == tp * together for body in polling)
    assert count(ptx, "add.rn.f32") == count(alone, "add.rn.f32") + TRIPS * 8 * tp
    assert count(ptx, "cvt.rn.bf16x2.f32") == count(alone, "cvt.rn.bf16x2.f32") + TRIPS * 4
    assert count(ptx, "atom.relaxed.gpu.global.cas.b32") == TRIPS
    origins = Origins(ptx)
    rearm = [line for line in instructions(ptx) if line.startswith("st.global.v4.u32")
             and all(origins.value(reg.strip()) == SENTINEL_I32 & 0xFFFFFFFF for reg in _operands(line)[1].strip("{}").split(","))]
    assert len(rearm) == TRIPS * tp
    slot_bytes = CAPACITY * WIDTH * 2
    sums = [chain for chain in chains(ptx, "add.rn.f32", link=1)
            if len(chain) == tp and origins.value(chain[0][1]) == 0
            and all(args[2] in origins.half for args in chain)]
    assert len(sums) == TRIPS * 8
    for chain in sums:
        placed = [origins.element(args[2], through_mul=False) for args in chain]
        assert [offset % (tp * slot_bytes) // slot_bytes for _, offset, _ in placed] == list(range(tp)), \
            "ranks must be added in order"
    assert not any(op.startswith("div.") for op in ops)


@pytest.mark.parametrize("transport", ["unicast", "multicast"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp, weight_dtype, before, single_launch", [
    (2, "bf16", True, False), (8, "bf16", True, False), (32, "fp32", False, False),
    (2, "bf16", True, True), (8, "bf16", True, True), (32, "fp32", False, True),
], ids=["tp2-two", "tp8-two", "tp32-two", "tp2-single", "tp8-single", "tp32-single"])
def test_the_publisher_assembles_without_spills(tp, weight_dtype, before, single_launch, arch, transport, tmp_path):
    """Every route's fragments are live at once (255 registers): a spill would put local memory on
    the load path the batching removed, and the single launch adds its reduction on top."""
    ptx = publisher_ptx(arch, tp, weight_dtype, before, transport, True, single_launch=single_launch)
    assert_no_spills(assemble(ptx, arch, tmp_path, "publisher"))


@pytest.mark.parametrize("single_launch", [False, True], ids=["two", "single"])
@pytest.mark.parametrize("tp, weight_dtype, before", [(2, "bf16", True), (3, "fp32", False), (8, "bf16", False),
                                                      (32, "fp32", True)])
@pytest.mark.parametrize("arch", ARCHS)
def test_multicast_and_unicast_publishers_compute_the_same_and_differ_in_the_stores(arch, tp, weight_dtype, before,
                                                                                   single_launch):
    """The bitwise argument in the emitted code: the same arithmetic on the same operands in the
    same order, the same payloads published (once per trip by multicast, to every peer by
    unicast); everything else that differs is a store, the peer-address loads, integer address
    arithmetic, or (single launch) the proxy fence."""
    unicast = publisher_ptx(arch, tp, weight_dtype, before, "unicast", True, single_launch=single_launch)
    multicast = publisher_ptx(arch, tp, weight_dtype, before, "multicast", True, single_launch=single_launch)
    trace = arithmetic_trace(unicast)
    assert sum(entry.startswith("publish ") for entry in trace) == TRIPS
    assert arithmetic_trace(multicast) == trace
    ignored = ("st.", "multimem.", "ld.global.b64", "ld.global.u64", "add.s64", "mul.wide", "shl.b64", "mad.wide",
               "cvt.s64", "cvt.u64", "fence.proxy", "selp", "setp", "mov.", "add.s32", "sub.s32", "ld.param", "@")
    def rest(ptx):
        return sorted(op for op in opcodes(ptx) if not op.startswith(ignored) and op != "bra.uni" and op != "bra")
    assert rest(unicast) == rest(multicast)


def test_the_arithmetic_trace_sees_a_changed_rounding_and_a_changed_payload():
    """The comparison itself: an fma turned into mul + add, or a payload register swapped, differs."""
    base = ("fma.rn.f32 %f3, %f1, %f2, %f0;\ncvt.rn.bf16x2.f32 %r1, %f3, %f3;\n"
            "st.relaxed.sys.global.v4.u32 [%rd1], {%r1, %r2, %r3, %r4};\n")
    assert arithmetic_trace(base) == arithmetic_trace(base.replace("%f", "%f1"))  # renumbered: the same
    split = base.replace("fma.rn.f32 %f3, %f1, %f2, %f0;", "mul.rn.f32 %f4, %f1, %f2;\nadd.rn.f32 %f3, %f4, %f0;")
    assert arithmetic_trace(split) != arithmetic_trace(base)
    swapped = base.replace("{%r1, %r2, %r3, %r4}", "{%r2, %r1, %r3, %r4}")
    assert arithmetic_trace(swapped) != arithmetic_trace(base)
    multicast = base.replace("st.relaxed.sys.global.v4.u32", "multimem.st.relaxed.sys.global.v4.bf16x2")
    assert arithmetic_trace(multicast) == arithmetic_trace(base) == arithmetic_trace(base + base.splitlines()[-1])


def test_every_loop_that_polls_reads_the_timer_in_a_broken_example():
    """The loop check itself: a volatile poll without %globaltimer is caught."""
    bad = "$L__BB0_1:\n ld.volatile.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];\n @%p1 bra $L__BB0_1;\n"
    with pytest.raises(AssertionError, match="globaltimer"):
        assert_bounded_polling(bad)
    good = "$L__BB0_1:\n mov.u64 %rd2, %globaltimer;\n ld.volatile.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];\n @%p1 bra $L__BB0_1;\n"
    assert_bounded_polling(good)


def test_compile_cache_is_keyed_by_every_knob():
    knobs = dict(tp=2, capacity=4, weight_before_norm=True, weight_dtype="bf16", eps=1e-8, gain_center=1.0,
                 transport="unicast", enable_pdl=True, arch="sm_90a")
    publisher = tail.compile_publisher(**knobs, rank=0)
    assert tail.compile_publisher(**knobs, rank=0, timeout_ns=5) is publisher  # the publisher alone never waits
    single = tail.compile_publisher(**knobs, rank=0, single_launch=True)
    assert single is not publisher and tail.compile_publisher(**knobs, rank=0, single_launch=True, timeout_ns=5) is not single
    assert tail.compile_publisher(**{**knobs, "capacity": 5}) is not publisher
    a = tail.compile_reduce(tp=2, rank=0, capacity=4, enable_pdl=True, arch="sm_90a")
    assert tail.compile_reduce(tp=2, rank=0, capacity=4, enable_pdl=True, arch="sm_90a") is a
    assert tail.compile_reduce(tp=2, capacity=4, enable_pdl=False, arch="sm_90a") is not a


def test_the_rank_is_not_part_of_any_compile_key():
    """One compilation serves every rank of a group: the rank is a runtime `Int32` argument."""
    knobs = dict(tp=3, capacity=4, weight_before_norm=True, weight_dtype="bf16", eps=1e-8, gain_center=1.0,
                 transport="unicast", enable_pdl=True, arch="sm_90a")
    for single_launch in (False, True):
        publisher = tail.compile_publisher(**knobs, single_launch=single_launch)
        assert all(tail.compile_publisher(**knobs, rank=r, single_launch=single_launch) is publisher for r in range(3))
    reduce = tail.compile_reduce(tp=3, capacity=4, enable_pdl=True, arch="sm_90a")
    assert all(tail.compile_reduce(tp=3, rank=r, capacity=4, enable_pdl=True, arch="sm_90a") is reduce for r in range(3))
