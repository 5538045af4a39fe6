"""One driver for every tail case: make inputs, run the ranks, check them, time them.

A case runs in three steps, whatever the launcher:
1. every rank binds its tail over its mailboxes, poisons its output and calls `run` warmup +
   iters times back to back (no barrier between calls), keeping the digest of every call's
   output and the last output (`RankOutcome`);
2. the outcomes meet on one rank (the virtual launcher's only thread of control, or rank 0 of
   a torchrun job) which computes the stock output once and checks every rank: bits vs the
   stock (count, first mismatch, max ULP), digests identical across ranks, identical across
   repeats (`evaluate_case`);
3. if any rank failed, every rank re-arms its mailboxes before the next case (a failed call
   leaves words and generations behind), so one failure never poisons the next case.

A rank never raises out of a case: errors, timeouts (with their fault record) and injected
faults come back as the outcome's one-line `error`.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from musebench import numerics as nx
from musebench.comm import lamport
from musebench.harness import checks
from musebench.harness.cases import WEIGHT_DTYPES, TailCase, TailInputs, make_tail_inputs
from musebench.harness.results import CaseResult, RankResult

DEFAULT_NSM = 148  # B200 / GB200 SM count: the TP stock's dispatch on the racks musebench targets


FAULT_KINDS = ("flip", "silent", "raise", "hang", "exit")  # each a `<kind>_rank` field of Faults


@dataclass(frozen=True)
class Faults:
    """Fault injection, for proving that every check can fail (each field a rank or None)."""

    flip_rank: int | None = None  # flips one bit of its output
    silent_rank: int | None = None  # never publishes: its peers must time out, not hang
    raise_rank: int | None = None  # raises inside its call
    hang_rank: int | None = None  # its host thread/process stops responding
    exit_rank: int | None = None  # its process dies (process launcher only)

    @classmethod
    def parse(cls, specs: Sequence[str]) -> Faults:
        """From `KIND:RANK` strings (`flip:1`, `silent:0`, `raise:2`, `hang:1`, `exit:3`)."""
        values: dict[str, int] = {}
        for spec in specs:
            kind, _, rank = spec.partition(":")
            if kind not in FAULT_KINDS or not rank.isdigit():
                raise ValueError(f"bad fault {spec!r}: expected KIND:RANK with KIND in {', '.join(FAULT_KINDS)}")
            values[f"{kind}_rank"] = int(rank)
        return cls(**values)

    def kinds(self) -> tuple[str, ...]:
        """The kinds of fault injected, in FAULT_KINDS order."""
        return tuple(kind for kind in FAULT_KINDS if getattr(self, f"{kind}_rank") is not None)

    def any(self) -> bool:
        return any(v is not None for v in vars(self).values())

    def max_rank(self) -> int:
        return max((v for v in vars(self).values() if v is not None), default=-1)


@dataclass(frozen=True)
class RunOptions:
    backend: str = "cpu"
    launcher: str = "virtual"
    iters: int = 3
    warmup: int = 1
    timeout_s: float = 10.0
    stock: str = "reference"
    nsm: int = DEFAULT_NSM
    transport: str = "auto"  # requested: auto | unicast | multicast (multicast: GB200 racks only)
    faults: Faults = field(default_factory=Faults)
    ep_launch: str = "two"  # the cute EP tail: "two" kernels (publisher, reduction) or a "single" one


@dataclass
class RankOutcome:
    rank: int
    output: torch.Tensor | None = None
    digests: list[str] = field(default_factory=list)
    times_us: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class RankMailboxes:
    """The mailboxes one rank's tails run over (EP: `ep`; TP: `tp_route` + `tp_token`)."""

    ep: lamport.Mailbox | None = None
    tp_route: lamport.Mailbox | None = None
    tp_token: lamport.Mailbox | None = None
    device_ep: object | None = None  # musebench.comm.device.DeviceMailbox (cute backend)
    device_tp_route: object | None = None
    device_tp_token: object | None = None

    def reset(self) -> None:
        """Re-arm this rank's own words and restart its generations (collective: after a barrier)."""
        for box in (self.ep, self.tp_route, self.tp_token):
            if box is not None:
                lamport.rearm(box.own)
                box.stage.zero_()
        device_boxes = [b for b in (self.device_ep, self.device_tp_route, self.device_tp_token) if b is not None]
        for box in device_boxes:
            box.reset()
        if device_boxes:  # re-armed before the caller's barrier lets a peer write again
            torch.cuda.synchronize()

    def close(self) -> None:
        for box in (self.ep, self.tp_route, self.tp_token):
            if box is not None:
                box.close()


