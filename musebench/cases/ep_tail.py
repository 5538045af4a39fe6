"""The EP tail family (`ep_tail`): publisher + reduction over one Lamport mailbox per rank.

Every rank holds the rows of its own experts' routes (`cases.tail_inputs`, EP layout); a call sums
each rank's routes into a partial and all-reduces the partials: `out` is bitwise the stock MNNVL
finalize's (`stock.ep.ep_tail_reference`), identical on every rank. With `--ep-launch single`
the cute tail runs as one kernel, bitwise the same (its rows are named `ep_tail_single`).

Mailbox: "ep", tp source slots of `capacity` rows of 4096 BF16 words. Bytes moved per rank and
call: the partial to every rank, tp * m * 8 KiB. Bench baselines: the stock finalize alone; with
processes, the finalize followed by musebench's one-shot all-reduce of the partial (own
implementation of the Lamport IPC one-shot, `kernels.oneshot_allreduce`, over the "one_shot"
mailbox a process bench adds: `baseline_mailboxes`), and with one process per GPU the finalize
followed by an NCCL all-reduce or by torch SymmetricMemory's one-shot all-reduce.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from musebench.cases import tail as shared
from musebench.harness.case import Expected, MailboxSpec, RunOptions
from musebench.harness.measure import PUBLISHER, SINGLE_LAUNCH
from musebench.cases.tail_inputs import TailCase, TailInputs

name = "ep_tail"
Case = TailCase
faults = ("flip", "silent", "raise", "hang", "exit")
PARTS = (PUBLISHER,)  # kernels of a call a bench times apart
VIRTUAL_STOCK = "finalize"  # the row's stock_us on virtual ranks: one rank's finalize, no communication
PROCESS_STOCK = "finalize+nccl"  # with a process per GPU: what a user runs without musebench
SINGLE_LAUNCH_KERNEL = "ep_tail_single"  # rows of the cute EP tail run as one kernel (--ep-launch single)

make_inputs = shared.make_inputs
baseline_mailboxes = shared.baseline_mailboxes  # a process bench's one-shot all-reduce mailbox


def mailboxes(case: TailCase, capacity: int) -> dict[str, MailboxSpec]:
    return {"ep": MailboxSpec(slots=case.tp, rows=capacity, width=case.width)}


def bind(case: TailCase, impl: Any, rank: int, boxes: dict[str, Any], inputs: TailInputs,
         options: RunOptions) -> shared.TailRunner:
    """This rank's EP tail over its "ep" mailbox (compiles on the cute backend: bind every rank
    before any rank runs, outside capture)."""
    box = boxes["ep"]
    if options.backend == "cute":
        tail = impl.ep_tail(case, rank, box, inputs, options)
    else:
        from musebench.cpu.tail import CpuEpTail

        tail = CpuEpTail(box, inputs.norm_weight, shared.cpu_options(case, rank, options))
    return shared.runner(case, tail, inputs, rank, options)


def expected(case: TailCase, inputs: TailInputs, options: RunOptions, approximations: Any) -> Expected:
    return shared.expected_outputs(case, inputs, options, approximations)


def bytes_moved(case: TailCase) -> int:
    """Payload bytes one rank stores to peers per call: its BF16 partial to every rank."""
    return case.tp * case.tokens * case.width * 2


def row_fields(case: TailCase, options: RunOptions) -> dict[str, Any]:
    return shared.row_fields(case, row_kernel(case, options))


def row_kernel(case: TailCase, options: RunOptions) -> str:
    if options.backend == "cute" and options.ep_launch == "single":
        return SINGLE_LAUNCH_KERNEL
    return name


def variants(case: TailCase, options: RunOptions) -> dict[str, RunOptions]:
    """Other forms of the kernel a bench times and checks beside the call: the two-launch cute
    tail's single launch."""
    if options.backend == "cute" and options.ep_launch == "two":
        return {SINGLE_LAUNCH: replace(options, ep_launch="single")}
    return {}


def baselines(case: TailCase, inputs: TailInputs, rank: int, runner: shared.TailRunner, comms: Any) -> dict:
    """name -> call, the paths a bench times beside this rank's tail on the same inputs."""
    return shared.tail_baselines(case, inputs, rank, runner, comms, reduce_first=False)
