"""What the EP and TP tail families share: the runner over a bound tail, and the stock check.

A tail case (`cases.tail_inputs.TailCase`, mode "ep" or "tp") binds one rank's tail through the
backend: `cute` builds the CuTe DSL tail over the rank's device mailboxes, `cpu` the CPU model of
the protocol over host mailboxes (the same bitwise reference checks both; on the CPU the
arithmetic checked is the reference's own, the protocol and layout handling are the model's).
The runner's one output is `out`, BF16 [m, 4096], identical on every rank where the stock's
bits are (the EP tail everywhere; the TP tail's copies differ from the owner's where the stock's
scrubbed delivery does, `stock.tp.tp_rank_output`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from musebench.harness.case import Expected, MailboxSpec, RunOptions
from musebench.harness.measure import PUBLISHER
from musebench.cases.tail_inputs import EDGE_PADDING_ROWS, TailCase, TailInputs, make_tail_inputs

OUT = "out"
ONE_SHOT_MAILBOX = "one_shot"  # the one-shot all-reduce baseline's mailbox (benches of processes only)
ONE_SHOT = "one-shot(own)"  # musebench's one-shot all-reduce in baseline names: our own implementation
ONE_SHOT_NOTE = ("one-shot(own) = musebench one-shot (Lamport IPC), own implementation of the published algorithm "
                 "(vLLM custom all-reduce / TRT-LLM one-shot Lamport), not FlashInfer's kernel, which needs a JIT "
                 "build the device cannot do (musebench/kernels/oneshot_allreduce.py); its result is checked "
                 "bitwise against the rank-order sum on every rank")


@dataclass
class TailRunner:
    """One rank's tail bound to its inputs and output: `call` is one `tail.run(unfinalized, out)`."""

    tail: Any
    unfinalized: Any
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    split_parts: bool = False  # the EP two-launch form: the publisher can be timed alone

    def call(self) -> None:
        self.tail.run(self.unfinalized, self.outputs[OUT])

    def check_fault(self) -> None:
        check = getattr(self.tail, "check_fault", None)
        if check is not None:
            check()

    def parts(self) -> dict[str, Callable[[], None]]:
        if not self.split_parts:
            return {}
        return {PUBLISHER: lambda: self.tail.run_publisher(self.unfinalized, self.outputs[OUT])}

    def launch_demands(self) -> list:
        demands = getattr(self.tail, "launch_demands", None)
        return demands(self.outputs[OUT].shape[0]) if demands is not None else []


def make_inputs(case: TailCase) -> TailInputs:
    return make_tail_inputs(case)


def runner(case: TailCase, tail: Any, inputs: TailInputs, rank: int, options: RunOptions) -> TailRunner:
    """The runner over `tail` with this rank's inputs on the backend's device and a fresh output."""
    if options.backend == "cute":
        device = torch.device("cuda", torch.cuda.current_device())
        unfinalized = inputs.per_rank[rank].to(device)
    else:
        device, unfinalized = torch.device("cpu"), inputs.per_rank[rank]
    out = torch.empty(case.tokens, case.width, dtype=torch.bfloat16, device=device)
    split = case.mode == "ep" and options.backend == "cute" and options.ep_launch == "two"
    return TailRunner(tail=tail, unfinalized=unfinalized, outputs={OUT: out}, split_parts=split)


def device_inputs(inputs: TailInputs, options: RunOptions) -> TailInputs:
    """The inputs where the reference computes them: on the GPU for the cute backend (its own
    approximate instructions), on the host otherwise."""
    if options.backend != "cute":
        return inputs
    device = torch.device("cuda", torch.cuda.current_device())
    return TailInputs(tuple(u.to(device) for u in inputs.per_rank), inputs.norm_weight.to(device))


def expected_outputs(case: TailCase, inputs: TailInputs, options: RunOptions, approximations: Any) -> Expected:
    """The stock's `out` on every rank and the stock path it took (see the module docstring)."""
    inputs = device_inputs(inputs, options)
    if case.mode == "ep":
        from musebench.stock.ep import ep_tail_reference

        out = ep_tail_reference(inputs.per_rank, inputs.norm_weight, eps=case.eps, gain_center=case.gain_center,
                                weight_before_norm=case.weight_before_norm, approximations=approximations)
        return Expected([{OUT: out.cpu()}] * case.tp, "ep-ll one-shot")
    from musebench.stock.tp import tp_rank_output, tp_tail_reference

    out, path = tp_tail_reference(inputs.per_rank, inputs.norm_weight, eps=case.eps, gain_center=case.gain_center,
                                  weight_before_norm=case.weight_before_norm, nsm=options.nsm,
                                  approximations=approximations)
    return Expected([{OUT: tp_rank_output(out, path, rank).cpu()} for rank in range(case.tp)], path.describe())


