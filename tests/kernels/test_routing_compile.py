"""The routing kernel compiles for sm_90a and sm_100a (no GPU needed), and its PTX says so; the
host side refuses what is outside the contract. CPU only.

Every variant (metadata on / off x renormalize on / off x PDL on / off) is compiled from fake
tensors and its PTX read back. The assertions are the contract's, checked in the emitted code:

- the float arithmetic is exactly the stock's instructions as inline asm: per lane 8 x
  (`sub.rn.f32` 0 - x, `mul.rn.f32` by 0x3FB8AA3B, `ex2.approx.f32`, `add.rn.f32` 1 + e,
  `div.full.f32` 1 / d, `add.rn.f32` score + bias), then the sum chain from +0.0 in selection
  order + f32(1e-15), one `div.full.f32` of the scale, 8 `mul.rn.f32`; no `fma` at all, nothing
  `.ftz`, nothing else in floating point; traced through registers from the loads;
- PDL: `griddepcontrol.wait` and `.launch_dependents` once each when enabled, none otherwise;
  the two bias loads come before the wait, the two logits loads after it;
- 8 rounds of `redux.sync.max.u32` + `vote.sync.ballot`; three `bar.sync` with metadata, none
  without; no local memory (the per-lane arrays stay in registers).

The selection algorithm (lane sort + warp rounds) and the metadata algorithm (counts, token-order
ranks, tile scan) are also modeled here in Python and compared with the references; the model is
the kernel's algorithm, not its code, which only the GPU tests run.

Compile times (this CPU host, CuTe DSL 4.8.1): 0.1-0.15 s per routing-only variant, 0.2-0.25 s
with metadata, both archs.
"""

from __future__ import annotations

import functools
import math
import re
import struct
import tempfile
import time

import pytest
import torch

pytest.importorskip("cutlass")

from musebench import config  # noqa: E402
from musebench.kernels import compilation, routing  # noqa: E402
from musebench.routing_metadata import RoutingMetadata, metadata_size  # noqa: E402
from musebench.stock.routing import (  # noqa: E402
    LOG2_E_F32_BITS,
    first_argmax,
    pack_metadata,
    routing_metadata_reference,
    routing_reference,
    sigmoid_scores,
)
from tests.kernels.test_ep_tail_compile import (  # noqa: E402
    _operands,
    _ptx_text,
    assert_rounding_is_explicit,
    chains,
    count,
    instructions,
    opcodes,
)

ARCHS = ("sm_90a", "sm_100a")
E, K, B = config.NUM_EXPERTS, config.TOP_K, config.MAX_DECODE_TOKENS
ZERO_BITS, ONE_BITS = 0x00000000, 0x3F800000
EPS_BITS = struct.unpack("<I", struct.pack("<f", config.ROUTER_SCORE_DIVISION_EPS))[0]
INF = float("inf")
COMPILE_SECONDS: dict[tuple, float] = {}


@functools.lru_cache(maxsize=None)
def routing_ptx(arch: str, metadata: bool, renormalize: bool, pdl: bool) -> str:
    # One dump folder per variant: the dump's file name does not carry every knob.
    options = routing.RoutingOptions(enable_pdl=pdl, arch=arch, ptx_dir=tempfile.mkdtemp(prefix="musebench-routing-ptx-"))
    started = time.perf_counter()
    compiled = routing.compile_routing(metadata, renormalize, build=options)
    COMPILE_SECONDS[(arch, metadata, renormalize, pdl)] = time.perf_counter() - started
    return _ptx_text(compiled)


# ---------------------------------------------------------------------------------------------
# A register-level view of the PTX: who defines each register.


class Definitions:
    """register -> (opcode, operands) of its defining instruction; constants from `mov`."""

    def __init__(self, ptx: str):
        self.lines = [line for line in instructions(ptx) if not line.endswith(":")]
        self.by_reg: dict[str, tuple[str, list[str]]] = {}
        for line in self.lines:
            op = opcodes(line + "\n")[0] if not line.startswith("@") else None
            if op is None:
                continue
            args = _operands(line)
            if not args:
                continue
            for reg in args[0].strip("{}").split(","):
                self.by_reg[reg.strip()] = (op, args)

    def op(self, reg: str) -> str | None:
        entry = self.by_reg.get(reg)
        return entry[0] if entry else None

    def const(self, reg: str) -> int | None:
        """The 32-bit value of a literal, or of a register set by `mov` from a literal."""
        for text in (reg, *([self.by_reg[reg][1][1]] if self.op(reg) in ("mov.b32", "mov.f32", "mov.u32") else [])):
            if re.fullmatch(r"0[fF][0-9a-fA-F]{8}", text):
                return int(text[2:], 16)
            if re.fullmatch(r"-?\d+", text):
                return int(text) & 0xFFFFFFFF
        return None

    def lines_of(self, opcode: str) -> list[list[str]]:
        return [_operands(line) for line in self.lines if not line.startswith("@") and opcodes(line + "\n")[0] == opcode]