def mailbox_geometry(mode: str, tp: int, capacity: int, width: int, top_k: int) -> dict[str, tuple[int, int, int]]:
    """name -> (slots, capacity rows, row width in 16-bit words) of the mailboxes a mode needs.

    The TP token mailbox carries rows widened to FP32 (2 * width words): a BF16 row can hold the
    32-bit sentinel pattern (two -0.0 side by side), a widened one never does.
    """
    if mode == "ep":
        return {"ep": (tp, capacity, width)}
    return {"tp_route": (tp, capacity * top_k, width), "tp_token": (1, capacity, 2 * width)}


def local_mailboxes(modes: Sequence[str], tp: int, capacity: int, width: int, top_k: int) -> list[RankMailboxes]:
    """Mailboxes of `tp` virtual ranks sharing host memory."""
    sets = [RankMailboxes() for _ in range(tp)]
    for mode in modes:
        for name, (slots, rows, row_width) in mailbox_geometry(mode, tp, capacity, width, top_k).items():
            for rank, box in enumerate(lamport.local_group(tp, slots, rows, row_width)):
                setattr(sets[rank], name, box)
    return sets


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


def device_mailboxes(modes: Sequence[str], tp: int, capacity: int, width: int, top_k: int,
                     rank: int | None = None) -> list[RankMailboxes]:
    """Device mailboxes of the cute tails: every virtual rank's (rank None, transport `local`) or,
    in a process launch, this rank's alone: CUDA IPC where processes share GPUs (`ipc`), torch
    SymmetricMemory peer pointers where each process has a GPU of its own (`unicast`)."""
    import os

    from musebench.comm.device import ipc_device_group, local_device_group, peer_mapping, symmetric_device_group

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", tp))
    mapping = peer_mapping(local_world, torch.cuda.device_count())
    group_of = symmetric_device_group if mapping == "symmetric" else ipc_device_group

    device = torch.device("cuda", torch.cuda.current_device())
    # the TP token mailbox carries FP32 rows (2 * width words): the stock's exact delivery paths
    shapes = {"device_ep": (tp, capacity, width), "device_tp_route": (tp, capacity * top_k, width),
              "device_tp_token": (1, capacity, 2 * width)}
    wanted = [name for name in shapes if (name == "device_ep" and "ep" in modes) or (name != "device_ep" and "tp" in modes)]
    sets = [RankMailboxes() for _ in range(tp if rank is None else 1)]
    for name in wanted:
        slots, rows, row_width = shapes[name]
        if rank is None:
            for r, box in enumerate(local_device_group(tp, slots, rows, row_width, device)):
                setattr(sets[r], name, box)
        else:
            setattr(sets[0], name, group_of(rank, tp, slots, rows, row_width, device))
    return sets


class InjectedFault(RuntimeError):
    pass


_SLEEP_CYCLES_PER_NS = 2  # torch.cuda._sleep spins clock cycles: two per ns hold >= `ns` at <= 2 GHz


def hold_current_stream(ns: int) -> None:
    """Keep the current stream busy for at least `ns` of GPU time (an injected hang; in tests, a
    hold that lets ranks forked from the stream start together), then free it."""
    if ns > 0:
        torch.cuda._sleep(ns * _SLEEP_CYCLES_PER_NS)


