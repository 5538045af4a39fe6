"""One rank of a process-launched run: `python -m musebench.harness.worker SPEC RESULTS`.

Started by torchrun (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT set). The CPU model's
mailboxes are POSIX shared-memory files, so all ranks must share one host. Per case: a barrier,
this rank's calls, the outcomes gathered to rank 0 (gloo, bounded by the case's time bound),
rank 0's check, one JSON line per case, and a collective re-arm when any rank failed. Progress
lines ("rank R started/done case N") go to stdout for the torchrun log; the launcher watches the
rank's progress record (`musebench.harness.progress.ProgressFile`, in the folder named by
MUSEBENCH_PROGRESS_DIR): one per phase of a case and one per call, each with the time the rank
promises to take until its next (bind: the compile bound; a call: `driver.call_bound_s`).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch.distributed as dist

from musebench.comm import lamport
from musebench.harness.bench import BenchOptions
from musebench.harness.cases import TailCase, make_tail_inputs
from musebench.harness.driver import (
    RankMailboxes,
    RankOutcome,
    RunOptions,
    bind_tail,
    call_bound_s,
    device_mailboxes,
    evaluate_case,
    mailbox_geometry,
    run_rank_case,
)
from musebench.harness.progress import ProgressFile
from musebench.harness.results import CaseResult

BIND_S = 30.0  # inputs and a CPU bind on a loaded host; a cute bind adds the compile bound
EVALUATE_S = 120.0  # rank 0: the stock reference of every rank and the checks
TEARDOWN_S = 30.0  # the last case reported: mailboxes closed, the process group destroyed, the process gone


def _open_mailboxes(cases: Sequence[TailCase], rank: int, tp: int, job: str) -> RankMailboxes:
    capacity = max(max(case.tokens for case in cases), 1)
    width, top_k = cases[0].width, cases[0].top_k
    geometry: dict[str, tuple[int, int, int]] = {}
    for mode in sorted({case.mode for case in cases}):
        geometry.update(mailbox_geometry(mode, tp, capacity, width, top_k))
    for name, (slots, rows, row_width) in geometry.items():
        lamport.shm_create(job, name, rank, slots, rows, row_width)
    dist.barrier()  # every file exists before anyone maps its peers
    boxes = RankMailboxes()
    for name, (slots, rows, row_width) in geometry.items():
        setattr(boxes, name, lamport.shm_open(job, name, rank, tp, slots, rows, row_width))
    dist.barrier()
    return boxes


def _open_device_mailboxes(cases: Sequence[TailCase], rank: int, tp: int) -> RankMailboxes:
    """Ranks as processes on this host's GPUs (ranks may outnumber GPUs and share them): CUDA IPC."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(torch.device("cuda", local_rank % torch.cuda.device_count()))
    capacity = max(max(case.tokens for case in cases), 1)
    modes = sorted({case.mode for case in cases})
    return device_mailboxes(modes, tp, capacity, cases[0].width, cases[0].top_k, rank=rank)[0]