def _position(ptx: str, opcode: str) -> list[int]:
    return [i for i, op in enumerate(opcodes(ptx)) if op == opcode]


VARIANTS = [
    pytest.param(arch, metadata, renormalize, id=f"{arch}-{'meta' if metadata else 'nometa'}-{'renorm' if renormalize else 'scale'}")
    for arch in ARCHS
    for metadata in (False, True)
    for renormalize in (True, False)
]


# ---------------------------------------------------------------------------------------------
# The PTX.


@pytest.mark.parametrize("arch, metadata, renormalize", VARIANTS)
def test_score_arithmetic_is_the_stock_instructions(arch, metadata, renormalize):
    ptx = routing_ptx(arch, metadata, renormalize, True)
    ops = opcodes(ptx)
    defs = Definitions(ptx)

    # Only these float instructions, each with its own rounding; no fma anywhere, nothing ftz.
    assert_rounding_is_explicit(ptx, approximate={"ex2.approx.f32", "div.full.f32"})
    assert not any(op.startswith("fma") or ".ftz" in op for op in ops)
    float_ops = {op for op in ops if re.search(r"\.f32$|\.f64$|\.f16|\.bf16", op) and not op.startswith(("selp.", "mov.", "ld.", "st."))}
    assert float_ops == {"sub.rn.f32", "mul.rn.f32", "ex2.approx.f32", "add.rn.f32", "div.full.f32"}, float_ops
    assert count(ptx, "sub.rn.f32") == K
    assert count(ptx, "ex2.approx.f32") == K
    assert count(ptx, "mul.rn.f32") == K + K  # (0 - x) * log2e, then the 8 weights
    assert count(ptx, "div.full.f32") == K + int(renormalize)
    assert count(ptx, "add.rn.f32") == 2 * K + (K + 1) * int(renormalize)

    # The sigmoid, traced: sub.rn(0, x) -> mul.rn(., 0x3FB8AA3B) -> ex2 -> add.rn(1, .) -> div.full(1, .)
    loads = [args for args in defs.lines_of("ld.global.v4.u32")]
    loaded = {reg.strip(): i for i, args in enumerate(loads) for reg in args[0].strip("{}").split(",")}
    subs = defs.lines_of("sub.rn.f32")
    assert all(defs.const(args[1]) == ZERO_BITS and args[2] in loaded for args in subs), "0 - x on a loaded logit"
    assert sorted({loaded[args[2]] for args in subs}) == [2, 3], "the logits are the two loads after the bias"
    mul_of_sub = [args for args in defs.lines_of("mul.rn.f32") if defs.op(args[1]) == "sub.rn.f32"]
    assert len(mul_of_sub) == K and all(defs.const(args[2]) == LOG2_E_F32_BITS for args in mul_of_sub)
    ex2 = defs.lines_of("ex2.approx.f32")
    assert all(defs.op(args[1]) == "mul.rn.f32" for args in ex2)
    one_plus = [args for args in defs.lines_of("add.rn.f32") if defs.op(args[2]) == "ex2.approx.f32"]
    assert len(one_plus) == K and all(defs.const(args[1]) == ONE_BITS for args in one_plus)
    sigmoid = [args for args in defs.lines_of("div.full.f32") if defs.op(args[2]) == "add.rn.f32" and defs.const(args[1]) == ONE_BITS]
    assert len(sigmoid) == K
    scores = {args[0] for args in sigmoid}
    keys = [args for args in defs.lines_of("add.rn.f32") if args[1] in scores]
    assert len(keys) == K and {loaded.get(args[2]) for args in keys} == {0, 1}, "key = score + a bias word"

    # Weights: the sum chain from +0.0 (8 scores, then f32(1e-15)), div.full(scale, sum), mul.rn.
    sums = [chain for chain in chains(ptx, "add.rn.f32", link=1) if len(chain) > 1]
    weights = [args for args in defs.lines_of("mul.rn.f32") if args not in mul_of_sub]
    assert len(weights) == K
    (scale_param,) = re.findall(r"\.param \.f32 (\S+?)[,\s)]", ptx)  # the only float parameter
    scale_regs = {args[0] for args in defs.lines_of("ld.param.b32") if args[1].strip("[]") == scale_param}
    assert len(scale_regs) == 1, "the scale is the f32 parameter, loaded once"
    if renormalize:
        assert len(sums) == 1 and len(sums[0]) == K + 1
        chain = sums[0]
        assert defs.const(chain[0][1]) == ZERO_BITS, "the sum starts from +0.0"
        assert defs.const(chain[-1][2]) == EPS_BITS, "then adds f32(1e-15)"
        (division,) = [args for args in defs.lines_of("div.full.f32") if args[2] == chain[-1][0]]
        assert division[1] in scale_regs
        assert {args[2] for args in weights} == {division[0]}
        assert [args[1] for args in weights] == [args[2] for args in chain[:K]], "w_k = s_k * inv, s_k the k-th summand"
    else:
        assert sums == []
        assert {args[2] for args in weights} <= scale_regs, "w_k = s_k * f32(scale)"


