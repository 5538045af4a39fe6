"""The torchrun launcher: ranks as processes, crashes and hangs end with a message, nothing left behind."""

from __future__ import annotations

import time

import pytest

from musebench.harness import launch
from musebench.cases.tail_inputs import TailCase
from musebench.harness.driver import Faults, RunOptions
from tests._processes import free_port_pair

pytestmark = pytest.mark.slow

FAST = dict(launcher="torchrun", iters=1, warmup=0, timeout_s=1.0)


def _cases(tp=2, tokens=(1, 3), mode="ep"):
    return [TailCase(mode=mode, tp=tp, tokens=m) for m in tokens]


def test_processes_pass_and_report_through_rank_zero(job_id):
    seen = []
    rows = launch.run_torchrun(_cases(), RunOptions(**FAST), on_case=seen.append)
    assert [row.passed for row in rows] == [True, True], [row.error for row in rows]
    assert len(seen) == 2 and all(row.transport == "shm" for row in rows)


def test_rank_that_exits_is_named_with_its_exit_code(job_id):
    rows = launch.run_torchrun(_cases(tp=3), RunOptions(**FAST, faults=Faults(exit_rank=1)))
    assert all(not row.passed for row in rows)
    assert rows[0].error == "rank 1 exited with code 17"


def test_silent_rank_times_out_and_the_job_goes_on(job_id):
    rows = launch.run_torchrun(_cases(), RunOptions(**FAST, faults=Faults(silent_rank=0)))
    assert len(rows) == 2
    assert all(row.error.startswith("rank 0: its outputs still hold the poison") for row in rows)
    assert all("waiting for rank 0" in r.error for row in rows for r in row.ranks if r.rank != 0)


def test_flipped_bit_in_a_process(job_id):
    rows = launch.run_torchrun(_cases(tokens=(2,)), RunOptions(**FAST, faults=Faults(flip_rank=1)))
    assert rows[0].mismatches == 1 and rows[0].first_mismatch.rank == 1


def test_hung_rank_is_killed_with_every_rank(job_id):
    """Its peers time out waiting for it: the watch names it, not the peer whose gather ran out."""
    options = RunOptions(**FAST, faults=Faults(hang_rank=1))
    started = time.monotonic()
    rows = launch.run_torchrun(_cases(tokens=(1, 2)), options)
    assert time.monotonic() - started < options.timeout_s + 15
    assert [row.passed for row in rows] == [False, False]
    assert rows[0].error.startswith("rank 1 stopped making progress in case 0 (call 1 of 1)"), rows[0].error
    assert "rank 0 timed out waiting for it" in rows[0].error and "killed with every rank" in rows[0].error


def test_the_deadline_backs_the_watch(job_id, monkeypatch):
    """Were the watch never to call a stall, the job's deadline still ends it, every rank killed."""
    monkeypatch.setattr(launch, "STARTUP_S", 15.0)
    monkeypatch.setattr(launch, "case_bound_s", lambda options, bench=None: 3.0)
    monkeypatch.setattr(launch.Watch, "stalled", lambda self, now=None: False)
    rows = launch.run_torchrun(_cases(tokens=(1,)), RunOptions(**FAST, faults=Faults(hang_rank=1)))
    assert not rows[0].passed
    assert "did not finish within 18s: killed with every rank (" in rows[0].error, rows[0].error


def test_the_hung_rank_of_the_main_command_is_named_within_the_timeout(job_id):
    """`musebench tail --tp 4 ... --timeout 3 --inject hang:1` exited 1 after 71 s naming rank 0
    (its gather's 60 s gloo timeout); now within 3 + 15 s, naming rank 1, nothing left behind."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "musebench", "tail", "--tp", "4", "--launcher", "torchrun", "--mode", "ep",
               "--tokens", "2", "--weights", "bf16", "--norm", "before", "--timeout", "3", "--inject", "hang:1",
               "--backend", "cpu"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert elapsed < 3 + 15, f"{elapsed:.1f}s\n{done.stdout}"
    assert ("rank 1 stopped making progress in case 0 (call 1 of 4)" in done.stdout
            and "ranks 0, 2, 3 timed out waiting for it" in done.stdout), done.stdout
    assert "rank 0 exited" not in done.stdout and "rank 2 exited" not in done.stdout


def test_inside_an_existing_torchrun_job_rank_zero_reports(job_id):
    """`torchrun ... -m musebench tail --launcher torchrun`: musebench runs as the job's ranks."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "musebench",
               "tail", "--tp", "2", "--launcher", "torchrun", "--mode", "ep", "--tokens", "1", "--weights", "bf16",
               "--norm", "after", "--iters", "1", "--warmup", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("1 passed, 0 failed") == 1  # one table, from rank 0


