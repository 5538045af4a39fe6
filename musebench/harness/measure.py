"""The two measurements of every case: the check (raw bits) and the bench (CUDA-graph medians).

Check. A rank's outputs after its calls are compared with the stock's expected bits for that
rank and output (`Expected`), on integer views (`checks.compare_bits`): mismatches summed over
ranks and outputs, the lowest rank's first mismatch, the max ULP. An output may have several
expected tensors (routing's ids must equal both the Triton stock and the reference): it must
equal each. Ranks the stock gives equal bits must hold equal bits (`rank_identical`); a rank's
repeated calls must give equal bits (`deterministic`); a rank whose outputs still hold the poison
wrote nothing, which is its error. Check rows carry no timings: a host clock around a call is
not a kernel time.

Bench (STYLE 11). N back-to-back calls captured in one CUDA graph, replayed, the median replay
divided by N; every timed row is checked after its replays like a check row. Virtual ranks
sharing one GPU time one call of the whole group (each call forks the capture stream to one
stream per rank and joins them); a process per rank times its own call behind a host barrier and
a one-call sync graph (so launch skew is not timed) and reports the max over ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from musebench.harness import checks
from musebench.harness.case import Expected
from musebench.harness.results import CaseResult, RankResult

PUBLISHER = "publisher"  # rows' kernels_us: the EP publishers alone
REDUCE_EXPOSED = "reduce (call - publisher)"
SINGLE_LAUNCH = "single launch"  # the EP tail as one kernel
WARM_REPLAYS = 3


@dataclass(frozen=True)
class BenchOptions:
    calls: int = 20  # back-to-back calls per graph
    replays: int = 30
    timeout_s: float = 2.0


@dataclass
class RankOutcome:
    """What one rank brings back from a case: its outputs (host copies), the digest of every
    checked call, its bench medians, or the one-line error that ended it."""

    rank: int
    outputs: dict[str, torch.Tensor] | None = None
    digests: list[str] = field(default_factory=list)
    times_us: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    variant_outputs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # bench: other forms
    host: str | None = None  # a process rank's host name (its diagnostics reach rank 0 with it)


def outputs_digest(outputs: dict[str, torch.Tensor]) -> str:
    return checks.digest(torch.cat([t.detach().cpu().contiguous().view(torch.uint8).flatten()
                                    for _, t in sorted(outputs.items())])) if outputs else ""


def check_rank(row: RankResult, got: dict[str, torch.Tensor], want: dict[str, Any]) -> None:
    """Fill `row` from one rank's outputs vs its expected bits (every output, every expectation)."""
    for name in sorted(want):
        got_tensor = got[name].detach().cpu()
        wants = want[name] if isinstance(want[name], tuple) else (want[name],)
        for expected in wants:
            count, ulp, first = checks.compare_bits(got_tensor, expected, rank=row.rank)
            row.mismatches += count
            row.max_ulp = max(row.max_ulp, ulp)
            row.first_mismatch = row.first_mismatch or first
    row.digest = outputs_digest(got)
    if got and all(checks.still_poisoned(t) for t in got.values()):
        row.error = row.error or f"rank {row.rank}: its outputs still hold the poison: the kernel wrote nothing"


def add_rank_counts(result: CaseResult, row: RankResult) -> None:
    """Add one rank's mismatch counts to its case's row (the first mismatch is the lowest rank's)."""
    result.mismatches += row.mismatches
    result.max_ulp = max(result.max_ulp, row.max_ulp)
    if row.first_mismatch is not None and result.first_mismatch is None:
        result.first_mismatch = row.first_mismatch


def identical_where_stock_is(got: dict[int, dict[str, torch.Tensor]], expected: Expected) -> bool:
    """Output by output, ranks the stock gives the same bits agree with each other (`got`: the
    outputs of the ranks that did not error). Per output, not per rank: routing's ids must agree
    on every rank though each rank's metadata is its own."""
    groups: dict[tuple[str, str], set[str]] = {}
    for rank, outputs in got.items():
        for name, want in expected.per_rank[rank].items():
            key = (name, checks.digest(want[0] if isinstance(want, tuple) else want))
            groups.setdefault(key, set()).add(checks.digest(outputs[name]))
    return all(len(digests) == 1 for digests in groups.values())


def summarize_errors(errors: Sequence[str]) -> str:
    """Root causes first: a rank that stopped making progress, an injected fault or a crash
    explains the timeouts it causes."""
    ordered = sorted(errors, key=lambda e: ("stopped making progress" not in e, "timed out" in e, e))
    extra = len(ordered) - 1
    return ordered[0] + (f" (+{extra} more rank error{'s' if extra > 1 else ''})" if extra else "")