@pytest.mark.parametrize("arch, metadata, renormalize", VARIANTS)
def test_pdl_order_selection_and_memory(arch, metadata, renormalize):
    ptx = routing_ptx(arch, metadata, renormalize, True)
    ops = opcodes(ptx)
    # PDL once each; the bias (2 loads) before the wait, the logits (2 loads) after it.
    assert count(ptx, "griddepcontrol.wait") == 1 and count(ptx, "griddepcontrol.launch_dependents") == 1
    wait = _position(ptx, "griddepcontrol.wait")[0]
    vector_loads = _position(ptx, "ld.global.v4.u32")
    assert len(vector_loads) == 4 and sum(1 for i in vector_loads if i < wait) == 2
    assert not any(op.startswith(("st.", "atom.", "red.")) for op in ops[:wait]), "nothing written before the wait"
    assert not any(op.startswith("ld.global") and op != "ld.global.v4.u32" for op in ops)

    # Eight warp rounds: max of the lane heads, the lanes holding it, the lowest one.
    assert count(ptx, "redux.sync.max.u32") == K
    assert count(ptx, "vote.sync.ballot.b32") == K
    assert count(ptx, "brev.b32") == K and count(ptx, "clz.b32") == K
    assert count(ptx, "bar.sync") == (4 if metadata else 0)
    # metadata: per-expert counts and ranks from one match.any in each route warp, no loop over tokens
    assert count(ptx, "match.any.sync.b32") == int(metadata)
    assert not any(".local" in op for op in ops), "per-lane arrays spilled to local memory"
    assert not any(op.startswith(("ld.shared", "st.shared")) for op in ops) or metadata

    # Stores: ids and weights as 2 + 2 vectors; with metadata the header and the -1 fill too.
    assert count(ptx, "st.global.v4.u32") == 4 + 2 * int(metadata)
    scalar_stores = count(ptx, "st.global.u32")  # CTA tables, fill tail, expanded, row tokens
    assert scalar_stores >= 5 if metadata else scalar_stores == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("metadata", [False, True], ids=["nometa", "meta"])
def test_without_pdl_has_no_griddepcontrol(arch, metadata):
    ptx = routing_ptx(arch, metadata, True, False)
    assert not any(op.startswith("griddepcontrol") for op in opcodes(ptx))
    assert count(ptx, "sub.rn.f32") == K and not any(op.startswith("fma") for op in opcodes(ptx))


def test_compile_times_are_small():
    for arch in ARCHS:
        for metadata in (False, True):
            routing_ptx(arch, metadata, True, True)
    slow = {key: round(s, 2) for key, s in COMPILE_SECONDS.items() if s > 10.0}
    assert not slow, f"compiles slower than 10 s: {slow}"


def test_compile_cache_is_keyed_by_every_knob():
    options = routing.RoutingOptions(arch="sm_90a")
    a = routing.compile_routing(False, True, build=options)
    assert routing.compile_routing(False, True, build=routing.RoutingOptions(arch="sm_90a")) is a
    assert routing.compile_routing(False, False, build=options) is not a
    assert routing.compile_routing(False, True, build=routing.RoutingOptions(arch="sm_90a", enable_pdl=False)) is not a


