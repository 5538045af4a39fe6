"""The CLI through click's CliRunner: usage errors exit 2 before launching, failures exit 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from musebench.cli import main

SMALL = ["--tokens", "1,2", "--weights", "bf16", "--norm", "before", "--iters", "1", "--warmup", "0"]


def _run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_help_imports_neither_torch_nor_cutlass():
    code = "import sys, musebench.cli as c; c.main(['--help'], standalone_mode=False); " \
           "print('torch' in sys.modules, 'cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False False")


@pytest.mark.parametrize(
    "args, message",
    [
        (["tail", "--tp", "1"], "tp must be in 2..32, got 1"),
        (["tail", "--tp", "33"], "tp must be in 2..32, got 33"),
        (["tail", "--tp", "4", "--tokens", "0-2"], "tokens must be in 1..8"),
        (["tail", "--tp", "4", "--tokens", "9", "--capacity", "8"], "tokens must be in 1..8"),
        (["tail", "--tp", "4", "--weights", "fp16"], "choose from bf16, fp32"),
        (["tail", "--tp", "4", "--inject", "flip:9"], "fault rank 9 does not exist"),
        (["routing", "--inputs", "edge"], "choose from random, adversarial"),  # a tail-only family
        # before the GPU is looked for: a capacity below the run's largest token count
        (["bench", "tail", "--tokens", "1,4", "--capacity", "2"], "tokens must be in 1..2"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(args, message):
    result = _run(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_the_flashinfer_stock_option_is_gone():
    """--stock only ever ran the reference (flashinfer was always refused): the option went."""
    result = _run("tail", "--tp", "4", "--stock", "flashinfer")
    assert result.exit_code == 2 and "No such option" in result.output and "--stock" in result.output


def test_cute_backend_without_a_gpu_exits_2():
    from musebench.harness.jobs import _gpu_name

    if _gpu_name() is not None:
        pytest.skip("this machine has a GPU")
    result = _run("tail", "--tp", "4", "--backend", "cute")
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output


def test_unknown_option_exits_2():
    assert _run("tail", "--bogus").exit_code == 2


def test_tail_runs_and_prints_the_table(tmp_path):
    out = tmp_path / "run.json"
    junit = tmp_path / "run.xml"
    result = _run("tail", "--tp", "3", *SMALL, "--json", str(out), "--junit", str(junit))
    assert result.exit_code == 0, result.output
    assert "✓" in result.output and "ep_tail" in result.output and "tp_tail" in result.output
    assert "CPU model" in result.output
    data = json.loads(out.read_text())
    assert data["passed"] and len(data["cases"]) == 4
    assert junit.read_text().count("<testcase") == 4


def test_injected_flip_fails_the_run_with_the_element():
    result = _run("tail", "--tp", "2", "--mode", "ep", *SMALL, "--inject", "flip:1")
    assert result.exit_code == 1
    assert "✗" in result.output and "rank 1" in result.output


def test_injected_missing_rank_fails_within_the_timeout():
    result = _run("tail", "--tp", "2", "--mode", "ep", "--tokens", "1", "--weights", "bf16", "--norm", "before",
                  "--iters", "1", "--warmup", "0", "--timeout", "0.5", "--inject", "silent:0")
    assert result.exit_code == 1
    assert "rank 0: its outputs still hold the poison" in result.output


def test_parity_json_then_report_and_compare(tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text('[[run]]\nmodes = ["ep"]\ntp = [2]\ntokens = [1]\nweights = ["bf16"]\nnorm = ["after"]\n'
                        'iters = 1\nwarmup = 0\n')
    out = tmp_path / "out.json"
    assert _run("parity", str(scenario), "--json", str(out)).exit_code == 0
    rendered = _run("report", str(out))
    assert rendered.exit_code == 0 and "ep_tail" in rendered.output
    # a regression: the old bench row was fast and correct, the new one is slower (check rows
    # carry no µs: only a bench row's graph medians are compared)
    data = json.loads(out.read_text())
    data["cases"][0].update(measurement="bench", tail_us=1.0)
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(data))
    data["cases"][0]["tail_us"] = 10.0
    slower = tmp_path / "slower.json"
    slower.write_text(json.dumps(data))
    compared = _run("report", str(slower), "--compare", str(fast))
    assert compared.exit_code == 1 and "timing" in compared.output
    both = _run("report", str(slower), "--compare", str(fast), "--side-by-side")
    assert both.exit_code == 1 and "side by side" in both.output and "10.00" in both.output
    assert _run("report", str(out), "--compare", str(out)).exit_code == 0
    alone = _run("report", str(out), "--side-by-side")
    assert alone.exit_code == 2 and "--side-by-side needs --compare" in alone.output
    assert "ep_tail" not in alone.output  # refused before anything is rendered


def test_a_check_run_prints_no_us_and_points_to_the_bench(tmp_path):
    """The CPU model's table held host wall-clock µs ("tail µs / stock µs / ratio") that read like
    kernel timings; a check has none, in the table or the JSON."""
    from musebench.harness.report import TIMING_POINTER

    out = tmp_path / "run.json"
    result = _run("tail", "--tp", "2", "--backend", "cpu", "--tokens", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "µs" not in result.output and "ratio" not in result.output
    assert TIMING_POINTER in result.output and "musebench bench tail" in result.output
    data = json.loads(out.read_text())
    assert data["schema_version"] == "1.4" and len(data["cases"]) == 8  # ep, tp x bf16, fp32 x before, after
    for row in data["cases"]:
        assert row["measurement"] == "check" and row["tail_us"] is None and row["stock_us"] is None
        assert row["ratio"] is None and all(rank["tail_us"] is None for rank in row["ranks"])


def test_report_renders_and_compares_a_1_2_file_with_host_timings(tmp_path):
    """A check run written before schema 1.3: its host µs are not shown and not compared."""
    out = tmp_path / "new.json"
    assert _run("tail", "--tp", "2", "--backend", "cpu", "--tokens", "1", "--mode", "ep", "--weights", "bf16",
                "--norm", "before", "--json", str(out)).exit_code == 0
    data = json.loads(out.read_text())
    data["schema_version"] = "1.2"
    for row in data["cases"]:
        del row["measurement"]
        row.update(tail_us=48015.0, stock_us=176685.0, ratio=0.27)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    rendered = _run("report", str(old))
    assert rendered.exit_code == 0 and "ep_tail" in rendered.output
    assert "48015" not in rendered.output and "µs" not in rendered.output
    compared = _run("report", str(out), "--compare", str(old), "--side-by-side")
    assert compared.exit_code == 0 and "no regressions" in compared.output, compared.output


def test_parity_dry_run_prints_cases_and_launches_nothing(tmp_path):
    result = _run("parity", "scenarios/parity.toml", "--dry-run")
    assert result.exit_code == 0
    assert "torch.distributed.run" in result.output and "ep_tail tp=2 m=1" in result.output


ROUTING_RUN = 'name = "routing"\nkernel = "routing"\ntp = [2, 4]\ntokens = [1, 8]\ntile = [8]\ninputs = ["random"]\n'
TAIL_RUN = 'name = "tail"\nmodes = ["ep"]\ntp = [2]\ntokens = [1]\nweights = ["bf16"]\nnorm = ["after"]\niters = 1\nwarmup = 0\n'


def _scenario(tmp_path, *runs: str):
    path = tmp_path / "s.toml"
    path.write_text("".join(f"[[run]]\n{run}" for run in runs))
    return str(path)


def _routing_row(case, **flaws):
    from musebench.harness.results import CaseResult

    return CaseResult(kernel="routing", mode="routing", tp=case.tp, tokens=case.tokens, weight_dtype="fp32",
                      norm="renorm" if case.renormalize else "raw", inputs=case.inputs, seed=case.seed,
                      backend="cute", launcher="virtual", transport="local", stock="triton", **flaws)


def test_parity_dry_run_lists_routing_cases_after_the_tails():
    result = _run("parity", "scenarios/parity.toml", "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "routing, virtual ranks (tp=8): 128 cases, backend auto, virtual ranks" in out
    assert "(in process) 8 virtual ranks on one GPU, 128 cases; skipped unless this machine has a CUDA GPU" in out
    for label in ("routing tp=2 b=1 tile=8 renorm random seed=0", "routing tp=8 b=8 tile=128 raw adversarial seed=1"):
        assert label in out
    assert out.index("routing tp=") > out.rindex("_tail tp=")


def test_parity_runs_routing_after_the_tails_whatever_the_file_order(tmp_path):
    result = _run("parity", _scenario(tmp_path, ROUTING_RUN, TAIL_RUN), "--dry-run")
    assert result.exit_code == 0, result.output
    assert result.output.index("tail (tp=2)") < result.output.index("routing (tp=2)")


def test_parity_reports_routing_as_skipped_without_a_gpu(tmp_path, no_gpu):
    out, junit = tmp_path / "run.json", tmp_path / "run.xml"
    result = _run("parity", _scenario(tmp_path, TAIL_RUN, ROUTING_RUN), "--json", str(out), "--junit", str(junit))
    assert result.exit_code == 0, result.output
    assert "routing: skipped, needs a CUDA GPU with SM >= 90 and CuTe DSL" in result.output
    assert "1 passed, 0 failed, 4 skipped" in result.output
    data = json.loads(out.read_text())
    assert data["passed"] and [case["kernel"] for case in data["cases"]] == ["ep_tail"]
    assert [(run["name"], run["cases"]) for run in data["skipped"]] == [("routing (tp=2)", 2), ("routing (tp=4)", 2)]
    assert 'skipped="2"' in junit.read_text() and junit.read_text().count("<skipped ") == 2


def test_a_routing_only_scenario_skipped_everywhere_exits_0(tmp_path, no_gpu):
    result = _run("parity", _scenario(tmp_path, ROUTING_RUN))
    assert result.exit_code == 0, result.output
    assert result.output.count("routing: skipped") == 2 and "0 passed, 0 failed, 4 skipped" in result.output


def _route_with(monkeypatch, per_case):
    """Routing cases reach the driver as every family's do; `per_case(case)` stands in for a GPU
    run of one routing case (other families run for real)."""
    from musebench.harness import driver

    real = driver.run_virtual

    def run_virtual(cases, options, on_case=None, **kwargs):
        if cases[0].family != "routing":
            return real(cases, options, on_case, **kwargs)
        rows = []
        for case in cases:
            rows.append(per_case(case))
            if on_case is not None:
                on_case(rows[-1])
        return rows

    monkeypatch.setattr(driver, "run_virtual", run_virtual)


def test_backend_cpu_skips_routing_even_on_a_gpu(tmp_path, gpu_with_dsl, monkeypatch):
    _route_with(monkeypatch, lambda case: pytest.fail("backend cpu ran routing"))
    result = _run("parity", _scenario(tmp_path, ROUTING_RUN), "--backend", "cpu")
    assert result.exit_code == 0, result.output
    assert "routing has no CPU model" in result.output


@pytest.mark.parametrize("how", ["option", "file"])
def test_routing_with_cute_asked_for_and_no_gpu_exits_2(tmp_path, no_gpu, how):
    if how == "option":
        result = _run("parity", _scenario(tmp_path, ROUTING_RUN), "--backend", "cute")
    else:
        result = _run("parity", _scenario(tmp_path, ROUTING_RUN + 'backend = "cute"\n'))
    assert result.exit_code == 2
    assert "routing (tp=2): routing needs a CUDA GPU with SM >= 90 and CuTe DSL" in result.output


@pytest.mark.parametrize(
    "flaw",
    [
        dict(mismatches=3, max_ulp=1),  # wrong bits on some rank
        dict(error="rank 1: the guard word past metadata_size(8) was written"),
        dict(rank_identical=False),  # ranks disagree
    ],
)
def test_a_failing_routing_row_fails_parity(tmp_path, gpu_with_dsl, monkeypatch, flaw):
    ran = []

    def runner(case):
        ran.append(case)
        return _routing_row(case, **(flaw if (case.tp, case.tokens) == (4, 8) else {}))

    _route_with(monkeypatch, runner)
    out = tmp_path / "run.json"
    result = _run("parity", _scenario(tmp_path, ROUTING_RUN), "--json", str(out))
    assert result.exit_code == 1, result.output
    assert len(ran) == 4 and "✗ routing[tp4-tok8-fp32-renorm-random-local]" in result.output
    data = json.loads(out.read_text())
    assert not data["passed"] and data["skipped"] == []
    assert [case["passed"] for case in data["cases"]] == [True, True, True, False]


def test_passing_routing_rows_land_in_the_parity_report(tmp_path, gpu_with_dsl, monkeypatch):
    _route_with(monkeypatch, _routing_row)
    out, junit = tmp_path / "run.json", tmp_path / "run.xml"
    result = _run("parity", _scenario(tmp_path, ROUTING_RUN), "--json", str(out), "--junit", str(junit))
    assert result.exit_code == 0, result.output
    assert "cute (CuTe DSL kernels on Fake H200)" in result.output and "4 passed, 0 failed" in result.output
    data = json.loads(out.read_text())
    assert data["passed"] and len(data["cases"]) == 4 and data["skipped"] == []
    assert {case["kernel"] for case in data["cases"]} == {"routing"}
    assert junit.read_text().count("<testcase") == 4


def test_only_the_reporting_rank_of_a_torchrun_job_routes(tmp_path, gpu_with_dsl, monkeypatch):
    _route_with(monkeypatch, lambda case: pytest.fail("rank 1 routed"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = _run("parity", _scenario(tmp_path, ROUTING_RUN))
    assert result.exit_code == 0 and "passed" not in result.output


@pytest.mark.parametrize(
    "content, message",
    [
        ("[[run]]\ntp = [1]\n", "tp must be in 2..32"),
        ("[[run]]\ntp = [4]\ncolour = 'red'\n", "unknown key 'colour'"),
        ("[[run]\n", "not valid TOML"),
        ("[defaults]\niters = 1\n", "no [[run]] tables"),
        ("[[run]]\ntokens = ['a']\n", "tokens must hold int"),
        ("[[run]]\nlauncher = 'slurm'\n", "launcher 'slurm' is not one of"),
        ("[[run]]\nkernel = 'routing'\nweights = ['bf16']\n", "run 1: key 'weights' belongs to tail runs"),
        ("[[run]]\ntile = [8]\n", "run 1: key 'tile' belongs to routing runs"),
        ("[[run]]\nkernel = 'routing'\ntile = [512]\n", "tile must be in 1..256"),
    ],
)
def test_malformed_scenario_exits_2(tmp_path, content, message):
    path = tmp_path / "bad.toml"
    path.write_text(content)
    result = _run("parity", str(path))
    assert result.exit_code == 2
    assert message in result.output


def test_report_of_a_malformed_file_exits_2(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    assert _run("report", str(path)).exit_code == 2


def test_env_runs_without_a_gpu():
    result = _run("env")
    assert result.exit_code == 0
    assert "cpu" in result.output.lower()


def test_gb200_nightly_scenario_dry_run_lists_the_rack_launch():
    result = _run("parity", "scenarios/gb200-nightly.toml", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "tp_tail tp=32 m=8" in result.output and "torch.distributed.run" in result.output


def test_gb200_nightly_scenario_runs_on_virtual_cpu_ranks(tmp_path, monkeypatch):
    """The nightly file itself (not a copy) on virtual ranks of the CPU model, trimmed by a wrapper."""
    from musebench.harness import jobs as jobs_module

    real = jobs_module.make_tail_job

    def trimmed(**kwargs):  # the rack's full matrix is hours on 2 cores: keep tp 4, one batch, one seed, one of each
        kwargs.update(tokens=(2,), seeds=(0,), iters=1, warmup=0, weights=("bf16",), norms=("before",), inputs=("random",))
        return real(**kwargs) if kwargs["tp"] == 4 else real(**{**kwargs, "tp": 4})

    monkeypatch.setattr(jobs_module, "make_tail_job", trimmed)
    out = tmp_path / "nightly.json"
    result = _run("parity", "scenarios/gb200-nightly.toml", "--launcher", "virtual", "--backend", "cpu",
                  "--transport", "auto", "--json", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["passed"] and len(data["skipped"]) == 5  # routing: no CPU model


MULTICAST_VARIABLES = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS")


@pytest.fixture
def nothing_launches(monkeypatch):
    """Every way a run starts fails the test: the job runner, both launchers, a subprocess."""
    from musebench.harness import driver, jobs, launch

    def launched(*args, **kwargs):
        pytest.fail("a run was launched")

    for module, name in ((jobs, "run_job"), (driver, "run_virtual"), (launch, "run_torchrun"),
                         (launch, "run_in_job"), (subprocess, "Popen")):
        monkeypatch.setattr(module, name, launched)


@pytest.mark.parametrize("launcher", ["virtual", "torchrun"])
def test_multicast_exits_2_with_the_reason_and_launches_nothing(monkeypatch, nothing_launches, launcher):
    """Here (no GPU, whatever its policy says): refused before anything starts, with the reason."""
    result = _run("tail", "--tp", "2", "--transport", "multicast", "--launcher", launcher)
    assert result.exit_code == 2, result.output
    assert "musebench: error: transport multicast: " in result.output


def test_multicast_where_the_policy_forbids_it_names_the_variables(monkeypatch, nothing_launches):
    """The lent H200s' environment: the policy is the reason, whatever the backend or launcher."""
    for name in MULTICAST_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    result = _run("tail", "--tp", "2", "--transport", "multicast")
    assert result.exit_code == 2
    assert ("transport multicast: multicast is forbidden here: TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0"
            in result.output)


