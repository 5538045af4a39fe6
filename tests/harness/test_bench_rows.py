"""A process bench's row (`driver.bench_row`), on CPU: the slowest rank of every path, and a timed
row still fails on wrong bits, a rank's error, a missing rank or a variant that differs."""

from __future__ import annotations

import json

import torch

from musebench.cases import ep_tail
from musebench.harness import launch
from musebench.harness.case import Expected, RunOptions
from musebench.cases.tail_inputs import TailCase
from musebench.harness.driver import bench_row, new_row
from musebench.harness.measure import BenchOptions, RankOutcome, evaluate
from musebench.harness.results import CaseResult

CASE = TailCase(mode="ep", tp=2, tokens=4)
OPTIONS = BenchOptions(calls=5, replays=5)
RUN = RunOptions(backend="cute", launcher="torchrun")
WANT = torch.arange(4 * 8, dtype=torch.float32).reshape(4, 8).to(torch.bfloat16)
EXPECTED = Expected([{"out": WANT}, {"out": WANT}], "ep-ll one-shot")


def _outcomes(**times) -> list[RankOutcome]:
    outcomes = []
    for rank in range(2):
        outcome = RankOutcome(rank=rank, outputs={"out": WANT.clone()},
                              times_us={"ep_tail": 4.0 + rank, "finalize": 3.0, "finalize+nccl": 20.0 - rank})
        outcome.times_us.update({name: values[rank] for name, values in times.items()})
        outcomes.append(outcome)
    return outcomes


def _row(outcomes: list[RankOutcome]) -> CaseResult:
    row = new_row(CASE, RUN, "unicast", OPTIONS.calls * OPTIONS.replays)
    evaluate(row, CASE.tp, outcomes, EXPECTED)
    bench_row(row, ep_tail, outcomes, EXPECTED)
    return row


def test_a_row_takes_the_slowest_rank_of_every_path():
    row = _row(_outcomes())
    assert row.passed, row.error
    assert row.tail_us == 5.0 and row.stock_us == 20.0 and row.ratio == 0.25
    assert row.baselines_us == {"finalize": 3.0, "finalize+nccl": 20.0}
    assert [r.tail_us for r in row.ranks] == [4.0, 5.0]


def test_wrong_bits_fail_a_timed_row():
    outcomes = _outcomes()
    outcomes[1].outputs["out"].view(torch.int16)[0, 3] ^= 1
    row = _row(outcomes)
    assert not row.passed and row.mismatches == 1 and row.first_mismatch.rank == 1


def test_ranks_that_disagree_fail_an_ep_row():
    outcomes = _outcomes()
    outcomes[1].outputs["out"].view(torch.int16)[2, 2] ^= 4
    assert not _row(outcomes).rank_identical


def test_a_missing_rank_or_a_rank_error_fails_the_row():
    assert "rank 1 returned no result" in _row(_outcomes()[:1]).error
    outcomes = _outcomes()
    outcomes[1] = RankOutcome(rank=1, error="rank 1: timed out waiting for rank 0 (slot 0, generation 1)")
    row = _row(outcomes)
    assert not row.passed and "rank 1" in row.error


def test_a_path_timed_on_some_ranks_only_is_dropped_with_a_note():
    outcomes = _outcomes()
    del outcomes[1].times_us["finalize+nccl"]
    outcomes[1].notes.append("finalize+nccl not timed: RuntimeError: x")
    row = _row(outcomes)
    assert row.stock_us is None and "finalize+nccl" not in row.baselines_us
    assert any("some ranks only" in note for note in row.notes) and any("not timed" in note for note in row.notes)


def test_the_publisher_and_the_single_launch_are_kernel_medians_not_baselines():
    outcomes = _outcomes(publisher=(1.5, 2.0), **{"single launch": (3.5, 3.25)})
    for outcome in outcomes:
        outcome.variant_outputs["single launch"] = {"out": WANT.clone()}
    row = _row(outcomes)
    # max over ranks; the tail is 5.0
    assert row.kernels_us == {"publisher": 2.0, "single launch": 3.5, "reduce (call - publisher)": 3.0}
    assert not {"publisher", "single launch"} & set(row.baselines_us)
    again = CaseResult.from_dict(json.loads(json.dumps(row.to_dict())))
    assert again.kernels_us == row.kernels_us