def row_fields(case: TailCase, kernel: str) -> dict[str, Any]:
    return dict(kernel=kernel, mode=case.mode, tp=case.tp, tokens=case.tokens, weight_dtype=case.weight_dtype,
                norm=case.norm, inputs=case.inputs, seed=case.seed)


def cpu_options(case: TailCase, rank: int, options: RunOptions) -> Any:
    """The CPU model's knobs for this rank (a silent rank's model never publishes)."""
    from musebench.cpu.tail import TailOptions

    return TailOptions(eps=case.eps, gain_center=case.gain_center, weight_before_norm=case.weight_before_norm,
                       timeout_s=options.timeout_s, publish=options.faults.silent_rank != rank)


@dataclass(frozen=True)
class Baseline:
    """A path a bench times beside the tail: `call` launches it on the current stream;
    `collective` ones are timed behind a one-call sync graph (every rank reaches the same call).
    `outputs` are poisoned before the timed replays (so the replays must write them); `check`
    (collective: every rank calls it after the path, timed or not) returns why the path's result
    is wrong on this rank, or None; `note` goes on the row."""

    call: Callable[[], None]
    collective: bool = False
    outputs: dict[str, torch.Tensor] | None = None
    check: Callable[[], str | None] | None = None
    note: str | None = None


def baseline_mailboxes(case: TailCase, capacity: int) -> dict[str, MailboxSpec]:
    """The mailbox a process bench allocates beside the case's own for the one-shot all-reduce
    baseline: tp slots of rows enough for the TP tail's K-partials (capacity * top_k routes and
    the edge inputs' padding rows), 4096 BF16 wide; the EP partial uses its first m rows."""
    return {ONE_SHOT_MAILBOX: MailboxSpec(slots=case.tp, rows=capacity * case.top_k + EDGE_PADDING_ROWS,
                                          width=case.width)}


def one_shot_check(all_reduce: Any, source: torch.Tensor, out: torch.Tensor, group: Any = None) -> Callable[[], str | None]:
    """Collective over `group` (the ranks the all-reduce sums: a case group of the job; the default
    process group when None): every rank's `source` gathered to every rank of it, this rank's `out`
    compared bitwise with their rank-order sum (`stock.all_reduce`), and the all-reduce's fault
    record read. Returns the first problem as a line, or None."""

    def check() -> str | None:
        import torch.distributed as dist

        from musebench.stock.all_reduce import mismatches, rank_order_sum

        problem, mine, got = None, None, None
        try:
            all_reduce.check_fault()
            mine, got = source.detach().cpu(), out.detach().cpu()
        except Exception as error:
            problem = f"{type(error).__name__}: {error}"
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
        if problem is not None:
            return problem
        if any(part is None for part in parts):
            return "a peer could not read its input back"
        wrong, first = mismatches(got, rank_order_sum(parts))
        if wrong:
            return f"{wrong} words differ from the rank-order sum of every rank's input, the first at flat index {first}"
        return None

    return check