def test_multicast_where_the_machine_has_it_makes_a_multicast_job(monkeypatch):
    """A multicast rack (stood in for): one process per GPU, every attribute set, the policy
    silent: the job is made with transport multicast and handed to the runner (stood in for
    here: nothing starts), not refused and not turned into unicast."""
    from musebench.comm import transport
    from musebench.harness import jobs

    for name in MULTICAST_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(jobs, "resolve_backend", lambda requested: ("cute", "cute (test)"))
    monkeypatch.setattr(transport, "visible_gpus", lambda: 4)
    monkeypatch.setattr(transport, "peer_access_everywhere", lambda gpus: True)
    monkeypatch.setattr(transport, "symmetric_memory_imports", lambda: True)
    monkeypatch.setattr(transport, "query_device_attribute", lambda count, attribute: [True] * count)
    monkeypatch.setattr(jobs, "gpu_sm_count", lambda: 148)
    handed: list = []

    def stand_in(job, *args, **kwargs):
        handed.append(job)
        raise SystemExit(0)

    monkeypatch.setattr(jobs, "run_job", stand_in)
    result = _run("tail", "--tp", "4", "--transport", "multicast", "--launcher", "torchrun")
    assert result.exit_code == 0, result.output
    assert [job.options.transport for job in handed] == ["multicast"]