def bind_tail(case: TailCase, rank: int, boxes: RankMailboxes, inputs: TailInputs, options: RunOptions):
    """The backend's bound tail for one rank: an object with run(unfinalized, out).

    Binding compiles (cute backend): do it for every rank before any rank runs, outside capture.
    `options.ep_launch == "single"`: the cute EP tail as one kernel.
    """
    if options.backend == "cute":
        from musebench.kernels.tail import MoETail, TpTail
        from musebench.layout import PostExpertNorm

        norm = PostExpertNorm(hidden_size=case.width, variance_epsilon=case.eps, fused_gain_center=case.gain_center,
                              applies_weight_before_norm=case.weight_before_norm, weight=inputs.norm_weight)
        dtypes = (WEIGHT_DTYPES[case.weight_dtype],)
        timeout_ns = int(options.timeout_s * 1e9)
        if case.mode == "tp":
            route, token = boxes.device_tp_route, boxes.device_tp_token
            tail = TpTail(None, tp=case.tp, rank=rank, device=route.words.device, capacity=token.capacity,
                          batches=range(1, token.capacity + 1), timeout_ns=timeout_ns, nsm=options.nsm, routes=route,
                          tokens=token)
        else:
            box = boxes.device_ep
            tail = MoETail(None, tp=case.tp, rank=rank, device=box.words.device, capacity=box.capacity,
                           timeout_ns=timeout_ns, single_launch=options.ep_launch == "single", mailbox=box)
        return tail.bind(norm, weight_dtypes=dtypes)
    if options.backend != "cpu":
        raise ValueError(f"unknown backend {options.backend!r}")
    from musebench.cpu.tail import CpuEpTail, CpuTpTail, TailOptions

    tail_options = TailOptions(
        eps=case.eps, gain_center=case.gain_center, weight_before_norm=case.weight_before_norm,
        timeout_s=options.timeout_s, publish=options.faults.silent_rank != rank,
    )
    if case.mode == "ep":
        return CpuEpTail(boxes.ep, inputs.norm_weight, tail_options)
    return CpuTpTail(boxes.tp_route, boxes.tp_token, inputs.norm_weight, tail_options, nsm=options.nsm, top_k=case.top_k)


