"""The EP tail kernels on one GPU with virtual ranks, bitwise against the torch reference.

Virtual ranks: every rank has its own mailbox (a separate device buffer), stage words, fault
record and CUDA stream; the peer table holds every mailbox's address, so the unicast publisher
writes straight into the other ranks' buffers as it would over NVLink. All ranks are launched
before anything waits, so the reductions overlap the publishers as on a real group.

Expected values: `musebench.stock.ep.ep_tail_reference` on the same inputs with the GPU's own
approximations (`hardware_approximations()`: the rsqrt bits). Outputs are poisoned first; the
comparison is on raw bits (-0.0 and NaN payloads count). The single-launch tail
(`single_launch=True`) is held to the same reference and, like the two launches, ends every
call with its stage words [calls % 3, 0].

Last run: four H200s, 2026-11-29, CuTe DSL 4.8.1 (cu13 libs), torch 2.11+cu130, at 8773b7e (the
kernels of 5582f64: the reduction polling while the publisher runs, the arrival count):
`pytest -m gpu tests/kernels` 690 passed (records/2026-11-29-4xh200-pytest-gpu-kernels.summary.json).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("cutlass")

from musebench.comm import protocol  # noqa: E402
from musebench.kernels.approx import hardware_approximations  # noqa: E402
from musebench.cases.tail_inputs import TailCase, make_tail_inputs  # noqa: E402
from musebench.kernels import ep_tail as tail  # noqa: E402
from musebench.layout import UnfinalizedMoEOutput  # noqa: E402
from musebench.stock.ep import ep_tail_reference  # noqa: E402
from tests._bits import assert_raw_bits_equal  # noqa: E402
from tests._streams import launch_ranks  # noqa: E402

pytestmark = pytest.mark.gpu

WIDTH, TOP_K, CAPACITY = 4096, 8, 8
POISON_BITS = 0x7FA5  # a BF16 NaN the conversion never produces (cvt.rn gives 0x7FFF for NaN)
SHORT_TIMEOUT_NS = 200_000_000
HOLD_NS = 1_000_000_000  # the live ranks start together: none times out on a rank still being launched


class VirtualGroup:
    """tp virtual ranks on the current GPU, armed and ready."""

    def __init__(self, tp: int, norm_weight: torch.Tensor, *, weight_dtype: str, before: bool,
                 timeout_ns: int = protocol.DEFAULT_TIMEOUT_NS, enable_pdl: bool = True, eps: float = 1e-8,
                 gain_center: float = 1.0, single_launch: bool = False):
        device = torch.device("cuda")
        self.tp = tp
        self.mailboxes = [
            torch.full(tail.mailbox_shape(tp, CAPACITY, WIDTH), protocol.SENTINEL_BF16_BITS, dtype=torch.int16, device=device)
            for _ in range(tp)
        ]
        self.peers = torch.tensor([box.data_ptr() for box in self.mailboxes], dtype=torch.int64, device=device)
        self.stages = [torch.zeros(protocol.STAGE_WORDS, dtype=torch.int32, device=device) for _ in range(tp)]
        self.faults = [torch.full((protocol.FAULT_WORDS,), protocol.FAULT_CLEAR, dtype=torch.int32, device=device) for _ in range(tp)]
        self.norm_weight = norm_weight.to(device)
        self.tails = [
            tail.EpTail(
                rank=rank, tp=tp, capacity=CAPACITY, mailbox=self.mailboxes[rank], stage=self.stages[rank],
                fault=self.faults[rank], norm_weight=self.norm_weight, peer_mailboxes=self.peers,
                weight_before_norm=before, weight_dtype=weight_dtype, eps=eps, gain_center=gain_center,
                enable_pdl=enable_pdl, timeout_ns=timeout_ns, single_launch=single_launch,
            )
            for rank in range(tp)
        ]
        self.streams = [torch.cuda.Stream() for _ in range(tp)]
        torch.cuda.synchronize()

    def launch(self, per_rank, outs, *, skip: tuple[int, ...] = (), hold_ns: int = 0) -> None:
        launch_ranks(self.tails, self.streams, per_rank, outs, skip=skip, hold_ns=hold_ns)

    def fault_records(self) -> list[tail.EpFault | None]:
        return [tail.decode_fault(f.tolist(), CAPACITY) for f in self.faults]


def _poisoned(m: int) -> torch.Tensor:
    return torch.full((m, WIDTH), POISON_BITS, dtype=torch.int16, device="cuda").view(torch.bfloat16)


def _on_gpu(u: UnfinalizedMoEOutput) -> UnfinalizedMoEOutput:
    return u.to("cuda")


def _reference(inputs, case: TailCase) -> torch.Tensor:
    return ep_tail_reference(
        [_on_gpu(u) for u in inputs.per_rank], inputs.norm_weight.cuda(), eps=case.eps, gain_center=case.gain_center,
        weight_before_norm=case.weight_before_norm, approximations=hardware_approximations(),
    )


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert_raw_bits_equal(got, want, what, poison_bits=POISON_BITS)


def _assert_clean(group: VirtualGroup, calls: int) -> None:
    """No fault, every mailbox fully re-armed, the stage words advanced `calls` times."""
    assert group.fault_records() == [None] * group.tp, group.fault_records()
    for rank, box in enumerate(group.mailboxes):
        assert bool((box == protocol.SENTINEL_BF16_BITS).all()), f"rank {rank}: mailbox not re-armed"
    # both forms: NEXT_STAGE, and the arrival count back to 0
    expected = [calls % protocol.LAMPORT_GENERATIONS, 0]
    for rank, stage in enumerate(group.stages):
        assert stage.tolist() == expected, f"rank {rank}: stage words {stage.tolist()} after {calls} calls"


# Regimes: tp 2 (smallest), 3 (odd: uneven expert split, peer wrap), 4, 8 (the H200 node); every
# token count of decode; both route-weight dtypes and norm orders; random rows and the adversarial
# family (-0.0 rows, subnormals, +-2^24 beside 1, overflowing squares, zero and tiny weights).
PARITY = [
    pytest.param(tp, m, dtype, norm, family, False, id=f"tp{tp}-m{m}-{dtype}-{norm}-{family}")
    for tp in (2, 3, 4, 8)
    for m in range(1, 9)
    for dtype in ("bf16", "fp32")
    for norm in ("before", "after")
    for family in ("random", "adversarial")
] + [  # the single launch: fewer token counts, the same regimes
    pytest.param(tp, m, dtype, norm, family, True, id=f"single-launch-tp{tp}-m{m}-{dtype}-{norm}-{family}")
    for tp in (2, 3, 8)
    for m in (1, 5, 8)
    for dtype in ("bf16", "fp32")
    for norm in ("before", "after")
    for family in ("random", "adversarial")
]


@pytest.mark.parametrize("tp, m, weight_dtype, norm, family, single_launch", PARITY)
def test_ep_tail_is_bitwise_the_reference(tp, m, weight_dtype, norm, family, single_launch):
    case = TailCase(mode="ep", tp=tp, tokens=m, weight_dtype=weight_dtype, norm=norm, inputs=family, seed=0)
    first = make_tail_inputs(case)
    group = VirtualGroup(tp, first.norm_weight, weight_dtype=weight_dtype, before=case.weight_before_norm,
                         single_launch=single_launch)
    # Three calls back to back: every generation once, each relying on the re-arms before it.
    for call, seed in enumerate((0, 1, 2)):
        inputs = make_tail_inputs(case.with_seed(seed))
        inputs = type(inputs)(inputs.per_rank, first.norm_weight)  # gamma is bound to the group
        outs = [_poisoned(m) for _ in range(tp)]
        group.launch([_on_gpu(u) for u in inputs.per_rank], outs)
        torch.cuda.synchronize()
        want = _reference(inputs, case)
        for rank in range(tp):
            assert_same_bits(outs[rank], want, f"{case.label()} call {call} rank {rank}")
        _assert_clean(group, call + 1)


@pytest.mark.parametrize("single_launch", [False, True], ids=["two-launches", "single-launch"])
@pytest.mark.parametrize("enable_pdl", [True, False], ids=["pdl", "nopdl"])
def test_many_calls_rotate_generations(enable_pdl, single_launch):
    case = TailCase(mode="ep", tp=3, tokens=5, weight_dtype="fp32", norm="before", inputs="random")
    gamma = make_tail_inputs(case).norm_weight
    group = VirtualGroup(3, gamma, weight_dtype="fp32", before=True, enable_pdl=enable_pdl, single_launch=single_launch)
    for call in range(10):
        m = 1 + call % CAPACITY  # the grid changes with m; the generation (and the arrival count) runs on
        case = TailCase(mode="ep", tp=3, tokens=m, weight_dtype="fp32", norm="before", inputs="random")
        inputs = make_tail_inputs(case.with_seed(100 + call))
        inputs = type(inputs)(inputs.per_rank, gamma)
        outs = [_poisoned(m) for _ in range(3)]
        group.launch([_on_gpu(u) for u in inputs.per_rank], outs)
        torch.cuda.synchronize()
        want = _reference(inputs, case)
        for rank in range(3):
            assert_same_bits(outs[rank], want, f"call {call} rank {rank}")
        _assert_clean(group, call + 1)


def test_publishers_then_reductions_apart_equal_the_whole_call():
    """`run_publisher` on every rank, then `run_reduce` on every rank (how scripts/profile-tail.py
    launches them for a serialising profiler): the same bits and stage words as `run`, twice."""
    case = TailCase(mode="ep", tp=2, tokens=8, weight_dtype="bf16", norm="before", inputs="adversarial")
    first = make_tail_inputs(case)
    group = VirtualGroup(2, first.norm_weight, weight_dtype="bf16", before=True)
    for call, seed in enumerate((0, 1)):
        inputs = make_tail_inputs(case.with_seed(seed))
        inputs = type(inputs)(inputs.per_rank, first.norm_weight)  # gamma is bound to the group
        per_rank = [_on_gpu(u) for u in inputs.per_rank]
        outs = [_poisoned(8) for _ in range(2)]
        for rank in range(2):  # the inputs' copies and the poison, issued on this stream, come first
            group.streams[rank].wait_stream(torch.cuda.current_stream())
        for rank in range(2):
            with torch.cuda.stream(group.streams[rank]):
                group.tails[rank].run_publisher(per_rank[rank], outs[rank])
        for rank in range(2):
            with torch.cuda.stream(group.streams[rank]):
                group.tails[rank].run_reduce(outs[rank])
        torch.cuda.synchronize()
        want = _reference(inputs, case)
        for rank in range(2):
            assert_same_bits(outs[rank], want, f"call {call} rank {rank}")
        _assert_clean(group, call + 1)
    with pytest.raises(ValueError, match="exceed the mailbox capacity"):
        group.tails[0].run_reduce(torch.empty(CAPACITY + 1, WIDTH, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="out must be"):
        group.tails[0].run_reduce(torch.empty(1, WIDTH, dtype=torch.float32, device="cuda"))
    single = VirtualGroup(2, first.norm_weight, weight_dtype="bf16", before=True, single_launch=True)
    with pytest.raises(ValueError, match="no separate reduction"):
        single.tails[0].run_reduce(_poisoned(1))


def test_empty_batch_launches_nothing():
    case = TailCase(mode="ep", tp=2, tokens=0)
    inputs = make_tail_inputs(case)
    group = VirtualGroup(2, inputs.norm_weight, weight_dtype="bf16", before=True)
    outs = [torch.empty(0, WIDTH, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    group.launch([_on_gpu(u) for u in inputs.per_rank], outs)
    torch.cuda.synchronize()
    assert [s.tolist() for s in group.stages] == [[0, 0], [0, 0]]
    assert group.fault_records() == [None, None]


@pytest.mark.parametrize("single_launch", [False, True], ids=["two-launches", "single-launch"])
@pytest.mark.parametrize("tp, missing", [(2, 1), (3, 1), (8, 0)])
def test_missing_rank_records_a_fault_instead_of_hanging(tp, missing, single_launch):
    m = 3
    case = TailCase(mode="ep", tp=tp, tokens=m)
    inputs = make_tail_inputs(case)
    group = VirtualGroup(tp, inputs.norm_weight, weight_dtype="bf16", before=True, timeout_ns=SHORT_TIMEOUT_NS,
                         single_launch=single_launch)
    outs = [_poisoned(m) for _ in range(tp)]
    started = time.monotonic()
    group.launch([_on_gpu(u) for u in inputs.per_rank], outs, skip=(missing,), hold_ns=HOLD_NS)
    torch.cuda.synchronize()
    waited = time.monotonic() - started
    assert waited < 30.0, f"the bounded wait took {waited:.1f}s"
    for rank in range(tp):
        if rank == missing:
            continue
        record = group.fault_records()[rank]
        assert record is not None, f"rank {rank} recorded no fault"
        assert (record.rank, record.peer, record.slot, record.generation) == (rank, missing, missing, 0), record
        assert 0 <= record.token < m
        # No fragment can complete without the missing rank: the output keeps its poison.
        assert bool((outs[rank].view(torch.int16) == POISON_BITS).all()), f"rank {rank} wrote output without rank {missing}"
        with pytest.raises(RuntimeError, match=f"rank {rank} timed out waiting for rank {missing}"):
            group.tails[rank].check_fault()
        # the generation advanced anyway and the arrival count is back to 0
        assert group.stages[rank].tolist() == [1, 0]


@pytest.mark.parametrize("single_launch", [False, True], ids=["two-launches", "single-launch"])
@pytest.mark.parametrize("tp", [2, 3, 8])
def test_graph_of_back_to_back_calls_replays_bitwise(tp, single_launch):
    calls, replays, m = 10, 100, 4
    case = TailCase(mode="ep", tp=tp, tokens=m, weight_dtype="bf16", norm="before", inputs="random")
    gamma = make_tail_inputs(case).norm_weight
    group = VirtualGroup(tp, gamma, weight_dtype="bf16", before=True, single_launch=single_launch)

    # Static input buffers, sized for the most rows a rank can hold (every route local).
    rows = [torch.zeros(m * TOP_K, WIDTH, dtype=torch.bfloat16, device="cuda") for _ in range(tp)]
    weights = [torch.zeros(m, TOP_K, dtype=torch.bfloat16, device="cuda") for _ in range(tp)]
    index = [torch.full((m, TOP_K), -1, dtype=torch.int32, device="cuda") for _ in range(tp)]
    static = [UnfinalizedMoEOutput(rows[r], weights[r], index[r]) for r in range(tp)]
    outs = [torch.empty(calls, m, WIDTH, dtype=torch.bfloat16, device="cuda") for _ in range(tp)]

    def load(seed: int):
        inputs = make_tail_inputs(case.with_seed(seed))
        for r, u in enumerate(inputs.per_rank):
            rows[r].zero_()
            rows[r][: u.gemm2_permuted.shape[0]].copy_(u.gemm2_permuted)
            weights[r].copy_(u.route_weights)
            index[r].copy_(u.expanded_idx_to_permuted_idx)
        for out in outs:
            out.view(torch.int16).fill_(POISON_BITS)
        return type(inputs)(inputs.per_rank, gamma)

    # Warm up eagerly (everything is compiled at construction; nothing compiles under capture).
    load(0)
    group.launch(static, [out[0] for out in outs])
    torch.cuda.synchronize()
    _assert_clean(group, 1)

    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=capture):
        for call in range(calls):
            group.launch(static, [out[call] for out in outs])

    done = 1
    for replay in range(replays):
        inputs = load(1000 + replay)
        graph.replay()
        torch.cuda.synchronize()
        done += calls
        want = _reference(inputs, case)
        for r in range(tp):
            for call in range(calls):
                assert_same_bits(outs[r][call], want, f"replay {replay} call {call} rank {r}")
        _assert_clean(group, done)
