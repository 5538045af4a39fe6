"""The driver's checks fail when they must: flipped bit, missing rank, raising rank, hung rank."""

from __future__ import annotations

import time

import pytest
import torch

from musebench.cases.tail_inputs import TailCase
from musebench.harness.driver import Faults, RunOptions, run_virtual
from tests._processes import spawned_ranks

FAST = dict(iters=1, warmup=0, timeout_s=0.5)


def _cases(mode="ep", tp=4, tokens=(2,)):
    return [TailCase(mode=mode, tp=tp, tokens=m) for m in tokens]


def test_clean_run_passes():
    rows = run_virtual(_cases(tokens=(1, 8)), RunOptions(**FAST))
    assert all(row.passed for row in rows), [row.error for row in rows]
    assert all(row.rank_identical and row.deterministic for row in rows)


def test_flipped_bit_is_reported_with_rank_and_element():
    row = run_virtual(_cases(), RunOptions(**FAST, faults=Faults(flip_rank=2)))[0]
    assert not row.passed
    assert row.mismatches == 1 and row.max_ulp >= 1
    assert row.first_mismatch.rank == 2
    assert row.first_mismatch.index == (1, 0)  # element numel // 2 of a [2, 4096] output
    assert not row.rank_identical


def test_missing_rank_times_out_within_the_timeout():
    started = time.monotonic()
    row = run_virtual(_cases(), RunOptions(**FAST, faults=Faults(silent_rank=1)))[0]
    assert time.monotonic() - started < 10
    assert not row.passed
    assert row.error.startswith("rank 1: its outputs still hold the poison")  # the check finds it
    assert all("timed out" in r.error and "waiting for rank 1" in r.error for r in row.ranks if r.rank != 1)


def test_raising_rank_is_reported_first():
    row = run_virtual(_cases(), RunOptions(**FAST, faults=Faults(raise_rank=3)))[0]
    assert not row.passed
    assert row.error.startswith("rank 3: InjectedFault")


@pytest.mark.parametrize("hung", [1, 3])
def test_hung_rank_is_named_as_the_one_that_stopped_making_progress(hung):
    """Within the poll timeout and a grace, not the old 30 s + grace per call, and the hung rank,
    not a peer that timed out waiting for it, leads the row's error."""
    options = RunOptions(**FAST, faults=Faults(hang_rank=hung))
    started = time.monotonic()
    rows = run_virtual(_cases(tokens=(1, 2)), options)
    assert time.monotonic() - started < options.timeout_s + 15
    assert len(rows) == 2 and rows[1].error.startswith("not run: ")  # the hung rank holds its mailboxes
    assert rows[1].ranks == []  # no later case ran on them, and it says so
    peers = ", ".join(str(r) for r in range(4) if r != hung)
    assert rows[0].error.startswith(f"rank {hung} stopped making progress in case 0 (call 1 of 1)"), rows[0].error
    assert f"ranks {peers} timed out waiting for it" in rows[0].error
    assert rows[0].ranks[hung].error.startswith(f"rank {hung} stopped making progress")


def test_failure_does_not_poison_the_next_case():
    rows = run_virtual(_cases(tokens=(1, 2, 3)), RunOptions(**FAST, faults=Faults(silent_rank=0)))
    assert not any(row.passed for row in rows)
    clean = run_virtual(_cases(tokens=(1, 2)), RunOptions(**FAST))
    assert all(row.passed for row in clean)


def test_fault_parsing():
    assert Faults.parse(["flip:1", "silent:0"]) == Faults(flip_rank=1, silent_rank=0)
    assert Faults.parse(["exit:2", "flip:1"]).kinds() == ("flip", "exit") and Faults().kinds() == ()
    with pytest.raises(ValueError):
        Faults.parse(["melt:1"])
    with pytest.raises(ValueError):
        Faults.parse(["flip:x"])


def test_group_load_adds_each_kernels_share():
    from musebench.kernels.occupancy import LaunchDemand, group_load

    publisher, reduce = LaunchDemand(None, ctas=8, threads=128), LaunchDemand(None, ctas=32, threads=128)
    assert group_load([publisher, reduce], 8, [1000, 1000]) == pytest.approx(8 * 8 / 1000 + 8 * 32 / 1000)
    assert group_load([reduce], 32, [512]) > 1.0  # 1024 CTAs on a GPU that holds 512: refused
    assert group_load([reduce], 1, [0]) == float("inf")


