"""One driver: launcher (virtual ranks | processes) x measurement (check | bench) x case.

Every case of every family runs the same way (`harness.case` names the steps): the driver
allocates the run's mailboxes once, then per case draws the inputs, binds every rank's runner
through the implementation under test (compiling, before any rank runs and outside capture),
runs the measurement on every rank and checks the ranks' outputs against the stock's bits:

- check: every rank poisons its outputs and makes warmup + iters calls back to back on its own
  CUDA stream (or host thread), each waited for at most `wait_bound_s`, reading its fault record
  and keeping the digest of every checked call and the last outputs (`RankOutcome`); the
  outcomes meet on one rank (the virtual launcher's only thread of control, or rank 0 of a
  process job: gathered over gloo), which computes the stock's bits once and checks every rank
  (`measure.evaluate`). Check rows carry no timings.
- bench: the case's call, its parts (kernels timed apart), its variants (another form of the
  kernel, checked like the call) and the family's baselines, each as CUDA-graph medians
  (`measure.graph_median_us`); the timed outputs are checked like a check row's.

A rank never raises out of a case: errors, timeouts (with their fault record) and injected faults
come back as the outcome's one-line `error`. If any rank failed, every rank re-arms its mailboxes
before the next case, so one failure never poisons the next case; a rank that stopped making
progress ends the run (it still holds its mailboxes), named in the row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from musebench.comm import mailboxes as mailbox_sets
from musebench.comm.transport import TransportRefused, decide, layout_here
from musebench.harness import checks
from musebench.harness.case import Faults, MailboxSpec, RunOptions  # noqa: F401  (Faults: callers' import)
from musebench.harness.measure import (
    PUBLISHER,
    REDUCE_EXPOSED,
    BenchOptions,
    PeerNotReady,
    RankOutcome,
    RankStalled,  # noqa: F401  (the stall a bounded wait raises; tests and callers catch it here)
    evaluate,
    graph_median_us,
    outputs_digest,
    wait_for_device,
)
from musebench.harness.progress import CALL_GRACE_S, ProgressFile, RankProgress, Watch
from musebench.harness.results import CaseResult

_SLEEP_CYCLES_PER_NS = 2  # torch.cuda._sleep spins clock cycles: two per ns hold >= `ns` at <= 2 GHz


class InjectedFault(RuntimeError):
    pass


def family_of(case: Any) -> Any:
    from musebench.cases import FAMILIES

    return FAMILIES[case.family]


def wait_bound_s(options: RunOptions) -> float:
    """How long the host waits for one call of one rank: every device wait inside it is bounded
    by `timeout_s`, and a call holds at most two waits in sequence (publisher, reduction)."""
    return 2.0 * options.timeout_s + 1.0


def hold_current_stream(ns: int) -> None:
    """Keep the current stream busy for at least `ns` of GPU time (an injected hang; in tests, a
    hold that lets ranks forked from the stream start together), then free it."""
    if ns > 0:
        torch.cuda._sleep(ns * _SLEEP_CYCLES_PER_NS)


STARTUP_S = 120.0  # interpreter + torch import + rendezvous for up to 32 ranks on 2 cores
BIND_S = 30.0  # inputs and a CPU bind on a loaded host; a cute bind adds the compile bound
EVALUATE_S = 120.0  # rank 0: the stock reference of every rank and the checks
TEARDOWN_S = 30.0  # the last case reported: mailboxes closed, the process group destroyed, the process gone
COMPILE_S = 240.0  # a cute rank may compile every variant of a case before its first barrier
BENCH_PATHS = 6  # paths a bench case may time: the call, a part, a variant and three baselines


def compile_bound_s(options: RunOptions) -> float:
    return COMPILE_S if options.backend == "cute" else 0.0


def case_bound_s(options: RunOptions, bench: BenchOptions | None = None) -> float:
    """How long one case may take on one rank: its calls, each bounded by `wait_bound_s`.

    A bench case times up to BENCH_PATHS paths, each a warm-up, a capture and 3 + replays replays
    of a one-call and a `calls`-call graph, every call bounded by the bench's poll timeout.
    """
    if bench is not None:
        return BENCH_PATHS * ((3 + bench.replays + 2) * (bench.calls + 1) * 0.01 + bench.timeout_s) + 30.0
    return (options.warmup + options.iters) * (wait_bound_s(options) + 1.0) + 10.0


def call_bound_s(options: RunOptions) -> float:
    """How long one call of one rank may take before the rank has stopped making progress: its
    waits (the CPU model's call waits against one deadline; a GPU call is waited for at most
    `wait_bound_s`) and the host work around them, on a loaded host."""
    waits = wait_bound_s(options) if options.backend == "cute" else options.timeout_s
    return waits + CALL_GRACE_S


def shared_gpu_timing_note(local_world: int) -> str | None:
    """The note on timings of `local_world` processes on this host where they share GPUs, else None.

    Without MPS the driver runs one process's kernels on a GPU at a time, so a collective call
    waits for its peers' time slices: measured on two H200s (tp 4, two processes per GPU),
    2.2 ms per EP tail call and 4.5 ms per TP tail call, against 5 and 10 µs one process per GPU.
    """
    if local_world <= torch.cuda.device_count():
        return None
    return ("processes share GPUs: a call waits for its peers' time slices (no MPS), so its µs time the "
            "driver's scheduling, not the kernels; time kernels one process per GPU or on virtual ranks")


# ---------------------------------------------------------------------------------------------
# What every launcher shares


def mailbox_specs(cases: Sequence[Any], capacity: int = 0, *, bench: bool = False) -> dict[str, MailboxSpec]:
    """The union of the cases' mailboxes, sized for `capacity` tokens (0: the largest token count;
    never fewer than that); with `bench` (a process bench) also their baselines' mailboxes
    (`baseline_mailboxes`, where a family has them)."""
    capacity = max(capacity, max(case.tokens for case in cases), 1)
    specs: dict[str, MailboxSpec] = {}
    for case in cases:
        family = family_of(case)
        wanted = dict(family.mailboxes(case, capacity))
        if bench and hasattr(family, "baseline_mailboxes"):
            wanted.update(family.baseline_mailboxes(case, capacity))
        for name, spec in wanted.items():
            if specs.setdefault(name, spec) != spec:
                raise ValueError(f"mailbox {name!r} is asked for with two shapes in one run")
    return specs


def run_mailbox_specs(cases: Sequence[Any], options: RunOptions, measurement: str) -> dict[str, MailboxSpec]:
    """The mailboxes a process run allocates once: its cases' at `options.capacity`, and for a bench
    their baselines' too (the one-shot all-reduce's); none without cases."""
    return mailbox_specs(cases, options.capacity, bench=measurement == "bench") if cases else {}


def load_impl(options: RunOptions) -> Any:
    """The implementation under test where the backend runs one (cute); None for the CPU model."""
    if options.backend != "cute":
        return None
    from musebench.harness.impl import load_impl as load

    impl = load(options.impl)
    impl.require_process_group(options.launcher)
    return impl


def expected_for(case: Any, inputs: Any, options: RunOptions) -> Any:
    """The stock's bits for the case: with the GPU's own approximate instructions on the cute
    backend (run on the GPU), the exact emulations on the CPU model."""
    from musebench import numerics as nx

    approximations = nx.PRECISE
    if options.backend == "cute":
        from musebench.kernels.approx import hardware_approximations

        approximations = hardware_approximations()
    return family_of(case).expected(case, inputs, options, approximations)


def new_row(case: Any, options: RunOptions, transport: str, iters: int, measurement: str = "check") -> CaseResult:
    """A row with the case's key fields, its run's settings and no result yet."""
    family = family_of(case)
    roofline = getattr(family, "roofline_us", None)  # optional: families with a bandwidth roofline
    fields = dict(backend=options.backend, launcher=options.launcher, transport=transport, stock="reference",
                  iters=iters, bytes_moved=family.bytes_moved(case), measurement=measurement,
                  roofline_us=roofline(case) if roofline is not None else None)
    return CaseResult(**{**fields, **family.row_fields(case, options)})


def co_residency_refusal(runner: Any, case: Any) -> str | None:
    """Why tp virtual ranks of this runner cannot all be resident on this GPU at once, or None.

    A Lamport wait ends only when its peers' CTAs run: every rank's grid must be resident at once,
    or, for launches whose waits split into groups, enough of them that one group is always whole;
    the occupancy API says how many CTAs of each kernel the GPU holds (musebench.kernels.occupancy).
    """
    demands = runner.launch_demands()
    if not demands:
        return None
    from musebench.kernels import occupancy

    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    resident = [occupancy.resident_ctas(demand, sm_count) for demand in demands]
    load = occupancy.group_load(demands, case.tp, resident)
    if load <= 1.0:
        return None
    needed = ", ".join(f"{d.needed_ctas(case.tp)} CTAs of {d.threads} threads at once (GPU holds {r})"
                       for d, r in zip(demands, resident))
    return (f"{case.tp} virtual ranks of the {case.family} at m={case.tokens} cannot all be resident on one GPU "
            f"({needed}; load {load:.2f}): use --launcher torchrun")


def _hang_here() -> None:
    """This rank's host stops making progress (a stuck host thread or process)."""
    threading.Event().wait(10 * 365 * 86400.0)


