"""The TP tail kernel on one GPU with virtual ranks, bitwise against the stock reference.

Virtual ranks: every rank has its own route and token mailboxes (separate device buffers), stage
words, fault record and CUDA stream; the peer tables hold every mailbox's address, so a rank's
pushes and publishes land straight in the other ranks' buffers as they would over NVLink. All
ranks are launched before anything waits.

Expected values: for each rank, `musebench.stock.tp.tp_rank_output` of `tp_tail_reference` on
the same inputs, on the path the stock's dispatch picks for an H200 (nsm = 132), with the GPU's
own rsqrt (`hardware_approximations()`). Each m is bound to that path's knobs
(`TpVariant.from_path`). Outputs are poisoned first; the comparison is on raw bits (-0.0 and
NaN payloads count).

Run on an H200 (CuTe DSL 4.8.1, torch 2.11) at 15f3cc4: every test but the 1000-replay one,
which was host-bound then (fresh inputs made on the CPU for each replay) and now draws from a
pool of input sets made once.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("cutlass")

from musebench.comm import protocol  # noqa: E402
from musebench.kernels.approx import hardware_approximations  # noqa: E402
from musebench.cases.tail_inputs import TailCase, make_tail_inputs  # noqa: E402
from musebench.kernels import tp_tail  # noqa: E402
from musebench.layout import UnfinalizedMoEOutput  # noqa: E402
from musebench.stock.tp import tp_rank_output, tp_stock_path, tp_tail_reference  # noqa: E402
from tests._bits import assert_raw_bits_equal  # noqa: E402
from tests._streams import launch_ranks  # noqa: E402

pytestmark = pytest.mark.gpu

H, K = tp_tail.H_DIM, tp_tail.TOP_K
CAPACITY = 8
NSM = 132  # the H200's SM count: the stock's dispatch rule applied to it
POISON_BITS = 0x7FA5  # a BF16 NaN the conversion never produces (cvt.rn gives 0x7FFF for NaN)
SHORT_TIMEOUT_NS = 200_000_000
HOLD_NS = 1_000_000_000  # the live ranks start together: none times out on a rank still being launched


def plan(tp: int, tokens: range | list[int] = range(1, CAPACITY + 1)) -> dict[int, tp_tail.TpVariant]:
    """The kernel's knobs for every m: the stock's path at (m, tp, nsm = 132)."""
    return {m: tp_tail.TpVariant.from_path(tp_stock_path(m, tp, NSM)) for m in tokens}


class VirtualGroup:
    """tp virtual ranks of the TP tail on the current GPU, armed and warmed up."""

    def __init__(self, tp: int, norm_weight: torch.Tensor, *, weight_dtype: str, before: bool,
                 variants: dict[int, tp_tail.TpVariant], timeout_ns: int = protocol.DEFAULT_TIMEOUT_NS,
                 enable_pdl: bool = True, eps: float = 1e-8, gain_center: float = 1.0):
        device = torch.device("cuda")
        self.tp = tp
        sentinel = protocol.SENTINEL_BF16_BITS
        self.route_boxes = [torch.full(tp_tail.route_mailbox_shape(tp, CAPACITY), sentinel, dtype=torch.int16, device=device)
                            for _ in range(tp)]
        self.token_boxes = [torch.full(tp_tail.token_mailbox_shape(CAPACITY), sentinel, dtype=torch.int16, device=device)
                            for _ in range(tp)]
        self.route_peers = torch.tensor([b.data_ptr() for b in self.route_boxes], dtype=torch.int64, device=device)
        self.token_peers = torch.tensor([b.data_ptr() for b in self.token_boxes], dtype=torch.int64, device=device)
        self.stages = [torch.zeros(protocol.STAGE_WORDS, dtype=torch.int32, device=device) for _ in range(tp)]
        self.faults = [torch.full((protocol.FAULT_WORDS,), protocol.FAULT_CLEAR, dtype=torch.int32, device=device) for _ in range(tp)]
        self.norm_weight = norm_weight.to(device)
        self.tails = [
            tp_tail.TpTail(
                rank=rank, tp=tp, capacity=CAPACITY, route_mailbox=self.route_boxes[rank], route_peers=self.route_peers,
                token_mailbox=self.token_boxes[rank], token_peers=self.token_peers, stage=self.stages[rank],
                fault=self.faults[rank], norm_weight=self.norm_weight, weight_before_norm=before,
                weight_dtype=weight_dtype, eps=eps, gain_center=gain_center, variants=variants,
                timeout_ns=timeout_ns, enable_pdl=enable_pdl,
            )
            for rank in range(tp)
        ]
        self.streams = [torch.cuda.Stream() for _ in range(tp)]
        torch.cuda.synchronize()

    def launch(self, per_rank, outs, *, skip: tuple[int, ...] = (), hold_ns: int = 0) -> None:
        launch_ranks(self.tails, self.streams, per_rank, outs, skip=skip, hold_ns=hold_ns)

    def fault_records(self) -> list[tp_tail.TpFault | None]:
        return [tp_tail.decode_fault(f.tolist()) for f in self.faults]


def _poisoned(m: int) -> torch.Tensor:
    return torch.full((m, H), POISON_BITS, dtype=torch.int16, device="cuda").view(torch.bfloat16)


def _on_gpu(u: UnfinalizedMoEOutput) -> UnfinalizedMoEOutput:
    return u.to("cuda")


def expected(per_rank, norm_weight, *, eps: float, gain_center: float, before: bool) -> list[torch.Tensor]:
    """Every rank's stock bits (H200 dispatch, the GPU's rsqrt)."""
    reference, path = tp_tail_reference(
        [_on_gpu(u) for u in per_rank], norm_weight.cuda(), eps=eps, gain_center=gain_center,
        weight_before_norm=before, nsm=NSM, approximations=hardware_approximations(),
    )
    return [tp_rank_output(reference, path, rank) for rank in range(len(per_rank))]


def _expected_for(inputs, case: TailCase) -> list[torch.Tensor]:
    return expected(inputs.per_rank, inputs.norm_weight, eps=case.eps, gain_center=case.gain_center,
                    before=case.weight_before_norm)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert_raw_bits_equal(got, want, what, poison_bits=POISON_BITS)


def _assert_clean(group: VirtualGroup, calls: int) -> None:
    """No fault, every mailbox word re-armed, the generation advanced `calls` times."""
    assert group.fault_records() == [None] * group.tp, group.fault_records()
    for rank in range(group.tp):
        assert bool((group.route_boxes[rank] == protocol.SENTINEL_BF16_BITS).all()), f"rank {rank}: route mailbox not re-armed"
        assert bool((group.token_boxes[rank] == protocol.SENTINEL_BF16_BITS).all()), f"rank {rank}: token mailbox not re-armed"
        want = [calls % protocol.LAMPORT_GENERATIONS, 0]
        assert group.stages[rank].tolist() == want, f"rank {rank}: stage words {group.stages[rank].tolist()} after {calls} calls"


# Regimes: tp 2, 4 (expert-owner S16, KO 4 / 2, EXACT delivery for every m <= 8), tp 8 (expert-owner
# KO 1 for m <= 7, token-owner XP = 8 rounded products at m = 8, SCRUBBED), tp 3 (extension: FMA
# chain, S16 up to m = 6 and S8 at m = 7, 8); every decode m; both route-weight dtypes and norm
# orders; random rows and the adversarial family (-0.0 rows, subnormals, +-2^24 beside 1,
# overflowing squares, K-partials that cancel, zero and tiny weights).
PARITY = [
    pytest.param(tp, m, dtype, norm, family, id=f"tp{tp}-m{m}-{dtype}-{norm}-{family}")
    for tp in (2, 3, 4, 8)
    for m in range(1, 9)
    for dtype in ("bf16", "fp32")
    for norm in ("before", "after")
    for family in ("random", "adversarial")
]


@pytest.mark.parametrize("tp, m, weight_dtype, norm, family", PARITY)
def test_tp_tail_is_bitwise_the_stock(tp, m, weight_dtype, norm, family):
    case = TailCase(mode="tp", tp=tp, tokens=m, weight_dtype=weight_dtype, norm=norm, inputs=family, seed=0)
    first = make_tail_inputs(case)
    group = VirtualGroup(tp, first.norm_weight, weight_dtype=weight_dtype, before=case.weight_before_norm,
                         variants=plan(tp, [m]))
    # Two calls back to back: the second runs on generation 1 and relies on the first's re-arm.
    for call, seed in enumerate((0, 1)):
        inputs = make_tail_inputs(case.with_seed(seed))
        inputs = type(inputs)(inputs.per_rank, first.norm_weight)  # gamma is bound to the group
        outs = [_poisoned(m) for _ in range(tp)]
        group.launch([_on_gpu(u) for u in inputs.per_rank], outs)
        torch.cuda.synchronize()
        want = _expected_for(inputs, case)
        for rank in range(tp):
            assert_same_bits(outs[rank], want[rank], f"{case.label()} call {call} rank {rank}")
        _assert_clean(group, call + 1)


def _negative_zero_inputs(tp: int, m: int) -> tuple[list[UnfinalizedMoEOutput], torch.Tensor]:
    """Inputs whose every output word is the sentinel pattern before and after rounding.

    Route 0 of every token has the row 1.0 (rank 0's K-partial; the others hold 0.0), weight
    -2^-134 (FP32); the other routes are zero with weight 0. With gamma = 0 and the norm after
    the weighting: Q = 4096, r = rsqrt(1 + 1e-8) = rsqrt(1.0), y = 1.0 * r, and the combine ends at
    -2^-134 (binary32 0x80008000) on every path, which rounds to BF16 -0.0: the owner's row is all
    (-0.0, -0.0) words. The single launch's copies must read +0.0; the expert-owner path must
    deliver -0.0 to every rank (its FP32 transport maps the sentinel pattern to -0.0).
    """
    rows_per_rank = []
    index = torch.arange(m * K, dtype=torch.int32).reshape(m, K)
    weights = torch.zeros(m, K, dtype=torch.float32)
    weights[:, 0] = -(2.0**-134)
    for rank in range(tp):
        rows = torch.zeros(m * K, H, dtype=torch.bfloat16)
        if rank == 0:
            rows[index[:, 0].long()] = 1.0
        rows_per_rank.append(UnfinalizedMoEOutput(rows, weights.clone(), index.clone()))
    return rows_per_rank, torch.zeros(H, dtype=torch.bfloat16)


@pytest.mark.parametrize("tp, m", [(2, 3), (4, 5), (8, 7), (8, 8), (3, 4)],
                         ids=["tp2-expert-owner", "tp4-expert-owner", "tp8-expert-owner", "tp8-token-owner", "tp3-extension"])
def test_negative_zero_rows_are_delivered_as_the_stock_delivers_them(tp, m):
    per_rank, gamma = _negative_zero_inputs(tp, m)
    group = VirtualGroup(tp, gamma, weight_dtype="fp32", before=False, variants=plan(tp, [m]))
    outs = [_poisoned(m) for _ in range(tp)]
    group.launch([_on_gpu(u) for u in per_rank], outs)
    torch.cuda.synchronize()
    want = expected(per_rank, gamma, eps=1e-8, gain_center=1.0, before=False)
    assert bool((want[0][0].view(torch.int16) == protocol.SENTINEL_BF16_BITS).all()), "the construction must give -0.0 rows"
    scrubbed = tp_stock_path(m, tp, NSM).scrubbed_copies
    for rank in range(tp):
        assert_same_bits(outs[rank], want[rank], f"tp {tp} m {m} rank {rank}")
        copied = [t for t in range(m) if t % tp != rank]
        if copied:
            bits = outs[rank][copied].view(torch.int16)
            assert bool((bits == (0 if scrubbed else protocol.SENTINEL_BF16_BITS)).all())
    _assert_clean(group, 1)


@pytest.mark.parametrize("enable_pdl", [True, False], ids=["pdl", "nopdl"])
def test_many_calls_rotate_generations(enable_pdl):
    case = TailCase(mode="tp", tp=3, tokens=5, weight_dtype="fp32", norm="before", inputs="random")
    gamma = make_tail_inputs(case).norm_weight
    group = VirtualGroup(3, gamma, weight_dtype="fp32", before=True, variants=plan(3), enable_pdl=enable_pdl)
    for call in range(10):
        m = 1 + call % CAPACITY  # the variant changes with m; the generation runs on regardless
        inputs = make_tail_inputs(TailCase(mode="tp", tp=3, tokens=m, weight_dtype="fp32", norm="before",
                                           inputs="random", seed=100 + call))
        inputs = type(inputs)(inputs.per_rank, gamma)
        outs = [_poisoned(m) for _ in range(3)]
        group.launch([_on_gpu(u) for u in inputs.per_rank], outs)
        torch.cuda.synchronize()
        want = expected(inputs.per_rank, gamma, eps=case.eps, gain_center=case.gain_center, before=True)
        for rank in range(3):
            assert_same_bits(outs[rank], want[rank], f"call {call} m {m} rank {rank}")
        _assert_clean(group, call + 1)


def test_empty_batch_launches_nothing():
    case = TailCase(mode="tp", tp=2, tokens=0)
    inputs = make_tail_inputs(case)
    group = VirtualGroup(2, inputs.norm_weight, weight_dtype="bf16", before=True, variants=plan(2))
    outs = [torch.empty(0, H, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    group.launch([_on_gpu(u) for u in inputs.per_rank], outs)
    torch.cuda.synchronize()
    assert [s.tolist() for s in group.stages] == [[0, 0], [0, 0]]
    assert group.fault_records() == [None, None]


@pytest.mark.parametrize("tp, m, missing", [(2, 3, 1), (3, 3, 1), (8, 8, 0), (4, 2, 3)])
def test_missing_rank_records_a_fault_instead_of_hanging(tp, m, missing):
    case = TailCase(mode="tp", tp=tp, tokens=m)
    inputs = make_tail_inputs(case)
    group = VirtualGroup(tp, inputs.norm_weight, weight_dtype="bf16", before=True, variants=plan(tp, [m]),
                         timeout_ns=SHORT_TIMEOUT_NS)
    outs = [_poisoned(m) for _ in range(tp)]
    started = time.monotonic()
    group.launch([_on_gpu(u) for u in inputs.per_rank], outs, skip=(missing,), hold_ns=HOLD_NS)
    torch.cuda.synchronize()
    waited = time.monotonic() - started
    assert waited < 30.0, f"the bounded wait took {waited:.1f}s"
    named = set()
    for rank in range(tp):
        if rank == missing:
            continue
        owned = [t for t in range(m) if t % tp == rank]
        others = [t for t in range(m) if t % tp != rank]
        record = group.fault_records()[rank]
        if not owned and not others:
            continue
        # Every token needs the missing rank's K-partials, so every live rank waits in vain.
        assert record is not None, f"rank {rank} recorded no fault"
        assert record.rank == rank and record.generation == 0, record
        if record.route is not None:
            assert record.peer == missing and record.token in owned, record
        else:
            assert record.token in others and record.peer == record.token % tp, record
        named.add(record.peer)
        # No row can complete without the missing rank: the output keeps its poison.
        assert bool((outs[rank].view(torch.int16) == POISON_BITS).all()), f"rank {rank} wrote output without rank {missing}"
        with pytest.raises(RuntimeError, match=f"rank {rank} timed out waiting for rank"):
            group.tails[rank].check_fault()
        # The generation advanced anyway: the next calls stay in step once the group is reset.
        assert group.stages[rank].tolist() == [1, 0]
    assert named, "no live rank waited"


@pytest.mark.parametrize("tp, m", [(4, 4), (8, 8)], ids=["tp4-expert-owner", "tp8-token-owner"])
def test_graph_replays_with_changing_inputs(tp, m):
    calls, replays = 2, 1000
    POOL = 7  # input sets; consecutive replays differ
    case = TailCase(mode="tp", tp=tp, tokens=m, weight_dtype="bf16", norm="before", inputs="random")
    gamma = make_tail_inputs(case).norm_weight
    group = VirtualGroup(tp, gamma, weight_dtype="bf16", before=True, variants=plan(tp, [m]))

    # Static input buffers (the TP layout: every rank has a row for every route).
    rows = [torch.zeros(m * K, H, dtype=torch.bfloat16, device="cuda") for _ in range(tp)]
    weights = [torch.zeros(m, K, dtype=torch.bfloat16, device="cuda") for _ in range(tp)]
    index = [torch.full((m, K), -1, dtype=torch.int32, device="cuda") for _ in range(tp)]
    static = [UnfinalizedMoEOutput(rows[r], weights[r], index[r]) for r in range(tp)]
    outs = [torch.empty(calls, m, H, dtype=torch.bfloat16, device="cuda") for _ in range(tp)]

    # A pool of input sets and their stock bits, made once on the GPU: consecutive replays always
    # load different inputs, and a replay costs device copies, not CPU work.
    pool = []
    for seed in range(1000, 1000 + POOL):
        inputs = make_tail_inputs(case.with_seed(seed))
        per_rank = [_on_gpu(u) for u in inputs.per_rank]
        want = expected(inputs.per_rank, gamma, eps=case.eps, gain_center=case.gain_center, before=True)
        pool.append((per_rank, want))

    def load(entry: int) -> list[torch.Tensor]:
        per_rank, want = pool[entry]
        for r, u in enumerate(per_rank):
            rows[r].copy_(u.gemm2_permuted)
            weights[r].copy_(u.route_weights)
            index[r].copy_(u.expanded_idx_to_permuted_idx)
        for out in outs:
            out.view(torch.int16).fill_(POISON_BITS)
        return want

    # Warm up eagerly (everything is compiled at construction; nothing compiles under capture).
    want = load(0)
    group.launch(static, [out[0] for out in outs])
    torch.cuda.synchronize()
    for r in range(tp):
        assert_same_bits(outs[r][0], want[r], f"warm-up rank {r}")
    _assert_clean(group, 1)

    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=capture):
        for call in range(calls):
            group.launch(static, [out[call] for out in outs])

    done = 1
    for replay in range(replays):
        want = load((replay + 1) % POOL)  # entry 0 was the warm-up's: the first replay changes inputs
        graph.replay()
        torch.cuda.synchronize()
        done += calls
        for r in range(tp):
            for call in range(calls):
                if not torch.equal(outs[r][call].view(torch.int16), want[r].view(torch.int16)):
                    assert_same_bits(outs[r][call], want[r], f"replay {replay} call {call} rank {r}")
        if replay % 100 == 99:
            _assert_clean(group, done)
    _assert_clean(group, done)
