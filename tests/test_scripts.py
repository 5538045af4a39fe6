"""The Python scripts under scripts/ load on a CPU-only host (their GPU work runs only as __main__)."""

from __future__ import annotations

import copy
import runpy

import pytest

from tests._processes import free_port_pair
from tests._scripts import REPO, run_script, script_module

SCRIPTS = sorted((REPO / "scripts").glob("*.py"))


def test_there_are_scripts_to_check():
    assert {path.name for path in SCRIPTS} >= {"profile-routing.py", "profile-tail.py", "profile-attn2.py", "sweep-attn2.py"}


@pytest.mark.parametrize("path", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_a_script_loads_without_a_gpu(path):
    namespace = runpy.run_path(str(path), run_name="musebench_script_check")
    assert callable(namespace.get("main")), f"{path.name} has no main()"


SBATCH = REPO / "scripts" / "gb200-nightly.sbatch"
SMALL_NIGHTLY = """\
[defaults]
modes = ["ep"]
launcher = "torchrun"
backend = "cpu"
tokens = [1]
weights = ["bf16"]
norm = ["before"]
iters = 1
warmup = 0
timeout = 5.0

[[run]]
name = "tails on groups"
tp = [2, 4]
"""


def _nightly_env(tmp_path, extra_args: str = "") -> dict:
    import os
    import sys
    import uuid

    scenario = tmp_path / "nightly.toml"
    scenario.write_text(SMALL_NIGHTLY)
    return dict(os.environ, PATH=f"{REPO / 'tests' / 'stand_ins'}:{os.environ['PATH']}",
                SLURM_JOB_ID="t" + uuid.uuid4().hex[:8], SLURM_NNODES="2", SLURM_JOB_NODELIST="127.0.0.1",
                SLURM_SUBMIT_DIR=str(REPO), MUSEBENCH_PYTHON=sys.executable, MUSEBENCH_GPUS_PER_NODE="2",
                MUSEBENCH_PORT=str(free_port_pair()), MUSEBENCH_SCENARIO=str(scenario),
                MUSEBENCH_PARITY_ARGS=extra_args, TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))


