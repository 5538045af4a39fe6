"""Routing jobs: where they run, where they are skipped (and say why), where they are refused; the
EP tail's launch choice of tail jobs."""

from __future__ import annotations

import pytest

from musebench.harness import jobs
from musebench.harness.results import CaseResult
from musebench.harness.scenario import RoutingScenarioRun


def _job(**overrides) -> jobs.Job:
    fields = dict(name="routing (tp=2)", tp=2, tokens=(1, 8), tiles=(8, 128), renormalize=(True, False),
                  inputs=("random", "adversarial"), seeds=(0, 1), backend="auto")
    fields.update(overrides)
    return jobs.make_routing_job(**fields)


def test_auto_skips_routing_without_a_gpu_and_says_why(no_gpu):
    assert jobs.resolve_routing_backend("auto") == (
        "skipped", "", "needs a CUDA GPU with SM >= 90 and CuTe DSL (no such GPU here)")


def test_auto_skips_routing_without_the_dsl(gpu_without_dsl):
    backend, _, reason = jobs.resolve_routing_backend("auto")
    assert backend == "skipped" and reason.endswith("(CuTe DSL does not import here)")


def test_cpu_always_skips_routing(gpu_with_dsl):
    backend, _, reason = jobs.resolve_routing_backend("cpu")
    assert backend == "skipped" and "routing has no CPU model" in reason


@pytest.mark.parametrize("machine", ["no_gpu", "gpu_without_dsl"])
def test_cute_is_refused_where_routing_cannot_run(request, machine):
    request.getfixturevalue(machine)
    with pytest.raises(ValueError, match="routing needs a CUDA GPU with SM >= 90 and CuTe DSL"):
        jobs.resolve_routing_backend("cute")
    with pytest.raises(ValueError, match=r"^routing \(tp=2\): routing needs"):
        _job(backend="cute")


@pytest.mark.parametrize("requested", ["auto", "cute"])
def test_routing_runs_where_the_kernel_runs(gpu_with_dsl, requested):
    backend, note, reason = jobs.resolve_routing_backend(requested)
    assert (backend, reason) == ("cute", None) and "Fake H200" in note


def test_a_job_holds_every_combination_once(no_gpu):
    job = _job()
    assert len(job.cases) == 2 * 2 * 2 * 2 * 2 == len(set(job.cases))
    assert {(c.tp, c.tokens, c.tile_n, c.renormalize, c.inputs, c.seed) for c in job.cases} == {
        (2, m, t, r, f, s) for m in (1, 8) for t in (8, 128) for r in (True, False)
        for f in ("random", "adversarial") for s in (0, 1)}
    skipped = job.skipped()
    assert (skipped.name, skipped.kernel, skipped.cases) == ("routing (tp=2)", "routing", 32)
    assert "needs a CUDA GPU" in skipped.reason


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tp=1), "tp must be in 2..32"),
        (dict(tokens=(9,)), "tokens must be in 1..8"),
        (dict(tiles=(0,)), "tile must be in 1..256"),
        (dict(inputs=("zeros",)), "inputs must be among"),
        (dict(seeds=()), "no seeds"),
    ],
)
def test_bad_values_are_refused_before_anything_runs(no_gpu, overrides, message):
    with pytest.raises(ValueError, match=message):
        _job(**overrides)


def test_a_dry_run_job_keeps_the_requested_backend_and_never_runs(monkeypatch):
    monkeypatch.setattr(jobs, "_gpu_name", lambda: pytest.fail("a dry run must not probe the machine"))
    job = _job(backend="cute", check_machine=False)
    assert (job.backend, job.skip_reason) == ("cute", None)
    with pytest.raises(ValueError, match="was not resolved"):
        jobs.run_job(job)


def test_a_skipped_job_runs_nothing(no_gpu, monkeypatch):
    from musebench.harness import driver

    monkeypatch.setattr(driver, "run_virtual", lambda *a, **k: pytest.fail("a skipped job ran a case"))
    assert jobs.run_job(_job()) == []


def test_a_runnable_job_runs_every_case_through_the_runner(gpu_with_dsl, monkeypatch):
    from musebench.harness import driver

    ran, seen = [], []

    def fake(cases, options, on_case=None, *, measurement, bench):
        rows = [one(case) for case in cases]
        for row in rows:
            on_case(row)
        return rows

    def one(case):
        ran.append(case)
        return CaseResult(kernel="routing", mode="routing", tp=case.tp, tokens=case.tokens, weight_dtype="fp32",
                          norm="renorm", inputs=case.inputs, seed=case.seed, backend="cute", launcher="virtual",
                          transport="local", stock="triton")

    monkeypatch.setattr(driver, "run_virtual", fake)
    job = _job()
    rows = jobs.run_job(job, on_case=seen.append)
    assert ran == list(job.cases) and rows == seen and len(rows) == 32