def test_wait_groups_need_one_whole_group_resident_not_every_grid():
    from musebench.kernels.occupancy import LaunchDemand, group_load

    # the TP tail at tp 8, m <= 8: 8 owners, clusters of 16, the H200's 58 clusters (928 CTAs)
    tp_tail = LaunchDemand(None, ctas=16 * 8, threads=32, cluster=16, wait_groups=8)
    assert tp_tail.needed_ctas(8) == (8 * 7 + 1) * 16
    assert group_load([tp_tail], 8, [928]) <= 1.0  # 57 clusters of 64 suffice
    assert group_load([tp_tail], 8, [56 * 16]) > 1.0  # 7 units of every group may hold all 56
    ungrouped = LaunchDemand(None, ctas=16 * 8, threads=32, cluster=16)
    assert group_load([ungrouped], 8, [928]) > 1.0  # every grid at once: 1024 CTAs
    tp16 = LaunchDemand(None, ctas=16 * 16, threads=32, cluster=16, wait_groups=16)
    assert group_load([tp16], 16, [928]) > 1.0  # tp 16 still refused: 241 clusters
    with pytest.raises(ValueError):
        LaunchDemand(None, ctas=16 * 8, threads=32, cluster=16, wait_groups=3).needed_ctas(8)


def test_timings_of_processes_sharing_gpus_carry_a_note(monkeypatch):
    from musebench.harness.driver import shared_gpu_timing_note

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert shared_gpu_timing_note(2) is None and shared_gpu_timing_note(1) is None  # a GPU per process
    note = shared_gpu_timing_note(4)  # two processes per GPU: time slices, measured at 2.2 ms a call
    assert "time slices" in note and "one process per GPU" in note


def test_the_mailboxes_hold_the_capacity_asked_for():
    """--capacity sizes the run's mailboxes (production's 8 at m = 1); never below the largest m."""
    from musebench.harness.driver import mailbox_specs

    cases = _cases(mode="tp", tp=2, tokens=(1, 3))
    assert mailbox_specs(cases)["tp_token"].rows == 3
    assert mailbox_specs(cases, 8)["tp_token"].rows == 8 and mailbox_specs(cases, 8)["tp_route"].rows == 64
    assert mailbox_specs(cases, 2)["tp_token"].rows == 3


def test_the_tail_job_carries_its_capacity():
    from musebench.harness.jobs import make_tail_job

    job = make_tail_job(name="t", tp=2, modes=("ep",), tokens=(1,), capacity=8, weights=("bf16",), norms=("before",),
                        inputs=("random",), seeds=(0,), launcher="virtual", backend="cpu", iters=1, warmup=0,
                        timeout_s=1.0)
    assert job.options.capacity == 8


def test_a_process_bench_allocates_its_baselines_mailboxes():
    """run_rank's mailboxes: a bench adds the one-shot all-reduce's (lost once in a merge, so the
    process bench timed no one-shot row), a check does not."""
    from musebench.cases.tail import ONE_SHOT_MAILBOX
    from musebench.harness.driver import run_mailbox_specs

    cases = _cases(mode="ep", tp=2, tokens=(1, 2))
    assert ONE_SHOT_MAILBOX in run_mailbox_specs(cases, RunOptions(capacity=8), "bench")
    assert ONE_SHOT_MAILBOX not in run_mailbox_specs(cases, RunOptions(capacity=8), "check")
    assert run_mailbox_specs([], RunOptions(), "bench") == {}