@pytest.mark.parametrize("backend, gpus, transport", [("cpu", 0, "shm"), ("cute", 1, "ipc"), ("cute", 2, "ipc"),
                                                      ("cute", 4, "unicast")])
def test_error_rows_name_the_transport_the_ranks_would_have_used(monkeypatch, backend, gpus, transport):
    """A launch error row (tp 4 processes) carries the transport comm.transport.decide picks for the layout."""
    from musebench.comm import transport as transport_module

    monkeypatch.delenv("MUSEBENCH_PEER_MAPPING", raising=False)
    monkeypatch.setattr(transport_module, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(transport_module, "peer_access_everywhere", lambda count: True)
    monkeypatch.setattr(transport_module, "symmetric_memory_imports", lambda: True)
    row = launch._error_row(TailCase(mode="ep", tp=4, tokens=1), RunOptions(backend=backend, launcher="torchrun"), "boom")
    assert row.transport == transport and row.error == "boom" and not row.passed


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_a_terminated_launcher_kills_its_ranks(job_id, signal_name):
    """`timeout` or a CI runner ends the launcher while a rank hangs: the job goes with it."""
    import signal
    import subprocess
    import sys

    from tests._processes import job_processes

    launcher = subprocess.Popen([sys.executable, "-c", (
        "from musebench.harness import launch; from musebench.cases.tail_inputs import TailCase; "
        "from musebench.harness.driver import Faults, RunOptions; "
        "launch.run_torchrun([TailCase(mode='ep', tp=2, tokens=1)], RunOptions(launcher='torchrun', iters=1, "
        "warmup=0, timeout_s=60.0, faults=Faults(hang_rank=1)))")], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(job_processes(job_id)) < 3 and time.monotonic() < deadline:  # torchrun and both ranks
        assert launcher.poll() is None, launcher.stderr.read()
        time.sleep(0.5)
    assert len(job_processes(job_id)) >= 3, "the job never started"
    launcher.send_signal(getattr(signal, signal_name))
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + getattr(signal, signal_name), stderr
    assert f"{signal_name}: killing the torchrun job" in stderr
    assert job_processes(job_id) == []


# ---------------------------------------------------------------------------------------------
# Several nodes on this machine: one launcher process per node, rendezvous on 127.0.0.1

TAIL = ["tail", "--launcher", "torchrun", "--mode", "ep", "--tokens", "1", "--weights", "bf16", "--norm", "before",
        "--backend", "cpu", "--iters", "1", "--warmup", "0"]


def _start_nodes(arguments, nnodes, nproc, extra_env=None, json_path=None):
    import os
    import subprocess
    import sys

    port = free_port_pair()
    env = dict(os.environ, **(extra_env or {}))
    launchers = []
    for node in range(nnodes):
        command = [sys.executable, "-m", "musebench", *arguments, "--nnodes", str(nnodes), "--node-rank", str(node),
                   "--nproc-per-node", str(nproc), "--rdzv-endpoint", f"127.0.0.1:{port}"]
        if json_path is not None and node == 0:
            command += ["--json", str(json_path)]
        launchers.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return launchers


@pytest.mark.parametrize("tp, nproc", [(4, 2), (8, 4)])
def test_two_nodes_pass_a_tail_across_them(job_id, tmp_path, tp, nproc):
    """`tail --tp 4` on 2 x 2 ranks and `--tp 8` on 2 x 4: one group across both nodes; node 0
    reports with every rank's host, node 1 prints its verdict."""
    import json

    out = tmp_path / "run.json"
    launchers = _start_nodes([*TAIL, "--tp", str(tp), "--timeout", "5"], 2, nproc, json_path=out)
    results = [launcher.communicate(timeout=240) for launcher in launchers]
    assert [launcher.returncode for launcher in launchers] == [0, 0], results
    report = json.loads(out.read_text())
    assert report["passed"] and len(report["cases"]) == 1 and report["cases"][0]["group"] is None
    assert len(report["cases"][0]["ranks"]) == tp and all(rank["host"] for rank in report["cases"][0]["ranks"])
    assert "node 1: 1 rows, 0 failed; node 0 writes the report" in results[1][0]


def test_one_job_of_eight_ranks_runs_tp_2_4_8_on_groups(job_id, tmp_path):
    """A scenario of tp 2, 4 and 8 on one launch of 8 ranks: 4 + 2 + 1 rows, each group its own."""
    import json
    import subprocess
    import sys

    scenario = tmp_path / "groups.toml"
    scenario.write_text('[defaults]\nmodes = ["ep"]\nlauncher = "torchrun"\nbackend = "cpu"\ntokens = [1]\n'
                        'weights = ["bf16"]\nnorm = ["before"]\niters = 1\nwarmup = 0\ntimeout = 5.0\n\n'
                        '[[run]]\nname = "groups"\ntp = [2, 4, 8]\n')
    out = tmp_path / "run.json"
    done = subprocess.run([sys.executable, "-m", "musebench", "parity", str(scenario), "--nproc-per-node", "8",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["cases"]
    assert [(row["tp"], row["group"]) for row in rows] == [(2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1), (8, None)]
    assert all(row["passed"] for row in rows)


def test_a_group_is_checked_on_its_own(job_id):
    """A flipped bit on rank 5 of a job of 8 ranks fails group 1 of tp 4 (ranks 4-7) alone, naming it."""
    options = RunOptions(**FAST, faults=Faults(flip_rank=5))
    from musebench.harness.nodes import Nodes

    rows = launch.run_torchrun(_cases(tp=4, tokens=(2,)), options, nodes=Nodes(1, 0, 8, None))
    assert [(row.group, row.passed) for row in rows] == [(0, True), (1, False)]
    assert rows[1].mismatches == 1 and rows[1].first_mismatch.rank == 1 and rows[1].group_label() == "group 1 (ranks 4-7)"


@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_node_ends_the_other_naming_it(job_id, killed):
    """SIGKILL to one node's launcher mid-run (rank 1 holds the job in a call): the other node ends
    within the heartbeat's silence bound and the kill, naming the node and its ranks; no process
    of the job is left on this machine."""
    import signal

    from musebench.harness.nodes import NODE_SILENCE_S
    from tests._processes import job_processes

    launchers = _start_nodes([*TAIL, "--tp", "4", "--timeout", "60", "--inject", "hang:1"], 2, 2)
    deadline = time.monotonic() + 120
    while len([p for p in job_processes(job_id) if "musebench.harness.worker" in p and "torch.distributed.run" not in p]) < 4:
        assert time.monotonic() < deadline and all(launcher.poll() is None for launcher in launchers)
        time.sleep(0.5)
    time.sleep(3)  # the ranks are in case 0
    launchers[killed].send_signal(signal.SIGKILL)
    started = time.monotonic()
    other = launchers[1 - killed]
    stdout, stderr = other.communicate(timeout=120)
    elapsed = time.monotonic() - started
    launchers[killed].wait(10)
    assert other.returncode == 1, stdout + stderr
    assert elapsed < NODE_SILENCE_S + 15, f"{elapsed:.1f}s"
    named = (f"node {killed} (host " if killed else "node 0 (host ")
    assert named in stdout + stderr and ("ranks 2-3)" if killed else "ranks 0-1)") in stdout + stderr, stdout + stderr
    assert ("went silent" if killed else "is gone") in stdout + stderr
    deadline = time.monotonic() + 15
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)


def _torchrun_report(failures: dict[int, tuple[int, int]]) -> str:
    """A torchrun log's end as torchrun writes it: its error line on the first observed failure and
    its ChildFailedError report of `failures` ({job rank: (local rank, exit code)}, in the order
    torchrun observed them)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    report = ChildFailedError("musebench.harness.worker", {
        rank: ProcessFailure(local_rank=local, pid=1000 + rank, exitcode=code, error_file="<N/A>")
        for rank, (local, code) in failures.items()})
    root, failure = report.get_first_failure()
    return (f"E1202 api.py:1002] failed (exitcode: {failure.exitcode}) local_rank: {failure.local_rank} "
            f"(pid: {failure.pid}) of binary: python\nTraceback (most recent call last):\n"
            f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n{report.format_msg()}\n")


@pytest.mark.parametrize("failures, summary, consequence", [
    # the flaky killed-node run: node 1 vanished, rank 1 exited 3, torchrun then stopped rank 0
    ({1: (1, 3), 0: (0, -15)}, "rank 1 exited with code 3", True),
    ({0: (0, 3), 1: (1, 3)}, "rank 0 exited with code 3", True),
    ({2: (2, 17), 0: (0, -15), 1: (1, -15), 3: (3, -15)}, "rank 2 exited with code 17", False),  # the cause
    ({1: (1, 3), 0: (0, 1)}, "rank 1 exited with code 3", False),  # a rank's own error beside it
    ({0: (0, -9), 1: (1, 3)}, "rank 0 exited with code -9", False),  # killed (OOM), its peer lost it
    ({3: (1, 3), 2: (0, -15)}, "rank 3 exited with code 3", True),  # node 1: job ranks, not local ones
])
def test_a_rank_torchrun_stopped_after_a_lost_peer_is_a_consequence(failures, summary, consequence):
    """torchrun lists the ranks it stopped (SIGTERM) after the first failure as failures too: a
    rank that lost its peer (exit 3) and the bystanders stopped after it still point elsewhere,
    and the first failure observed is named by its job rank."""
    log = _torchrun_report(failures)
    assert launch._failure_summary(log) == summary
    assert launch._only_consequences(log) is consequence


def test_a_bystander_exit_does_not_hide_a_vanished_node(job_id, monkeypatch, tmp_path):
    """The race behind a flaky `test_a_killed_node_ends_the_other_naming_it[1]`: node 1 vanishes
    while node 0's ranks are in a collective with it; node 0's rank 1 exits 3 (its collective
    failed) and torchrun stops rank 0 (SIGTERM), before node 1's key has been silent for
    NODE_SILENCE_S. Node 0 must wait for the cause and name node 1, not its own rank 1.

    Node 0 runs here with a stand-in torchrun (two ranks that do just that); node 1 is a link that
    beats, then stops. Fault injection: node 0 cannot tell that node 1 is silent until it has seen
    its torchrun fail, so the bystander's exit always wins the race, whatever the machine's load."""
    import sys
    import threading

    from musebench.harness.nodes import NodeLink, Nodes

    vanished, running = tmp_path / "node-1-vanished", tmp_path / "rank-1-running"
    ranks = tmp_path / "ranks.py"
    ranks.write_text(
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '1':  # its collective with node 1 fails once node 1 is gone\n"
        f"    open({str(running)!r}, 'w').close()\n"
        "    deadline = time.monotonic() + 60\n"
        f"    while not os.path.exists({str(vanished)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.02)\n"
        "    sys.exit(3)\n"
        "time.sleep(120)  # a bystander: torchrun stops it\n")

    def stand_in_torchrun(nodes, spec="SPEC.json", results="RESULTS.jsonl", log_dir=None):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                "--max-restarts=0", "--monitor-interval=0.2", str(ranks), spec]

    monkeypatch.setattr(launch, "launch_command", stand_in_torchrun)
    judged = threading.Event()  # node 0 has seen its torchrun fail
    only_consequences, silent = launch._only_consequences, NodeLink.silent
    monkeypatch.setattr(launch, "_only_consequences", lambda log: judged.set() or only_consequences(log))
    monkeypatch.setattr(NodeLink, "silent", lambda self, *args: silent(self, *args) if judged.is_set() else None)
    port = free_port_pair()
    errors: list = []

    def node_1() -> None:
        try:
            link = NodeLink(Nodes(2, 1, 2, f"127.0.0.1:{port}"), job_id, 60.0)
            launch.agree_on_hosts(link, lambda hosts: None)
            deadline = time.monotonic() + 60
            while not running.exists() and time.monotonic() < deadline:
                link.beat({})
                time.sleep(0.1)
            link.beat({})
            vanished.touch()  # then it is gone: no beat, no failure, no finish
        except Exception as error:  # handed to the test
            errors.append(error)
            vanished.touch()

    thread = threading.Thread(target=node_1, daemon=True)
    thread.start()
    run = launch.Spec((TailCase(mode="ep", tp=4, tokens=1),), RunOptions(**FAST))
    rows = launch.run_launch([run], Nodes(2, 0, 2, f"127.0.0.1:{port}"))[0]
    thread.join(10)
    assert not errors, errors
    assert judged.is_set() and len(rows) == 1 and not rows[0].passed
    assert rows[0].error.startswith("node 1 (host ") and "ranks 2-3) went silent" in rows[0].error, rows[0].error


@pytest.mark.parametrize("arguments, message", [
    (["--tp", "4", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "127.0.0.1:29999"],
     "need --launcher torchrun"),
    (["--tp", "4", "--launcher", "torchrun", "--nnodes", "2", "--node-rank", "5", "--nproc-per-node", "2",
      "--rdzv-endpoint", "127.0.0.1:29999"], "--node-rank 5 is outside 0..1"),
    (["--tp", "8", "--launcher", "torchrun", "--nnodes", "2", "--nproc-per-node", "3",
      "--rdzv-endpoint", "127.0.0.1:29999"], "6 ranks cannot be split into groups of tp 8"),
    (["--tp", "4", "--launcher", "torchrun", "--nnodes", "2", "--nproc-per-node", "2"], "needs --rdzv-endpoint"),
    (["--tp", "2", "--launcher", "torchrun", "--nproc-per-node", "4", "--inject", "flip:5"],
     "fault rank 5 does not exist at tp=2 on 4 ranks"),
])
def test_node_options_that_cannot_work_exit_2_before_launching(arguments, message):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "musebench", "tail", "--backend", "cpu", *arguments],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_stopped_node_0_ends_the_other_within_the_silence_bound(job_id):
    """Node 0's launcher stopped (SIGSTOP: a host that hangs or is cut off keeps its connections
    open, so nothing resets them): node 1's next question to the launchers' store must not wait
    for the store's connect timeout (120 s) but end within the silence bound, naming node 0."""
    import signal

    from musebench.harness.nodes import NODE_SILENCE_S
    from tests._processes import job_processes

    launchers = _start_nodes([*TAIL, "--tp", "4", "--timeout", "60", "--inject", "hang:1"], 2, 2)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in job_processes(job_id)
                   if "musebench.harness.worker" in p and "torch.distributed.run" not in p]) < 4:
            assert time.monotonic() < deadline and all(launcher.poll() is None for launcher in launchers)
            time.sleep(0.5)
        time.sleep(2)
        launchers[0].send_signal(signal.SIGSTOP)
        started = time.monotonic()
        stdout, stderr = launchers[1].communicate(timeout=NODE_SILENCE_S + 30)
        elapsed = time.monotonic() - started
        assert launchers[1].returncode == 1, stdout + stderr
        assert elapsed < NODE_SILENCE_S + 15, f"{elapsed:.1f}s"
        assert "node 0 (host " in stdout + stderr and "is gone" in stdout + stderr, stdout + stderr
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()  # a stopped process ends on SIGKILL; its torchrun follows (PDEATHSIG)
                launcher.wait(10)
    deadline = time.monotonic() + 20
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