def test_a_variant_that_differs_fails_the_row():
    outcomes = _outcomes(**{"single launch": (3.5, 3.25)})
    for outcome in outcomes:
        outcome.variant_outputs["single launch"] = {"out": WANT.clone()}
    outcomes[0].variant_outputs["single launch"]["out"].view(torch.int16)[1, 1] ^= 1
    row = _row(outcomes)
    assert not row.passed and "single launch" in row.error and row.mismatches == 1


def test_rows_with_baselines_survive_json():
    row = _row(_outcomes())
    again = CaseResult.from_dict(json.loads(json.dumps(row.to_dict())))
    assert again.baselines_us == row.baselines_us and again.notes == row.notes


def test_the_spec_carries_the_measurement_and_the_bench_options():
    spec = launch.spec_from_json(json.loads(json.dumps(launch.spec_to_json([CASE], RUN, OPTIONS, "bench"))))
    assert spec.cases == (CASE,) and spec.options == RUN and spec.bench == OPTIONS and spec.measurement == "bench"
    assert launch.spec_from_json(launch.spec_to_json([CASE], RunOptions())).bench is None


def test_a_bench_case_is_bounded():
    bound = launch.case_bound_s(RunOptions(backend="cute"), OPTIONS)
    assert 30.0 < bound < 120.0


def test_a_row_gives_the_tail_over_each_baseline_of_the_same_run():
    row = _row(_outcomes(**{"finalize+one-shot(own)": (8.0, 10.0)}))
    assert row.baselines_us["finalize+one-shot(own)"] == 10.0  # the slowest rank
    assert row.baseline_ratios == {"finalize": 5.0 / 3.0, "finalize+nccl": 0.25, "finalize+one-shot(own)": 0.5}
    data = json.loads(json.dumps(row.to_dict()))
    assert data["baseline_ratios"]["finalize+one-shot(own)"] == 0.5
    assert CaseResult.from_dict(data).baseline_ratios == row.baseline_ratios  # derived, not stored


def test_a_baseline_timed_on_no_rank_has_no_ratio():
    row = _row(_outcomes())
    row.tail_us = None
    assert row.baseline_ratios == {}


def test_a_family_can_pair_a_baselines_ratio_with_another_baseline():
    """BASELINE_RATIO_OF (qkv_front: cold cuBLAS against the cold launch): that baseline's ratio is
    the other baseline's µs over its own, kept through JSON; the rest stay the tail's; without the
    other path timed the cell has no ratio (never the tail's in its place)."""
    from types import SimpleNamespace

    family = SimpleNamespace(name=ep_tail.name, PARTS=ep_tail.PARTS, PROCESS_STOCK=ep_tail.PROCESS_STOCK,
                             BASELINE_RATIO_OF={"cold matmul": "cold", "absent": "cold"})
    outcomes = _outcomes(cold=(6.0, 8.0), **{"cold matmul": (9.0, 10.0)})
    row = new_row(CASE, RUN, "unicast", OPTIONS.calls * OPTIONS.replays)
    evaluate(row, CASE.tp, outcomes, EXPECTED)
    bench_row(row, family, outcomes, EXPECTED)
    assert row.baseline_ratio_of == {"cold matmul": "cold"}  # only the baselines timed
    assert row.baseline_ratios["cold matmul"] == 0.8 and row.baseline_ratios["cold"] == 5.0 / 8.0
    assert row.baseline_ratios["finalize"] == 5.0 / 3.0
    again = CaseResult.from_dict(json.loads(json.dumps(row.to_dict())))
    assert again.baseline_ratio_of == row.baseline_ratio_of and again.baseline_ratios == row.baseline_ratios
    del row.baselines_us["cold"]
    assert "cold matmul" not in row.baseline_ratios
    plain = _row(_outcomes(cold=(6.0, 8.0), **{"cold matmul": (9.0, 10.0)}))  # ep_tail pairs nothing
    assert plain.baseline_ratio_of == {} and plain.baseline_ratios["cold matmul"] == 0.5