def run_rank_case(case: TailCase, rank: int, boxes: RankMailboxes, options: RunOptions,
                  inputs: TailInputs | None = None, tail=None) -> RankOutcome:
    """Run one rank's calls of a case; never raises (errors come back in the outcome)."""
    outcome = RankOutcome(rank=rank)
    try:
        inputs = inputs if inputs is not None else make_tail_inputs(case)
        tail = tail if tail is not None else bind_tail(case, rank, boxes, inputs, options)
        if options.backend == "cute":
            _run_device_calls(case, rank, tail, inputs, options, outcome)
            return outcome
        unfinalized = inputs.per_rank[rank]
        out = torch.empty(case.tokens, case.width, dtype=torch.bfloat16)
        faults = options.faults
        for call in range(options.warmup + options.iters):
            checks.poison(out)
            if faults.raise_rank == rank:
                raise InjectedFault(f"injected fault: rank {rank} raised in call {call}")
            if faults.hang_rank == rank:
                threading.Event().wait(10 * 365 * 86400.0)  # models a host that stops responding
            if faults.exit_rank == rank:
                import os

                os._exit(17)
            started = time.perf_counter()
            tail.run(unfinalized, out)
            elapsed = time.perf_counter() - started
            if faults.flip_rank == rank and out.numel():
                checks.flip_one_bit(out, index=out.numel() // 2)
            if call >= options.warmup:
                outcome.times_us.append(elapsed * 1e6)
                outcome.digests.append(checks.digest(out))
        outcome.output = out
    except lamport.MailboxTimeout as timeout:
        outcome.error = str(timeout)
    except Exception as error:  # a rank reports, it never takes the run down
        outcome.error = f"rank {rank}: {type(error).__name__}: {error}"
    return outcome


def _run_device_calls(case: TailCase, rank: int, tail, inputs: TailInputs, options: RunOptions,
                      outcome: RankOutcome) -> None:
    """One rank's calls on its own CUDA stream; a device fault record becomes the outcome's error."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    unfinalized = inputs.per_rank[rank].to(device)
    out = torch.empty(case.tokens, case.width, dtype=torch.bfloat16, device=device)
    faults = options.faults
    host = None
    with torch.cuda.stream(stream):
        for call in range(options.warmup + options.iters):
            checks.poison(out)
            if faults.raise_rank == rank:
                raise InjectedFault(f"injected fault: rank {rank} raised in call {call}")
            if faults.silent_rank == rank:  # never launches: its peers' bounded waits must report it
                raise InjectedFault(f"injected fault: rank {rank} never published")
            if call == options.warmup and faults.hang_rank == rank:  # mid-run: its host stops responding
                threading.Event().wait(10 * 365 * 86400.0)
            if call == options.warmup and faults.exit_rank == rank:  # mid-run: its process dies
                import os

                os._exit(17)
            started = time.perf_counter()
            tail.run(unfinalized, out)
            stream.synchronize()
            elapsed = time.perf_counter() - started
            tail.check_fault()
            host = out.cpu()  # the checks read this copy
            if faults.flip_rank == rank and host.numel():
                # flipped on the host: a torch kernel's first launch here could wait for a peer's
                # spinning reduction until it times out (lazy module loading, as in EpTail._warm_up);
                # on the H200 the device-side flip timed out 3 runs in 4
                checks.flip_one_bit(host, index=host.numel() // 2)
            if call >= options.warmup:
                outcome.times_us.append(elapsed * 1e6)
                outcome.digests.append(checks.digest(host))
    outcome.output = host if host is not None else out.cpu()


def expected_outputs(case: TailCase, inputs: TailInputs, options: RunOptions) -> tuple[list[torch.Tensor], str]:
    """The stock's output on every rank and the stock path it took.

    The EP tail's bits are the same on every rank. The TP stock's single launch is not: a
    token's owner keeps its row while the other ranks receive a copy scrubbed per 32-bit word
    (`stock.tp.tp_rank_output`), so each rank is checked against its own expected bits.
    """
    approximations = nx.PRECISE
    if options.backend == "cute":  # the GPU's own approximate instructions, on the GPU
        approximations = nx.hardware_approximations()
        device = torch.device("cuda", torch.cuda.current_device())
        inputs = TailInputs(tuple(u.to(device) for u in inputs.per_rank), inputs.norm_weight.to(device))
    if case.mode == "ep":
        from musebench.stock.ep import ep_tail_reference

        out = ep_tail_reference(inputs.per_rank, inputs.norm_weight, eps=case.eps, gain_center=case.gain_center,
                                weight_before_norm=case.weight_before_norm, approximations=approximations)
        return [out.cpu()] * case.tp, "ep-ll one-shot"
    from musebench.stock.tp import tp_rank_output, tp_tail_reference

    out, path = tp_tail_reference(inputs.per_rank, inputs.norm_weight, eps=case.eps, gain_center=case.gain_center,
                                  weight_before_norm=case.weight_before_norm, nsm=options.nsm,
                                  approximations=approximations)
    return [tp_rank_output(out, path, rank).cpu() for rank in range(case.tp)], path.describe()


SINGLE_LAUNCH_KERNEL = "ep_tail_single"  # rows of the cute EP tail run as one kernel (--ep-launch single)


def row_kernel(case: TailCase, options: RunOptions) -> str:
    """The kernel a case's row names: the single-launch EP tail's rows apart from the two launches'."""
    if case.mode == "ep" and options.backend == "cute" and options.ep_launch == "single":
        return SINGLE_LAUNCH_KERNEL
    return case.kernel


def evaluate_case(case: TailCase, outcomes: Sequence[RankOutcome], options: RunOptions, transport: str,
                  inputs: TailInputs | None = None) -> CaseResult:
    """Check every rank's outcome against the stock; the case's row."""
    result = CaseResult(
        kernel=row_kernel(case, options), mode=case.mode, tp=case.tp, tokens=case.tokens, weight_dtype=case.weight_dtype,
        norm=case.norm, inputs=case.inputs, seed=case.seed, backend=options.backend, launcher=options.launcher,
        transport=transport, stock=options.stock, iters=options.iters,
        bytes_moved=bytes_moved(case),
    )
    try:
        inputs = inputs if inputs is not None else make_tail_inputs(case)
        started = time.perf_counter()
        wants, result.stock_path = expected_outputs(case, inputs, options)
        result.stock_us = (time.perf_counter() - started) * 1e6
    except Exception as error:
        result.error = f"stock: {type(error).__name__}: {error}"
        return result
    by_rank = {o.rank: o for o in outcomes}
    errors = []
    for rank in range(case.tp):
        outcome = by_rank.get(rank)
        row = RankResult(rank=rank)
        result.ranks.append(row)
        if outcome is None:
            row.error = f"rank {rank} returned no result"
        elif outcome.error is not None:
            row.error = outcome.error
        elif outcome.output is None:
            row.error = f"rank {rank} produced no output"
        if row.error is not None:
            errors.append(row.error)
            continue
        check_rank_output(row, outcome.output, wants[rank])
        row.tail_us = statistics.median(outcome.times_us) if outcome.times_us else None
        add_rank_counts(result, row)
        if len(set(outcome.digests)) > 1:
            result.deterministic = False
    result.rank_identical = identical_where_stock_is(result.ranks, wants) and not errors
    if errors:
        result.error = _summarize_errors(errors)
    times = [row.tail_us for row in result.ranks if row.tail_us is not None]
    result.tail_us = max(times) if times else None
    return result


def check_rank_output(row: RankResult, output: torch.Tensor, want: torch.Tensor) -> None:
    """Fill `row` (digest, mismatches, max ULP, first mismatch) from one rank's output vs its stock bits."""
    row.digest = checks.digest(output)
    row.mismatches, row.max_ulp, row.first_mismatch = checks.compare_bits(output, want, rank=row.rank)


def add_rank_counts(result: CaseResult, row: RankResult) -> None:
    """Add one rank's mismatch counts to its case's row (the first mismatch is the lowest rank's)."""
    result.mismatches += row.mismatches
    result.max_ulp = max(result.max_ulp, row.max_ulp)
    if row.first_mismatch is not None and result.first_mismatch is None:
        result.first_mismatch = row.first_mismatch


def identical_where_stock_is(ranks: Sequence[RankResult], wants: Sequence[torch.Tensor]) -> bool:
    """Ranks the stock gives the same bits agree with each other (ranks that errored aside)."""
    groups: dict[str, set[str]] = {}
    for row in ranks:
        if row.error is None:
            groups.setdefault(checks.digest(wants[row.rank]), set()).add(row.digest)
    return all(len(digests) == 1 for digests in groups.values())


def _summarize_errors(errors: Sequence[str]) -> str:
    """Root causes first: an injected fault or crash explains the timeouts it causes."""
    ordered = sorted(errors, key=lambda e: ("timed out" in e, e))
    extra = len(ordered) - 1
    return ordered[0] + (f" (+{extra} more rank error{'s' if extra > 1 else ''})" if extra else "")


def bytes_moved(case: TailCase) -> int:
    """Payload bytes one rank stores to peers per call (BF16)."""
    row = case.width * 2
    if case.mode == "ep":
        return case.tp * case.tokens * row
    return case.tokens * case.top_k * row + ((case.tokens + case.tp - 1) // case.tp) * case.tp * row


def co_residency_refusal(tail, case: TailCase) -> str | None:
    """Why tp virtual ranks of this tail cannot all be resident on this GPU at once, or None.

    A Lamport wait ends only when its peers' CTAs run: every rank's grid must be resident at once,
    or, for launches whose waits split into groups, enough of them that one group is always whole;
    the occupancy API says how many CTAs of each kernel the GPU holds (musebench.kernels.occupancy).
    """
    from musebench.kernels import occupancy

    demands = tail.launch_demands(case.tokens)
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    resident = [occupancy.resident_ctas(demand, sm_count) for demand in demands]
    load = occupancy.group_load(demands, case.tp, resident)
    if load <= 1.0:
        return None
    needed = ", ".join(f"{d.needed_ctas(case.tp)} CTAs of {d.threads} threads at once (GPU holds {r})"
                       for d, r in zip(demands, resident))
    return (f"{case.tp} virtual ranks of the {case.kernel} at m={case.tokens} cannot all be resident on one GPU "
            f"({needed}; load {load:.2f}): use --launcher torchrun")


def run_virtual(cases: Sequence[TailCase], options: RunOptions,
                on_case: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """All ranks in this process, one thread per rank, over shared host mailboxes."""
    if not cases:
        return []
    tp = cases[0].tp
    if any(case.tp != tp for case in cases):
        raise ValueError("one virtual run serves one tp")
    if options.faults.exit_rank is not None:
        raise ValueError("the exit fault needs the torchrun launcher (virtual ranks share one process)")
    capacity = max(max(case.tokens for case in cases), 1)
    modes = tuple(sorted({case.mode for case in cases}))
    if options.backend == "cute":
        boxes = device_mailboxes(modes, tp, capacity, cases[0].width, cases[0].top_k)
    else:
        boxes = local_mailboxes(modes, tp, capacity, cases[0].width, cases[0].top_k)
    transport = "local" if options.backend == "cute" else "cpu-local"
    results = []
    for case in cases:
        inputs = make_tail_inputs(case)
        outcomes: list[RankOutcome | None] = [None] * tp
        tails: list[object | None] = [None] * tp
        try:  # compile every rank's variant here, before any rank spins on a peer
            tails = [bind_tail(case, rank, boxes[rank], inputs, options) for rank in range(tp)]
            if options.backend == "cute":
                refusal = co_residency_refusal(tails[0], case)
                if refusal is not None:
                    raise ValueError(refusal)
        except Exception as error:
            failed = [RankOutcome(rank=rank, error=f"bind: {type(error).__name__}: {error}") for rank in range(tp)]
            results.append(evaluate_case(case, failed, options, transport, inputs))
            if on_case is not None:
                on_case(results[-1])
            continue
        threads = []
        for rank in range(tp):
            def work(rank: int = rank) -> None:
                outcomes[rank] = run_rank_case(case, rank, boxes[rank], options, inputs, tails[rank])

            thread = threading.Thread(target=work, name=f"musebench-rank{rank}", daemon=True)
            thread.start()
            threads.append(thread)
        # a rank's calls are bounded by its polls' timeouts; a thread past that is hung
        grace = (options.warmup + options.iters) * (options.timeout_s + 5.0) + 30.0
        deadline = time.monotonic() + grace
        hung = []
        for rank, thread in enumerate(threads):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                hung.append(rank)
        for rank in hung:
            outcomes[rank] = RankOutcome(rank=rank, error=f"rank {rank} hung: no result within {grace:.0f}s")
        result = evaluate_case(case, [o for o in outcomes if o is not None], options, transport, inputs)
        results.append(result)
        if on_case is not None:
            on_case(result)
        if hung:
            # A hung rank still holds its mailboxes: later cases cannot run on this group.
            break
        if not result.passed:
            for rank_boxes in boxes:
                rank_boxes.reset()
    return results
