"""The progress watch: when a launch has stalled, and which rank it blames (no processes: records by hand)."""

from __future__ import annotations

from musebench.harness.progress import (
    CALL_GRACE_S,
    EVIDENCE_GRACE_S,
    WAIT_GRACE_S,
    ProgressFile,
    RankProgress,
    Watch,
    read_progress,
)

TIMEOUT = 3.0
CALL = TIMEOUT + CALL_GRACE_S


def _call(rank, call=0, case=0, calls=4, seq=1):
    return RankProgress(rank=rank, phase="call", case=case, call=call, calls=calls, bound_s=CALL, seq=seq)


def _timed_out(rank, peer, call=0, case=0, seq=2):
    error = f"rank {rank} timed out after 3.00s waiting for rank {peer} (mailbox slot {peer}, token 0, generation 0)"
    return RankProgress(rank=rank, phase="gather", case=case, call=call, calls=4, error=error, seq=seq)


def test_peers_timeouts_name_the_rank_still_in_the_call_they_gave_up_in():
    watch = Watch(4, TIMEOUT, startup_s=60.0, now=0.0)
    watch.observe({r: _call(r) for r in range(4)}, now=0.0)
    assert not watch.stalled(now=TIMEOUT)
    watch.observe({r: _timed_out(r, 1) for r in (0, 2, 3)}, now=TIMEOUT)
    assert not watch.stalled(now=TIMEOUT + EVIDENCE_GRACE_S - 0.1)  # rank 1 may still post its next record
    assert watch.stalled(now=TIMEOUT + EVIDENCE_GRACE_S + 0.1)
    assert watch.blame(now=TIMEOUT + EVIDENCE_GRACE_S + 0.1) == (
        "rank 1 stopped making progress in case 0 (call 1 of 4), silent for 4.1s; ranks 0, 2, 3 timed out waiting for it")


def test_the_first_rank_to_report_an_error_is_not_blamed():
    """What the launcher used to name: the first rank whose process ended (rank 0, after its gather
    timed out), not the rank its peers waited for."""
    watch = Watch(4, TIMEOUT, startup_s=60.0, now=0.0)
    watch.observe({0: _timed_out(0, 1), 1: _call(1), 2: _timed_out(2, 1), 3: _timed_out(3, 1)}, now=0.0)
    assert watch.stalled(now=TIMEOUT + EVIDENCE_GRACE_S + 0.1)
    assert watch.blame(now=TIMEOUT + EVIDENCE_GRACE_S + 0.1).startswith("rank 1 stopped making progress")


def test_a_silent_rank_that_moves_on_is_not_stalled():
    """silent:0 never publishes but runs on: its peers time out naming it in call 1, while it is
    already in call 2, keeping its promise; the case ends with a row, not a kill."""
    watch = Watch(2, TIMEOUT, startup_s=60.0, now=0.0)
    watch.observe({0: _call(0, call=0), 1: _call(1, call=0)}, now=0.0)
    watch.observe({0: _call(0, call=1, seq=2)}, now=0.1)
    watch.observe({1: _timed_out(1, 0, call=0)}, now=TIMEOUT)
    assert not watch.stalled(now=TIMEOUT + EVIDENCE_GRACE_S + 0.5)  # rank 0 is not in the call rank 1 gave up in
    assert watch.stalled(now=0.1 + CALL + 0.1)  # until its own promise runs out


def test_a_call_past_its_bound_with_every_peer_waiting_is_blamed_without_evidence():
    watch = Watch(3, TIMEOUT, startup_s=60.0, now=0.0)
    waiting = RankProgress(rank=0, phase="gather", case=2, call=3, calls=4, seq=9)
    watch.observe({0: waiting, 1: _call(1, call=3, case=2), 2: RankProgress(rank=2, phase="gather", case=2, seq=9)},
                  now=0.0)
    assert not watch.stalled(now=CALL - 0.1)
    assert watch.stalled(now=CALL + 0.1)
    assert watch.blame(now=CALL + 0.1).startswith("rank 1 stopped making progress in case 2 (call 4 of 4)")


def test_a_long_compile_keeps_the_others_waiting_at_the_barrier():
    watch = Watch(2, TIMEOUT, startup_s=60.0, now=0.0)
    watch.observe({0: RankProgress(rank=0, phase="bind", case=0, bound_s=270.0, seq=2),
                   1: RankProgress(rank=1, phase="barrier", case=0, seq=3)}, now=0.0)
    assert not watch.stalled(now=200.0)
    assert watch.stalled(now=271.0)
    assert watch.blame(now=271.0).startswith("rank 0 stopped making progress in case 0 (bind)")


def test_every_rank_waiting_and_none_moving_is_a_stall_of_the_least_advanced():
    watch = Watch(3, TIMEOUT, startup_s=60.0, now=0.0)
    watch.observe({0: RankProgress(rank=0, phase="gather", case=1, seq=5),
                   1: RankProgress(rank=1, phase="barrier", case=1, seq=5),
                   2: RankProgress(rank=2, phase="gather", case=1, seq=5)}, now=0.0)
    assert not watch.stalled(now=WAIT_GRACE_S - 0.1)
    assert watch.stalled(now=WAIT_GRACE_S + 0.1)
    assert watch.blame(now=WAIT_GRACE_S + 0.1).startswith("rank 1 stopped making progress in case 1 (barrier)")


def test_a_rank_that_never_reports_is_blamed_after_the_startup_bound():
    watch = Watch(3, TIMEOUT, startup_s=20.0, now=0.0)
    watch.observe({0: RankProgress(rank=0, phase="start", bound_s=20.0, seq=1),
                   2: RankProgress(rank=2, phase="start", bound_s=20.0, seq=1)}, now=1.0)
    assert not watch.stalled(now=19.0)
    assert watch.stalled(now=21.5)
    assert watch.blame(now=21.5).startswith("rank 1 stopped making progress in startup (no progress reported")


def test_records_round_trip_through_the_job_folder(tmp_path):
    writer = ProgressFile(tmp_path, rank=2)
    writer.update(phase="call", case=1, call=0, calls=4, bound_s=CALL)
    writer.update(phase="gather", bound_s=None, error="rank 2 timed out after 3.00s waiting for rank 0 (...)")
    (record,) = read_progress(tmp_path).values()
    assert record.rank == 2 and record.seq == 2 and record.case == 1 and record.call == 0
    assert record.waiting_for() == {0} and record.where() == "case 1 (gather)"
    assert not list(tmp_path.glob(".*.tmp"))
    ProgressFile(None, rank=0).update(phase="start")  # no folder: records go nowhere