def tail_baselines(case: TailCase, inputs: TailInputs, rank: int, runner: TailRunner, comms: Any,
                   *, reduce_first: bool) -> dict[str, Baseline]:
    """The stock finalize of this rank's rows alone (`finalize`, no communication), and with
    `comms` (a process bench's) the finalize and an all-reduce of the partial (EP) or,
    `reduce_first` (TP: the norm needs whole rows), the all-reduce of the K-partial rows then the
    finalize: musebench's one-shot all-reduce over the `one_shot` mailbox wherever the run has one
    (`finalize+one-shot(own)`, `one-shot(own)+finalize`; processes sharing a GPU too), and with an
    NCCL group (one process per GPU) NCCL's and torch SymmetricMemory's (`finalize+nccl`,
    `finalize+symm_mem`; `nccl+finalize`, `symm_mem+finalize`). The one-shot's result is checked
    bitwise against the rank-order sum of every rank's input (`one_shot_check`); the others'
    outputs are not checked: their sums run in another order."""
    from musebench.layout import UnfinalizedMoEOutput
    from musebench.stock.triton_finalize import triton_finalize

    source = runner.unfinalized
    device = source.gemm2_permuted.device
    norm_weight = inputs.norm_weight.to(device)
    m, width = case.tokens, case.width
    partial = torch.empty(m, width, dtype=torch.bfloat16, device=device)

    def finalize(rows: Any, into: torch.Tensor) -> None:
        triton_finalize(rows, norm_weight, into, eps=case.eps, gain_center=case.gain_center,
                        weight_before_norm=case.weight_before_norm)

    paths = {"finalize": Baseline(lambda: finalize(source, partial))}
    if comms is None:
        return paths
    box = comms.mailboxes.get(ONE_SHOT_MAILBOX)
    if box is not None:
        paths.update(_one_shot_baselines(case, source, box, comms.timeout_ns, finalize, partial, reduce_first,
                                         group=getattr(comms, "host_group", None)))
    group = comms.group
    if group is None:
        return paths
    import torch.distributed as dist

    if not reduce_first:
        def finalize_nccl() -> None:
            finalize(source, partial)
            dist.all_reduce(partial, group=group)

        symmetric = comms.symmetric_buffer((m, width), device)
        reduced = torch.empty_like(partial)

        def finalize_one_shot() -> None:
            finalize(source, symmetric)
            comms.one_shot(symmetric, reduced)

        paths["finalize+nccl"] = Baseline(finalize_nccl, collective=True)
        paths["finalize+symm_mem"] = Baseline(finalize_one_shot, collective=True)
        return paths
    rows = source.gemm2_permuted.clone()
    summed = UnfinalizedMoEOutput(rows, source.route_weights, source.expanded_idx_to_permuted_idx)

    def nccl_finalize() -> None:
        dist.all_reduce(rows, group=group)  # in place, as on the GEMM's output
        finalize(summed, partial)

    symmetric = comms.symmetric_buffer(tuple(source.gemm2_permuted.shape), device)
    symmetric.copy_(source.gemm2_permuted)
    reduced_rows = torch.empty_like(symmetric)
    reduced = UnfinalizedMoEOutput(reduced_rows, source.route_weights, source.expanded_idx_to_permuted_idx)

    def one_shot_finalize() -> None:
        comms.one_shot(symmetric, reduced_rows)
        finalize(reduced, partial)

    paths["nccl+finalize"] = Baseline(nccl_finalize, collective=True)
    paths["symm_mem+finalize"] = Baseline(one_shot_finalize, collective=True)
    return paths


def _one_shot_baselines(case: TailCase, source: Any, box: Any, timeout_ns: int, finalize: Callable[[Any, torch.Tensor], None],
                        partial: torch.Tensor, reduce_first: bool, group: Any = None) -> dict[str, Baseline]:
    """EP: the finalize of this rank's rows, then the one-shot all-reduce of its [m, 4096] BF16
    result; TP: the one-shot all-reduce of the K-partial rows (their first 4096 columns), then
    the finalize of the summed rows."""
    from musebench.kernels.oneshot_allreduce import OneShotAllReduce
    from musebench.layout import UnfinalizedMoEOutput

    all_reduce = OneShotAllReduce.from_mailbox(box, timeout_ns=timeout_ns)  # compiles, warms up: before capture
    if not reduce_first:
        finalized = torch.empty_like(partial)
        reduced = torch.empty_like(partial)

        def finalize_one_shot() -> None:
            finalize(source, finalized)
            all_reduce.run(finalized, reduced)

        return {f"finalize+{ONE_SHOT}": Baseline(finalize_one_shot, collective=True, outputs={OUT: reduced},
                                                  check=one_shot_check(all_reduce, finalized, reduced, group),
                                                  note=ONE_SHOT_NOTE)}
    rows = source.gemm2_permuted[:, : case.width].contiguous()
    reduced_rows = torch.empty_like(rows)
    summed = UnfinalizedMoEOutput(reduced_rows, source.route_weights, source.expanded_idx_to_permuted_idx)

    def one_shot_finalize() -> None:
        all_reduce.run(rows, reduced_rows)
        finalize(summed, partial)

    return {f"{ONE_SHOT}+finalize": Baseline(one_shot_finalize, collective=True, outputs={OUT: reduced_rows},
                                              check=one_shot_check(all_reduce, rows, reduced_rows, group),
                                              note=ONE_SHOT_NOTE)}