def run_rank(cases: Sequence[TailCase], options: RunOptions, results_path: Path | None,
             on_case: Callable[[CaseResult], None] | None = None,
             bench: BenchOptions | None = None) -> list[CaseResult]:
    """This process's rank of the run; rank 0 returns the checked rows, the others [].

    With `bench` the cases are timed (`musebench.harness.bench_process`, cute backend only).
    """
    from musebench.harness.launch import STARTUP_S, case_bound_s, compile_bound_s

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    tp = cases[0].tp if cases else world
    if world != tp:
        raise SystemExit(f"musebench: WORLD_SIZE {world} differs from --tp {tp}")
    if local_world != world:
        raise SystemExit("musebench: the CPU model's shared-memory mailboxes need every rank on one host")
    job = os.environ.get("MUSEBENCH_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "job")
    if bench is not None and options.backend != "cute":
        raise SystemExit("musebench: benches run the cute backend")
    progress = ProgressFile.from_environment(rank)
    progress.update(phase="start", bound_s=STARTUP_S)
    bound_s = case_bound_s(options, bench) + compile_bound_s(options) + 30.0  # a barrier may wait for a peer compiling
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=bound_s))
    boxes = _open_device_mailboxes(cases, rank, tp) if options.backend == "cute" else _open_mailboxes(cases, rank, tp, job)
    device_box = boxes.device_ep or boxes.device_tp_route
    transport = device_box.transport if device_box is not None else "shm"
    rows: list[CaseResult] = []
    try:
        if bench is not None:
            from musebench.harness.bench_process import run_bench_rank

            # one opaque phase: its cases' calls are graph replays the bench bounds itself
            progress.update(phase="bench", bound_s=compile_bound_s(options) + len(cases) * case_bound_s(options, bench))
            return run_bench_rank(cases, options, bench, boxes, transport, results_path, on_case)
        call_s = call_bound_s(options)
        for index, case in enumerate(cases):
            progress.update(phase="bind", case=index, call=-1, calls=0, bound_s=BIND_S + compile_bound_s(options))
            inputs = make_tail_inputs(case)
            tail, bind_error = None, None
            try:  # compile before the barrier: no rank may spin on a peer that is still compiling
                tail = bind_tail(case, rank, boxes, inputs, options)
            except Exception as error:
                bind_error = f"rank {rank}: bind: {type(error).__name__}: {error}"
            progress.update(phase="barrier", bound_s=None)
            dist.barrier()
            print(f"rank {rank} started case {index}", flush=True)
            if bind_error is None:
                outcome = run_rank_case(case, rank, boxes, options, inputs, tail,
                                        progress=lambda call, calls: progress.update(phase="call", call=call,
                                                                                     calls=calls, bound_s=call_s))
            else:
                outcome = RankOutcome(rank=rank, error=bind_error)
            print(f"rank {rank} done case {index}", flush=True)
            progress.update(phase="gather", bound_s=None, error=outcome.error)
            row = finish_case(outcome, lambda gathered: evaluate_case(case, gathered, options, transport, inputs),
                              boxes, results_path, on_case, progress=progress)
            if row is not None:
                rows.append(row)
        progress.update(phase="finished", bound_s=TEARDOWN_S)
    finally:
        boxes.close()
        dist.destroy_process_group()
    return rows


def finish_case(outcome, evaluate: Callable[[list], CaseResult], boxes: RankMailboxes, results_path: Path | None,
                on_case: Callable[[CaseResult], None] | None, progress: ProgressFile | None = None) -> CaseResult | None:
    """Collective end of one case: every rank's outcome gathered to rank 0, which evaluates it into
    the row (appended as a JSON line to `results_path`, passed to `on_case`, returned; other ranks
    get None); if the row failed every rank re-arms its mailboxes between two barriers. `progress`
    (the caller reported `gather` before): rank 0's evaluation and the re-arm are reported too."""
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(outcome, gathered, dst=0)
    row, failed = None, [False]
    if rank == 0:
        if progress is not None:
            progress.update(phase="evaluate", bound_s=EVALUATE_S)
        row = evaluate(gathered)
        failed = [not row.passed]
        if results_path is not None:
            with open(results_path, "a") as out:
                out.write(json.dumps(row.to_dict()) + "\n")
        if on_case is not None:
            on_case(row)
        if progress is not None:
            progress.update(phase="gather", bound_s=None)
    dist.broadcast_object_list(failed, src=0)
    if failed[0]:
        if progress is not None:
            progress.update(phase="reset", bound_s=None)
        dist.barrier()  # nobody is still reading before the words are re-armed
        boxes.reset()
        dist.barrier()
    return row


def main(argv: Sequence[str]) -> int:
    from musebench.harness.launch import spec_from_json

    spec, results = argv
    cases, options, bench = spec_from_json(json.loads(Path(spec).read_text()))
    run_rank(cases, options, Path(results), bench=bench)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
