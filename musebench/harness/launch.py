"""Launchers: `virtual` (every rank a thread of this process) and `torchrun` (a process per rank).

`run_torchrun` starts `python -m torch.distributed.run --standalone` for one node itself, in a
new session, and watches it: a rank that crashes ends the job (torchrun stops the others; the
rank and exit code are reported); a rank that stops making progress ends it too. Every rank
writes its progress record into the job folder (`musebench.harness.progress`: its phase of each
case and each call it begins, with how long until its next record at the latest); when the
records say the job has stalled (no rank keeps its promise, or peers timed out waiting for a
rank still in the call they gave up in) the launcher kills the session and every rank it knows
by pid, and names the rank that stopped making progress, e.g. "rank 1 stopped making progress
in case 0 (call 1 of 4); ranks 0, 2, 3 timed out waiting for it". An overall deadline (startup,
compile and every case's bound) backs the watch. The job's shared-memory mailboxes are removed. SIGTERM or
SIGHUP to the launcher (`timeout`, a CI runner, a closed terminal) kills the session the same way
before it exits with 128 + the signal's number. The ranks
(`musebench.harness.worker`) gather their outcomes to rank 0, which checks them and writes one
JSON line per case to the job folder; the parent reads those lines.

Inside an existing torchrun/srun job (RANK and WORLD_SIZE set, across nodes) `run_in_job` runs
the same worker body in this process: rank 0 returns the rows, the other ranks return [].
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from musebench.harness.case import Faults, RunOptions
from musebench.harness.driver import STARTUP_S, case_bound_s, compile_bound_s  # noqa: F401  (the launch's deadline)
from musebench.harness.measure import BenchOptions
from musebench.harness.progress import PROGRESS_DIR_ENV, Watch, read_progress
from musebench.harness.results import CaseResult



@dataclasses.dataclass(frozen=True)
class Spec:
    """What every rank of a process launch runs: the cases, options, measurement and bench knobs."""

    cases: tuple
    options: RunOptions
    measurement: str = "check"
    bench: BenchOptions | None = None


def spec_to_json(cases: Sequence[Any], options: RunOptions, bench: BenchOptions | None = None,
                 measurement: str = "check") -> dict:
    return {"cases": [{"family": c.family, **dataclasses.asdict(c)} for c in cases],
            "options": dataclasses.asdict(options), "measurement": measurement,
            "bench": dataclasses.asdict(bench) if bench is not None else None}


def spec_from_json(data: dict) -> Spec:
    from musebench.cases import FAMILIES

    cases = []
    for fields in data["cases"]:
        fields = dict(fields)
        family = FAMILIES[fields.pop("family")]
        cases.append(family.Case(**{k: v for k, v in fields.items() if k != "family"}))
    opts = dict(data["options"])
    opts["faults"] = Faults(**opts["faults"])
    bench = data.get("bench")
    return Spec(tuple(cases), RunOptions(**opts), data.get("measurement", "check"),
                BenchOptions(**bench) if bench is not None else None)


def in_torchrun_job() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _failure_summary(log: str, tp: int) -> str:
    """The first failed rank and its exit code from torchrun's error report, else its last line."""
    ranks = re.findall(r"rank\s*:\s*(\d+)", log)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", log)
    if ranks and codes:
        return f"rank {ranks[0]} exited with code {codes[0]}"
    lines = [line for line in log.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "torchrun failed without output"


def run_torchrun(
    cases: Sequence[Any],
    options: RunOptions,
    on_case: Callable[[CaseResult], None] | None = None,
    bench: BenchOptions | None = None,
    measurement: str = "check",
) -> list[CaseResult]:
    """Run the cases with one process per rank on this host; returns rank 0's rows (the bench's
    timed rows with `measurement="bench"`)."""
    if not cases:
        return []
    tp = cases[0].tp
    job = os.environ.get("MUSEBENCH_JOB_ID") or uuid.uuid4().hex[:12]
    with tempfile.TemporaryDirectory(prefix=f"musebench-{job}-") as folder:
        spec = Path(folder) / "spec.json"
        spec.write_text(json.dumps(spec_to_json(cases, options, bench, measurement)))
        results_path = Path(folder) / "results.jsonl"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
            "--max-restarts=0", "--monitor-interval=0.2",
            "-m", "musebench.harness.worker", str(spec), str(results_path),
        ]
        progress_dir = Path(folder) / "progress"
        progress_dir.mkdir()
        env = dict(os.environ, MUSEBENCH_JOB_ID=job, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   **{PROGRESS_DIR_ENV: str(progress_dir)})
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        log_path = Path(folder) / "torchrun.log"
        bound_s = STARTUP_S + compile_bound_s(options) + len(cases) * case_bound_s(
            options, bench if measurement == "bench" else None)
        deadline = time.monotonic() + bound_s
        watch = Watch(tp, options.timeout_s, startup_s=STARTUP_S)
        killed, stalled = False, None
        rows: list[CaseResult] = []
        seen = 0
        with open(log_path, "w") as log, _exit_on_termination():
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:  # at once: a signal between the start and this try would leave the session running
                while True:
                    seen = _drain(results_path, rows, seen, on_case)
                    if process.poll() is not None:
                        break
                    watch.observe(read_progress(progress_dir))
                    if watch.stalled():
                        stalled = f"{watch.blame()}: killed with every rank"
                        _kill_session(process, _rank_pids(watch, folder))
                        killed = True
                        break
                    if time.monotonic() > deadline:
                        _kill_session(process, _rank_pids(watch, folder))
                        killed = True
                        break
                    time.sleep(0.1)
            except BaseException:
                _kill_session(process, _rank_pids(watch, folder))
                raise
            finally:
                _cleanup_shm(job)
        _drain(results_path, rows, seen, on_case)
        code = process.returncode
        if len(rows) == len(cases) and code not in (0, None) and rows and rows[-1].error is None:
            # every case reported, then a rank died (teardown): the run did not end cleanly
            rows[-1].error = f"torchrun exited with code {code} after the last case: " + _failure_summary(
                log_path.read_text(errors="replace"), tp)
        if len(rows) < len(cases):
            if stalled is not None:
                reason = stalled
            elif killed:
                reason = f"torchrun job did not finish within {bound_s:.0f}s: killed with every rank ({watch.blame()})"
            else:
                reason = _failure_summary(log_path.read_text(errors="replace"), tp)
            for case in cases[len(rows):]:
                row = _error_row(case, options, reason, measurement)
                rows.append(row)
                if on_case is not None:
                    on_case(row)
        return rows


