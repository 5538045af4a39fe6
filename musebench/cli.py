"""The `musebench` command: thin click commands over musebench.harness.

Data (tables, --json) goes to stdout, progress and diagnostics to stderr. Exit codes: 0 every
case passed, 1 a mismatch, timeout or rank error, 2 bad usage (nothing was launched).
`musebench --help` imports neither torch nor cutlass: heavy imports live inside the commands.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

import click

from musebench.comm.transport import REQUESTS as TRANSPORT_REQUESTS

EXIT_FAILED = 1
EXIT_USAGE = 2
# Virtual ranks put tp streams on one GPU; with the default 8 hardware queues, streams share a
# queue and a spinning reduction can sit in front of a peer's publisher until that peer's stream
# gets its turn. Giving every stream its own queue needs the variable set before CUDA
# initializes, so the CLI sets it first thing (an explicit value in the environment wins).
CUDA_CONNECTIONS = "32"
DEFAULT_SCENARIO = "scenarios/parity.toml"


def _parse_ints(text: str, what: str) -> tuple[int, ...]:
    """'1-8' / '1,2,4' / '3' -> ints; click.BadParameter otherwise."""
    values: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part[1:]:
                low, high = part.split("-", 1)
                values.extend(range(int(low), int(high) + 1))
            else:
                values.append(int(part))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integers (e.g. 1-8 or 1,2,4)", param_hint=what) from None
    return tuple(values)


def _parse_choices(text: str, choices: Sequence[str], what: str) -> tuple[str, ...]:
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    bad = [item for item in items if item not in choices]
    if bad or not items:
        raise click.BadParameter(f"{text!r}: choose from {', '.join(choices)}", param_hint=what)
    return items


def _stdout():
    from rich.console import Console

    # a pipe or CI log gets the full table, not an 80-column squeeze
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def _stderr():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _usage_error(message: str) -> None:
    click.echo(f"musebench: error: {message}", err=True)
    sys.exit(EXIT_USAGE)


def _command_line() -> str:
    return shlex.join(["musebench", *sys.argv[1:]])


def _node_options(command):
    """--nnodes, --node-rank, --nproc-per-node, --rdzv-endpoint: a torchrun launch across nodes."""
    for option in reversed([
        click.option("--nnodes", type=int, default=None,
                     help="Nodes of the torchrun launch (the same command runs on every node; SLURM_NNODES under SLURM)."),
        click.option("--node-rank", type=int, default=None, help="This node, 0..N-1 (SLURM_NODEID under SLURM)."),
        click.option("--nproc-per-node", type=int, default=None,
                     help="Ranks per node: a job of nnodes x nproc ranks runs every tp on groups of tp ranks."),
        click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                     help="Node 0's host and port (SLURM: the first host of the job, port 29500); the launchers "
                          "also use PORT+1."),
    ]):
        command = option(command)
    return command


def _resolve_nodes(launcher: str, nnodes, node_rank, nproc_per_node, endpoint):
    """The launch's nodes (`harness.nodes.resolve_nodes`) or None; exit 2 for options that cannot work."""
    from musebench.harness.nodes import resolve_nodes

    given = any(value is not None for value in (nnodes, node_rank, nproc_per_node, endpoint))
    if given and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _usage_error("--nnodes, --node-rank, --nproc-per-node and --rdzv-endpoint start the ranks; inside a "
                     "torchrun/srun job (RANK and WORLD_SIZE set) the ranks are already there")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return None
    try:
        return resolve_nodes(launcher=launcher, nnodes=nnodes, node_rank=node_rank, nproc_per_node=nproc_per_node,
                             endpoint=endpoint)
    except ValueError as error:
        _usage_error(str(error))


def _print_node_commands(jobs, nodes) -> None:
    """--dry-run of a launch across nodes: the command every node runs and the torchrun it starts."""
    import dataclasses

    from musebench.harness.launch import launch_command

    out = _stdout()
    argv = [arg for arg in sys.argv[1:] if arg != "--dry-run"]
    for node in range(nodes.nnodes):
        here = dataclasses.replace(nodes, node_rank=node)
        words = ["musebench", *argv]
        if "--node-rank" not in argv and not any(arg.startswith("--node-rank=") for arg in argv):
            words += ["--node-rank", str(node)]
        else:
            words = ["musebench", *_with_node_rank(argv, node)]
        out.print(f"node {node}: {shlex.join(words)}", markup=False, soft_wrap=True)
        out.print(f"  starts: {shlex.join(launch_command(here))}", markup=False, soft_wrap=True)
    tps = sorted({job.cases[0].tp for job in jobs if job.nodes is not None and job.cases})
    out.print(f"  {nodes.world} ranks ({nodes.nnodes} x {nodes.nproc_per_node}); tp {', '.join(map(str, tps))} on "
              f"groups of consecutive ranks, one launch", markup=False)