def _rank_of_a_job(rank: int, world: int, port: int, job: str, refusing: tuple, answers) -> None:
    """One process rank of a CPU job (spawned): `refusing` ranks' transport decision refuses
    (their GPUs or environment differ); puts (rank, exit code or the error's line)."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MUSEBENCH_JOB_ID=job)
    from musebench.comm.transport import TransportRefused
    from musebench.harness import driver

    if rank in refusing:
        def refuse(*args, **kwargs):
            raise TransportRefused("auto", f"this rank's machine says no (rank {rank})")

        driver.group_transports = refuse
    try:
        driver.run_rank([TailCase(mode="ep", tp=2, tokens=1)], RunOptions(launcher="torchrun", **FAST))
        answers.put((rank, 0))
    except SystemExit as done:
        answers.put((rank, done.code))
    except BaseException as error:
        answers.put((rank, f"{type(error).__name__}: {str(error)[:80]}"))


@pytest.mark.slow
def test_a_transport_refusal_on_some_ranks_exits_2_on_every_rank(job_id):
    """Ranks decide the transport with their own GPUs and environment: where rank 3 (group 1)
    refuses and the others do not, every rank exits 2 before any mailbox, none left in a collective."""
    got = dict(spawned_ranks(_rank_of_a_job, 4, lambda rank, port, answers: (rank, 4, port, job_id, (3,), answers)))
    assert got == {0: 2, 1: 2, 2: 2, 3: 2}, got


def _rank_of_a_bench(rank: int, port: int, answers) -> None:
    """Rank `rank` of a 4-rank job (spawned, CPU; the GPU's parts faked) with case groups {0, 1} and
    {2, 3}: the baselines' collectives agreed over the job, then group 0 benches while group 1
    skips the case (a rank could not bind it), both meeting in the job's gather after."""
    import datetime
    import os

    import torch.distributed as dist

    from musebench.harness import driver
    from musebench.harness.measure import BenchOptions

    os.environ.update(LOCAL_WORLD_SIZE="2", WORLD_SIZE="4")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results = {}
    # nodes differ in GPUs: ranks 2-3 see one GPU for their two processes, ranks 0-1 two
    torch.cuda.device_count = lambda: 2 if rank < 2 else 1

    class Collectives:
        def __init__(self, tp):
            dist.new_group([0, 1, 2, 3])  # collective over the job, as NCCL's new_group
            if rank == 1 and made.get("fail"):
                raise RuntimeError("NCCL could not start")

    made: dict = {}
    driver._Collectives = Collectives
    results["disagree"] = driver._agreed_collectives(2, f"host{rank}")
    torch.cuda.device_count = lambda: 2
    made["fail"] = True
    results["one_fails"] = driver._agreed_collectives(2, f"host{rank}")

    torch.cuda.Stream = lambda device=None: None
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args: None
    driver.mailbox_sets.reset = lambda boxes: None

    def graph_median_us(call, stream, bench, barrier=None, sync=None, agree=None, before_replays=None):
        assert agree(True)
        barrier()
        call()
        return 1.0

    driver.graph_median_us = graph_median_us

    class Runner:
        outputs: dict = {}

        def call(self):
            pass

        def check_fault(self):
            pass

        def parts(self):
            return {"part": self.call}

    class Family:
        name = "fam"

        def variants(self, case, options):
            return {}

        def baselines(self, case, inputs, rank, runner, comms):
            return {}

    if rank < 2:
        outcome = driver._process_bench(TailCase(mode="ep", tp=2, tokens=1), Family(), rank, Runner(), {}, None,
                                        RunOptions(), BenchOptions(), None, None, group=groups[0])
        results["bench"] = (outcome.error, sorted(outcome.times_us))
    results["job"] = len(driver._gathered(rank))
    answers.put((rank, results))
    dist.destroy_process_group()


@pytest.mark.slow
def test_bench_collectives_stay_in_step_across_groups_and_nodes():
    """The NCCL baselines are made only where every rank's node has a GPU per process (made on some
    ranks only, the others never entered the job-wide new_group), kept only where every rank made
    them; a group's bench agrees and barriers within its group, so a group that skipped the case
    never leaves another in a collective of the job."""
    got = dict(spawned_ranks(_rank_of_a_bench, 4, lambda rank, port, answers: (rank, port, answers)))
    for rank in range(4):
        assert got[rank]["disagree"] == (None, None)
        collectives, why = got[rank]["one_fails"]
        assert collectives is None and why.startswith("NCCL / SymmetricMemory baselines unavailable: rank 1: "
                                                      "RuntimeError: NCCL could not start (host host1)"), why
        assert got[rank]["job"] == 4
    assert got[0]["bench"] == got[1]["bench"] == (None, ["fam", "part"])
