"""The process bench's row assembly and spec, on CPU: a timed row still fails on wrong bits."""

from __future__ import annotations

import json

from musebench.harness import launch
from musebench.harness.bench import BenchOptions
from musebench.harness.bench_process import RankTimes, bench_row
from musebench.harness.cases import TailCase
from musebench.harness.driver import RunOptions
from musebench.harness.results import CaseResult, Mismatch, RankResult

CASE = TailCase(mode="ep", tp=2, tokens=4)
OPTIONS = BenchOptions(calls=5, replays=5)


def _ranks(**overrides) -> list[RankTimes]:
    ranks = [RankTimes(check=RankResult(rank=r, digest="same"),
                       times_us={"ep_tail": 4.0 + r, "finalize": 3.0, "finalize+nccl": 20.0 - r}) for r in range(2)]
    for name, value in overrides.items():
        setattr(ranks[1].check, name, value)
    return ranks


def test_a_row_takes_the_slowest_rank_of_every_path():
    row = bench_row(CASE, _ranks(), "unicast", OPTIONS)
    assert row.passed
    assert row.tail_us == 5.0 and row.stock_us == 20.0 and row.ratio == 0.25
    assert row.baselines_us == {"finalize": 3.0, "finalize+nccl": 20.0}
    assert [r.tail_us for r in row.ranks] == [4.0, 5.0]


def test_wrong_bits_fail_a_timed_row():
    first = Mismatch(rank=1, index=(0, 3), got_bits=1, want_bits=0, got=1e-45, want=0.0)
    row = bench_row(CASE, _ranks(mismatches=1, max_ulp=1, first_mismatch=first), "unicast", OPTIONS)
    assert not row.passed and row.mismatches == 1 and row.first_mismatch == first


def test_ranks_that_disagree_fail_an_ep_row():
    assert not bench_row(CASE, _ranks(digest="other"), "unicast", OPTIONS).passed


def test_a_missing_rank_or_a_rank_error_fails_the_row():
    assert "1 rank(s) returned no result" in bench_row(CASE, _ranks()[:1], "unicast", OPTIONS).error
    row = bench_row(CASE, _ranks(error="rank 1: timed out waiting for rank 0 (slot 0, generation 1)"), "ipc", OPTIONS)
    assert not row.passed and "rank 1" in row.error


def test_a_path_timed_on_some_ranks_only_is_dropped_with_a_note():
    ranks = _ranks()
    del ranks[1].times_us["finalize+nccl"]
    ranks[1].notes.append("NCCL baseline not timed: RuntimeError: x")
    row = bench_row(CASE, ranks, "unicast", OPTIONS)
    assert row.stock_us is None and "finalize+nccl" not in row.baselines_us
    assert any("some ranks only" in note for note in row.notes) and any("NCCL" in note for note in row.notes)


def test_the_publisher_and_the_single_launch_are_kernel_medians_not_baselines():
    ranks = _ranks()
    ranks[0].times_us["publisher"], ranks[1].times_us["publisher"] = 1.5, 2.0
    ranks[0].times_us["single launch"], ranks[1].times_us["single launch"] = 3.5, 3.25
    row = bench_row(CASE, ranks, "unicast", OPTIONS)
    # max over ranks; the tail is 5.0
    assert row.kernels_us == {"publisher": 2.0, "single launch": 3.5, "reduce (call - publisher)": 3.0}
    assert not {"publisher", "single launch"} & set(row.baselines_us)
    again = CaseResult.from_dict(json.loads(json.dumps(row.to_dict())))
    assert again.kernels_us == row.kernels_us


def test_rows_with_baselines_survive_json():
    row = bench_row(CASE, _ranks(), "unicast", OPTIONS)
    again = CaseResult.from_dict(json.loads(json.dumps(row.to_dict())))
    assert again.baselines_us == row.baselines_us and again.notes == row.notes


def test_the_spec_carries_the_bench_options():
    cases, options, bench = launch.spec_from_json(
        json.loads(json.dumps(launch.spec_to_json([CASE], RunOptions(backend="cute"), OPTIONS))))
    assert cases == [CASE] and options.backend == "cute" and bench == OPTIONS
    assert launch.spec_from_json(launch.spec_to_json([CASE], RunOptions()))[2] is None


def test_a_bench_case_is_bounded():
    bound = launch.case_bound_s(RunOptions(backend="cute"), OPTIONS)
    assert 30.0 < bound < 120.0