@pytest.mark.parametrize("args, kwargs", [((1, True), {}), ((False, "yes"), {}), ((False, True, 3), {}),
                                          ((False, True), {"build": "sm_90a"})])
def test_compile_routing_refuses_bad_knobs(args, kwargs):
    with pytest.raises(ValueError):
        routing.compile_routing(*args, **kwargs)


def test_options_validate():
    for bad in ({"enable_pdl": 1}, {"arch": 90}, {"ptx_dir": 3}):
        with pytest.raises(ValueError):
            routing.RoutingOptions(**bad)


def test_baked_metadata_offsets_are_the_layout():
    for tile in (1, 2, 3, 8, 64, 128, 255, 256):
        layout = RoutingMetadata(tile)
        off = layout.offsets
        assert (routing.EXPANDED_OFFSET, routing.CTA_TO_EXPERT_OFFSET, routing.CTA_ROW_LIMIT_OFFSET, routing.PERMUTED_TO_TOKEN_OFFSET) == (
            off["expanded_to_permuted"], off["cta_to_expert"], off["cta_row_limit"], off["permuted_to_token"]
        )
        # the seeds' size: the layout and one guard element after it
        assert routing.metadata_size(tile) == metadata_size(tile) + 1 == layout.size + 1
        assert (routing.META_EXPANDED_TO_PERMUTED, routing.META_CTA_BATCH, routing.META_CTA_LIMIT,
                routing.META_PERMUTED_TO_TOKEN) == (off["expanded_to_permuted"], off["cta_to_expert"],
                                                    off["cta_row_limit"], off["permuted_to_token"])


# ---------------------------------------------------------------------------------------------
# The ordered key.


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


ORDERED_VALUES = [-INF, -3.4028234663852886e38, -2.0, -1.0, -1e-38, -1.401298464324817e-45, 0.0, 1.401298464324817e-45,
                  1e-38, 0.5, 1.0, 1.0000001192092896, 2.0, 3.4028234663852886e38, INF]


def test_ordered_key_is_monotone_and_merges_the_zeros():
    keys = [routing.ordered_key_u32(_bits(v)) for v in ORDERED_VALUES]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert routing.ordered_key_u32(_bits(-0.0)) == routing.ordered_key_u32(_bits(0.0)) == 0x80000000
    assert routing.ORDERED_NEG_INF == routing.ordered_key_u32(_bits(-INF)) == 0x00800000
    assert routing.EMPTY_KEY < routing.ORDERED_NEG_INF
    for nan_bits in (0x7FC00000, 0x7F800001, 0xFFC00000, 0xFFFFFFFF):  # NaNs: outside [-inf, +inf]
        key = routing.ordered_key_u32(nan_bits)
        assert key > routing.ordered_key_u32(_bits(INF)) or routing.EMPTY_KEY < key < routing.ORDERED_NEG_INF


def test_ordered_key_on_random_floats_matches_float_order():
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(4000, generator=g) * 10.0 ** torch.randint(-40, 38, (4000,), generator=g).float(),
                   torch.tensor([0.0, -0.0, INF, -INF])]).float()
    x = x[~torch.isnan(x)]
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    keys = routing.ordered_key_u32(bits)
    i, j = torch.randint(0, x.numel(), (2, 20000), generator=g)
    assert torch.equal(x[i] < x[j], keys[i] < keys[j])
    assert torch.equal(x[i] == x[j], keys[i] == keys[j])


# ---------------------------------------------------------------------------------------------
# The algorithm, modeled in Python (lanes of 8 experts, one stable sort, 8 warp rounds).


def model_selection(keys: torch.Tensor) -> list[int]:
    """The kernel's selection for one row of 256 float32 keys."""
    ordered = (routing.ordered_key_u32(keys.view(torch.int32).to(torch.int64) & 0xFFFFFFFF)).tolist()
    lanes = []
    for lane in range(32):
        mine = [(ordered[8 * lane + j], j) for j in range(8)]
        lanes.append(sorted(mine, key=lambda kv: -kv[0]))  # Python's sort is stable: lower slot first on ties
    chosen = []
    for _ in range(K):
        heads = [lane[0][0] if lane else routing.EMPTY_KEY for lane in lanes]
        best = max(heads)
        winner = heads.index(best)  # the lowest lane holding the maximum
        slot = lanes[winner][0][1]
        chosen.append(0 if best == routing.ORDERED_NEG_INF else 8 * winner + slot)
        lanes[winner].pop(0)
    return chosen