def test_a_scenario_asking_for_multicast_exits_2_before_launching(nothing_launches):
    result = _run("parity", "scenarios/gb200-nightly.toml", "--backend", "cpu")  # the file's own transport
    assert result.exit_code == 2 and "transport multicast: " in result.output


def test_a_transport_the_layout_cannot_have_exits_2(nothing_launches):
    result = _run("tail", "--tp", "2", "--transport", "unicast", "--backend", "cpu")
    assert result.exit_code == 2
    assert "transport unicast: the CPU model moves data through host memory" in result.output


def test_cute_backend_takes_a_hang_on_either_launcher(monkeypatch):
    from musebench.comm import transport
    from musebench.harness import jobs

    monkeypatch.setattr(jobs, "resolve_backend", lambda requested: ("cute", "cute (test)"))
    monkeypatch.setattr(transport, "visible_gpus", lambda: 1)  # the transport decision sees the stand-in's GPU
    def job(launcher):
        return jobs.make_tail_job(name="t", tp=2, modes=("ep",), tokens=(1,), capacity=8, weights=("bf16",),
                                  norms=("before",), inputs=("random",), seeds=(0,), launcher=launcher,
                                  backend="cute", iters=1, warmup=0, timeout_s=1.0, nsm=132,
                                  faults=jobs.Faults(hang_rank=1))

    # virtual ranks hold the rank's stream past the bound; a process's host stops
    assert job("virtual").options.faults.hang_rank == job("torchrun").options.faults.hang_rank == 1


