"""CUDA-graph timing with one process per rank: `musebench bench tail --launcher torchrun`.

Every rank process times the same paths on the same inputs, each as a CUDA graph of `calls`
back-to-back calls on the rank's stream, and rank 0 reports the max over ranks of each median:

- `ep_tail` / `tp_tail`: musebench's kernels over the Lamport mailboxes (checked bitwise against
  the stock's expected bits for this rank after the last replay);
- `finalize`: the stock post-expert finalize alone (`stock.triton_finalize`), no communication;
- EP, `finalize+nccl`: the finalize, then `torch.distributed.all_reduce` of the BF16 partial
  (NCCL); `finalize+symm_mem`: the finalize into a SymmetricMemory buffer, then torch's one-shot
  all-reduce (peer loads, no multicast);
- TP, `nccl+finalize` / `symm_mem+finalize`: the all-reduce of the BF16 K-partial rows, then the
  finalize (the norm needs the full rows, so the reduction comes first).
The row's `stock_us` is the NCCL path (what a user runs without musebench) and `ratio` is
tail / stock. EP rows also time the `publisher` alone (then every rank re-arms its mailboxes
between two barriers), give the reduction's exposed time, the tail minus the publisher, and time
the `single launch` EP tail (one kernel) over the same re-armed mailboxes, checked against the
same bits; all max over ranks, in `kernels_us`. Baseline outputs are not checked bitwise: their sums run in another order.

Replay protocol (per path and replay): a host barrier, one untimed call (a collective: once it
returns on a rank, every peer has reached the same call, so launch skew is not timed), the start
event, the timed graph, the end event. NCCL refuses two ranks on one GPU, so the NCCL and
SymmetricMemory baselines run only with one process per GPU; otherwise the row notes why, and that
the tail's µs then time the driver's time slices (`driver.shared_gpu_timing_note`).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from musebench.harness import checks
from musebench.harness.bench import PUBLISHER, REDUCE_EXPOSED, SINGLE_LAUNCH, BenchOptions, capture_graph
from musebench.harness.cases import TailCase, TailInputs, make_tail_inputs
from musebench.harness.driver import (
    RankMailboxes,
    RunOptions,
    add_rank_counts,
    bind_tail,
    bytes_moved,
    check_rank_output,
    expected_outputs,
    shared_gpu_timing_note,
)
from musebench.harness.results import CaseResult, RankResult
from musebench.layout import UnfinalizedMoEOutput


@dataclass
class RankTimes:
    """One rank's medians (µs per call) and its check of the tail's last output."""

    check: RankResult  # the tail's output vs this rank's stock bits, or the rank's error
    times_us: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.check.rank


class _Collectives:
    """The baselines' communication: an NCCL group and SymmetricMemory on it (one process per GPU)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="nccl")
        from musebench.comm.device import enable_symmetric_memory

        self.symmetric_memory = enable_symmetric_memory(self.group)

    def symmetric_buffer(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        buffer = self.symmetric_memory.empty(*shape, dtype=torch.bfloat16, device=device)
        buffer.zero_()
        self.symmetric_memory.rendezvous(buffer, self.group)
        return buffer

    def one_shot(self, source: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops.symm_mem.one_shot_all_reduce_out(source, "sum", self.group.group_name, out)


def time_path(body: Callable[[], None], stream: torch.cuda.Stream, options: BenchOptions,
              collective: bool) -> float:
    """Median µs per call of `body` replayed as a graph of `options.calls` calls (see module doc).

    Collective: every rank calls this for the same path in the same order.
    """
    with torch.cuda.stream(stream):
        body()  # eager warm-up: compiles, initialises communicators, outside capture
    stream.synchronize()
    sync = capture_graph(stream, 1, body) if collective else None
    timed = capture_graph(stream, options.calls, body)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.cuda.stream(stream):
        for replay in range(3 + options.replays):
            dist.barrier()
            if sync is not None:
                sync.replay()
            start.record(stream)
            timed.replay()
            end.record(stream)
            end.synchronize()
            if replay >= 3:
                times.append(start.elapsed_time(end) * 1e3 / options.calls)
    return statistics.median(times)


def _bench_case(case: TailCase, rank: int, boxes: RankMailboxes, run_options: RunOptions, options: BenchOptions,
                collectives: _Collectives | None) -> RankTimes:
    from musebench.stock.triton_finalize import triton_finalize

    result = RankTimes(check=RankResult(rank=rank))
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    inputs: TailInputs = make_tail_inputs(case)
    unfinalized = inputs.per_rank[rank].to(device)
    norm_weight = inputs.norm_weight.to(device)
    m, width = case.tokens, case.width
    try:
        tail = bind_tail(case, rank, boxes, inputs, run_options)
        want = expected_outputs(case, inputs, run_options)[0][rank]
        out = checks.poison(torch.empty(m, width, dtype=torch.bfloat16, device=device))
        result.times_us[case.kernel] = time_path(lambda: tail.run(unfinalized, out), stream, options, collective=True)
        tail.check_fault()
        check_rank_output(result.check, out.cpu(), want)
    except Exception as error:
        result.check.error = f"rank {rank}: {type(error).__name__}: {error}"
        return result
    if case.mode == "ep":
        try:  # the publisher alone; its slots stay published, so every rank re-arms after
            result.times_us[PUBLISHER] = time_path(lambda: tail.run_publisher(unfinalized, out), stream, options,
                                                   collective=False)
        except Exception as error:
            result.notes.append(f"publisher not timed: {type(error).__name__}: {error}")
        dist.barrier()  # no peer still publishing into this rank's mailbox
        boxes.reset()
        dist.barrier()
        # a difference is this rank's error, but the collective paths below still run on every rank
        _time_single_launch(case, rank, boxes, inputs, unfinalized, want, run_options, options, stream, result)

    def finalize(source: UnfinalizedMoEOutput, into: torch.Tensor) -> None:
        triton_finalize(source, norm_weight, into, eps=case.eps, gain_center=case.gain_center,
                        weight_before_norm=case.weight_before_norm)

    partial = torch.empty(m, width, dtype=torch.bfloat16, device=device)
    try:
        result.times_us["finalize"] = time_path(lambda: finalize(unfinalized, partial), stream, options,
                                                collective=False)
    except Exception as error:
        result.notes.append(f"finalize not timed: {type(error).__name__}: {error}")
        return result
    if collectives is None:
        timing_note = shared_gpu_timing_note(int(os.environ.get("LOCAL_WORLD_SIZE", case.tp)))
        if timing_note is not None:
            result.notes.append(timing_note)
            result.notes.append("NCCL and SymmetricMemory baselines need one process per GPU "
                                "(NCCL refuses two ranks on one GPU)")
        return result
    group = collectives.group
    try:
        if case.mode == "ep":
            def finalize_nccl() -> None:
                finalize(unfinalized, partial)
                dist.all_reduce(partial, group=group)

            result.times_us["finalize+nccl"] = time_path(finalize_nccl, stream, options, collective=True)
        else:
            rows = unfinalized.gemm2_permuted.clone()
            summed = UnfinalizedMoEOutput(rows, unfinalized.route_weights, unfinalized.expanded_idx_to_permuted_idx)

            def nccl_finalize() -> None:
                dist.all_reduce(rows, group=group)  # in place, as on the GEMM's output
                finalize(summed, partial)

            result.times_us["nccl+finalize"] = time_path(nccl_finalize, stream, options, collective=True)
    except Exception as error:
        result.notes.append(f"NCCL baseline not timed: {type(error).__name__}: {error}")
    try:
        if case.mode == "ep":
            source = collectives.symmetric_buffer((m, width), device)
            reduced = torch.empty_like(partial)

            def finalize_one_shot() -> None:
                finalize(unfinalized, source)
                collectives.one_shot(source, reduced)

            result.times_us["finalize+symm_mem"] = time_path(finalize_one_shot, stream, options, collective=True)
        else:
            source = collectives.symmetric_buffer(tuple(unfinalized.gemm2_permuted.shape), device)
            source.copy_(unfinalized.gemm2_permuted)
            reduced_rows = torch.empty_like(source)
            summed = UnfinalizedMoEOutput(reduced_rows, unfinalized.route_weights,
                                          unfinalized.expanded_idx_to_permuted_idx)

            def one_shot_finalize() -> None:
                collectives.one_shot(source, reduced_rows)
                finalize(summed, partial)

            result.times_us["symm_mem+finalize"] = time_path(one_shot_finalize, stream, options, collective=True)
    except Exception as error:
        result.notes.append(f"SymmetricMemory baseline not timed: {type(error).__name__}: {error}")
    return result


STOCK_BASELINE = {"ep": "finalize+nccl", "tp": "nccl+finalize"}
KERNEL_TIMES = (PUBLISHER, SINGLE_LAUNCH)  # rows' kernels_us, not baselines


def _time_single_launch(case: TailCase, rank: int, boxes: RankMailboxes, inputs: TailInputs,
                        unfinalized: UnfinalizedMoEOutput, want: torch.Tensor, run_options: RunOptions,
                        options: BenchOptions, stream: torch.cuda.Stream, result: RankTimes) -> None:
    """Collective: the EP tail as one kernel over this rank's re-armed mailboxes, timed like the
    tail and checked against the same bits (a difference, a fault or a failure is the rank's
    error, as in the virtual bench); every rank re-arms again after it."""
    device = unfinalized.gemm2_permuted.device
    out = checks.poison(torch.empty(case.tokens, case.width, dtype=torch.bfloat16, device=device))
    try:
        single = bind_tail(case, rank, boxes, inputs, replace(run_options, ep_launch="single"))
        dist.barrier()  # every rank compiled and warmed up before any spins on a peer
        result.times_us[SINGLE_LAUNCH] = time_path(lambda: single.run(unfinalized, out), stream, options,
                                                   collective=True)
        single.check_fault()
        check = RankResult(rank=rank)
        check_rank_output(check, out.cpu(), want)
        if check.mismatches:
            first = check.first_mismatch
            if not result.check.mismatches:  # the row's counts are the first failing form's
                result.check.mismatches, result.check.max_ulp = check.mismatches, check.max_ulp
                result.check.first_mismatch = first
            result.check.error = (f"rank {rank}: the single-launch EP tail differs from the stock: {check.mismatches} "
                                  f"words, first at {first.index if first is not None else '?'}")
    except Exception as error:
        result.check.error = result.check.error or f"rank {rank}: single launch: {type(error).__name__}: {error}"
        result.times_us.pop(SINGLE_LAUNCH, None)
    dist.barrier()
    boxes.reset()
    dist.barrier()


def bench_row(case: TailCase, ranks: Sequence[RankTimes], transport: str, options: BenchOptions) -> CaseResult:
    """Rank 0's row: every path's max over ranks, the tail's bit check summed over ranks."""
    row = CaseResult(
        kernel=case.kernel, mode=case.mode, tp=case.tp, tokens=case.tokens, weight_dtype=case.weight_dtype,
        norm=case.norm, inputs=case.inputs, seed=case.seed, backend="cute", launcher="torchrun",
        transport=transport, stock="reference", iters=options.calls * options.replays,
        bytes_moved=bytes_moved(case), measurement="bench",
        stock_path=f"timed vs {STOCK_BASELINE[case.mode]}",
    )
    errors = [r.check.error for r in ranks if r.check.error is not None]
    for r in sorted(ranks, key=lambda r: r.rank):
        row.ranks.append(replace(r.check, tail_us=r.times_us.get(case.kernel)))
        add_rank_counts(row, row.ranks[-1])
        row.notes.extend(note for note in r.notes if note not in row.notes)
    if len(ranks) != case.tp:
        errors.append(f"{case.tp - len(ranks)} rank(s) returned no result")
    if errors:
        row.error = errors[0] + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else "")
        row.rank_identical = False
        return row
    if case.mode == "ep":  # the EP tail gives every rank the same bits
        row.rank_identical = len({r.check.digest for r in ranks}) == 1
    names = dict.fromkeys(name for r in ranks for name in r.times_us)
    worst = {name: max(r.times_us[name] for r in ranks if name in r.times_us) for name in names}
    missing = [name for name in names if any(name not in r.times_us for r in ranks)]
    for name in missing:
        row.notes.append(f"{name}: timed on some ranks only")
        worst.pop(name)
    row.tail_us = worst.pop(case.kernel, None)
    for name in KERNEL_TIMES:
        if name in worst:
            row.kernels_us[name] = worst.pop(name)
    if PUBLISHER in row.kernels_us and row.tail_us is not None:
        row.kernels_us[REDUCE_EXPOSED] = row.tail_us - row.kernels_us[PUBLISHER]
    row.stock_us = worst.get(STOCK_BASELINE[case.mode])
    row.baselines_us = worst
    return row


def run_bench_rank(cases: Sequence[TailCase], run_options: RunOptions, options: BenchOptions, boxes: RankMailboxes,
                   transport: str, results_path: Path | None,
                   on_case: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """This rank's part of a process bench (process group and mailboxes already set up); rank 0
    returns the rows, the others []."""
    from musebench.harness.worker import finish_case

    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    collectives, unavailable = None, None
    if local_world <= torch.cuda.device_count():
        try:  # collective: every rank takes the same branch (same host, same GPU count)
            collectives = _Collectives()
        except Exception as error:  # the tails are still timed; the row says why the baselines are not
            unavailable = f"NCCL / SymmetricMemory baselines unavailable: {type(error).__name__}: {error}"
    rows = []
    for index, case in enumerate(cases):
        print(f"rank {rank} started case {index}", flush=True)
        times = _bench_case(case, rank, boxes, run_options, options, collectives)
        if unavailable is not None:
            times.notes.append(unavailable)
        print(f"rank {rank} done case {index}", flush=True)
        row = finish_case(times, lambda gathered: bench_row(case, gathered, transport, options), boxes,
                          results_path, on_case)
        if row is not None:
            rows.append(row)
    return rows
