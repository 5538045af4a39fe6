"""CUDA-graph timing of the cute tails on virtual ranks sharing one GPU.

Method (STYLE 11): compile and warm every rank's tail, check one eager call bitwise against the
stock's expected bits for each rank, then capture `calls` back-to-back calls of all tp ranks in
one CUDA graph (each call forks the capture stream to one stream per rank and joins them again),
replay the graph `replays` times, and report the median replay time divided by `calls`. The
outputs of the last replay are checked again, so every timed row carries its correctness.

On one GPU the tp ranks share the SMs: the number is the time of one collective call of the
whole group (every rank's kernels), not one rank's time on its own GPU; the process bench
(`bench_process`, one process per GPU) gives that. `stock_us` is the stock finalize of one rank's
partial alone, timed the same way (the brief's aim: a tail per rank no slower than it).

Per kernel (`kernels_us`, EP rows): the publishers alone, graph-replayed the same way (their
slots stay published, so every mailbox is re-armed before the tail is timed, and the tail's
check after its replays shows the group intact), the reduction's exposed time, the call minus
the publisher, and the EP tail as one kernel (`single launch`, over re-armed mailboxes, checked
like the call: a difference fails the row). The TP tail is one kernel: its row's `tail_us`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from musebench.harness import checks
from musebench.harness.cases import TailCase, TailInputs, make_tail_inputs
from musebench.harness.results import CaseResult, RankResult


# The EP reduction is timed only behind its publisher (alone it would wait on slots nobody fills):
# its exposed time is the call's median minus the publisher's.
PUBLISHER = "publisher"  # the EP publishers alone
REDUCE_EXPOSED = "reduce (call - publisher)"
SINGLE_LAUNCH = "single launch"  # the EP tail as one kernel (publisher and reduction per token in one CTA)


@dataclass(frozen=True)
class BenchOptions:
    calls: int = 20  # back-to-back calls per graph
    replays: int = 30
    timeout_s: float = 2.0


def _check(outs: list[torch.Tensor], wants: list[torch.Tensor], row: CaseResult) -> None:
    """Every rank's output against its own expected bits; ranks the stock gives equal bits must agree."""
    from musebench.harness.driver import add_rank_counts, check_rank_output, identical_where_stock_is

    row.ranks = []
    row.mismatches, row.max_ulp, row.first_mismatch = 0, 0, None
    for rank, out in enumerate(outs):
        result = RankResult(rank=rank)
        check_rank_output(result, out.cpu(), wants[rank])
        row.ranks.append(result)
        add_rank_counts(row, result)
    row.rank_identical = identical_where_stock_is(row.ranks, wants)


def _eager_and_checked(call: Callable[[], None], stream: torch.cuda.Stream, tails, outs: list[torch.Tensor],
                       wants: list[torch.Tensor], row: CaseResult) -> None:
    """One eager `call` on `stream` into poisoned outputs (compiling and loading what it needs
    before any capture), then every rank's fault record and bits into `row`."""
    for out in outs:
        checks.poison(out)
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    for tail in tails:
        tail.check_fault()
    _check(outs, wants, row)


def bench_virtual_tail(case: TailCase, options: BenchOptions, nsm: int) -> CaseResult:
    """One timed row: the cute tail of `case` on tp virtual ranks of the current GPU, and the stock
    finalize of rank 0's partial alone (no communication) timed the same way as `stock_us`."""
    from musebench.harness.driver import (
        RunOptions,
        bind_tail,
        bytes_moved,
        co_residency_refusal,
        device_mailboxes,
        expected_outputs,
    )

    device = torch.device("cuda", torch.cuda.current_device())
    run_options = RunOptions(backend="cute", launcher="virtual", timeout_s=options.timeout_s, nsm=nsm)
    row = CaseResult(
        kernel=case.kernel, mode=case.mode, tp=case.tp, tokens=case.tokens, weight_dtype=case.weight_dtype,
        norm=case.norm, inputs=case.inputs, seed=case.seed, backend="cute", launcher="virtual", transport="local",
        stock="reference", iters=options.calls * options.replays,
        bytes_moved=bytes_moved(case), measurement="bench",
    )
    try:
        inputs = make_tail_inputs(case)
        wants, path = expected_outputs(case, inputs, run_options)
        row.stock_path = f"{path}; timed vs finalize (one rank, no communication)"
        boxes = device_mailboxes((case.mode,), case.tp, case.tokens, case.width, case.top_k)
        tails = [bind_tail(case, r, boxes[r], inputs, run_options) for r in range(case.tp)]
        refusal = co_residency_refusal(tails[0], case)
        if refusal is not None:
            raise ValueError(refusal)
        unfinalized = [u.to(device) for u in inputs.per_rank]
        outs = [checks.poison(torch.empty(case.tokens, case.width, dtype=torch.bfloat16, device=device))
                for _ in range(case.tp)]
        streams = [torch.cuda.Stream(device) for _ in range(case.tp)]
        main = torch.cuda.Stream(device)

        def group_call(launch) -> None:
            fork = torch.cuda.Event()
            fork.record(main)
            for rank in range(case.tp):
                streams[rank].wait_event(fork)
                with torch.cuda.stream(streams[rank]):
                    launch(rank)
            for rank in range(case.tp):
                join = torch.cuda.Event()
                join.record(streams[rank])
                main.wait_event(join)

        def one_call() -> None:
            group_call(lambda rank: tails[rank].run(unfinalized[rank], outs[rank]))

        _eager_and_checked(one_call, main, tails, outs, wants, row)
        if not row.passed:
            return row

        if case.mode == "ep":
            # The publishers alone; their slots stay published, so every mailbox is re-armed after.
            row.kernels_us[PUBLISHER] = graph_median_us(
                lambda: group_call(lambda rank: tails[rank].run_publisher(unfinalized[rank], outs[rank])), main, options)
            torch.cuda.synchronize()
            for box in boxes:
                box.reset()

        for out in outs:
            checks.poison(out)
        row.tail_us = graph_median_us(one_call, main, options)
        if PUBLISHER in row.kernels_us:
            row.kernels_us[REDUCE_EXPOSED] = row.tail_us - row.kernels_us[PUBLISHER]
        for tail in tails:
            tail.check_fault()
        _check(outs, wants, row)
        row.stock_us = bench_finalize(case, inputs, options)
        row.baselines_us["finalize"] = row.stock_us
        if case.mode == "ep" and row.passed:
            _time_single_launch(case, inputs, unfinalized, boxes, wants, row, options, run_options, group_call, outs,
                                main)
    except Exception as error:
        row.error = f"{type(error).__name__}: {error}"
    return row