def check_calls(case: Any, rank: int, runner: Any, options: RunOptions,
                progress: Callable[[int, int], None] | None = None, fault_rank: int | None = None) -> RankOutcome:
    """One rank's calls of a check; never raises (errors come back in the outcome).

    On a GPU every call runs on a stream of the rank's own (forked from the current one, so it
    follows what made the inputs) and is waited for at most `wait_bound_s`. Faults: `silent`
    never launches (its outputs keep the poison, its peers' bounded waits report it); `raise`
    raises; `hang` stops the host (CPU model, processes) or holds the rank's stream past the
    bound (virtual ranks on a GPU, whose host threads cannot be stopped); `exit` ends the
    process; `flip` flips one bit of the host copy (a torch kernel's first launch on the device
    could wait behind a peer's spinning reduction). `progress(call, calls)` is called on this
    rank's thread before each call begins: a rank stuck in a call is the one whose last report
    names it (`harness.progress`). `rank` is the rank within its case group (what the outcome and
    its errors name); `fault_rank` the rank the faults name (the job's rank; `rank` when None).
    """
    outcome = RankOutcome(rank=rank)
    me = rank if fault_rank is None else fault_rank
    calls = options.warmup + options.iters
    faults = options.faults
    device = options.backend == "cute"
    try:
        stream = torch.cuda.Stream() if device else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        host: dict[str, torch.Tensor] = {}
        for call in range(calls):
            if progress is not None:
                progress(call, calls)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for tensor in runner.outputs.values():  # on the rank's stream: before its call, in order
                    checks.poison(tensor)
            if faults.raise_rank == me:
                raise InjectedFault(f"injected fault: rank {rank} raised in call {call}")
            # a GPU rank hangs after its warm-up call (kernels loaded); a host stops at once
            hang = faults.hang_rank == me and call == (options.warmup if device else 0)
            if faults.exit_rank == me and call == options.warmup:
                os._exit(17)
            if hang and not (device and options.launcher == "virtual"):
                _hang_here()
            if faults.silent_rank == me:
                pass  # never launched: the check must find the poison, the peers' waits must report it
            elif device:
                with torch.cuda.stream(stream):
                    if hang:
                        hold_current_stream(int((wait_bound_s(options) + 1.0) * 1e9))
                    runner.call()
                    done = torch.cuda.Event()
                    done.record(stream)
                wait_for_device(done, wait_bound_s(options), f"rank {rank}: call {call} of {case.label()}")
            else:
                runner.call()
            runner.check_fault()
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                host = {name: tensor.detach().cpu().clone() for name, tensor in runner.outputs.items()}
            if faults.flip_rank == me:
                first = next(iter(host.values()))
                if first.numel():
                    checks.flip_one_bit(first, index=first.numel() // 2)
            if call >= options.warmup:
                outcome.digests.append(outputs_digest(host))
        outcome.outputs = host
    except Exception as error:  # a rank reports, it never takes the run down
        message = str(error)  # timeouts and stalls name their rank already
        outcome.error = message if message.startswith("rank ") else f"rank {rank}: {type(error).__name__}: {error}"
    return outcome


# ---------------------------------------------------------------------------------------------
# Virtual ranks: every rank a thread of this process


def run_virtual(cases: Sequence[Any], options: RunOptions, on_case: Callable[[CaseResult], None] | None = None,
                *, measurement: str = "check", bench: BenchOptions | None = None) -> list[CaseResult]:
    """All ranks in this process (one thread, and on a GPU one stream, per rank), over shared
    mailboxes; the rows in case order."""
    if not cases:
        return []
    tp = cases[0].tp
    if any(case.tp != tp for case in cases):
        raise ValueError("one virtual run serves one tp")
    if options.faults.exit_rank is not None:
        raise ValueError("the exit fault needs the torchrun launcher (virtual ranks share one process)")
    bench = bench or BenchOptions()
    transport = decide(layout_here(options.backend, "virtual", tp), options.transport).name  # refused: nothing made
    impl = load_impl(options)
    boxes = mailbox_sets.allocate_virtual(mailbox_specs(cases, options.capacity), tp, transport)
    results = []
    for index, case in enumerate(cases):
        family = family_of(case)
        iters = options.iters if measurement == "check" else bench.calls * bench.replays
        row = new_row(case, options, transport, iters, measurement)
        try:  # draw, then compile every rank's runner here (its variants bind later), before any rank spins
            inputs = family.make_inputs(case)
            runners = [family.bind(case, impl, rank, boxes[rank], inputs, options) for rank in range(tp)]
            if options.backend == "cute":
                refusal = co_residency_refusal(runners[0], case)
                if refusal is not None:
                    raise ValueError(refusal)
            expected = expected_for(case, inputs, options)
        except Exception as error:
            row.error = f"bind: {type(error).__name__}: {error}"
            row.rank_identical = False
            results.append(row)
            if on_case is not None:
                on_case(row)
            continue
        hung: list[int] = []
        if measurement == "check":
            outcomes, hung = _virtual_check(case, index, runners, options)
            evaluate(row, tp, outcomes, expected)
        else:
            _virtual_bench(case, family, runners, boxes, inputs, expected, options, bench, row, impl)
        results.append(row)
        if on_case is not None:
            on_case(row)
        if hung:  # a hung rank still holds its mailboxes: later cases cannot run on this group
            for later in cases[index + 1:]:
                skipped = new_row(later, options, transport, 0, measurement)
                skipped.error = f"not run: {row.error}"
                skipped.rank_identical = False
                results.append(skipped)
                if on_case is not None:
                    on_case(skipped)
            break
        if not row.passed:
            if options.backend == "cute":
                torch.cuda.synchronize()  # nothing still in flight before the words are re-armed
            for rank_boxes in boxes:
                mailbox_sets.reset(rank_boxes)
    for rank_boxes in boxes:
        mailbox_sets.close(rank_boxes)
    return results


def _virtual_check(case: Any, index: int, runners: list, options: RunOptions) -> tuple[list[RankOutcome], list[int]]:
    """Every rank's calls on a thread of its own; returns the outcomes and the hung ranks.

    Each thread reports its calls (`check_calls`'s progress hook) and its end, with its outcome's
    error, to a `progress.Watch`: when no rank has kept its promise (a call: `call_bound_s`) or
    the peers' timeouts name a rank still in the call they gave up in, the ranks still running
    are hung; the watch's line, naming the rank that stopped making progress, is their outcome's
    error. A hung thread is left behind (daemon).
    """
    tp = case.tp
    outcomes: list[RankOutcome | None] = [None] * tp
    records: dict[int, RankProgress] = {}
    bound_s = call_bound_s(options)

    def work(rank: int) -> None:
        def report(call: int, calls: int) -> None:
            records[rank] = RankProgress(rank=rank, phase="call", case=index, call=call, calls=calls, bound_s=bound_s,
                                         seq=call + 1)

        outcome = check_calls(case, rank, runners[rank], options, progress=report)
        outcomes[rank] = outcome
        last = records.get(rank, RankProgress(rank=rank, case=index))
        records[rank] = dataclasses.replace(last, phase="finished", error=outcome.error, seq=last.seq + 1)

    threads = [threading.Thread(target=work, args=(rank,), name=f"musebench-rank{rank}", daemon=True)
               for rank in range(tp)]
    watch = Watch(tp, options.timeout_s, startup_s=bound_s)  # a thread not yet at its first call
    for thread in threads:
        thread.start()
    while True:
        alive = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
        if not alive:
            return [o for o in outcomes if o is not None], []
        watch.observe(dict(records))  # a copy: the threads replace their records meanwhile
        if watch.stalled():
            line = watch.blame()
            for rank in alive:
                outcomes[rank] = RankOutcome(rank=rank, error=line)
            return [o for o in outcomes if o is not None], alive
        threads[alive[0]].join(0.05)


def _group_call(streams: list, main: Any, launch: Callable[[int], None], ranks: Sequence[int]) -> None:
    """One call of every rank in `ranks`: the main stream forks to one stream per rank and joins;
    one rank alone (ranks that never wait on each other) launches on the main stream itself, so
    its time holds no fork and join."""
    if len(ranks) == 1:
        launch(ranks[0])
        return
    fork = torch.cuda.Event()
    fork.record(main)
    for rank in ranks:
        streams[rank].wait_event(fork)
        with torch.cuda.stream(streams[rank]):
            launch(rank)
    for rank in ranks:
        join = torch.cuda.Event()
        join.record(streams[rank])
        main.wait_event(join)


def _poisoner(runners: list, ranks: Sequence[int]) -> Callable[[], None]:
    """Poisons the outputs of `ranks` (the timed ones; the others keep their eager-checked
    outputs): run between a bench's warm-up and its replays, so the replays must write them."""
    def poison() -> None:
        for rank in ranks:
            for tensor in runners[rank].outputs.values():
                checks.poison(tensor)

    return poison


def _eager_check(call: Callable[[], None], main: Any, runners: list, row: CaseResult, tp: int,
                 expected: Any) -> None:
    """One eager call into poisoned outputs (compiling and loading what it needs before capture),
    then every rank's fault record and bits into `row`."""
    for runner in runners:
        for tensor in runner.outputs.values():
            checks.poison(tensor)
    main.wait_stream(torch.cuda.current_stream())  # the poison lands before the call
    with torch.cuda.stream(main):
        call()
    torch.cuda.synchronize()
    _checked(runners, row, tp, expected)


def _checked(runners: list, row: CaseResult, tp: int, expected: Any) -> None:
    """Every rank's fault record and current outputs checked into `row` (its checks replaced)."""
    row.ranks, row.mismatches, row.max_ulp, row.first_mismatch, row.error = [], 0, 0, None, None
    outcomes = []
    for rank, runner in enumerate(runners):
        outcome = RankOutcome(rank=rank)
        try:
            runner.check_fault()
            outcome.outputs = {name: t.detach().cpu() for name, t in runner.outputs.items()}
        except Exception as error:
            outcome.error = f"rank {rank}: {type(error).__name__}: {error}"
        outcomes.append(outcome)
    evaluate(row, tp, outcomes, expected)


def _virtual_bench(case: Any, family: Any, runners: list, boxes: list, inputs: Any, expected: Any,
                   options: RunOptions, bench: BenchOptions, row: CaseResult, impl: Any) -> None:
    """One timed row on virtual ranks of this GPU (see `harness.measure`): ranks that share
    mailboxes are timed as one call of the whole group; ranks without any (routing) never wait on
    each other, so rank 0's call alone is timed."""
    device = torch.device("cuda", torch.cuda.current_device())
    streams = [torch.cuda.Stream(device) for _ in range(case.tp)]
    main = torch.cuda.Stream(device)
    timed_ranks = range(case.tp) if boxes[0] else (0,)
    note = "" if boxes[0] else "; one rank's call (ranks do not communicate)"
    try:
        def call_of(group: list) -> Callable[[], None]:
            return lambda: _group_call(streams, main, lambda rank: group[rank].call(), timed_ranks)

        _eager_check(lambda: _group_call(streams, main, lambda rank: runners[rank].call(), range(case.tp)), main,
                     runners, row, case.tp, expected)
        if not row.passed:
            return
        for name in runners[0].parts():
            row.kernels_us[name] = graph_median_us(
                lambda name=name: _group_call(streams, main, lambda rank: runners[rank].parts()[name](), timed_ranks),
                main, bench)
            torch.cuda.synchronize()
            for rank_boxes in boxes:  # a part leaves slots published: every mailbox re-armed after
                mailbox_sets.reset(rank_boxes)
        row.tail_us = graph_median_us(call_of(runners), main, bench,
                                      before_replays=_poisoner(runners, timed_ranks))
        _checked(runners, row, case.tp, expected)
        if PUBLISHER in row.kernels_us:
            row.kernels_us[REDUCE_EXPOSED] = row.tail_us - row.kernels_us[PUBLISHER]
        for name, baseline in family.baselines(case, inputs, 0, runners[0], None).items():
            row.baselines_us[name] = graph_median_us(baseline.call, main, bench)
        row.baseline_ratio_of = ratios_of(family, row.baselines_us)
        row.stock_us = row.baselines_us.get(family.VIRTUAL_STOCK)
        row.stock_path = f"{row.stock_path}; timed vs {family.VIRTUAL_STOCK} (one rank, no communication){note}"
        if row.passed:
            for name, variant in family.variants(case, options).items():
                _virtual_variant(case, family, name, variant, boxes, inputs, expected, bench, row, impl, streams,
                                 main, timed_ranks)
    except Exception as error:
        row.error = f"{type(error).__name__}: {error}"


def _virtual_variant(case: Any, family: Any, name: str, variant: RunOptions, boxes: list, inputs: Any,
                     expected: Any, bench: BenchOptions, row: CaseResult, impl: Any, streams: list, main: Any,
                     timed_ranks: Sequence[int]) -> None:
    """Another form of the case's kernel over the same (re-armed) mailboxes: its median as
    `kernels_us[name]`, its outputs checked like the row's (a difference fails the row)."""
    for rank_boxes in boxes:
        mailbox_sets.reset(rank_boxes)
    others = [family.bind(case, impl, rank, boxes[rank], inputs, variant) for rank in range(case.tp)]
    checked = dataclasses.replace(row, ranks=[])
    call = lambda: _group_call(streams, main, lambda rank: others[rank].call(), timed_ranks)  # noqa: E731
    _eager_check(lambda: _group_call(streams, main, lambda rank: others[rank].call(), range(case.tp)), main, others,
                 checked, case.tp, expected)
    if checked.passed:
        row.kernels_us[name] = graph_median_us(call, main, bench, before_replays=_poisoner(others, timed_ranks))
        _checked(others, checked, case.tp, expected)
    for rank_boxes in boxes:
        mailbox_sets.reset(rank_boxes)
    if not checked.passed:
        _fail_with_variant(row, checked, name)


def _fail_with_variant(row: CaseResult, checked: CaseResult, name: str) -> None:
    first = checked.first_mismatch
    row.mismatches, row.max_ulp, row.first_mismatch = checked.mismatches, checked.max_ulp, first
    row.rank_identical, row.ranks = checked.rank_identical, checked.ranks
    row.error = checked.error or (f"the {name} form differs from the stock: {checked.mismatches} words"
                                  + (f", first on rank {first.rank} at {first.index}" if first is not None else ""))


# ---------------------------------------------------------------------------------------------
# Processes: this process is one rank of a torchrun (or srun) job


class _Collectives:
    """The baselines' communication: an NCCL group of this rank's case group (the whole job where
    tp is WORLD_SIZE) and SymmetricMemory on it (one process per GPU). Collective: every rank of
    the job makes every group, in order."""

    def __init__(self, tp: int | None = None) -> None:
        import torch.distributed as dist

        from musebench.comm.device import enable_symmetric_memory
        from musebench.comm.transport import keep_multicast_off

        # the baselines never ask for NVLink multicast: where the environment does not say
        # otherwise, neither NCCL nor SymmetricMemory may create a multicast object for them
        keep_multicast_off()
        world, rank = dist.get_world_size(), dist.get_rank()
        tp = tp or world
        if tp == world:
            self.group = dist.new_group(backend="nccl")
        else:
            groups = [dist.new_group(list(range(first, first + tp)), backend="nccl") for first in range(0, world, tp)]
            self.group = groups[rank // tp]
        self.symmetric_memory = enable_symmetric_memory(self.group)

    def symmetric_buffer(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        buffer = self.symmetric_memory.empty(*shape, dtype=torch.bfloat16, device=device)
        buffer.zero_()
        self.symmetric_memory.rendezvous(buffer, self.group)
        return buffer

    def one_shot(self, source: torch.Tensor, out: torch.Tensor) -> None:
        torch.ops.symm_mem.one_shot_all_reduce_out(source, "sum", self.group.group_name, out)


@dataclasses.dataclass(frozen=True)
class _BaselineComms:
    """What a process bench's baselines communicate through (`Family.baselines`' `comms`): the
    NCCL group with SymmetricMemory (`collectives`, one process per GPU; None where processes
    share GPUs or NCCL could not start), this rank's mailboxes (the cases' and their baselines'),
    the bound on a baseline's device waits, and the case group's host process group (`host_group`,
    what a baseline's check gathers over: a row's ranks are its group's, not the job's)."""

    collectives: _Collectives | None
    mailboxes: dict
    timeout_ns: int
    host_group: Any = None  # the case group's gloo process group (None: the whole job): the baselines' checks gather over it

    @property
    def group(self) -> Any:
        return self.collectives.group if self.collectives is not None else None

    def symmetric_buffer(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return self.collectives.symmetric_buffer(shape, device)

    def one_shot(self, source: torch.Tensor, out: torch.Tensor) -> None:
        self.collectives.one_shot(source, out)


def span(ranks: Sequence[int]) -> str:
    """`ranks 4-7`, `rank 3`, `ranks 0, 2, 5`."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def process_transport(options: RunOptions, tp: int, hosts: int = 1, local_world: int | None = None) -> Any:
    """The transport a group of `tp` processes on `hosts` distinct hosts gets
    (`comm.transport.decide`, as every rank asks it); `local_world`: processes on this host where
    the environment does not say (a launcher of several nodes: its --nproc-per-node)."""
    return decide(layout_here(options.backend, "torchrun", tp, hosts=hosts, local_world=local_world),
                  options.transport)


def group_transports(options: RunOptions, tp: int, hosts: Sequence[str], local_world: int | None = None) -> list:
    """The transport of every group of `tp` consecutive ranks, from every rank's host name (rank
    order: len(hosts) is the job's WORLD_SIZE). TransportRefused names the first group that cannot
    have one, and where its ranks sit when they span hosts (the CPU model's shared memory is one
    host's). The same names give the same answer on every rank and every launcher node."""
    decided: dict[int, Any] = {}
    transports = []
    for first in range(0, len(hosts), tp):
        members = hosts[first:first + tp]
        distinct = list(dict.fromkeys(members))
        try:
            if len(distinct) not in decided:
                decided[len(distinct)] = process_transport(options, tp, len(distinct), local_world)
        except TransportRefused as refusal:
            if len(distinct) == 1:
                raise
            where = "; ".join(f"{host}: {span([first + i for i, h in enumerate(members) if h == host])}"
                              for host in distinct)
            group = f"group {first // tp} ({span(range(first, first + tp))})" if len(hosts) > tp else "the job"
            raise TransportRefused(refusal.request, f"{refusal.reason}; {group} spans {len(distinct)} hosts "
                                                    f"({where})") from None
        transports.append(decided[len(distinct)])
    return transports


_RUNS = itertools.count()  # run_rank calls of this process: every rank makes them in one order


def process_group_timeout_s(options: RunOptions, bench: BenchOptions | None = None, groups: int = 1) -> float:
    """How long a collective of a process run may wait: a case on the slowest rank, its compile,
    rank 0's evaluation of every group, and a margin."""
    return case_bound_s(options, bench) + compile_bound_s(options) + EVALUATE_S * groups + 30.0


def run_rank(cases: Sequence[Any], options: RunOptions, results_path: Any = None,
             on_case: Callable[[CaseResult], None] | None = None, *, measurement: str = "check",
             bench: BenchOptions | None = None, progress: Callable[[str], None] | None = None) -> list[CaseResult]:
    """This process's rank of the run (RANK, WORLD_SIZE, LOCAL_RANK set by torchrun).

    A job of WORLD_SIZE ranks runs every case (one tp, WORLD_SIZE a multiple of it) on WORLD_SIZE
    / tp groups of consecutive ranks at once: group g holds ranks g*tp .. g*tp + tp - 1, with a
    process group (`torch.distributed.new_group`) and mailboxes of its own (allocated with the
    rank's place in the group and a key no other group shares), and is checked into a row of its
    own (`CaseResult.group`; None where one group is the whole job). A row numbers its ranks within
    the group; faults (`options.faults`) name ranks of the job. The ranks' host names are gathered
    first: the transport is decided per group from how many hosts it spans (the CPU model refuses
    a group on several hosts) and this rank's GPUs and environment; the refusals are gathered, so
    one rank's refusal prints its reason and exits 2 on every rank alike.

    Rank 0 returns the checked rows, the others []. Rank 0 appends every row as a JSON line to
    `results_path`; so does the lowest rank of every other node (LOCAL_RANK 0), from rank 0's
    broadcast, so every node's launcher learns the verdict through the process group. The default
    process group is used where one exists (the worker's, shared by several runs), else made and
    ended here.
    """
    import datetime
    import socket
    import sys

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp = cases[0].tp if cases else world
    if world % tp:
        raise SystemExit(f"musebench: WORLD_SIZE {world} is not a multiple of tp {tp}: ranks would be left "
                         "without a group")
    if measurement == "bench" and options.backend != "cute":
        raise SystemExit("musebench: benches run the cute backend")
    say = progress or (lambda line: print(line, flush=True))
    bench = bench or BenchOptions()
    groups, group, group_rank = world // tp, rank // tp, rank % tp
    record = ProgressFile.from_environment(rank)  # what the launcher watches (harness.progress)
    record.update(phase="start", bound_s=STARTUP_S, group_base=group * tp)
    owned = not dist.is_initialized()
    if owned:
        timeout = process_group_timeout_s(options, bench if measurement == "bench" else None, groups)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    host = socket.gethostname()
    boxes: dict = {}
    subgroups: list = []
    rows: list[CaseResult] = []
    try:
        everyone = _gathered((host, os.environ.get("MUSEBENCH_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "job")))
        job = everyone[0][1]  # rank 0's: every rank names the mailboxes alike, whatever its launcher set
        transport, refusal = None, None
        try:  # the same names on every rank, but each rank's own GPUs and environment
            transport = group_transports(options, tp, [name for name, _ in everyone])[group]
        except TransportRefused as error:
            refusal = str(error)
        refusals = _gathered(refusal)  # every rank refuses alike, before any mailbox is made
        if any(refusals):
            first = next(index for index, line in enumerate(refusals) if line)
            line = refusals[first] if len(set(refusals)) == 1 else f"rank {first} (host {everyone[first][0]}): " \
                                                                     f"{refusals[first]}"
            record.update(phase="finished", bound_s=TEARDOWN_S, error=f"musebench: {line}")
            print(f"musebench: error: {line}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        if options.backend == "cute":
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(torch.device("cuda", local_rank % torch.cuda.device_count()))
        if groups > 1:  # every rank makes every group, in order (new_group is collective)
            subgroups = [dist.new_group(list(range(first, first + tp))) for first in range(0, world, tp)]
        specs = run_mailbox_specs(cases, options, measurement)
        key = f"{job}-{next(_RUNS)}g{group}"  # unique per run and group; the launcher's cleanup matches `{job}-*`
        from musebench.comm.device import PeerMappingRefused

        mapping_error = None
        if specs:
            try:  # collective in the group; a pair that cannot be mapped refuses on every rank of it
                boxes = mailbox_sets.allocate_process(specs, group_rank, tp, transport, key,
                                                      group=subgroups[group] if subgroups else None)
            except (PeerMappingRefused, TransportRefused) as refusal:
                mapping_error = f"group {group}: {refusal}" if groups > 1 else str(refusal)
        refused = [error for error in _gathered(mapping_error) if error is not None]  # every group alike
        if refused:  # before any kernel: no group may go on into collectives another group has left
            record.update(phase="finished", bound_s=TEARDOWN_S, error=f"musebench: {refused[0]}")
            print(f"musebench: error: {refused[0]}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        transport = transport.name
        impl = load_impl(options)
        collectives, unavailable = None, None
        if measurement == "bench":
            collectives, unavailable = _agreed_collectives(tp, host)
        case_group = subgroups[group] if subgroups else None  # the bench's agreements and barriers
        call_s = call_bound_s(options)
        for index, case in enumerate(cases):
            record.update(phase="bind", case=index, call=-1, calls=0, bound_s=BIND_S + compile_bound_s(options))
            family = family_of(case)
            inputs, runner, bind_error = None, None, None
            try:  # compile before the agreement: no rank may spin on a peer that is still compiling
                inputs = family.make_inputs(case)
                runner = family.bind(case, impl, group_rank, boxes, inputs, options)
            except Exception as error:
                bind_error = f"rank {group_rank}: bind: {type(error).__name__}: {error}"
            record.update(phase="barrier", bound_s=None)
            # also the barrier; a group skips the case where one of its ranks cannot bind it
            failed_binds = [f for f in _gathered(bind_error)[group * tp:(group + 1) * tp] if f is not None]
            say(f"rank {rank} started case {index}")
            if failed_binds:  # every rank of the group skips the case alike: none waits on a rank that cannot run it
                outcome = RankOutcome(rank=group_rank, error=bind_error or f"rank {group_rank}: not run: {failed_binds[0]}")
            elif measurement == "check":
                outcome = check_calls(case, group_rank, runner, options, progress=lambda call, calls: record.update(
                    phase="call", call=call, calls=calls, bound_s=call_s), fault_rank=rank)
            else:
                # one opaque phase: the case's paths are graph replays the bench bounds itself
                # the forms it binds (the single launch) and the baselines' warm-ups compile inside it
                record.update(phase="bench", bound_s=case_bound_s(options, bench) + compile_bound_s(options))
                outcome = _process_bench(case, family, group_rank, runner, boxes, inputs, options, bench, collectives,
                                         impl, group=case_group)
                if unavailable is not None:
                    outcome.notes.append(unavailable)
            outcome.host = host
            say(f"rank {rank} done case {index}")
            record.update(phase="gather", bound_s=None, error=outcome.error)
            iters = options.iters if measurement == "check" else bench.calls * bench.replays

            def evaluate_gathered(gathered: list, case: Any = case, inputs: Any = inputs, iters: int = iters) -> CaseResult:
                row = new_row(case, options, transport, iters, measurement)
                try:
                    expected = expected_for(case, inputs, options)
                except Exception as error:
                    row.error = f"stock: {type(error).__name__}: {error}"
                    return row
                try:  # rank 0 must reach the broadcast after it, whatever happens here
                    evaluate(row, case.tp, [o for o in gathered if o is not None], expected)
                    if measurement == "bench":
                        bench_row(row, family_of(case), gathered, expected)
                except Exception as error:
                    row.error, row.rank_identical = f"evaluate: {type(error).__name__}: {error}", False
                return row

            rows.extend(_finish_case(outcome, evaluate_gathered, boxes, results_path, on_case, record, options, tp=tp))
        record.update(phase="finished", bound_s=TEARDOWN_S)
    finally:
        mailbox_sets.close(boxes)
        for made in subgroups:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(made)
        if owned:
            dist.destroy_process_group()
    return rows


def _gathered(value: Any, group: Any = None) -> list:
    """Every rank's `value` (of `group`; the whole job when None), in rank order (collective: a
    barrier too)."""
    import torch.distributed as dist

    values: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def _agreed_collectives(tp: int, host: str) -> tuple[Any, str | None]:
    """(the bench baselines' `_Collectives`, or None, and why not where the row should say):
    collective over the job. Every rank first says whether its node runs one process per GPU
    (nodes may differ in GPUs), and makes the NCCL groups only where every rank does (making them
    is collective over the job: a rank that skipped it would leave the others in it); then every
    rank says whether its groups came up, and all keep them or none does."""
    wanted = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))) <= torch.cuda.device_count()
    if not all(_gathered(wanted)):
        return None, None  # processes share GPUs somewhere: the bench's note says why (shared_gpu_timing_note)
    collectives, error = None, None
    try:
        collectives = _Collectives(tp)
    except Exception as failure:  # the case is still timed; the row says why the baselines are not
        error = f"{type(failure).__name__}: {failure}"
    failed = [(rank, line) for rank, line in enumerate(_gathered(error and f"{error} (host {host})")) if line]
    if failed:
        rank, line = failed[0]
        return None, f"NCCL / SymmetricMemory baselines unavailable: rank {rank}: {line}"
    return collectives, None


def _finish_case(outcome: RankOutcome, evaluate_gathered: Callable[[list], CaseResult], boxes: dict,
                 results_path: Any, on_case: Callable[[CaseResult], None] | None, record: ProgressFile,
                 options: RunOptions, tp: int | None = None) -> list[CaseResult]:
    """Collective end of one case: every rank's outcome gathered to rank 0, which evaluates each
    group's (`tp` consecutive ranks; the whole job when None) into its row (appended as a JSON line
    to `results_path`, passed to `on_case`, returned; other ranks get []). Rank 0 broadcasts the
    rows: the lowest rank of every other node appends them to its node's `results_path`; if a
    group's row failed every rank of it re-arms its mailboxes between two barriers of the job.
    Rank 0's evaluation and every re-arm are reported to the launcher's watch (`record`)."""
    import json

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    tp = tp or world
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(outcome, gathered, dst=0)
    rows: list[CaseResult] = []
    shared: list = [None]
    if rank == 0:
        record.update(phase="evaluate", bound_s=EVALUATE_S * (world // tp))
        for first in range(0, world, tp):
            row = evaluate_gathered(gathered[first:first + tp])  # never raises: its errors are the row's
            if world > tp:
                row.group = first // tp
                if row.error is not None:
                    row.error = f"{row.group_label()}: {row.error}"
            rows.append(row)
            if results_path is not None:
                with open(results_path, "a") as out:
                    out.write(json.dumps(row.to_dict()) + "\n")
            if on_case is not None:
                on_case(row)
        shared = [[(row.passed, json.dumps(row.to_dict())) for row in rows]]
        record.update(phase="gather", bound_s=None)
    dist.broadcast_object_list(shared, src=0)
    verdicts = shared[0]
    if rank != 0 and results_path is not None and int(os.environ.get("LOCAL_RANK", rank)) == 0:
        with open(results_path, "a") as out:  # this node's launcher learns the rows through the process group
            out.write("".join(line + "\n" for _, line in verdicts))
    failed = [not passed for passed, _ in verdicts]
    if any(failed):
        record.update(phase="reset", bound_s=None)
        if options.backend == "cute":
            torch.cuda.synchronize()  # this rank's calls (a stalled one included, bounded) are over
        dist.barrier()  # nobody is still reading before the words are re-armed
        if failed[rank // tp]:
            mailbox_sets.reset(boxes)
        dist.barrier()
    return rows


def _process_bench(case: Any, family: Any, rank: int, runner: Any, boxes: dict, inputs: Any, options: RunOptions,
                   bench: BenchOptions, collectives: Any, impl: Any, group: Any = None) -> RankOutcome:
    """This rank's medians of the case's call, parts, variants and baselines, and its outputs
    after the call's replays. Collective over `group` (the rank's case group, a gloo process group;
    the whole job when None): every rank of it times the same paths in the same order, and every
    path begins with an agreement (`graph_median_us`'s `agree`), so a rank that cannot time a path
    makes every rank of its group skip it instead of leaving its peers in a barrier it never
    reaches. No collective here spans other groups: a group that skips a case (a rank could not
    bind it) or a path never leaves another group waiting for it."""
    import torch.distributed as dist

    outcome = RankOutcome(rank=rank)
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)

    def agree(ready: bool) -> bool:
        return all(_gathered(ready, group))

    def barrier() -> None:
        dist.barrier(group=group)

    def time_path(call: Callable[[], None], collective: bool, outputs: dict | None = None) -> float:
        poison = (lambda: [checks.poison(t) for t in outputs.values()]) if outputs else None
        return graph_median_us(call, stream, bench, barrier=barrier, sync=call if collective else None,
                               agree=agree, before_replays=poison)

    def rearm() -> None:  # a part or a form leaves slots published: every rank of the group re-arms after it
        torch.cuda.synchronize()
        barrier()
        mailbox_sets.reset(boxes)
        barrier()

    try:
        outcome.times_us[family.name] = time_path(runner.call, collective=True, outputs=runner.outputs)
        runner.check_fault()
        outcome.outputs = {name: t.detach().cpu() for name, t in runner.outputs.items()}
    except Exception as error:  # every rank raised here alike (the agreement): the case ends on all
        outcome.error = f"rank {rank}: {type(error).__name__}: {error}"
        return outcome
    for name, part in runner.parts().items():
        try:
            outcome.times_us[name] = time_path(part, collective=False)
        except Exception as error:
            outcome.notes.append(f"{name} not timed: {type(error).__name__}: {error}")
        rearm()
    for name, variant in family.variants(case, options).items():
        _process_variant(case, family, name, variant, rank, boxes, inputs, time_path, outcome, impl, agree, rearm)
    try:
        comms = _BaselineComms(collectives, boxes, int(options.timeout_s * 1e9), host_group=group)
        paths = family.baselines(case, inputs, rank, runner, comms)
    except Exception as error:
        paths = {}
        outcome.notes.append(f"baselines not timed: {type(error).__name__}: {error}")
    if not agree(bool(paths)):  # every rank times the same baselines or none
        if paths:
            outcome.notes.append("baselines not timed: a peer could not prepare them")
        paths = {}
    for name, baseline in paths.items():
        try:
            outcome.times_us[name] = time_path(baseline.call, collective=baseline.collective,
                                               outputs=baseline.outputs)
        except Exception as error:
            outcome.notes.append(f"{name} not timed: {type(error).__name__}: {error}")
        if baseline.note and baseline.note not in outcome.notes:
            outcome.notes.append(baseline.note)
        if baseline.check is not None:  # collective: every rank, timed or not
            problem = baseline.check()
            if problem is not None:  # a baseline that computes garbage fast fails the row
                outcome.times_us.pop(name, None)
                outcome.error = outcome.error or f"rank {rank}: the {name} baseline is wrong: {problem}"
    if collectives is None:
        note = shared_gpu_timing_note(int(os.environ.get("LOCAL_WORLD_SIZE", case.tp)))
        if note is not None and boxes:
            outcome.notes.append(note)
            outcome.notes.append("NCCL and SymmetricMemory baselines need one process per GPU "
                                 "(NCCL refuses two ranks on one GPU)")
    return outcome


def _process_variant(case: Any, family: Any, name: str, variant: RunOptions, rank: int, boxes: dict, inputs: Any,
                     time_path: Callable, outcome: RankOutcome, impl: Any, agree: Callable[[bool], bool],
                     rearm: Callable[[], None]) -> None:
    """Collective: another form of the kernel over this rank's mailboxes, re-armed before and
    after it, timed like the call and checked against the same bits (on rank 0, from the gathered
    outcome's `variant_outputs`). A rank whose form fails to bind or run makes it this rank's
    error; every rank still takes the same collectives."""
    rearm()
    other, error = None, None
    try:
        other = family.bind(case, impl, rank, boxes, inputs, variant)
    except Exception as failure:
        error = failure
    try:
        if not agree(error is None):  # every rank compiled and warmed up before any spins on a peer
            raise error if error is not None else PeerNotReady(f"a peer could not bind the {name} form")
        outcome.times_us[name] = time_path(other.call, collective=True, outputs=other.outputs)
        other.check_fault()
        outcome.variant_outputs[name] = {key: t.detach().cpu() for key, t in other.outputs.items()}
    except Exception as failure:
        outcome.error = outcome.error or f"rank {rank}: {name}: {type(failure).__name__}: {failure}"
        outcome.times_us.pop(name, None)
    rearm()


def ratios_of(family: Any, baselines_us: dict[str, float]) -> dict[str, str]:
    """The row's `baseline_ratio_of`: the family's optional BASELINE_RATIO_OF (baseline -> the
    baseline its ratio divides instead of the tail) for the baselines timed; where the other one
    was not, the cell has no ratio (never the tail's in its place)."""
    pairs = getattr(family, "BASELINE_RATIO_OF", {})
    return {name: over for name, over in pairs.items() if name in baselines_us}


def bench_row(row: CaseResult, family: Any, gathered: list, expected: Any) -> None:
    """Rank 0's timings: every path's max over ranks; variants checked like the call."""
    ranks = [o for o in gathered if o is not None]
    for outcome in ranks:
        row.notes.extend(note for note in outcome.notes if note not in row.notes)
    if row.error is not None:
        return
    names = dict.fromkeys(name for o in ranks for name in o.times_us)
    worst = {name: max(o.times_us[name] for o in ranks if name in o.times_us) for name in names}
    for name in [name for name in names if any(name not in o.times_us for o in ranks)]:
        row.notes.append(f"{name}: timed on some ranks only")
        worst.pop(name)
    for result, outcome in zip(sorted(row.ranks, key=lambda r: r.rank), sorted(ranks, key=lambda o: o.rank)):
        result.tail_us = outcome.times_us.get(family.name)
    row.tail_us = worst.pop(family.name, None)
    variant_names = {name for o in ranks for name in o.variant_outputs}
    for name in variant_names:
        checked = dataclasses.replace(row, ranks=[], error=None, mismatches=0, max_ulp=0, first_mismatch=None)
        outs = [RankOutcome(rank=o.rank, outputs=o.variant_outputs.get(name)) for o in ranks]
        evaluate(checked, row.tp, outs, expected)
        if not checked.passed:
            _fail_with_variant(row, checked, name)
    for name in list(worst):
        if name in variant_names or name in family.PARTS:
            row.kernels_us[name] = worst.pop(name)
    if PUBLISHER in row.kernels_us and row.tail_us is not None:
        row.kernels_us[REDUCE_EXPOSED] = row.tail_us - row.kernels_us[PUBLISHER]
    row.baselines_us = worst
    row.baseline_ratio_of = ratios_of(family, worst)
    row.stock_us = worst.get(family.PROCESS_STOCK)  # None where it was not timed: no ratio, never another one's
    if row.stock_us is not None:
        row.stock_path = f"{row.stock_path}; timed vs {family.PROCESS_STOCK}"