def _with_node_rank(argv, node: int) -> list[str]:
    words, skip = [], False
    for arg in argv:
        if skip:
            words.append(str(node))
            skip = False
        elif arg == "--node-rank":
            words.append(arg)
            skip = True
        elif arg.startswith("--node-rank="):
            words.append(f"--node-rank={node}")
        else:
            words.append(arg)
    return words


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="musebench")
def main() -> None:
    """Bitwise parity and timing for Muse Spark's decode kernels across TP ranks.

    \b
    musebench env                   what this machine can run
    musebench tail --tp 8           the MoE tails on 8 ranks, checked against the stock
    musebench parity [FILE.toml]    the scenario's runs (default scenarios/parity.toml)
    musebench report RUN.json       re-render a run; --compare OLD.json flags regressions
    musebench bench tail            CUDA-graph timings of the cute EP tail (GPU)
    musebench routing --tp 8        the routing kernel and its metadata on every rank (GPU)
    musebench bench routing         the routing kernel vs the Triton stock (GPU)
    """
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", CUDA_CONNECTIONS)


@main.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the probe as JSON.")
def env(json_path: str | None) -> None:
    """Versions, GPUs, P2P and multicast, and which transports and backends this machine gets."""
    import json

    from musebench.harness.environment import probe, render_probe

    info = probe()
    render_probe(info, _stdout())
    if json_path:
        with open(json_path, "w") as out:
            json.dump(info, out, indent=2, default=str)