def reference_selection(keys: torch.Tensor) -> list[int]:
    masked = keys.clone().unsqueeze(0)
    chosen = []
    for _ in range(K):
        winner = int(first_argmax(masked)[0])
        chosen.append(winner)
        masked[0, winner] = -INF
    return chosen


def adversarial_keys(g: torch.Generator) -> list[torch.Tensor]:
    rows = []
    rows.append(torch.zeros(E))  # all tied: experts 0..7
    row = torch.full((E,), -1.0)
    row[[3, 7, 10, 50, 90, 120, 121, 200, 255]] = 2.0  # nine tied at the top
    rows.append(row)
    row = torch.zeros(E)
    row[::2] = -0.0  # signed zeros tie with +0.0
    rows.append(row)
    rows.append(torch.full((E,), -INF))  # only -inf: expert 0 eight times
    row = torch.full((E,), -INF)
    row[[5, 77, 130]] = 0.25  # three finite keys, then -inf: 0 repeated
    rows.append(row)
    row = torch.full((E,), 0.5)
    row[8:16] = 0.75  # all eight winners in one lane
    rows.append(row)
    row = torch.full((E,), 0.5)
    row[248:256] = INF  # +inf keys in the last lane
    rows.append(row)
    for _ in range(40):
        rows.append(torch.randint(-3, 4, (E,), generator=g).float() * 0.125)  # many ties
        rows.append(torch.randn(E, generator=g))
    return rows


def test_model_selection_equals_the_reference_argmax_rounds():
    g = torch.Generator().manual_seed(1)
    for n, keys in enumerate(adversarial_keys(g)):
        assert model_selection(keys) == reference_selection(keys), f"row {n}"


def test_model_selection_on_the_stock_keys_equals_routing_reference():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, E, generator=g) * 4
    logits[0, :] = 0.0
    logits[1, ::3] = INF
    logits[2, :] = -INF
    bias = torch.randn(E, generator=g) * 0.05
    bias[::7] = 0.0
    ids, _ = routing_reference(logits, bias, route_scale=1.0)
    keys = sigmoid_scores(logits) + bias
    for t in range(logits.shape[0]):
        assert model_selection(keys[t]) == ids[t].tolist(), f"token {t}"


