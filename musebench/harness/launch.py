"""Launchers: `virtual` (every rank a thread of this process) and `torchrun` (a process per rank).

`run_torchrun` / `run_launch` start `python -m torch.distributed.run` on this node, in a new
session, and watch it: `--standalone` with tp processes (one node, today's meaning of `--tp`), or
this node's ranks of a job across nodes (`harness.nodes.Nodes`: `--nnodes N --node-rank R
--nproc-per-node P --rdzv-endpoint HOST:PORT`, the same command on every node; the job's N*P ranks
run every run's cases on groups of tp consecutive ranks, several runs in one launch). A rank that
crashes ends the job (torchrun stops the others; the rank and exit code are reported); a rank
that stops making progress ends it too. Every rank writes its progress record into the job folder
(`musebench.harness.progress`: its phase of each case and each call it begins, with how long until
its next record at the latest); when the records say the job has stalled (no rank keeps its
promise, or peers timed out waiting for a rank still in the call they gave up in) the launcher
kills the session and every rank it knows by pid, and names the rank that stopped making
progress, e.g. "rank 1 stopped making progress in case 0 (call 1 of 4); ranks 0, 2, 3 timed out
waiting for it". Across nodes the launchers share their ranks' records and a heartbeat through a
store of their own (`harness.nodes.NodeLink`: every node's watch sees every rank; a node that
dies ends the others within `nodes.NODE_SILENCE_S` and the kill, named). An overall deadline
(startup, compile and every case's bound) backs the watch. The job's shared-memory mailboxes are
removed. SIGTERM or SIGHUP to the launcher (`timeout`, a CI runner, a closed terminal) kills the
session the same way before it exits with 128 + the signal's number; SIGKILL takes torchrun with
it (PR_SET_PDEATHSIG). The ranks (`musebench.harness.worker`) gather their outcomes to rank 0 over
the process group, which checks them and writes one JSON line per row to its node's job folder;
the lowest rank of every other node writes the rows rank 0 broadcast, so every node's launcher
reads the verdict. `MUSEBENCH_LOG_DIR`: each node's launcher log (`launcher-nodeR.log`) and its
ranks' logs (torchrun's `--log-dir`, `ranks-nodeR/`) go there.

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
import socket
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
from musebench.harness.nodes import (
    COLLECTIVE_FAILED_EXIT,
    HEARTBEAT_S,
    NODE_SILENCE_S,
    LinkLost,
    NodeLink,
    Nodes,
    NodesRefused,
    check_tp,
    describe,
    die_with_parent,
)
from musebench.harness.progress import PROGRESS_DIR_ENV, Watch, read_progress, records_from_json
from musebench.harness.results import CaseResult

LOG_DIR_ENV = "MUSEBENCH_LOG_DIR"  # set: each node's launcher log and its ranks' logs go there



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


def specs_from_json(data: dict) -> list[Spec]:
    """The runs of a launch's spec file: `{"runs": [...]}` (several runs of one launch, in order) or
    one run (`spec_to_json`'s form)."""
    return [spec_from_json(run) for run in data["runs"]] if "runs" in data else [spec_from_json(data)]


def in_torchrun_job() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


_REPORT_ENTRY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
# how torchrun stops the ranks still running once one has failed (`--max-restarts=0`); its report
# lists them too, as failures of their own. (The SIGKILL it sends a rank that outlives that by 30 s
# is not taken for it: a rank killed by SIGKILL may be the cause, the OOM killer's victim.)
_STOPPED_BY_TORCHRUN = -signal.SIGTERM


def _torchrun_failures(log: str) -> tuple[tuple[int, int] | None, list[tuple[int, int]]]:
    """(root cause, other failures) of torchrun's last failure report (its ChildFailedError), each
    (job rank, exit code; a negative code is the signal that ended the rank); (None, []) where the
    log holds no report. The root cause is the first failure torchrun observed; the others
    include the ranks it stopped itself after that failure (-SIGTERM)."""
    head, marker, tail = log.rpartition("Root Cause (first observed failure):")
    if not marker:
        return None, []
    root = _REPORT_ENTRY.search(tail)
    others = head.rpartition("Failures:")[2]
    return ((int(root.group(1)), int(root.group(2))) if root else None,
            [(int(rank), int(code)) for rank, code in _REPORT_ENTRY.findall(others)])


def _failure_summary(log: str, tp: int = 0) -> str:
    """The first failed rank (its job rank) and its exit code from torchrun's failure report, else
    from its error line, else its last line."""
    root, _ = _torchrun_failures(log)
    if root is not None:
        return f"rank {root[0]} exited with code {root[1]}"
    ranks = re.findall(r"rank\s*:\s*(\d+)", log)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", log)
    if ranks and codes:
        return f"rank {ranks[0]} exited with code {codes[0]}"
    lines = [line for line in log.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "torchrun failed without output"


def _only_consequences(log: str) -> bool:
    """Whether this node's ranks failed only because a peer went away, so the cause is elsewhere:
    the first failure torchrun observed is a rank whose collective failed
    (`nodes.COLLECTIVE_FAILED_EXIT`), and every other rank it reports either failed alike or is a
    bystander torchrun stopped after it (SIGTERM). Without a report: every exit code in
    the log is COLLECTIVE_FAILED_EXIT."""
    root, others = _torchrun_failures(log)
    if root is not None:
        return root[1] == COLLECTIVE_FAILED_EXIT and all(
            code in (COLLECTIVE_FAILED_EXIT, _STOPPED_BY_TORCHRUN) for _, code in others)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", log)
    return bool(codes) and all(int(code) == COLLECTIVE_FAILED_EXIT for code in codes)


def run_torchrun(
    cases: Sequence[Any],
    options: RunOptions,
    on_case: Callable[[CaseResult], None] | None = None,
    bench: BenchOptions | None = None,
    measurement: str = "check",
    nodes: Nodes | None = None,
) -> list[CaseResult]:
    """Run the cases with one process per rank (this host's ranks of `nodes`; None: tp processes
    on this host); returns the rows (the bench's timed rows with `measurement="bench"`)."""
    if not cases:
        return []
    return run_launch([Spec(tuple(cases), options, measurement, bench)], nodes, on_case)[0]


def expected_rows(runs: Sequence[Spec], world: int) -> list[tuple[int, Any, int | None]]:
    """(run index, case, group) of every row a launch of `world` ranks reports, in its order: per
    case, one row per group of tp consecutive ranks (group None where tp is the world)."""
    return [(index, case, group if world > case.tp else None)
            for index, run in enumerate(runs) for case in run.cases for group in range(world // case.tp)]


def launch_command(nodes: Nodes, spec: str = "SPEC.json", results: str = "RESULTS.jsonl",
                   log_dir: str | None = None) -> list[str]:
    """The torchrun command a node's launcher starts."""
    logs = [f"--log-dir={log_dir}", "--tee=3"] if log_dir else []
    return [sys.executable, "-m", "torch.distributed.run", *nodes.torchrun_arguments(), "--max-restarts=0",
            "--monitor-interval=0.2", *logs, "-m", "musebench.harness.worker", spec, results]


def check_hosts(runs: Sequence[Spec], nodes: Nodes, hosts: Sequence[str]) -> None:
    """Refuse (NodesRefused) runs whose groups the transport cannot serve where they sit: the
    nodes' host names (`NodeLink.exchange_hosts`), every rank on its node's host."""
    from musebench.comm.transport import TransportRefused
    from musebench.harness.driver import group_transports

    per_rank = [hosts[rank // nodes.nproc_per_node] for rank in range(nodes.world)]
    for run in runs:
        try:
            group_transports(run.options, run.cases[0].tp, per_rank, local_world=nodes.nproc_per_node)
        except TransportRefused as refusal:
            raise NodesRefused(str(refusal)) from None


def agree_on_hosts(link: NodeLink, check: Callable[[list[str]], None]) -> None:
    """Every node's host name exchanged, `check(hosts)` (NodesRefused where a group cannot have its
    transport) run on every node, and the verdicts exchanged: where any node refuses, every node
    raises NodesRefused with the first refusal by node, so the nodes never split into some that
    exit 2 and some that launch (a node judges the transport by its own GPUs and environment)."""
    hosts = link.exchange_hosts(STARTUP_S)
    try:
        check(hosts)
        verdict = ""
    except NodesRefused as refusal:
        verdict = str(refusal) or "refused"
    verdicts = link.exchange("hosts-verdict", verdict, STARTUP_S)
    refused = [(node, line) for node, line in enumerate(verdicts) if line]
    if refused:
        node, line = refused[0]
        raise NodesRefused(f"{describe(link.nodes, node, hosts[node])}: {line}")


def run_launch(runs: Sequence[Spec], nodes: Nodes | None = None,
               on_case: Callable[[CaseResult], None] | None = None) -> list[list[CaseResult]]:
    """Run every run (in order) in one torchrun launch on this node: `nodes` None is today's one
    node of tp processes (one run); else this node's ranks of a job of `nodes.world` ranks, every
    run's cases on groups of tp ranks (`driver.run_rank`). Returns each run's rows: rank 0's on
    node 0, and on the other nodes the same rows as rank 0 broadcast them (their verdict), error
    rows for what never reported. Several nodes: `nodes.NodeLink` (the launchers' store) before
    anything starts; NodesRefused (exit 2) where a group cannot have its transport on its hosts."""
    runs = [run for run in runs if run.cases]
    if not runs:
        return []
    if nodes is None:
        if len(runs) > 1:
            raise ValueError("one node of tp processes runs one run; several need nodes (--nproc-per-node)")
        nodes = Nodes(nproc_per_node=runs[0].cases[0].tp)
    for run in runs:
        check_tp(nodes, run.cases[0].tp)
    expected = expected_rows(runs, nodes.world)
    options = [run.options for run in runs]
    timeout_s = max(o.timeout_s for o in options)
    job = os.environ.get("MUSEBENCH_JOB_ID") or uuid.uuid4().hex[:12]
    bound_s = STARTUP_S + sum(compile_bound_s(run.options) + len(run.cases) * case_bound_s(
        run.options, run.bench if run.measurement == "bench" else None) for run in runs)
    link = None
    if nodes.nnodes > 1:
        link = NodeLink(nodes, job, STARTUP_S)
        job = link.job
        try:
            agree_on_hosts(link, lambda hosts: check_hosts(runs, nodes, hosts))
        except NodesRefused as refusal:
            link.finish("failed", str(refusal))
            raise
        except LinkLost:
            link.finish("failed")
            raise
    log_dir = os.environ.get(LOG_DIR_ENV) or None
    with tempfile.TemporaryDirectory(prefix=f"musebench-{job}-") as folder:
        spec = Path(folder) / "spec.json"
        spec.write_text(json.dumps({"runs": [spec_to_json(run.cases, run.options, run.bench, run.measurement)
                                             for run in runs]}))
        results_path = Path(folder) / "results.jsonl"
        rank_logs = None
        if log_dir:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            rank_logs = str(Path(log_dir) / f"ranks-node{nodes.node_rank}")
        command = launch_command(nodes, str(spec), str(results_path), rank_logs)
        progress_dir = Path(folder) / "progress"
        progress_dir.mkdir()
        env = dict(os.environ, MUSEBENCH_JOB_ID=job, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   **{PROGRESS_DIR_ENV: str(progress_dir)})
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        log_path = Path(log_dir) / f"launcher-node{nodes.node_rank}.log" if log_dir else Path(folder) / "torchrun.log"
        deadline = time.monotonic() + bound_s
        watch = Watch(nodes.world, timeout_s, startup_s=STARTUP_S,
                      place=(lambda ranks: link_place(link, ranks)) if link is not None else None)
        killed, reason = False, None
        rows: list[CaseResult] = []
        seen = 0
        with open(log_path, "w") as log, _exit_on_termination():
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                       preexec_fn=die_with_parent_sigterm)
            try:  # at once: a signal between the start and this try would leave the session running
                while True:
                    seen = _drain(results_path, rows, seen, on_case, nodes.node_rank == 0)
                    if process.poll() is not None:
                        break
                    records = read_progress(progress_dir)
                    if link is not None:
                        reason = _remote_reason(link, records, watch)
                        if reason is not None:
                            break
                    else:
                        watch.observe(records)
                    if watch.stalled():
                        reason = f"{watch.blame()}: killed with every rank"
                        break
                    if time.monotonic() > deadline:
                        reason = (f"torchrun job did not finish within {bound_s:.0f}s: killed with every rank "
                                  f"({watch.blame()})")
                        break
                    time.sleep(HEARTBEAT_S)
                if reason is not None:
                    if link is not None:
                        link.fail(reason)
                    _kill_session(process, _rank_pids(watch, folder))
                    killed = True
            except BaseException as error:
                if link is not None:
                    what = (f"its launcher ended ({signal.Signals(error.code - 128).name})"
                            if isinstance(error, SystemExit) and isinstance(error.code, int) and error.code > 128
                            else f"its launcher failed ({type(error).__name__}: {error})")
                    link.fail(f"{describe(nodes, nodes.node_rank, socket.gethostname())}: {what}")
                _kill_session(process, _rank_pids(watch, folder))
                raise
            finally:
                _cleanup_shm(job)
        _drain(results_path, rows, seen, on_case, nodes.node_rank == 0)
        code = process.returncode
        torchrun_log = log_path.read_text(errors="replace")
        if len(rows) >= len(expected) and code not in (0, None) and rows and rows[-1].error is None and not killed:
            # every case reported, then a rank died (teardown): the run did not end cleanly
            rows[-1].error = f"torchrun exited with code {code} after the last case: " + _failure_summary(torchrun_log)
        if len(rows) < len(expected) and reason is None:
            reason = _failure_summary(torchrun_log)
            if link is not None:
                reason = _cause_elsewhere(link, watch, reason, _only_consequences(torchrun_log))
        if link is not None:
            failed = reason is not None or any(not row.passed for row in rows)
            link.finish("failed" if failed else "done", reason)
        for index, case, group in expected[len(rows):]:
            row = _error_row(case, runs[index].options, reason or "not reported", runs[index].measurement, group,
                             nodes.nproc_per_node)
            rows.append(row)
            if on_case is not None:
                on_case(row)
        per_run: list[list[CaseResult]] = [[] for _ in runs]
        for (index, _, _), row in zip(expected, rows):
            per_run[index].append(row)
        return per_run


def link_place(link: NodeLink, ranks: Sequence[int]) -> str:
    """` on node 1 (host b)`: where `ranks` sit, for the watch's blame across nodes."""
    nodes = sorted({rank // link.nodes.nproc_per_node for rank in ranks})
    return " on " + ", ".join(f"node {node}" + (f" (host {link.hosts[node]})" if node in link.hosts else "")
                              for node in nodes)


def die_with_parent_sigterm() -> None:
    """torchrun's preexec: it gets SIGTERM (and stops its ranks) when its launcher dies, even by SIGKILL."""
    die_with_parent(signal.SIGTERM)


def _remote_reason(link: NodeLink, records: dict, watch: Watch) -> str | None:
    """One poll of the other nodes: share this node's records, read theirs into the watch; why this
    node must stop (another node failed, went silent, or node 0 is gone), or None."""
    try:
        link.beat(records)
        states = link.poll()
        failure = link.first_failure()
    except LinkLost as lost:
        return str(lost)
    merged = dict(records)
    for state in states.values():
        merged.update({rank: record for rank, record in records_from_json(state["records"]).items()
                       if rank not in records})
    watch.observe(merged)
    if failure is not None:
        return failure
    return link.silent(states)


def _cause_elsewhere(link: NodeLink, watch: Watch, local: str, consequence: bool) -> str:
    """Why the job ended, where this node's torchrun failed: the earliest failure a node published,
    and where this node's ranks only lost their peers, the other nodes' (waiting at most
    NODE_SILENCE_S + 1 s for one to fail, fall silent or vanish); else this node's own, published."""
    deadline = time.monotonic() + (NODE_SILENCE_S + 1.0 if consequence else 0.0)
    while True:
        reason = _remote_reason(link, {}, watch)
        if reason is not None:
            return reason
        if time.monotonic() >= deadline:
            break
        time.sleep(HEARTBEAT_S)
    line = f"{describe(link.nodes, link.nodes.node_rank, link.host)}: {local}"
    link.fail(line)
    try:
        return link.first_failure() or line
    except LinkLost:
        return line


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


def _drain(path: Path, rows: list[CaseResult], seen: int, on_case, report: bool = True) -> int:
    """Rows appended to `path` since `seen` lines (to `on_case` where this node reports)."""
    if not path.exists():
        return seen
    lines = path.read_text().splitlines()
    complete = [line for line in lines if line.endswith("}")]
    for line in complete[seen:]:
        row = CaseResult.from_dict(json.loads(line))
        rows.append(row)
        if on_case is not None and report:
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


def _error_row(case: Any, options: RunOptions, reason: str, measurement: str = "check", group: int | None = None,
               local_world: int | None = None) -> CaseResult:
    """The row of a case (of one group) the job never reported (its ranks died or were killed)."""
    from musebench.comm.transport import TransportRefused
    from musebench.harness.driver import new_row, process_transport

    try:
        transport = process_transport(options, case.tp, local_world=local_world).name
    except TransportRefused:  # the ranks' own errors say why; the row names what was asked
        transport = options.transport
    row = new_row(case, options, transport, 0, measurement)
    row.error, row.rank_identical, row.group = reason, False, group
    return row


def run_in_job(cases: Sequence[Any], options: RunOptions,
               on_case: Callable[[CaseResult], None] | None = None,
               bench: BenchOptions | None = None, measurement: str = "check") -> list[CaseResult]:
    """Inside an existing torchrun/srun job: this process is one rank."""
    from musebench.harness.driver import run_rank

    return run_rank(cases, options, results_path=None, on_case=on_case, measurement=measurement, bench=bench)
