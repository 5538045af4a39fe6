"""The TP tail family (`tp_tail`): expert TP, one launch over a route and a token mailbox.

Every rank holds a K-partial of every route's row (`cases.tail_inputs`, TP layout); a call sums the
partials across ranks in rank order, RMS-normalizes and weights each route and sums a token's
routes: `out` is bitwise the stock TP finalize's (`stock.tp.tp_tail_reference`) on the path its
host dispatch takes for (m, tp, nsm) (`musebench.tp_dispatch`), every path; a token's owner keeps
its row, the other ranks get the stock's copy (`stock.tp.tp_rank_output`).

Mailboxes: "tp_route" (tp source slots of capacity * 8 route rows) and "tp_token" (one slot of
capacity rows widened to FP32: a BF16 row can hold the 32-bit sentinel). Bench baselines: the
stock finalize alone; with processes, musebench's one-shot all-reduce of the K-partial rows
(`kernels.oneshot_allreduce`, over the "one_shot" mailbox of `baseline_mailboxes`) followed by the
finalize; with one process per GPU an NCCL or SymmetricMemory all-reduce of the K-partial rows
followed by the finalize (the norm needs whole rows).
"""

from __future__ import annotations

from typing import Any

from musebench.cases import tail as shared
from musebench.harness.case import Expected, MailboxSpec, RunOptions
from musebench.cases.tail_inputs import TailCase, TailInputs

name = "tp_tail"
Case = TailCase
faults = ("flip", "silent", "raise", "hang", "exit")
PARTS = ()  # kernels of a call a bench times apart
VIRTUAL_STOCK = "finalize"  # the row's stock_us on virtual ranks: one rank's finalize, no communication
PROCESS_STOCK = "nccl+finalize"  # with a process per GPU: what a user runs without musebench

make_inputs = shared.make_inputs
baseline_mailboxes = shared.baseline_mailboxes  # a process bench's one-shot all-reduce mailbox


def mailboxes(case: TailCase, capacity: int) -> dict[str, MailboxSpec]:
    return {"tp_route": MailboxSpec(slots=case.tp, rows=capacity * case.top_k, width=case.width),
            "tp_token": MailboxSpec(slots=1, rows=capacity, width=2 * case.width)}


def bind(case: TailCase, impl: Any, rank: int, boxes: dict[str, Any], inputs: TailInputs,
         options: RunOptions) -> shared.TailRunner:
    """This rank's TP tail over its route and token mailboxes (compiles on the cute backend)."""
    if options.backend == "cute":
        tail = impl.tp_tail(case, rank, boxes["tp_route"], boxes["tp_token"], inputs, options)
    else:
        from musebench.cpu.tail import CpuTpTail

        tail = CpuTpTail(boxes["tp_route"], boxes["tp_token"], inputs.norm_weight,
                         shared.cpu_options(case, rank, options), nsm=options.nsm, top_k=case.top_k)
    return shared.runner(case, tail, inputs, rank, options)


def expected(case: TailCase, inputs: TailInputs, options: RunOptions, approximations: Any) -> Expected:
    return shared.expected_outputs(case, inputs, options, approximations)


def bytes_moved(case: TailCase) -> int:
    """Payload bytes one rank stores to peers per call: its K-partials of every route to the
    token's owner, and the owned rows to every rank."""
    row = case.width * 2
    return case.tokens * case.top_k * row + ((case.tokens + case.tp - 1) // case.tp) * case.tp * row


def row_fields(case: TailCase, options: RunOptions) -> dict[str, Any]:
    return shared.row_fields(case, row_kernel(case, options))


def row_kernel(case: TailCase, options: RunOptions) -> str:
    return name


def variants(case: TailCase, options: RunOptions) -> dict[str, RunOptions]:
    return {}


def baselines(case: TailCase, inputs: TailInputs, rank: int, runner: shared.TailRunner, comms: Any) -> dict:
    return shared.tail_baselines(case, inputs, rank, runner, comms, reduce_first=True)