def test_the_nightly_dry_run_prints_every_nodes_command(tmp_path):
    import subprocess

    env = _nightly_env(tmp_path)
    done = subprocess.run(["bash", str(SBATCH), "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "srun --ntasks-per-node=1 --label bash -c" in done.stdout and "kill-on-bad-exit" not in done.stdout
    port = env["MUSEBENCH_PORT"]
    for node in (0, 1):
        assert f"node {node}: musebench parity " in done.stdout and f"--node-rank {node}" in done.stdout
        assert f"--nnodes=2 --node-rank={node} --nproc-per-node=2 --rdzv-backend=static " \
               f"--rdzv-endpoint=127.0.0.1:{port}" in done.stdout
    assert "4 ranks (2 x 2); tp 2, 4 on groups" in done.stdout


@pytest.mark.slow
def test_the_nightly_runs_two_nodes_through_srun(tmp_path):
    """The sbatch script itself, on two nodes of this machine (a stand-in srun starts them): every
    group passes, node 0 writes JSON and JUnit, every node's logs come back, nothing is left."""
    import json
    import subprocess

    from tests.conftest import assert_no_strays

    env = _nightly_env(tmp_path)
    artifacts = tmp_path / "artifacts"
    done = subprocess.run(["bash", str(SBATCH), str(artifacts)], env=env, capture_output=True, text=True, timeout=300)
    log = (artifacts / "launchers.log").read_text() if (artifacts / "launchers.log").exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + log
    report = json.loads((artifacts / "parity.json").read_text())
    assert report["passed"] and [(row["tp"], row["group"]) for row in report["cases"]] == [(2, 0), (2, 1), (4, None)]
    assert all(rank["host"] for row in report["cases"] for rank in row["ranks"])
    assert (artifacts / "parity.xml").exists() and (artifacts / "cases.txt").exists()
    for node in (0, 1):
        assert (artifacts / "logs" / f"node-{node}" / f"launcher-node{node}.log").exists()
        assert list((artifacts / "logs" / f"node-{node}").glob(f"ranks-node{node}/**/stdout.log"))
        assert (artifacts / "logs" / f"node-{node}" / "env.json").exists()
    assert "1: musebench: node 1: 3 rows, 0 failed" in log
    assert (artifacts / "leftovers.txt").read_text() == ""
    assert_no_strays(f"nightly-{env['SLURM_JOB_ID']}")


@pytest.mark.slow
def test_the_nightly_fails_when_the_launch_is_refused(tmp_path):
    """A refusal on every node (the CPU model has no unicast) fails the nightly, with the reason."""
    import subprocess

    env = _nightly_env(tmp_path, extra_args="--transport unicast")
    artifacts = tmp_path / "artifacts"
    done = subprocess.run(["bash", str(SBATCH), str(artifacts)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "transport unicast: the CPU model moves data through host memory" in (artifacts / "launchers.log").read_text()


@pytest.mark.slow
def test_a_failing_nightly_still_writes_node_0s_report(tmp_path):
    """Every row fails (a wait bound no peer can meet): node 1 learns it and exits 1 at once, while
    node 0 still writes the report (here slowed by 3 s): srun must not kill node 0 for node 1's exit
    (--kill-on-bad-exit did, and the nightly lost parity.json and parity.xml on every mismatch);
    the launchers end each other where a node dies."""
    import json
    import os
    import subprocess
    import sys

    slow = tmp_path / "python-slow-node-0-report"
    slow.write_text(f"""#!/usr/bin/env bash
if [[ "${{1:-}} ${{2:-}}" == "-m musebench" && "${{SLURM_NODEID:-}}" == "0" ]]; then
  shift 2
  exec {sys.executable} -c "import sys, time, runpy; import musebench.harness.report as r; write = r.write_json; \\
r.write_json = lambda *a, **k: (time.sleep(3), write(*a, **k)); sys.argv = ['musebench'] + sys.argv[1:]; \\
runpy.run_module('musebench', run_name='__main__')" "$@"
fi
exec {sys.executable} "$@"
""")
    slow.chmod(0o755)
    env = _nightly_env(tmp_path)
    (tmp_path / "nightly.toml").write_text(SMALL_NIGHTLY.replace("timeout = 5.0", "timeout = 0.000001"))
    env["MUSEBENCH_PYTHON"] = str(slow)
    artifacts = tmp_path / "artifacts"
    done = subprocess.run(["bash", str(SBATCH), str(artifacts)], env=env, capture_output=True, text=True, timeout=300)
    log = (artifacts / "launchers.log").read_text() if (artifacts / "launchers.log").exists() else ""
    assert done.returncode == 1, done.stdout + done.stderr + log
    assert (artifacts / "parity.json").exists() and (artifacts / "parity.xml").exists(), done.stdout + log
    report = json.loads((artifacts / "parity.json").read_text())
    assert not report["passed"] and len(report["cases"]) == 3
    assert "1: musebench: node 1: 3 rows, 3 failed" in log
    assert os.path.exists(artifacts / "leftovers.txt") and (artifacts / "leftovers.txt").read_text() == ""


def test_the_nightly_dry_run_without_a_python_says_what_it_needs(tmp_path):
    """Before the setup step the node-local venv does not exist: the dry run exits 2 saying so (it
    failed on a missing file), and with MUSEBENCH_PYTHON it prints the setup every node runs."""
    import subprocess

    env = _nightly_env(tmp_path)
    env.pop("MUSEBENCH_PYTHON")
    done = subprocess.run(["bash", str(SBATCH), "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "set MUSEBENCH_PYTHON to a Python that has it" in done.stderr, done.stderr
    done = subprocess.run(["bash", str(SBATCH), "--dry-run"], env=_nightly_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "setup, every node: srun --ntasks-per-node=1 --label bash -c" in done.stdout


SWEEP_ATTN2 = "sweep-attn2.py"


def assert_refused(result, reason: str) -> None:
    """The script refused its options: exit 2 with `reason` on stderr."""
    assert result.returncode == 2, result.stderr
    assert reason in result.stderr


@pytest.mark.parametrize("args, reason", [
    (["--splits-per-cta", "3"], "must be one of (1, 2)"),
    (["--splits-per-cta", "x"], "neither an int nor auto"),
    (["--splits-per-cta", "1,1"], "each value once"),
    (["--splits", "1", "--splits-per-cta", "2"], "does not divide the plan's 1 splits"),
    (["--splits", "3"], "not a power of two"),
    (["--pages-per-step", "3"], "pages_per_step must be one of (1, 2)"),
    (["--pages-per-step", "0,1"], "pages_per_step must be one of (1, 2)"),
    (["--pages-per-step", "1.5"], "neither an int nor auto"),
    (["--pages-per-step", "2,2"], "each value once"),
    (["--pages-per-step", "auto,auto"], "each value once"),
    (["--ring-stages", "7"], "ring_stages must be one of"),
    (["--ring-stages", "x"], "ring_stages must be one of"),
    (["--ring-stages", "8,8"], "each value once"),
    (["--early-release", "--pdl", "1,0"], "--pdl 0 has none to release"),
    (["--full-tree", "--splits", "1,4"], "a one-split plan (--splits 1) has no combine"),
    (["--early-release", "--splits", "1"], "a one-split plan (--splits 1) has no combine"),
    (["--empty-ctas-stay", "--splits", "1,256"], "--empty-ctas-stay: a one-split plan (--splits 1) has no CTA"),
    (["--grid-order", "--splits", "1"], "--grid-order: a one-split plan (--splits 1) has one CTA"),
    (["--spread-splits", "--splits", "1"], "--spread-splits: a one-split plan (--splits 1) has one CTA"),
    (["--spread-splits", "--grid-order"], "--grid-order and --spread-splits: one split order at a time"),
])
def test_sweep_attn2_refuses_bad_splits_per_cta_before_any_gpu_work(args, reason):
    """sweep-attn2.py --splits-per-cta / --splits / --pages-per-step / --ring-stages: a value it cannot run exits 2
    with the reason, before the GPU is touched (this machine has none: reaching it would end otherwise)."""
    pytest.importorskip("cutlass")
    assert_refused(run_script(SWEEP_ATTN2, args), reason)


def test_sweep_attn2_without_a_gpu_refuses_after_its_options():
    """With valid options and no CUDA GPU, sweep-attn2.py exits 2 naming what it needs (a bad option
    is refused before that, with its own reason: the parametrized refusals above)."""
    pytest.importorskip("cutlass")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the sweep would run")
    assert_refused(run_script(SWEEP_ATTN2, ["--tp", "8", "--lengths", "8192", "--issue", "auto"]), "needs a CUDA GPU")


def test_profile_attn2_takes_loads_only_and_names_the_gpu_it_needs():
    """profile-attn2.py --loads-only (the page-stream probe) parses, and without a CUDA GPU ends with one
    line naming what it needs (no traceback); a bad --issue is refused first."""
    pytest.importorskip("cutlass")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the profile would run")
    script = "profile-attn2.py"
    done = run_script(script, ["--loads-only", "--lengths", "131072"])
    assert done.returncode == 1 and "needs a CUDA GPU" in done.stderr and "Traceback" not in done.stderr
    bad = run_script(script, ["--loads-only", "--issue", "fast"])
    assert bad.returncode == 1 and "--issue" in bad.stderr and "needs a CUDA GPU" not in bad.stderr


def test_profile_attn2_sequential_pages_keep_the_values():
    """profile-attn2.py's --sequential-pages layout: the table becomes the identity over the request's
    pages, and the CPU model of the kernel gives the same bits as with the shuffled table (a window and
    spare entries included); a check that sees a changed page."""
    import dataclasses

    import torch

    from musebench.cases.attn2_inputs import make_problem
    from musebench.cpu.attn2 import attn2_model

    used = (300 + 15) // 16  # the request's pages
    with script_module("profile-attn2.py", "profile_attn2") as module:
        in_logical_order = module.in_logical_order
    for window in (0, 100):
        problem = make_problem("random", 300, 4096, window=window, num_kv_heads=1)
        ordered = in_logical_order(problem)
        assert ordered.page_table[0, :used].tolist() == list(range(used))
        want = attn2_model(ordered, num_splits=4)
        assert torch.equal(attn2_model(problem, num_splits=4).view(torch.int16), want.view(torch.int16))
        broken = ordered.kv_cache.clone()
        broken[used - 1] = 0  # the page holding L - 1, which every row sees
        changed = attn2_model(dataclasses.replace(ordered, kv_cache=broken), num_splits=4)
        assert not torch.equal(changed.view(torch.int16), want.view(torch.int16))


def test_profile_qkv_front_plans_the_loads_only_probe_and_names_the_gpu_it_needs():
    """profile-qkv-front.py --loads-only: the option parses (with --list, which prints the plan and
    returns before the option is read, so this shows only that argparse takes it: the plan is the
    same by construction), and without a CUDA GPU one line naming what it needs, exit 2, before
    any GPU work."""
    import torch

    script = "profile-qkv-front.py"
    probe = run_script(script, ["--list", "--l2", "cold", "--loads-only"])
    assert probe.returncode == 0 and "N 2304 T 1 cold" in probe.stdout, probe.stderr
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the profile would run")
    assert_refused(run_script(script, ["--loads-only", "--n", "2304", "--tokens", "1", "--l2", "cold"]),
                   "needs a CUDA GPU")


def test_sweep_attn2_pages_per_step_values():
    """auto is the deployment's rule for the plan (`attn2_layout.pages_per_step`: 2 for split plans
    without a window, 1 with one or with one split); 1 and 2 as written, whatever the plan (2 with
    two splits a CTA runs)."""
    pytest.importorskip("cutlass")
    with script_module(SWEEP_ATTN2, "sweep_attn2") as sweep:
        per_step = sweep._pages_per_step
    assert per_step("auto", 0, 256) == 2 and per_step("auto", 0, 64) == 2
    assert per_step("auto", 2048, 64) == 1 and per_step("auto", 0, 1) == 1
    assert per_step("1", 0, 256) == 1 and per_step("2", 2048, 64) == 2
    with pytest.raises(ValueError, match="must be one of"):
        per_step("3", 0, 256)
    with pytest.raises(ValueError, match="neither an int nor auto"):
        per_step("x", 0, 256)


def test_sweep_attn2_splits_per_cta_values():
    """auto is the deployment's (`attn2_layout.splits_per_cta`: two a CTA from 1024 leaves); 1 and 2 as written."""
    pytest.importorskip("cutlass")
    with script_module(SWEEP_ATTN2, "sweep_attn2") as sweep:
        per_cta = sweep._splits_per_cta
    assert [per_cta("auto", heads, 256) for heads in (1, 2, 4, 8)] == [1, 1, 2, 2]
    assert per_cta("2", 2, 256) == 2 and per_cta("1", 2, 1) == 1
    with pytest.raises(ValueError, match="does not divide"):
        per_cta("2", 2, 1)


TRACE_FRONT = "trace-qkv-front.py"


@pytest.mark.parametrize("args, reason", [
    (["--tp", "2"], "--tp: '2' is not a comma list of 16, 8, 4"),
    (["--tokens", "0"], "--tokens"),
    (["--tokens", "x"], "--tokens"),
    (["--tp", "16", "--calls", "5"], "needs --calls >= 13"),
])
def test_trace_qkv_front_refuses_bad_options_before_any_gpu_work(args, reason):
    """trace-qkv-front.py: an option it cannot run exits 2 with the reason before the GPU is touched
    (a tp outside 16 / 8 / 4, a token count outside 1..16, too few calls to keep the weights cold)."""
    pytest.importorskip("cutlass")
    assert_refused(run_script(TRACE_FRONT, args), reason)


# A traced kernel's row fields, as the scripts read them: the SM, the entry and end %globaltimer (ns),
# then the five %clock64 instants that bound the CTA's four phases.
QKV_FRONT_FIELDS = ("smid", "globaltimer_entry", "globaltimer_end", "clock_entry", "clock_waited", "clock_streamed",
                    "clock_reduced", "clock_end")
ATTN2_SPLIT_FIELDS = ("smid", "globaltimer_entry", "globaltimer_end", "clock_entry", "clock_waited", "clock_prologue",
                      "clock_chained", "clock_written")
ATTN2_COMBINE_FIELDS = ("smid", "globaltimer_entry", "globaltimer_end", "clock_entry", "clock_waited", "clock_loaded",
                        "clock_merged", "clock_end")


def _trace_row(fields: tuple[str, ...], smid: int, entry_ns: int, phases_cycles: tuple[int, int, int, int]) -> dict:
    """A CTA's trace row named by `fields` (the SM, entry and end ns, five clocks) at 2 cycles a ns:
    entry at `entry_ns` (clock 1000), then its four phases' cycles; its end is its entry plus its
    cycles / 2."""
    clocks = [1000]
    for cycles in phases_cycles:
        clocks.append(clocks[-1] + cycles)
    life_ns = (clocks[-1] - clocks[0]) // 2
    return dict(zip(fields, [smid, entry_ns, entry_ns + life_ns, *clocks], strict=True))


def test_trace_qkv_front_phases_and_sm_loads():
    """The trace's arithmetic on made-up rows: phases in ns at the measured cycles-per-ns ratio, the
    stream split by how many of the launch's CTAs shared the SM, spans, skew and overlap."""
    pytest.importorskip("cutlass")
    f = QKV_FRONT_FIELDS
    # launch A: SM 0 holds two CTAs (streams of 8000 cycles = 4 µs), SM 1 one (4000 cycles = 2 µs)
    a = [_trace_row(f, 0, 0, (200, 8000, 1000, 600)), _trace_row(f, 0, 100, (200, 8000, 1000, 600)),
         _trace_row(f, 1, 50, (200, 4000, 1000, 600))]
    # launch B starts 4000 ns after A's first entry, before A's last end (5000 ns): 1000 ns overlap
    b = [_trace_row(f, 2, 4000, (400, 4000, 1000, 600)), _trace_row(f, 3, 4000, (400, 4000, 1000, 600))]
    with script_module(TRACE_FRONT, "trace_qkv_front") as script:
        launches = [script.summarize(rows, f) for rows in (a, b)]
        table = script.phase_table(launches)
    assert launches[0]["sm_load"] == [2, 2, 1] and launches[0]["entry_skew_ns"] == 100
    assert launches[0]["cycles_per_ns"] == pytest.approx(2.0, rel=1e-3)
    assert table["stream_by_ctas_on_the_sm"] == {"1": dict(ctas=3, median_ns=2000, max_ns=2000),
                                                 "2": dict(ctas=2, median_ns=4000, max_ns=4000)}
    assert table["pdl_wait"] == dict(median_ns=100, max_ns=200) and table["finish"]["median_ns"] == 300
    assert table["launch_period_ns"] == {"median": 4000}
    assert table["overlap_with_previous_ns"] == {"median": a[1]["globaltimer_end"] - 4000}


ATTN2_SASS = "attn2-sass.py"


@pytest.mark.parametrize("args, reason", [
    (["--pages-per-step", "3"], "invalid choice"),
    (["--pages-per-step", "auto"], "invalid int value"),
    (["--max-model-len", "0"], "max_model_len must be a positive int"),
])
def test_attn2_sass_refuses_bad_pages_per_step_before_compiling(args, reason):
    """attn2-sass.py --pages-per-step: 1 or 2 (default: the deployment's, which needs a valid
    plan); exit 2 otherwise, before compiling."""
    pytest.importorskip("cutlass")
    assert_refused(run_script(ATTN2_SASS, args), reason)


TRACE_ATTN2 = "trace-attn2.py"


@pytest.fixture(scope="module")
def trace_attn2():
    """scripts/trace-attn2.py as a module (`tests._scripts.script_module`); it needs no GPU to load."""
    with script_module(TRACE_ATTN2, "trace_attn2") as module:
        yield module


@pytest.mark.parametrize("args, reason", [
    (["--tp", "3"], "--tp: '3' is not a comma list of 16, 8, 4, 2, each once"),
    (["--tp", "8,8"], "--tp: '8,8' is not a comma list of 16, 8, 4, 2, each once"),
    (["--tp", "x"], "--tp: 'x' is not a comma list of 16, 8, 4, 2"),
    (["--lengths", "4"], "--lengths: '4' is not a comma list of lengths in [8, 131072], each once"),
    (["--lengths", "7"], "--lengths: '7' is not a comma list of lengths in [8, 131072]"),
    (["--lengths", "131073"], "--lengths: '131073' is not a comma list of lengths in [8, 131072]"),
    (["--max-model-len", "7"], "--max-model-len: 7 is not a max_model_len in [8, 131072]"),
    (["--max-model-len", "131073"], "--max-model-len: 131073 is not a max_model_len in [8, 131072]"),
    (["--lengths", "8,129", "--max-model-len", "128"], "--lengths: 129 is past --max-model-len 128"),
    (["--splits", "3"], "--splits: 3 is not a power of two in [2, 256]"),
    (["--splits", "512"], "--splits: 512 is not a power of two in [2, 256]"),
    (["--calls", "2"], "--calls: 2 leaves fewer than two launches after the first (needs >= 3)"),
    (["--window", "-1"], "--window: -1 is not 0 or in [1, --max-model-len 131072)"),
    (["--window", "128", "--max-model-len", "128", "--lengths", "8"],
     "--window: 128 is not 0 or in [1, --max-model-len 128)"),
    (["--grid-order", "--spread-splits"], "--grid-order and --spread-splits: one split order at a time"),
    (["--spread-splits", "--max-model-len", "64", "--lengths", "8"],
     "max_model_len 64 runs one split a KV head: no order"),
    (["--json", "/nonexistent-folder/trace.json"], "--json: the folder of '/nonexistent-folder/trace.json' does not exist"),
    (["--rows", "/nonexistent-folder/rows.json"], "--rows: the folder of '/nonexistent-folder/rows.json' does not exist"),
])
def test_trace_attn2_refuses_bad_options_before_any_gpu_work(args, reason):
    """trace-attn2.py: an option it cannot run exits 2 with the reason before the GPU is touched
    (a tp outside 16 / 8 / 4 / 2, a length outside [8, 131072] or past --max-model-len, a
    max_model_len outside [8, 131072], a split count not a power of two in [2, 256], a value twice,
    fewer than three calls, a window outside [0, max_model_len), both split orders or one with a
    one-split plan, a --json or --rows folder that does not exist)."""
    assert_refused(run_script(TRACE_ATTN2, args), reason)


def test_trace_attn2_without_a_gpu_refuses_after_its_options():
    """With valid options and no CUDA GPU, trace-attn2.py exits 2 naming what it needs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the trace would run")
    assert_refused(run_script(TRACE_ATTN2, ["--tp", "8", "--lengths", "8"]), "needs a CUDA GPU")


def test_trace_attn2_phases_gaps_and_sm_loads(trace_attn2):
    """The trace's arithmetic on made-up rows: phases in ns at each kernel's cycles-per-ns ratio
    (over every CTA and over the CTAs with pages), the gap from the split grid's end to the
    combine's first post-wait instant, spans, overlap with the previous launch and CTAs per SM."""
    def launch(at: int) -> dict:
        # two split CTAs on SM 0 (one with pages: a 4 µs chain), one on SM 1 without pages
        split = [_trace_row(ATTN2_SPLIT_FIELDS, 0, at, (200, 400, 8000, 400)),
                 _trace_row(ATTN2_SPLIT_FIELDS, 0, at + 100, (200, 400, 0, 0)),
                 _trace_row(ATTN2_SPLIT_FIELDS, 1, at + 50, (200, 400, 0, 0))]
        # the split grid ends at at + 4500; the combine CTAs enter at at + 1000 and wait 4000 ns
        combine = [_trace_row(ATTN2_COMBINE_FIELDS, 2, at + 1000, (8000, 600, 400, 200)),
                   _trace_row(ATTN2_COMBINE_FIELDS, 3, at + 1200, (8000, 600, 400, 200))]
        return dict(split=split, combine=combine, split_pages=[3, 0, 0])

    launches = [launch(0), launch(5000)]
    table = trace_attn2.summarize(launches)
    assert table["cycles_per_ns"] == {"split": 2.0, "combine": 2.0}
    assert table["split"]["chain"] == dict(median_ns=0, max_ns=4000)
    assert table["split"]["with_pages"]["ctas"] == 1 and table["split"]["with_pages"]["chain"]["median_ns"] == 4000
    assert table["split"]["pdl_wait"] == dict(median_ns=100, max_ns=100)
    assert table["split"]["ctas_by_ctas_on_the_sm"] == {"1": 1, "2": 2} and table["split"]["ctas"] == 3
    assert table["combine"]["loads"] == dict(median_ns=300, max_ns=300)
    assert table["combine"]["ctas_by_ctas_on_the_sm"] == {"1": 2}
    assert table["split_span_ns"]["median"] == 4500
    assert table["gap_split_end_to_combine_waited_ns"]["median"] == 5000 - 4500
    assert table["launch_span_ns"]["median"] == 1200 + 4600
    assert table["combine_first_entry_after_split_first_entry_ns"]["median"] == 1000
    assert table["launch_period_ns"] == {"median": 5000, "max": 5000}
    assert table["overlap_with_previous_ns"]["median"] == 5800 - 5000
    assert "tp 8 L 8" in trace_attn2.render(8, 8, table)
    windowed = dict(table, window=2048, split_order="grid")
    assert "tp 8 L 8, window 2048, grid order:" in trace_attn2.render(8, 8, windowed)
    assert "tp 8 L 8, spread order:" in trace_attn2.render(8, 8, dict(table, window=0, split_order="spread"))


def _loaded_launch(at: int) -> dict:
    """A launch at 2 cycles a ns, times in ns after `at`: SM 0 holds two split CTAs (4 pages each;
    chains 1000 .. 5000 and 1200 .. 6000), SM 1 one (2 pages; chain 1000 .. 3000); every split CTA
    enters at 0, waits 100 and writes its partial in 100; one combine CTA enters at 5500, is past
    its wait at 6600 and ends at 7000."""
    split = [_trace_row(ATTN2_SPLIT_FIELDS, 0, at, (200, 1800, 8000, 200)),
             _trace_row(ATTN2_SPLIT_FIELDS, 0, at, (200, 2200, 9600, 200)),
             _trace_row(ATTN2_SPLIT_FIELDS, 1, at, (200, 1800, 4000, 200))]
    combine = [_trace_row(ATTN2_COMBINE_FIELDS, 2, at + 5500, (2200, 200, 200, 400))]
    return dict(split=split, combine=combine, split_pages=[4, 4, 2])


def test_trace_attn2_sms_by_their_load(trace_attn2):
    """`sm_loads`: per CTAs-an-SM count, the SMs, when their last chain ends, and their pages a µs
    over first chain start to last chain end (SM 1: 2 pages in 2 µs; SM 0: 8 pages in 5 µs)."""
    got = trace_attn2.sm_loads(_loaded_launch(0)["split"], [4, 4, 2], 2.0)
    assert got == {"1": dict(sms=1, last_chain_end_ns=dict(median_ns=3000, max_ns=3000), pages_per_us_median=1.0),
                   "2": dict(sms=1, last_chain_end_ns=dict(median_ns=6000, max_ns=6000), pages_per_us_median=1.6)}


def test_trace_attn2_within_an_sm(trace_attn2):
    """`within_sm`: SM 0's two CTAs end their prologues 200 ns apart (1000, 1200) and their chains
    1000 ns apart (5000, 6000), the later prologue last; SM 1's lone CTA is left out; a CTA without
    pages is left out; no SM with two CTAs with pages gives {}."""
    launches = [_loaded_launch(0), _loaded_launch(8000)]
    got = trace_attn2.within_sm(launches, 2.0)
    assert got == dict(sm_launches=2, prologue_end_spread=dict(median_ns=200, p90_ns=200),
                       chain_end_spread=dict(median_ns=1000, p90_ns=1000), last_prologue_ends_last=1.0)
    # the order reversed on one launch: the CTA whose prologue ends last ends its chain first
    flipped = copy.deepcopy(launches)
    flipped[1]["split"][1]["clock_chained"] = flipped[1]["split"][1]["clock_prologue"] + 2 * 3000
    assert trace_attn2.within_sm(flipped, 2.0)["last_prologue_ends_last"] == 0.5
    idle = copy.deepcopy(launches)
    for x in idle:
        x["split_pages"] = [4, 0, 2]
    assert trace_attn2.within_sm(idle, 2.0) == {}


def test_trace_attn2_summary_with_sm_loads_and_idle_between_launches(trace_attn2):
    """Two launches 8 µs apart, the first ending at 7 µs: a negative overlap (1 µs idle), the SM
    groups of the last launch in the table and in the printed line; `summarize` leaves its
    launches as they were."""
    launches = [_loaded_launch(0), _loaded_launch(8000)]
    before = copy.deepcopy(launches)
    table = trace_attn2.summarize(launches)
    assert launches == before
    assert table["cycles_per_ns"] == {"split": 2.0, "combine": 2.0}
    assert table["split"]["chain"] == dict(median_ns=4000, max_ns=4800)
    assert table["split"]["ctas_by_ctas_on_the_sm"] == {"1": 1, "2": 2}
    assert table["split"]["sms_by_ctas_on_the_sm"]["2"]["pages_per_us_median"] == 1.6
    assert table["split_span_ns"] == dict(median=6100, max=6100)
    assert table["launch_span_ns"] == dict(median=7000, max=7000)
    assert table["gap_split_end_to_combine_waited_ns"] == dict(median=500, max=500)
    assert table["launch_period_ns"] == dict(median=8000, max=8000)
    assert table["overlap_with_previous_ns"] == dict(median=-1000, max=-1000)  # 1 us idle between the launches
    text = trace_attn2.render(8, 131072, dict(table, tp=8, seq_len=131072))
    assert "2 an SM: 1 SMs, last chain end 6.00 (max 6.00) µs, 1.6 pages/µs" in text
    assert table["split"]["within_sm"]["chain_end_spread"] == dict(median_ns=1000, p90_ns=1000)
    assert ("within an SM (2 SM-launches, CTAs with pages): prologues end 0.20 (p90 0.20) µs apart, chains 1.00 "
            "(p90 1.00) µs apart; the last prologue ends its chain last in 100 %") in text


WEIGHT_TERMS = "weight-terms-attn2.py"


@pytest.mark.parametrize("args, reason", [
    (["--tp", "3"], "--tp: '3' is not a comma list of 16, 8, 4, 2, each once"),
    (["--tp", "8,8"], "--tp: '8,8' is not a comma list of 16, 8, 4, 2, each once"),
    (["--tp", "x"], "--tp: 'x' is not a comma list of 16, 8, 4, 2"),
    (["--lengths", "7"], "--lengths: '7' is not a comma list of lengths in [8, 131072], each once"),
    (["--lengths", "131073"], "--lengths: '131073' is not a comma list of lengths in [8, 131072]"),
    (["--lengths", ","], "--lengths: ',' is not a comma list of lengths in [8, 131072]"),
    (["--families", "noise"], "--families: 'noise': a comma list of distinct random, large, equal, tiny"),
    (["--families", "random,random"], "--families: 'random,random': a comma list of distinct random, large"),
    (["--calls", "0"], "--calls and --replays must be >= 1"),
    (["--replays", "0"], "--calls and --replays must be >= 1"),
    (["--json", "/nonexistent-folder/w.json"], "--json: the folder of '/nonexistent-folder/w.json' does not exist"),
])
def test_weight_terms_attn2_refuses_bad_options_before_any_gpu_work(args, reason):
    """weight-terms-attn2.py: an option it cannot run exits 2 with the reason, naming the values it
    takes, before the GPU is touched (a tp outside `cases.attn2.TPS`, a length outside [8, 131072],
    an unknown input family, a value twice, no calls or replays, a --json folder that does not exist)."""
    assert_refused(run_script(WEIGHT_TERMS, args), reason)


def test_weight_terms_attn2_without_a_gpu_refuses_after_its_options():
    """With valid options and no CUDA GPU, weight-terms-attn2.py exits 2 naming what it needs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the comparison would run")
    assert_refused(run_script(WEIGHT_TERMS, ["--tp", "8", "--lengths", "8192"]), "needs a CUDA GPU")


@pytest.mark.parametrize("filename", [SWEEP_ATTN2, ATTN2_SASS])
def test_the_issue_help_names_every_split_issue_switch(filename):
    """sweep-attn2.py's and attn2-sass.py's --issue help name every short name `SplitIssue.named`
    takes (`SplitIssue.SHORT_NAMES`), so none is left for the reader to guess."""
    pytest.importorskip("cutlass")
    from musebench.kernels.attn2 import SplitIssue

    done = run_script(filename, ["--help"])
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps the help
    assert all(f" {name} " in text for name in SplitIssue.SHORT_NAMES), text