def test_scenario_overrides_reach_routing_runs_but_launch_options_do_not(no_gpu):
    run = RoutingScenarioRun(source="s.toml", name="r", kernel="routing", tp=(2, 4), tokens=(1,), tile=(8,),
                             renormalize=(True,), inputs=("random",), seeds=(0,), backend="auto")
    built = jobs.jobs_from_scenario([run], overrides={"backend": "cpu", "launcher": "torchrun", "transport": "unicast"})
    assert [job.name for job in built] == ["r (tp=2)", "r (tp=4)"]
    assert all("no CPU model" in job.skip_reason for job in built)


@pytest.mark.gpu
def test_a_routing_job_passes_on_this_gpu():
    job = _job(tokens=(1, 8), tiles=(8,), seeds=(0,))
    if job.skip_reason is not None:
        pytest.skip(job.skip_reason)
    rows = jobs.run_job(job)
    assert len(rows) == len(job.cases) and all(row.passed for row in rows), [row.error for row in rows]


def _tail_job(**overrides) -> jobs.Job:
    fields = dict(name="tail (tp=2)", tp=2, modes=("ep", "tp"), tokens=(1,), capacity=8, weights=("bf16",),
                  norms=("before",), inputs=("random",), seeds=(0,), launcher="virtual", backend="cpu", iters=1,
                  warmup=0, timeout_s=1.0)
    fields.update(overrides)
    return jobs.make_tail_job(**fields)


def test_the_single_launch_ep_tail_needs_the_cute_backend(no_gpu):
    with pytest.raises(ValueError, match="ep_launch must be one of two, single"):
        _tail_job(ep_launch="one")
    with pytest.raises(ValueError, match="single-launch EP tail is a cute kernel"):
        _tail_job(ep_launch="single")
    with pytest.raises(ValueError, match="single-launch EP tail is a cute kernel"):  # a dry run checks the values too
        _tail_job(ep_launch="single", check_machine=False)
    assert _tail_job(ep_launch="single", backend="cute", nsm=132, check_machine=False).options.ep_launch == "single"


def test_single_launch_rows_are_told_apart():
    from musebench.harness import launch
    from musebench.cases.tail_inputs import TailCase
    from musebench.harness.driver import RunOptions, new_row

    cases = [TailCase(mode="ep", tp=2, tokens=1), TailCase(mode="tp", tp=2, tokens=1)]
    single = RunOptions(backend="cute", ep_launch="single")
    assert [new_row(case, single, "local", 1).kernel for case in cases] == ["ep_tail_single", "tp_tail"]
    assert [new_row(case, RunOptions(backend="cute"), "local", 1).kernel for case in cases] == ["ep_tail", "tp_tail"]
    assert [launch._error_row(case, single, "x").kernel for case in cases] == ["ep_tail_single", "tp_tail"]


@pytest.mark.parametrize("make, names", [
    (lambda impl: jobs.make_front_job(name="front", tp=8, tokens=(1,), rope=(True,), inputs=("random",), seeds=(0,),
                                      backend="auto", impl=impl), "launch_qkv_front"),
    (lambda impl: jobs.make_attn2_job(name="attn", tp=8, lengths=(17,), max_model_len=4096, windows=(0,),
                                      inputs=("random",), seeds=(0,), backend="auto", impl=impl),
     "launch_attn2 / prepare_attn2 / attn2_splits / attn2_workspace_bytes"),
])
def test_the_attention_jobs_refuse_an_impl_without_their_entry_point_before_launch(gpu_with_dsl, make, names):
    """--impl of a module without the family's cute_ops entry point: a ValueError (exit 2) when the
    job is built, not a row that fails at bind; musebench's own passes."""
    assert make("musebench").skip_reason is None
    with pytest.raises(ValueError, match=f"--impl tests.impls.reexport provides no {names} \\(cute_ops\\)"):
        make("tests.impls.reexport")


def test_an_attn2_impl_without_the_split_plan_is_refused_before_launch(gpu_with_dsl):
    """The runner sizes the launch with the implementation's attn2_splits and
    attn2_workspace_bytes: a cute_ops with the launch and prepare_attn2 alone is refused when the
    job is built (exit 2), not at bind with an AttributeError."""
    with pytest.raises(ValueError, match="provides no launch_attn2 / prepare_attn2 / attn2_splits / "
                                         "attn2_workspace_bytes"):
        jobs.make_attn2_job(name="attn", tp=8, lengths=(17,), max_model_len=4096, windows=(0,), inputs=("random",),
                            seeds=(0,), backend="auto", impl="tests.impls.attn2_launch_only")


def test_the_one_gpu_families_name_themselves_when_skipped(no_gpu):
    job = jobs.make_front_job(name="front", tp=8, tokens=(1,), rope=(True,), inputs=("random",), seeds=(0,),
                              backend="cpu")
    assert job.skip_reason.startswith("qkv_front has no CPU model")
    with pytest.raises(ValueError, match="^attn: attn2 needs a CUDA GPU"):
        jobs.make_attn2_job(name="attn", tp=8, lengths=(17,), max_model_len=4096, windows=(0,), inputs=("random",),
                            seeds=(0,), backend="cute")