def model_metadata(ids: torch.Tensor, offset: int, n_local: int, tile: int) -> torch.Tensor:
    """The kernel's metadata phase over a [b, 8] id table, packed (unwritten words stay -7)."""
    b = ids.shape[0]
    layout = RoutingMetadata(tile)
    buffer = torch.full((layout.size,), -7, dtype=torch.int32)
    route_ids = ids.reshape(-1).tolist() + [routing.NO_ROUTE] * (routing.ROUTES_MAX - b * K)
    counts = [sum(1 for v in route_ids if v == e) if offset <= e < offset + n_local else 0 for e in range(E)]
    tiles = [-(-c // tile) for c in counts]
    first = [sum(tiles[:e]) for e in range(E)]
    cta_count = sum(tiles)
    padded = cta_count * tile
    buffer[:4] = torch.tensor([padded, cta_count, b, tile])
    for e in range(E):
        for j in range(tiles[e]):
            c = first[e] + j
            buffer[routing.CTA_TO_EXPERT_OFFSET + c] = e - offset
            buffer[routing.CTA_ROW_LIMIT_OFFSET + c] = min((c + 1) * tile, first[e] * tile + counts[e])
    buffer[routing.PERMUTED_TO_TOKEN_OFFSET : routing.PERMUTED_TO_TOKEN_OFFSET + padded] = -1
    for r in range(b * K):
        e = route_ids[r]
        rank = sum(1 for q in range(r) if route_ids[q] == e)
        local = offset <= e < offset + n_local
        row = first[e] * tile + rank
        buffer[routing.EXPANDED_OFFSET + r] = row if local else routing.NOT_LOCAL
        if local:
            buffer[routing.PERMUTED_TO_TOKEN_OFFSET + row] = r // K
    return buffer


@pytest.mark.parametrize("tile", [1, 3, 8, 64, 256])
@pytest.mark.parametrize("offset, n_local", [(0, 256), (0, 128), (128, 128), (17, 40), (255, 1)])
def test_model_metadata_equals_the_reference_on_live_words(tile, offset, n_local):
    g = torch.Generator().manual_seed(tile * 131 + offset)
    layout = RoutingMetadata(tile)
    for b in range(1, B + 1):
        for crowd in (E, 12):  # spread, or crowded onto a few experts
            base = min(offset, E - crowd)
            ids = torch.stack([base + torch.randperm(crowd, generator=g)[:K] for _ in range(b)]).to(torch.int32)
            got = layout.live_fields(model_metadata(ids, offset, n_local, tile))
            want = layout.live_fields(pack_metadata(routing_metadata_reference(ids, local_expert_offset=offset, num_local_experts=n_local, tile_n=tile), tile_n=tile))
            for name in want:
                assert torch.equal(got[name], want[name]), (b, crowd, name)
            # Nothing outside the live words.
            buffer = model_metadata(ids, offset, n_local, tile)
            live = torch.zeros(layout.size, dtype=torch.bool)
            off = layout.offsets
            padded, ctas = int(buffer[0]), int(buffer[1])
            for name, length in (("header", 4), ("expanded_to_permuted", b * K), ("cta_to_expert", ctas), ("cta_row_limit", ctas), ("permuted_to_token", padded)):
                live[off[name] : off[name] + length] = True
            assert bool((buffer[~live] == -7).all())


def test_model_metadata_stays_in_bounds_with_repeated_ids():
    # -inf biases make the router repeat expert 0; the stock is undefined there, the kernel must
    # still stay inside the layout.
    ids = torch.zeros(B, K, dtype=torch.int32)
    for tile in (1, 7, 256):
        buffer = model_metadata(ids, 0, E, tile)
        layout = RoutingMetadata(tile)
        assert int(buffer[1]) <= layout.max_ctas(B) and int(buffer[0]) <= layout.max_padded_rows(B)


# ---------------------------------------------------------------------------------------------
# route(): every argument outside the contract is a ValueError before any launch.


def _args(b: int = 2, **overrides):
    args = {
        "logits": torch.zeros(b, E),
        "bias": torch.zeros(E),
        "ids": torch.zeros(b, K, dtype=torch.int32),
        "weights": torch.zeros(b, K),
        "scale": 2.5,
        "renormalize": True,
        "metadata": None,
        "local_expert_offset": 0,
        "num_local_experts": 0,
        "tile_n": 0,
    }
    args.update(overrides)
    return args


def _meta_args(tile: int = 8, **overrides):
    base = {"metadata": torch.zeros(routing.metadata_size(tile), dtype=torch.int32), "local_expert_offset": 0, "num_local_experts": E, "tile_n": tile}
    base.update(overrides)
    return _args(**base)


def _misaligned(shape, dtype) -> torch.Tensor:
    n = math.prod(shape)
    return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


BAD_ROUTE_ARGS = [
    # tensors: type, dtype, shape, batch bounds, layout
    ("logits", _args(logits=[[0.0] * E]), "logits must be a torch.Tensor"),
    ("logits", _args(logits=torch.zeros(2, E, dtype=torch.float64)), "logits must be torch.float32"),
    ("logits", _args(logits=torch.zeros(2, E, dtype=torch.bfloat16)), "logits must be torch.float32"),
    ("logits", _args(logits=torch.zeros(2, 128)), r"logits must be \[b, 256\]"),
    ("logits", _args(logits=torch.zeros(2 * E)), r"logits must be \[b, 256\]"),
    ("logits", _args(logits=torch.zeros(0, E), ids=torch.zeros(0, K, dtype=torch.int32), weights=torch.zeros(0, K)), "batch must be 1..8"),
    ("logits", _args(9, ), "batch must be 1..8"),
    ("logits", _args(logits=torch.zeros(E, 2).t()), "logits must be contiguous"),
    ("logits", _args(logits=_misaligned((2, E), torch.float32)), "logits must be 16-byte aligned"),
    ("bias", _args(bias=torch.zeros(E, dtype=torch.float16)), "bias must be torch.float32"),
    ("bias", _args(bias=torch.zeros(E + 1)), r"bias must have shape \(256,\)"),
    ("bias", _args(bias=torch.zeros(2 * E)[::2]), "bias must be contiguous"),
    ("bias", _args(bias=_misaligned((E,), torch.float32)), "bias must be 16-byte aligned"),
    ("ids", _args(ids=torch.zeros(2, K, dtype=torch.int64)), "ids must be torch.int32"),
    ("ids", _args(ids=torch.zeros(3, K, dtype=torch.int32)), r"ids must have shape \(2, 8\)"),
    ("ids", _args(ids=torch.zeros(2, 4, dtype=torch.int32)), r"ids must have shape \(2, 8\)"),
    ("ids", _args(ids=torch.zeros(K, 2, dtype=torch.int32).t()), "ids must be contiguous"),
    ("weights", _args(weights=torch.zeros(2, K, dtype=torch.bfloat16)), "weights must be torch.float32"),
    ("weights", _args(weights=torch.zeros(1, K)), r"weights must have shape \(2, 8\)"),
    ("weights", _args(weights=_misaligned((2, K), torch.float32)), "weights must be 16-byte aligned"),
    # scalars
    ("scale", _args(scale=float("nan")), "scale must be finite"),
    ("scale", _args(scale=INF), "scale must be finite"),
    ("scale", _args(scale=True), "scale must be a real number"),
    ("scale", _args(scale="2.5"), "scale must be a real number"),
    ("scale", _args(scale=torch.tensor(2.5)), "scale must be a real number"),
    ("renormalize", _args(renormalize=1), "renormalize must be a bool"),
    # metadata knobs without a buffer
    ("no-metadata", _args(tile_n=8), "only go with a metadata buffer"),
    ("no-metadata", _args(num_local_experts=E), "only go with a metadata buffer"),
    ("no-metadata", _args(local_expert_offset=3), "only go with a metadata buffer"),
    ("no-metadata", _args(tile_n=False), "only go with a metadata buffer"),
    # metadata
    ("tile_n", _meta_args(tile_n=0), r"tile_n must be in \[1, 256\]"),
    ("tile_n", _meta_args(tile_n=257), r"tile_n must be in \[1, 256\]"),
    ("tile_n", _meta_args(tile_n=8.0), "tile_n must be an int"),
    ("tile_n", _meta_args(tile_n=True), "tile_n must be an int"),
    ("num_local_experts", _meta_args(num_local_experts=0), r"num_local_experts must be in \[1, 256\]"),
    ("num_local_experts", _meta_args(num_local_experts=257), r"num_local_experts must be in \[1, 256\]"),
    ("local_expert_offset", _meta_args(local_expert_offset=-1), r"local_expert_offset must be in \[0, 255\]"),
    ("local_expert_offset", _meta_args(local_expert_offset=200, num_local_experts=57), r"local experts \[200, 257\) exceed 256"),
    ("metadata", _meta_args(metadata=torch.zeros(routing.metadata_size(8), dtype=torch.int64)), "metadata must be torch.int32"),
    # the layout without its guard element is one short
    ("metadata", _meta_args(metadata=torch.zeros(metadata_size(8), dtype=torch.int32)), r"at least metadata_size\(8\) = 709 words"),
    ("metadata", _meta_args(16, metadata=torch.zeros(routing.metadata_size(8), dtype=torch.int32)), r"at least metadata_size\(16\)"),
    ("metadata", _meta_args(metadata=torch.zeros(2, routing.metadata_size(8), dtype=torch.int32)), "1-D buffer"),
    ("metadata", _meta_args(metadata=_misaligned((routing.metadata_size(8),), torch.int32)), "metadata must be 16-byte aligned"),
    ("metadata", _meta_args(metadata=torch.zeros(2 * routing.metadata_size(8), dtype=torch.int32)[::2]), "metadata must be contiguous"),
    # everything valid, but on the CPU
    ("device", _args(), "logits must be on a CUDA device"),
    ("device", _meta_args(), "logits must be on a CUDA device"),
]


@pytest.mark.parametrize("what, args, message", BAD_ROUTE_ARGS, ids=[f"{i}-{w}" for i, (w, _, _) in enumerate(BAD_ROUTE_ARGS)])
def test_route_refuses_arguments_outside_the_contract(what, args, message):
    before = compilation.CACHE.keys()
    with pytest.raises(ValueError, match=message):
        routing.route(**args)
    assert compilation.CACHE.keys() == before, "nothing is compiled (or launched) for a refused call"


def test_route_checks_layouts_before_devices():
    # On a CPU-only host every tensor is on the wrong device; the layout checks still come first.
    with pytest.raises(ValueError, match="bias must have shape"):
        routing.route(**_args(bias=torch.zeros(3)))
