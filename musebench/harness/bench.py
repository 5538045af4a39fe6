"""CUDA-graph timing of the cute EP tail on virtual ranks sharing one GPU.

Method (STYLE 11): compile and warm every rank's tail, check one eager call bitwise against the
stock reference, then capture `calls` back-to-back calls of all tp ranks in one CUDA graph (each
call forks the capture stream to one stream per rank and joins them again), replay the graph
`replays` times, and report the median replay time divided by `calls`. The outputs of the last
replay are checked again, so every timed row carries its correctness.

On one GPU the tp ranks share the SMs: the number is the time of one collective call of the
whole group (every rank's publisher and reduction), not one rank's time on its own GPU.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from musebench import numerics as nx
from musebench.harness import checks
from musebench.harness.cases import TailCase, TailInputs, make_tail_inputs
from musebench.harness.results import CaseResult, RankResult


@dataclass(frozen=True)
class BenchOptions:
    calls: int = 20  # back-to-back calls per graph
    replays: int = 30
    timeout_s: float = 2.0


def _expected(case: TailCase, inputs: TailInputs, device: torch.device) -> torch.Tensor:
    from musebench.stock.ep import ep_tail_reference

    return ep_tail_reference(
        [u.to(device) for u in inputs.per_rank], inputs.norm_weight.to(device), eps=case.eps,
        gain_center=case.gain_center, weight_before_norm=case.weight_before_norm,
        approximations=nx.hardware_approximations(),
    ).cpu()


def _check(case: TailCase, outs: list[torch.Tensor], want: torch.Tensor, row: CaseResult) -> None:
    row.ranks = []
    row.mismatches, row.max_ulp, row.first_mismatch = 0, 0, None
    for rank, out in enumerate(outs):
        got = out.cpu()
        count, ulp, first = checks.compare_bits(got, want, rank=rank)
        row.ranks.append(RankResult(rank=rank, digest=checks.digest(got), mismatches=count, max_ulp=ulp, first_mismatch=first))
        row.mismatches += count
        row.max_ulp = max(row.max_ulp, ulp)
        row.first_mismatch = row.first_mismatch or first
    row.rank_identical = len({r.digest for r in row.ranks}) == 1


def bench_ep_tail(case: TailCase, options: BenchOptions) -> CaseResult:
    """One timed row: the EP tail of `case` on tp virtual ranks of the current GPU."""
    from musebench.comm.device import local_device_group
    from musebench.kernels.tail import EpTail

    device = torch.device("cuda", torch.cuda.current_device())
    row = CaseResult(
        kernel=case.kernel, mode=case.mode, tp=case.tp, tokens=case.tokens, weight_dtype=case.weight_dtype,
        norm=case.norm, inputs=case.inputs, seed=case.seed, backend="cute", launcher="virtual", transport="local",
        stock="reference", stock_path="ep-ll one-shot", iters=options.calls * options.replays,
        bytes_moved=case.tp * case.tokens * case.width * 2,
    )
    try:
        inputs = make_tail_inputs(case)
        want = _expected(case, inputs, device)
        boxes = local_device_group(case.tp, case.tp, case.tokens, case.width, device)
        tails = [
            EpTail(rank=r, tp=case.tp, capacity=case.tokens, mailbox=b.words, stage=b.stage, fault=b.fault,
                   norm_weight=inputs.norm_weight.to(device), peer_mailboxes=b.peer_table,
                   weight_before_norm=case.weight_before_norm, weight_dtype=case.weight_dtype, eps=case.eps,
                   gain_center=case.gain_center, timeout_ns=int(options.timeout_s * 1e9))
            for r, b in enumerate(boxes)
        ]
        unfinalized = [u.to(device) for u in inputs.per_rank]
        outs = [checks.poison(torch.empty(case.tokens, case.width, dtype=torch.bfloat16, device=device))
                for _ in range(case.tp)]
        streams = [torch.cuda.Stream(device) for _ in range(case.tp)]
        main = torch.cuda.Stream(device)

        def one_call() -> None:
            fork = torch.cuda.Event()
            fork.record(main)
            for rank in range(case.tp):
                streams[rank].wait_event(fork)
                with torch.cuda.stream(streams[rank]):
                    tails[rank].run(unfinalized[rank], outs[rank])
            for rank in range(case.tp):
                join = torch.cuda.Event()
                join.record(streams[rank])
                main.wait_event(join)

        with torch.cuda.stream(main):
            one_call()
        torch.cuda.synchronize()
        for tail in tails:
            tail.check_fault()
        _check(case, outs, want, row)
        if not row.passed:
            return row

        for out in outs:
            checks.poison(out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=main):
            for _ in range(options.calls):
                one_call()
        row.tail_us = _median_replay_us(graph, main, options)
        for tail in tails:
            tail.check_fault()
        _check(case, outs, want, row)
    except Exception as error:
        row.error = f"{type(error).__name__}: {error}"
    return row


def bench_empty_kernel(options: BenchOptions) -> float:
    """Median µs of one empty launch with the same graph method (the floor every row sits on)."""
    device = torch.device("cuda", torch.cuda.current_device())
    scratch = torch.zeros(1, device=device)
    main = torch.cuda.Stream(device)
    with torch.cuda.stream(main):
        scratch.add_(0)  # warm the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=main):
        for _ in range(options.calls):
            scratch.add_(0)
    return _median_replay_us(graph, main, options)


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