def _time_single_launch(case, inputs, unfinalized, boxes, wants, row: CaseResult, options: BenchOptions, run_options,
                        group_call, outs, main) -> None:
    """The EP tail as one kernel per rank over the same (re-armed) mailboxes: its median as
    `kernels_us[SINGLE_LAUNCH]`, its outputs checked like the row's (a difference fails the row)."""
    from musebench.harness.driver import bind_tail

    for box in boxes:
        box.reset()
    single_options = dataclasses.replace(run_options, ep_launch="single")
    singles = [bind_tail(case, r, boxes[r], inputs, single_options) for r in range(case.tp)]

    def one_call() -> None:
        group_call(lambda rank: singles[rank].run(unfinalized[rank], outs[rank]))

    checked = dataclasses.replace(row, ranks=[])  # the row's case; its own checks
    _eager_and_checked(one_call, main, singles, outs, wants, checked)
    if checked.passed:
        for out in outs:
            checks.poison(out)
        row.kernels_us[SINGLE_LAUNCH] = graph_median_us(one_call, main, options)
        for single in singles:
            single.check_fault()
        _check(outs, wants, checked)
    for box in boxes:
        box.reset()
    if not checked.passed:
        first = checked.first_mismatch
        row.mismatches, row.max_ulp, row.first_mismatch = checked.mismatches, checked.max_ulp, first
        row.rank_identical, row.ranks = checked.rank_identical, checked.ranks
        row.error = (f"the single-launch EP tail differs from the stock: {checked.mismatches} words"
                     + (f", first on rank {first.rank} at {first.index}" if first is not None else ""))


def bench_finalize(case: TailCase, inputs: TailInputs, options: BenchOptions) -> float:
    """Median µs of the stock finalize (`stock.triton_finalize`) of rank 0's input, graph-replayed."""
    from musebench.stock.triton_finalize import triton_finalize

    device = torch.device("cuda", torch.cuda.current_device())
    source = inputs.per_rank[0].to(device)
    weight = inputs.norm_weight.to(device)
    partial = torch.empty(case.tokens, case.width, dtype=torch.bfloat16, device=device)
    main = torch.cuda.Stream(device)

    def call() -> None:
        triton_finalize(source, weight, partial, eps=case.eps, gain_center=case.gain_center,
                        weight_before_norm=case.weight_before_norm)

    with torch.cuda.stream(main):
        call()  # compile outside capture
    torch.cuda.synchronize()
    return graph_median_us(call, main, options)


def bench_empty_kernel(options: BenchOptions) -> float:
    """Median µs of one empty launch with the same graph method (the floor every row sits on)."""
    device = torch.device("cuda", torch.cuda.current_device())
    scratch = torch.zeros(1, device=device)
    main = torch.cuda.Stream(device)
    with torch.cuda.stream(main):
        scratch.add_(0)  # warm the kernel before capture
    torch.cuda.synchronize()
    return graph_median_us(lambda: scratch.add_(0), main, options)


def capture_graph(stream: torch.cuda.Stream, calls: int, call: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """`call` captured `calls` times back to back in one CUDA graph on `stream` (compiled and warmed
    up before: capture allocates and compiles nothing)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            call()
    return graph


def graph_median_us(call: Callable[[], None], stream: torch.cuda.Stream, options: BenchOptions) -> float:
    """`call` captured `options.calls` times in one CUDA graph (`capture_graph`), replayed: the
    median µs per call."""
    return _median_replay_us(capture_graph(stream, options.calls, call), stream, options)


def _median_replay_us(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, options: BenchOptions) -> float:
    """Median over `replays` of one replay's time divided by the calls it holds (after 3 warm replays).

    `graph.replay()` launches on the *current* stream, so the replays and the events that bracket
    them are issued on `stream` together.
    """
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        for _ in range(3):
            graph.replay()
        stream.synchronize()
        for _ in range(options.replays):
            start.record(stream)
            graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / options.calls)
    return statistics.median(times)