@contextlib.contextmanager
def _exit_on_termination():
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread while a job runs, so the
    launcher's cleanup kills the ranks' session (their default action would end the launcher
    alone and leave torchrun and every rank running). Handlers someone else installed are kept."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum, frame):
        for sig in previous:  # a second signal must not cut the cleanup short
            signal.signal(sig, signal.SIG_IGN)
        print(f"musebench: {signal.Signals(signum).name}: killing the torchrun job and its ranks",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, exit_now)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _drain(path: Path, rows: list[CaseResult], seen: int, on_case) -> int:
    if not path.exists():
        return seen
    lines = path.read_text().splitlines()
    complete = [line for line in lines if line.endswith("}")]
    for line in complete[seen:]:
        row = CaseResult.from_dict(json.loads(line))
        rows.append(row)
        if on_case is not None:
            on_case(row)
    return len(complete)


def _rank_pids(watch: Watch, folder: str) -> list[int]:
    """The pids of the job's ranks from their progress records, each still a rank of this job
    (its command line names the job folder: a pid reused since is not touched)."""
    pids = []
    for record in watch.records.values():
        try:
            command = Path(f"/proc/{record.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone already
            continue
        if folder in command:
            pids.append(record.pid)
    return pids


def _kill_session(process: subprocess.Popen, ranks: Sequence[int] = ()) -> None:
    """SIGTERM then SIGKILL to the whole session: torchrun and every rank it started; then SIGKILL
    to the sessions of `ranks` (pids), which torchrun starts in sessions of their own: a rank
    torchrun could not stop in time is not left behind."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait_s)
            # the leader may be gone while ranks linger: one more sweep below
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _cleanup_shm(job: str) -> None:
    for path in Path("/dev/shm").glob(f"musebench-{job}-*"):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _error_row(case: Any, options: RunOptions, reason: str, measurement: str = "check") -> CaseResult:
    """The row of a case the job never reported (its ranks died or were killed)."""
    from musebench.comm.transport import TransportRefused
    from musebench.harness.driver import new_row, process_transport

    try:
        transport = process_transport(options, case.tp).name
    except TransportRefused:  # the ranks' own errors say why; the row names what was asked
        transport = options.transport
    row = new_row(case, options, transport, 0, measurement)
    row.error, row.rank_identical = reason, False
    return row


def run_in_job(cases: Sequence[Any], options: RunOptions,
               on_case: Callable[[CaseResult], None] | None = None,
               bench: BenchOptions | None = None, measurement: str = "check") -> list[CaseResult]:
    """Inside an existing torchrun/srun job: this process is one rank."""
    from musebench.harness.driver import run_rank

    return run_rank(cases, options, results_path=None, on_case=on_case, measurement=measurement, bench=bench)