def evaluate(row: CaseResult, tp: int, outcomes: Sequence[RankOutcome], expected: Expected) -> CaseResult:
    """Check every rank's outcome against the stock into `row` (its key fields already set)."""
    row.stock_path = row.stock_path or expected.stock_path
    by_rank = {o.rank: o for o in outcomes}
    errors = []
    checked: dict[int, dict[str, torch.Tensor]] = {}
    for rank in range(tp):
        outcome = by_rank.get(rank)
        result = RankResult(rank=rank, host=outcome.host if outcome is not None else None)
        row.ranks.append(result)
        if outcome is None:
            result.error = f"rank {rank} returned no result"
        elif outcome.error is not None:
            result.error = outcome.error
        elif outcome.outputs is None:
            result.error = f"rank {rank} produced no output"
        if result.error is None:
            check_rank(result, outcome.outputs, expected.per_rank[rank])
            add_rank_counts(row, result)
            checked[rank] = outcome.outputs
            if len(set(outcome.digests)) > 1:
                row.deterministic = False
        if result.error is not None:
            errors.append(result.error)
    row.rank_identical = identical_where_stock_is(checked, expected) and not errors
    if errors:
        row.error = summarize_errors(errors)
    return row


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


class RankStalled(RuntimeError):
    """A rank's work on its device did not finish within its bound: it stopped making progress."""


class PeerNotReady(RuntimeError):
    """A collective path was not timed: some rank could not prepare it (its own error says why)."""


def wait_for_device(event: Any, timeout_s: float, what: str, poll_s: float = 1e-4) -> None:
    """Wait for a recorded CUDA event at most `timeout_s`; RankStalled naming `what` after that."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise RankStalled(f"{what} did not finish within {timeout_s:g} s: the rank stopped making progress")
        time.sleep(poll_s)


def replay_bound_s(options: BenchOptions) -> float:
    """How long one replay of `options.calls` calls may take: each call's waits are bounded by
    the bench's poll timeout (two in sequence at most)."""
    return options.calls * 2.0 * options.timeout_s + 5.0


def graph_median_us(call: Callable[[], None], stream: torch.cuda.Stream, options: BenchOptions,
                    barrier: Callable[[], None] | None = None, sync: Callable[[], None] | None = None,
                    agree: Callable[[bool], bool] | None = None,
                    before_replays: Callable[[], None] | None = None,
                    samples: list[float] | None = None) -> float:
    """Median µs per call of `call` captured `options.calls` times in one graph and replayed
    `options.replays` times after warm replays, every replay waited for at most `replay_bound_s`.

    With `barrier` (processes: a host barrier) every replay waits for every rank first; with
    `sync` (a collective path) a one-call graph of it runs before the timed graph, so a rank's time
    starts when every peer has reached the same call. `agree(ready)` (processes: collective) tells
    every rank whether every rank warmed up and captured the path: if one could not, none replays
    (PeerNotReady, or the rank's own error), so the ranks' barriers stay in step.
    `before_replays` runs on `stream` after the warm-up and capture, before the first replay (the
    caller's poison: the replays, not the warm-up, must write what the check then reads).
    `samples`, where given, receives every timed replay's µs per call (the spread around the median).
    """
    error: Exception | None = None
    sync_graph = timed = None
    try:
        stream.wait_stream(torch.cuda.current_stream())  # what the caller queued (inputs, poison) lands first
        with torch.cuda.stream(stream):
            call()  # eager warm-up: compiles, initialises communicators, outside capture
        warmed = torch.cuda.Event()
        warmed.record(stream)
        wait_for_device(warmed, replay_bound_s(options), "the warm-up call")
        sync_graph = capture_graph(stream, 1, sync) if sync is not None else None
        timed = capture_graph(stream, options.calls, call)
    except Exception as failure:  # reported after every rank knows
        error = failure
    if agree is not None and not agree(error is None):
        raise error if error is not None else PeerNotReady("a peer could not prepare this path")
    if error is not None:
        raise error
    if before_replays is not None:
        with torch.cuda.stream(stream):
            before_replays()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    with torch.cuda.stream(stream):
        for replay in range(WARM_REPLAYS + options.replays):
            if barrier is not None:
                barrier()
            if sync_graph is not None:
                sync_graph.replay()
            start.record(stream)
            timed.replay()
            end.record(stream)
            wait_for_device(end, replay_bound_s(options), "a timed replay")
            if replay >= WARM_REPLAYS:
                times.append(start.elapsed_time(end) * 1e3 / options.calls)
    if samples is not None:
        samples.extend(times)
    return statistics.median(times)