@pytest.mark.parametrize(("inject", "message"), [
    ("raise:1", "routing injects only flip, silent, hang faults, not raise"),
    ("flip:2", "a fault names rank 2, but tp is 2"),
    ("melt:1", "bad fault 'melt:1'"),
])
def test_routing_refuses_a_fault_it_cannot_inject_before_anything_runs(inject, message):
    result = _run("routing", "--tp", "2", "--inject", inject)
    assert result.exit_code == 2 and message in result.output, result.output


def test_routing_refuses_a_nonpositive_timeout():
    result = _run("routing", "--tp", "2", "--timeout", "0")
    assert result.exit_code == 2 and "timeout must be positive" in result.output


def test_an_implementation_on_the_cpu_model_is_refused_before_anything_runs(monkeypatch):
    from musebench.harness import driver

    monkeypatch.setattr(driver, "run_virtual", lambda *a, **k: pytest.fail("a refused run launched"))
    result = _run("tail", "--tp", "2", "--tokens", "1", "--backend", "cpu", "--impl", "tests.impls.reexport")
    assert result.exit_code == 2
    assert "--impl tests.impls.reexport: the cpu backend runs the CPU model" in result.output


def test_launch_options_on_a_routing_only_scenario_are_refused(tmp_path, monkeypatch):
    """Routing runs have no mailboxes and run on virtual ranks: --transport / --launcher would do
    nothing there, so a scenario of routing runs alone refuses them before anything runs."""
    from musebench.harness import driver

    monkeypatch.setattr(driver, "run_virtual", lambda *a, **k: pytest.fail("a refused run launched"))
    for option, value in (("--transport", "multicast"), ("--launcher", "torchrun")):
        result = _run("parity", _scenario(tmp_path, ROUTING_RUN), option, value)
        assert result.exit_code == 2 and f"{option} applies to tail runs" in result.output, result.output