def _run_jobs_and_report(jobs, *, json_path, junit_path, title: str, nodes=None) -> None:
    """Run tail and routing jobs with a progress bar and report them; a routing job this machine
    cannot run is reported as skipped, never as passed. Across nodes (`nodes`) node 0 reports (its
    rank 0 gathered every rank's outcome); another node prints one line and exits like node 0."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from musebench.harness.jobs import build_report, run_jobs
    from musebench.harness.nodes import LinkLost, NodesRefused

    def skips(job) -> bool:
        return job.skip_reason is not None

    skipped = [job for job in jobs if skips(job)]
    running = [job for job in jobs if not skips(job)]
    rows = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=_stderr(), transient=True)
    groups = {id(job): job.nodes.world // job.cases[0].tp if job.nodes is not None and job.cases else 1
              for job in running}
    try:
        with progress:
            task = progress.add_task("cases", total=sum(len(job.cases) * groups[id(job)] for job in running))
            progress.update(task, description=", ".join(dict.fromkeys(job.name for job in running)) or "cases")
            rows.extend(run_jobs(running, on_case=lambda row: progress.advance(task)))
    except NodesRefused as refusal:
        _usage_error(str(refusal))
    except LinkLost as lost:
        click.echo(f"musebench: {lost}", err=True)
        sys.exit(EXIT_FAILED)
    notes = sorted({job.backend_note for job in running})  # no µs: the table points to musebench bench
    run = build_report(rows, command=_command_line(), backend_note="; ".join(notes),
                       skipped=[job.skipped() for job in skipped])
    if nodes is not None and nodes.node_rank != 0:
        failed = [row for row in run.cases if not row.passed]
        click.echo(f"musebench: node {nodes.node_rank}: {len(run.cases)} rows, {len(failed)} failed"
                   + (f" (first: {failed[0].error or 'mismatch'})" if failed else "")
                   + "; node 0 writes the report")
        if failed:
            sys.exit(EXIT_FAILED)
        return
    if _is_reporting_rank():
        _emit(run, title=title, json_path=json_path, junit_path=junit_path)


def _emit(run, *, title: str, json_path: str | None, junit_path: str | None = None) -> None:
    """Render the run, write the files asked for, exit 1 unless every row passed."""
    from musebench.harness import report

    report.render_table(run, _stdout(), title=title)
    if json_path:
        report.write_json(run, json_path)
    if junit_path:
        report.write_junit(run, junit_path)
    if not run.passed:
        sys.exit(EXIT_FAILED)


def _is_reporting_rank() -> bool:
    """Inside an external torchrun/srun job only rank 0 reports."""
    return os.environ.get("RANK", "0") == "0" or "WORLD_SIZE" not in os.environ


@main.command()
@click.option("--tp", type=int, default=8, show_default=True, help="Ranks (2..32).")
@click.option("--mode", type=click.Choice(["ep", "tp", "both"]), default="both", show_default=True)
@click.option("--tokens", default="1-8", show_default=True, help="Token counts, e.g. 1-8 or 1,2,8.")
@click.option("--capacity", type=int, default=8, show_default=True, help="Mailbox capacity in tokens.")
@click.option("--weights", default="bf16,fp32", show_default=True, help="Route-weight dtypes.")
@click.option("--norm", default="before,after", show_default=True, help="Weight before / after the norm.")
@click.option("--inputs", default="random", show_default=True, help="Input families: random, adversarial, edge.")
@click.option("--seed", type=int, default=0, show_default=True, help="First seed.")
@click.option("--seeds", type=int, default=1, show_default=True, help="Number of seeds (fresh inputs each).")
@click.option("--launcher", type=click.Choice(["virtual", "torchrun"]), default="virtual", show_default=True)
@click.option("--backend", type=click.Choice(["auto", "cpu", "cute"]), default="auto", show_default=True)
@click.option("--iters", type=int, default=3, show_default=True, help="Timed calls per case.")
@click.option("--warmup", type=int, default=1, show_default=True)
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds any wait may last.")
@click.option("--nsm", type=int, default=None, help="SM count the TP stock dispatches for (default 148).")
@click.option("--transport", type=click.Choice(TRANSPORT_REQUESTS), default="auto", show_default=True,
              help="Mailbox transport: auto picks the layout's (local, unicast, ipc; the CPU model's cpu-local, shm); "
                   "multicast maps the mailboxes through NVLink multicast too (one process per GPU, where the "
                   "driver reports it and the environment allows it); a transport the layout or machine cannot "
                   "have exits 2 with the reason (`musebench env` says which this machine gets).")
@click.option("--ep-launch", type=click.Choice(["two", "single"]), default="two", show_default=True,
              help="The cute EP tail as two kernels (publisher, reduction) or one (rows: ep_tail_single).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), help="Write JUnit XML.")
@click.option("--inject", multiple=True, hidden=True, help="Fault injection KIND:RANK (flip, silent, raise, hang, exit).")
@click.option("--impl", default="musebench", show_default=True, metavar="MODULE",
              help="The implementation under test: a module providing the seeds' API.")
@_node_options
@click.option("--dry-run", is_flag=True, help="Print the cases and the command every node runs; launch nothing.")
def tail(tp, mode, tokens, capacity, weights, norm, inputs, seed, seeds, launcher, backend, iters, warmup,
         timeout, nsm, transport, ep_launch, json_path, junit_path, inject, impl, nnodes, node_rank, nproc_per_node,
         rdzv_endpoint, dry_run) -> None:
    """Run the MoE tails (EP and TP) on TP ranks and check them bitwise against the stock.

    With --nproc-per-node (and --nnodes, --node-rank, --rdzv-endpoint across nodes) a torchrun
    launch of nnodes x nproc ranks runs every case on groups of --tp consecutive ranks."""
    from musebench.harness.case import Faults
    from musebench.cases.tail_inputs import INPUT_FAMILIES, NORM_ORDERS, WEIGHT_DTYPES
    from musebench.harness.jobs import make_tail_job

    token_list = _parse_ints(tokens, "--tokens")
    modes = ("ep", "tp") if mode == "both" else (mode,)
    nodes = _resolve_nodes(launcher, nnodes, node_rank, nproc_per_node, rdzv_endpoint)
    try:
        if seeds < 1:
            raise ValueError("--seeds must be >= 1")
        job = make_tail_job(
            name=f"tail tp={tp}", tp=tp, modes=modes, tokens=token_list, capacity=capacity,
            weights=_parse_choices(weights, tuple(WEIGHT_DTYPES), "--weights"),
            norms=_parse_choices(norm, NORM_ORDERS, "--norm"),
            inputs=_parse_choices(inputs, INPUT_FAMILIES, "--inputs"),
            seeds=tuple(range(seed, seed + seeds)), launcher=launcher, backend=backend, iters=iters, warmup=warmup,
            timeout_s=timeout, nsm=nsm, transport=transport, faults=Faults.parse(inject),
            ep_launch=ep_launch, impl=impl, check_machine=not dry_run, nodes=nodes,
        )
    except ValueError as error:
        _usage_error(str(error))
    if dry_run:
        _dry_run([job], nodes)
        return
    _run_jobs_and_report([job], json_path=json_path, junit_path=junit_path, title=f"musebench tail --tp {tp}",
                         nodes=nodes)


@main.command()
@click.argument("scenarios", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), help="Write JUnit XML.")
@click.option("--dry-run", is_flag=True, help="Print the runs, their cases and launch commands; launch nothing.")
@click.option("--launcher", type=click.Choice(["virtual", "torchrun"]), default=None,
              help="Override the files' launcher (tail runs; routing runs on virtual ranks of one GPU).")
@click.option("--backend", type=click.Choice(["auto", "cpu", "cute"]), default=None,
              help="Override the files' backend (routing: auto skips it without a GPU, cpu always, cute refuses).")
@click.option("--transport", type=click.Choice(TRANSPORT_REQUESTS), default=None,
              help="Override the files' transport (tail runs).")
@_node_options
def parity(scenarios, json_path, junit_path, dry_run, launcher, backend, transport, nnodes, node_rank,
           nproc_per_node, rdzv_endpoint) -> None:
    """Run scenario files (default scenarios/parity.toml): every case bitwise against the stock.

    Tail runs go first, then routing runs. A routing run needs a GPU with SM >= 90 and CuTe DSL;
    elsewhere it is reported as skipped (exit 0 if nothing failed), never as passed.
    """
    from musebench.harness.jobs import jobs_from_scenario
    from musebench.harness.scenario import load_scenario

    paths = scenarios or (DEFAULT_SCENARIO,)
    overrides = {"launcher": launcher, "backend": backend, "transport": transport}
    try:
        runs = [run for path in paths for run in load_scenario(path)]
    except ValueError as error:
        _usage_error(str(error))
    # the node options serve the files' tail runs, which must all be torchrun ones
    tail_launchers = {launcher or run.launcher for run in runs if run.kernel == "tail"}
    nodes = _resolve_nodes("torchrun" if tail_launchers == {"torchrun"} else "virtual", nnodes, node_rank,
                           nproc_per_node, rdzv_endpoint)
    try:
        jobs = jobs_from_scenario(runs, overrides=overrides, check_machine=not dry_run, nodes=nodes)
    except ValueError as error:
        _usage_error(str(error))
    asked = {name: value for name, value in (("--launcher", launcher), ("--transport", transport))
             if value not in (None, "auto")}
    if asked and all(job.kernel == "routing" for job in jobs):  # the options would do nothing
        verb = "apply" if len(asked) > 1 else "applies"
        _usage_error(f"{' and '.join(asked)} {verb} to tail runs (routing runs on virtual ranks, without "
                     "mailboxes), and these scenarios have none")
    # Routing last: inside a torchrun job only the reporting rank routes (virtual ranks on its own
    # GPU), so no rank may be left waiting at a tail barrier for a peer that is still routing.
    jobs.sort(key=lambda job: job.kernel == "routing")  # stable: file order within each kind
    if nodes is not None and nodes.node_rank != 0:  # routing runs on node 0's launcher, after the tails
        jobs = [job for job in jobs if job.kernel != "routing"]
    if dry_run:
        _dry_run(jobs, nodes)
        return
    if not _is_reporting_rank():
        jobs = [job for job in jobs if job.kernel != "routing"]
    _run_jobs_and_report(jobs, json_path=json_path, junit_path=junit_path, title="musebench parity", nodes=nodes)


def _dry_run(jobs, nodes) -> None:
    """Print the jobs, their cases and launch commands (every node's, across nodes)."""
    out = _stdout()
    for job in jobs:
        if job.kernel == "routing":
            how = f"backend {job.backend}, virtual ranks"
        else:
            how = f"backend {job.options.backend}, launcher {job.options.launcher}"
        out.print(f"[bold]{job.name}[/bold]: {len(job.cases)} cases, {how}")
        out.print(f"  launch: {job.launch_command()}", markup=False, soft_wrap=True)
        for case in job.cases:
            out.print(f"  {case.label()}")
    if nodes is not None:
        _print_node_commands(jobs, nodes)


@main.group()
def bench() -> None:
    """CUDA-graph timings (GPU only): medians of back-to-back calls, every row checked bitwise."""


@bench.command("tail")
@click.option("--tp", "tp_list", default="2,4,8", show_default=True, help="TP sizes, e.g. 2,4,8.")
@click.option("--mode", type=click.Choice(["ep", "tp", "both"]), default="both", show_default=True)
@click.option("--tokens", default="1-8", show_default=True)
@click.option("--capacity", type=int, default=8, show_default=True,
              help="Mailbox capacity in tokens (what a deployment sizes for its largest batch): every case "
                   "runs over mailboxes of this many tokens; at least the largest --tokens.")
@click.option("--weights", default="bf16", show_default=True)
@click.option("--norm", default="before", show_default=True)
@click.option("--launcher", type=click.Choice(["virtual", "torchrun"]), default="virtual", show_default=True,
              help="virtual: every rank a stream of this GPU (µs of the whole group); torchrun: a process per "
                   "rank (µs per rank, max over ranks, with the NCCL and SymmetricMemory paths beside).")
@click.option("--calls", type=int, default=20, show_default=True, help="Back-to-back calls per CUDA graph.")
@click.option("--replays", type=int, default=30, show_default=True)
@click.option("--timeout", type=float, default=2.0, show_default=True, help="Seconds any device wait may last.")
@click.option("--nsm", type=int, default=None, help="SM count the TP stock dispatches for (default: this GPU's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
@_node_options
def bench_tail(tp_list, mode, tokens, capacity, weights, norm, launcher, calls, replays, timeout, nsm, json_path,
               nnodes, node_rank, nproc_per_node, rdzv_endpoint) -> None:
    """The cute tails, CUDA-graph timed against the stock finalize (and, per process, NCCL paths)."""
    from musebench.cases.tail_inputs import NORM_ORDERS, WEIGHT_DTYPES
    from musebench.harness.jobs import resolve_backend
    from musebench.harness.scenario import validate_tokens, validate_tp

    tps, token_list = _parse_ints(tp_list, "--tp"), _parse_ints(tokens, "--tokens")
    nodes = _resolve_nodes(launcher, nnodes, node_rank, nproc_per_node, rdzv_endpoint)
    weight_list = _parse_choices(weights, tuple(WEIGHT_DTYPES), "--weights")
    norms = _parse_choices(norm, NORM_ORDERS, "--norm")
    modes = ("ep", "tp") if mode == "both" else (mode,)
    try:
        for tp in tps:
            validate_tp(tp)
        validate_tokens(token_list, capacity)
        if calls < 1 or replays < 1:
            raise ValueError("--calls and --replays must be >= 1")
        if timeout <= 0:
            raise ValueError("--timeout must be positive")
        _, note = resolve_backend("cute")
    except ValueError as error:
        _usage_error(str(error))
    from musebench.harness.jobs import gpu_sm_count, make_tail_job
    from musebench.harness.measure import BenchOptions

    options = BenchOptions(calls=calls, replays=replays, timeout_s=timeout)
    try:
        jobs = [make_tail_job(name=f"bench tail tp={tp}", tp=tp, modes=modes, tokens=token_list, capacity=capacity,
                              weights=weight_list, norms=norms, inputs=("random",), seeds=(0,), launcher=launcher,
                              backend="cute", iters=1, warmup=0, timeout_s=timeout,
                              nsm=nsm if nsm is not None else gpu_sm_count(), measurement="bench", bench=options,
                              nodes=nodes)
                for tp in tps]
    except ValueError as error:
        _usage_error(str(error))
    if launcher == "virtual":
        note = f"{note}; tp virtual ranks share the GPU: µs = one call of the whole group"
    else:
        note = f"{note}; a process per rank: µs per call, max over ranks"
    _bench_and_report(jobs, options, note, title="musebench bench tail", json_path=json_path, nodes=nodes)


def _bench_and_report(jobs, options, note: str, *, title: str, json_path: str | None, nodes=None) -> None:
    """Run bench jobs after timing an empty launch (the floor every row sits on), and report (node
    0 across nodes; another node prints one line and exits like it). Rows hold measured times only;
    a family's roofline travels as the row's `roofline_us` (`driver.new_row`)."""
    from musebench.harness.jobs import build_report, run_jobs
    from musebench.harness.measure import bench_empty_kernel
    from musebench.harness.nodes import LinkLost, NodesRefused

    rows = []
    try:
        with _stderr().status("benchmarking") as status:
            floor = bench_empty_kernel(options)
            status.update(", ".join(f"{job.name}: {len(job.cases)} cases" for job in jobs))
            rows.extend(run_jobs(jobs))
    except NodesRefused as refusal:
        _usage_error(str(refusal))
    except LinkLost as lost:
        click.echo(f"musebench: {lost}", err=True)
        sys.exit(EXIT_FAILED)
    run_report = build_report(rows, command=_command_line(), backend_note=f"{note}; empty launch {floor:.2f} µs")
    run_report.machine["empty_launch_us"] = floor
    if nodes is not None and nodes.node_rank != 0:
        failed = [row for row in run_report.cases if not row.passed]
        click.echo(f"musebench: node {nodes.node_rank}: {len(run_report.cases)} rows, {len(failed)} failed; "
                   "node 0 writes the report")
        if failed:
            sys.exit(EXIT_FAILED)
        return
    if _is_reporting_rank():
        _emit(run_report, title=title, json_path=json_path)


@main.command()
@click.option("--tp", type=int, default=8, show_default=True, help="Ranks (2..32), each with its own expert range.")
@click.option("--tokens", default="1-8", show_default=True)
@click.option("--tile", "tiles", default="8", show_default=True, help="GEMM tile sizes for the metadata (1..256).")
@click.option("--renormalize/--no-renormalize", default=True, show_default=True)
@click.option("--inputs", default="random,adversarial", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--seeds", type=int, default=1, show_default=True)
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Seconds a rank's kernel may take.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), help="Write JUnit XML.")
@click.option("--inject", multiple=True, hidden=True, help="Fault injection KIND:RANK (flip, silent, hang).")
@click.option("--impl", default="musebench", show_default=True, metavar="MODULE",
              help="The implementation under test: a module providing the seeds' API.")
def routing(tp, tokens, tiles, renormalize, inputs, seed, seeds, timeout, json_path, junit_path, inject, impl) -> None:
    """GPU: the routing kernel on every rank vs the Triton stock, the reference and the metadata reference."""
    from musebench.harness.case import Faults
    from musebench.cases.tail_inputs import ROUTING_INPUT_FAMILIES
    from musebench.harness.jobs import make_routing_job

    token_list, tile_list = _parse_ints(tokens, "--tokens"), _parse_ints(tiles, "--tile")
    families = _parse_choices(inputs, ROUTING_INPUT_FAMILIES, "--inputs")
    try:
        if seeds < 1:
            raise ValueError("--seeds must be >= 1")
        job = make_routing_job(name=f"routing tp={tp}", tp=tp, tokens=token_list, tiles=tile_list,
                               renormalize=(renormalize,), inputs=families, seeds=tuple(range(seed, seed + seeds)),
                               backend="cute", timeout_s=timeout, faults=Faults.parse(inject), impl=impl)
    except ValueError as error:
        _usage_error(str(error))
    _run_jobs_and_report([job], json_path=json_path, junit_path=junit_path, title=f"musebench routing --tp {tp}")


@bench.command("routing")
@click.option("--tokens", default="1-8", show_default=True)
@click.option("--tile", "tile", type=int, default=8, show_default=True)
@click.option("--calls", type=int, default=20, show_default=True)
@click.option("--replays", type=int, default=30, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
def bench_routing_command(tokens, tile, calls, replays, json_path) -> None:
    """GPU: the routing kernel with its metadata (and without) vs the Triton stock followed by the
    separate metadata pass (and alone), rank 0's expert range of tp 8 (µs per call)."""
    from musebench.harness.jobs import make_routing_job
    from musebench.harness.measure import BenchOptions

    options = BenchOptions(calls=calls, replays=replays)
    try:
        if calls < 1 or replays < 1:
            raise ValueError("--calls and --replays must be >= 1")
        job = make_routing_job(name="bench routing", tp=8, tokens=_parse_ints(tokens, "--tokens"), tiles=(tile,),
                               renormalize=(True,), inputs=("random",), seeds=(0,), backend="cute",
                               measurement="bench", bench=options)
    except ValueError as error:
        _usage_error(str(error))
    _bench_and_report([job], options, job.backend_note, title="musebench bench routing", json_path=json_path)


@main.command("report")
@click.argument("run_json", type=click.Path(dir_okay=False))
@click.option("--compare", "old_json", type=click.Path(dir_okay=False), help="Flag regressions against an older run.")
@click.option("--threshold", type=float, default=0.05, show_default=True, help="Relative slowdown that counts.")
@click.option("--side-by-side", is_flag=True, help="With --compare: every shared case's µs, old and new, and new / old.")
def report_command(run_json: str, old_json: str | None, threshold: float, side_by_side: bool) -> None:
    """Re-render a run's JSON; with --compare, list regressions and exit 1 if any."""
    from musebench.harness import report

    if side_by_side and old_json is None:
        _usage_error("--side-by-side needs --compare OLD.json")
    try:
        new = report.read_json(run_json)
        old = report.read_json(old_json) if old_json else None
    except (OSError, ValueError) as error:
        _usage_error(str(error))
    title = f"{run_json} — {new.backend_note}" if new.backend_note else run_json
    report.render_table(new, _stdout(), title=title)
    if old is not None:
        if side_by_side:
            report.render_side_by_side(report.side_by_side(old, new), _stdout())
        regressions = report.compare(old, new, threshold=threshold)
        report.render_comparison(regressions, _stdout())
        if regressions:
            sys.exit(EXIT_FAILED)
    elif not new.passed:
        sys.exit(EXIT_FAILED)


# ---------------------------------------------------------------------------------------------
# qkv_front: `musebench front` and `musebench bench front`.

FRONT_TPS = (4, 8, 16)  # N = 4608, 2304, 1152 per rank


@main.command("front")
@click.option("--tp", type=int, default=8, show_default=True, help="Ranks: 4, 8 or 16 (N = 4608, 2304, 1152).")
@click.option("--tokens", default="1,2,3,4,5,8,16", show_default=True, help="Token counts, 1..16.")
@click.option("--rope", "rope", default="rope,nope", show_default=True, help="rope, nope or both.")
@click.option("--inputs", default="random,adversarial", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--seeds", type=int, default=1, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), help="Write JUnit XML.")
@click.option("--inject", multiple=True, hidden=True, help="Fault injection KIND:RANK (flip, silent).")
@click.option("--impl", default="musebench", show_default=True, metavar="MODULE",
              help="The implementation under test: a module providing cute_ops.launch_qkv_front.")
def front(tp, tokens, rope, inputs, seed, seeds, json_path, junit_path, inject, impl) -> None:
    """GPU: the QKV front on every rank: its epilogue and cache insert bitwise vs the stock's arithmetic
    on its own projection, the projection repeatable and at least as accurate as cuBLAS's."""
    from musebench.harness.case import Faults
    from musebench.harness.jobs import make_front_job

    if tp not in FRONT_TPS:
        _usage_error(f"--tp {tp}: the QKV front runs at tp 4, 8 or 16 (N = 4608, 2304, 1152; "
                     "Muse Spark's 16 KV heads give 4, 2 or 1 per rank)")
    flags = _parse_choices(rope, ("rope", "nope"), "--rope")
    try:
        if seeds < 1:
            raise ValueError("--seeds must be >= 1")
        job = make_front_job(name=f"front tp={tp}", tp=tp, tokens=_parse_ints(tokens, "--tokens"),
                             rope=tuple(flag == "rope" for flag in flags),
                             inputs=_parse_choices(inputs, ("random", "adversarial"), "--inputs"),
                             seeds=tuple(range(seed, seed + seeds)), faults=Faults.parse(inject), impl=impl,
                             backend="auto")  # no GPU here: the run is reported skipped, with the reason
    except ValueError as error:
        _usage_error(str(error))
    _run_jobs_and_report([job], json_path=json_path, junit_path=junit_path, title=f"musebench front --tp {tp}")


@bench.command("front")
@click.option("--tp", "tp_list", default="16,8,4", show_default=True, help="tps 4, 8, 16 (N = 4608, 2304, 1152).")
@click.option("--tokens", default="1,2,4,8,16", show_default=True)
@click.option("--calls", type=int, default=20, show_default=True)
@click.option("--replays", type=int, default=30, show_default=True)
@click.option("--cold-weights", is_flag=True,
              help="Also time the launch with every call of the graph reading its own weight copy (none "
                   "L2-resident: a deployment's layers), the 'cold weights' column, and torch.matmul (cuBLAS "
                   "alone) reading the same copies, 'torch matmul, cold weights' (cold vs cold: its ratio is "
                   "cold weights / it, below 1 where the fused launch beats the GEMM); needs --calls >= 13 / 7 / 4 "
                   "at tp 16 / 8 / 4.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
def bench_front_command(tp_list, tokens, calls, replays, cold_weights, json_path) -> None:
    """GPU: the QKV front as a deployment launches it (no tap, PDL: the tail column) vs the unfused
    path (torch.matmul, i.e. cuBLAS, then the Triton stock epilogue), torch.matmul alone and the
    same launch built without PDL ('front without PDL': its cell's ratio is PDL / no PDL, same run)
    on rank 0's weight, CUDA-graph medians; 'with tap' times the tap launch; the roofline column is
    the row's bytes (N x 8192 x 2) / 4.2 TB/s."""
    from musebench.harness.jobs import make_front_job
    from musebench.harness.measure import BenchOptions

    tps = _parse_ints(tp_list, "--tp")
    bad = [tp for tp in tps if tp not in FRONT_TPS]
    if bad:
        _usage_error(f"--tp {bad[0]}: the QKV front runs at tp 4, 8 or 16")
    options = BenchOptions(calls=calls, replays=replays)
    try:
        if calls < 1 or replays < 1:
            raise ValueError("--calls and --replays must be >= 1")
        if cold_weights:  # every tp's copies before any job looks at the machine
            from musebench.cases.qkv_front import cold_copies_for

            for tp in tps:
                cold_copies_for(tp, calls)
        jobs = [make_front_job(name=f"bench front tp={tp}", tp=tp, tokens=_parse_ints(tokens, "--tokens"), rope=(True,),
                               inputs=("random",), seeds=(0,), measurement="bench", bench=options,
                               cold_weights=cold_weights) for tp in tps]
    except ValueError as error:
        _usage_error(str(error))
    note = f"{jobs[0].backend_note}; roofline = N x 8192 x 2 B / 4.2 TB/s (N 1152: 4.5 µs, 2304: 9.0 µs, 4608: 18.0 µs)"
    _bench_and_report(jobs, options, note, title="musebench bench front", json_path=json_path)


# ---------------------------------------------------------------------------------------------
# attn2: `musebench attn` and `musebench bench attn`.

ATTN_INPUTS = ("random", "large", "equal", "tiny")


def _attn_tp_error(tp: int) -> str | None:
    from musebench.cases.attn2 import kv_heads_for

    try:
        kv_heads_for(tp)
    except ValueError as error:
        return f"--tp {tp}: {error}"
    return None


@main.command("attn")
@click.option("--tp", type=int, default=8, show_default=True, help="Ranks: 2, 4, 8 or 16 (8 .. 1 KV heads a rank).")
@click.option("--lengths", default="8,17,2047,2049,4000", show_default=True, help="Request lengths L (8..max-model-len).")
@click.option("--max-model-len", type=int, default=4096, show_default=True, help="The deployment's (fixes the splits).")
@click.option("--window", "windows", default="0,2048", show_default=True, help="Sliding windows (0: none).")
@click.option("--inputs", default=",".join(ATTN_INPUTS), show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--seeds", type=int, default=1, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), help="Write JUnit XML.")
@click.option("--inject", multiple=True, hidden=True, help="Fault injection KIND:RANK (flip, silent).")
@click.option("--impl", default="musebench", show_default=True, metavar="MODULE",
              help="The implementation under test: a module providing cute_ops.launch_attn2.")
def attn(tp, lengths, max_model_len, windows, inputs, seed, seeds, json_path, junit_path, inject, impl) -> None:
    """GPU: attn2 (the verify step's attention, o-norm and gate) on every rank: bits repeatable and equal to
    a 16-KV-head launch's, max and mean error vs FP64 each at most the stock's (SDPA flash + the gate)."""
    from musebench.harness.case import Faults
    from musebench.harness.jobs import make_attn2_job

    refusal = _attn_tp_error(tp)
    if refusal:
        _usage_error(refusal)
    try:
        if seeds < 1:
            raise ValueError("--seeds must be >= 1")
        job = make_attn2_job(name=f"attn tp={tp}", tp=tp, lengths=_parse_ints(lengths, "--lengths"),
                             max_model_len=max_model_len, windows=_parse_ints(windows, "--window"),
                             inputs=_parse_choices(inputs, ATTN_INPUTS, "--inputs"),
                             seeds=tuple(range(seed, seed + seeds)), faults=Faults.parse(inject), impl=impl,
                             backend="auto")  # no GPU here: the run is reported skipped, with the reason
    except ValueError as error:
        _usage_error(str(error))
    _run_jobs_and_report([job], json_path=json_path, junit_path=junit_path, title=f"musebench attn --tp {tp}")


@bench.command("attn")
@click.option("--tp", "tp_list", default="8,16", show_default=True, help="tps 2, 4, 8, 16 (2 and 1 KV heads: 8, 16).")
@click.option("--lengths", default="8,512,2048,8192,32768,131072", show_default=True, help="Request lengths L.")
@click.option("--max-model-len", type=int, default=131072, show_default=True, help="The deployment's (fixes the splits).")
@click.option("--window", "windows", default="0,2048", show_default=True, help="Sliding windows (0: none).")
@click.option("--calls", type=int, default=20, show_default=True)
@click.option("--replays", type=int, default=30, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the run report as JSON.")
def bench_attn_command(tp_list, lengths, max_model_len, windows, calls, replays, json_path) -> None:
    """GPU: attn2 on rank 0's KV heads vs torch SDPA (flash) on the same K/V gathered contiguous,
    CUDA-graph medians, beside the HBM roofline (the roofline column: K + V bytes / 4.2 TB/s). Accuracy is reported,
    not enforced (the row says so); the bits are checked as in `musebench attn`."""
    from musebench.harness.jobs import make_attn2_job
    from musebench.harness.measure import BenchOptions

    tps = _parse_ints(tp_list, "--tp")
    for tp in tps:
        refusal = _attn_tp_error(tp)
        if refusal:
            _usage_error(refusal)
    options = BenchOptions(calls=calls, replays=replays)
    try:
        if calls < 1 or replays < 1:
            raise ValueError("--calls and --replays must be >= 1")
        jobs = [make_attn2_job(name=f"bench attn tp={tp}", tp=tp, lengths=_parse_ints(lengths, "--lengths"),
                               max_model_len=max_model_len, windows=_parse_ints(windows, "--window"),
                               inputs=("random",), seeds=(0,), measurement="bench", bench=options,
                               enforce_accuracy=False) for tp in tps]
    except ValueError as error:
        _usage_error(str(error))
    note = (f"{jobs[0].backend_note}; SDPA flash: a KV head's 64 query rows over its visible keys, contiguous, "
            "no mask; roofline = K + V bytes of the visible pages / 4.2 TB/s")
    _bench_and_report(jobs, options, note, title="musebench bench attn", json_path=json_path)
