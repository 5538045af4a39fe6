"""Jobs: a list of cases of one family kind with their run options, resolved, launched and
turned into a report.

The CLI builds jobs (`make_tail_job`, `make_routing_job`: from options or scenario files;
`make_front_job`, `make_attn2_job`: the attention front's; a measurement, check or bench, each)
and runs them with `run_job`, which hands every job to the one driver (`harness.driver`) through
its launcher; everything that can be refused is refused in the `make_*_job` functions and
`resolve_backend`, before any rank starts.

A routing, qkv_front or attn2 job runs only where `resolve_backend` picks cute (a GPU with SM >= 90
and CuTe DSL): these kernels have no CPU model, so where auto would fall back to the CPU model, or
the backend is cpu, the job carries a `skip_reason`, runs nothing and is reported as a
`SkippedRun`, never as a pass. Asking for cute where it cannot run is a ValueError, as for the
tails.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from musebench.comm.transport import REQUESTS, decide, layout_here
from musebench.harness.case import DEFAULT_NSM, MEASUREMENTS, Faults, RunOptions
from musebench.cases.tail_inputs import EP_LAUNCHES, tail_cases
from musebench.harness.measure import BenchOptions
from musebench.harness.nodes import Nodes, check_tp
from musebench.harness.results import CaseResult, RunReport, SkippedRun
from musebench.harness.scenario import (
    RoutingScenarioRun,
    ScenarioRun,
    validate_routing_tokens,
    validate_tiles,
    validate_tokens,
    validate_tp,
)

if TYPE_CHECKING:
    from typing import Any

CPU_NOTE_NO_GPU = "CPU model (no GPU present)"
CPU_NOTE_NO_DSL = "CPU model (CuTe DSL does not import here)"
CPU_NOTE_ASKED = "CPU model"
CUTE_NOTE = "cute (CuTe DSL kernels on {gpu})"
ROUTING_NEEDS = "needs a CUDA GPU with SM >= 90 and CuTe DSL"
_ROUTING_WHY_NOT = {CPU_NOTE_NO_GPU: "no such GPU here", CPU_NOTE_NO_DSL: "CuTe DSL does not import here"}


@dataclass(frozen=True)
class Job:
    """Cases of one tp and family kind with the options they run under; `skip_reason` set: the
    machine cannot run them and the job runs nothing (reported as skipped, never as passed);
    `resolved` False: built for a dry run, never to be run."""

    name: str
    cases: tuple[Any, ...]
    options: RunOptions
    backend_note: str
    measurement: str = "check"
    bench: BenchOptions | None = None
    skip_reason: str | None = None
    resolved: bool = True
    kernel: str = "tail"  # what a skipped job's report names
    nodes: Nodes | None = None  # a process launch of nodes.world ranks on groups of tp (None: tp processes, one node)

    @property
    def backend(self) -> str:
        return "skipped" if self.skip_reason is not None else self.options.backend

    def launch_command(self) -> str:
        """What runs the job, for --dry-run."""
        tp = self.cases[0].tp if self.cases else 0
        if self.options.launcher == "virtual":
            where = {
                "auto": "; skipped unless this machine has a CUDA GPU with SM >= 90 and CuTe DSL",
                "cpu": "; skipped: routing has no CPU model",
            }.get(self.options.backend, "") if self.kernel == "routing" else ""
            if self.skip_reason is not None:
                where = f"; skipped: {self.skip_reason}"
            gpu = " on one GPU" if self.kernel == "routing" else ""
            return f"(in process) {tp} virtual ranks{gpu}, {len(self.cases)} cases{where}"
        from musebench.harness.launch import launch_command

        nodes = self.nodes or Nodes(nproc_per_node=tp)
        command = shlex.join(launch_command(nodes))
        if self.nodes is not None and self.nodes.world > tp:
            command += f"  # {self.nodes.world // tp} groups of {tp} ranks"
        return command

    def skipped(self) -> SkippedRun:
        return SkippedRun(name=self.name, kernel=self.kernel, cases=len(self.cases), reason=self.skip_reason or "")



def _gpu_name() -> str | None:
    """The current GPU's name if torch sees one with SM >= 90 (what the kernels are built for)."""
    try:
        import torch

        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
            return None
        return torch.cuda.get_device_name()
    except Exception:
        return None


def gpu_sm_count() -> int:
    """The current GPU's SM count: what the TP stock's dispatch is checked for on a GPU run."""
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _dsl_imports() -> bool:
    try:
        import cutlass  # noqa: F401

        return True
    except Exception:
        return False


def resolve_backend(requested: str) -> tuple[str, str]:
    """(backend, note for the table title); ValueError for a backend this machine cannot run."""
    if requested == "cpu":
        return "cpu", CPU_NOTE_ASKED
    if requested not in ("auto", "cute"):
        raise ValueError(f"unknown backend {requested!r}")
    gpu = _gpu_name()
    if requested == "cute":
        if gpu is None:
            raise ValueError("the cute backend needs a CUDA GPU with SM >= 90; use --backend cpu")
        if not _dsl_imports():
            raise ValueError("the cute backend needs CuTe DSL (nvidia-cutlass-dsl), which does not import here")
        return "cute", CUTE_NOTE.format(gpu=gpu)
    if gpu is None:
        return "cpu", CPU_NOTE_NO_GPU
    if not _dsl_imports():
        return "cpu", CPU_NOTE_NO_DSL
    return "cute", CUTE_NOTE.format(gpu=gpu)


def check_transport(transport: str, backend: str, launcher: str, tp: int, nodes: Nodes | None = None) -> None:
    """Refuse a transport this run cannot have (musebench.comm.transport.decide: TransportRefused,
    a ValueError); never creates a multicast object to find out. With `nodes`, this node's
    --nproc-per-node processes; the hosts a group spans are checked at launch, from the nodes'
    host names (`launch.check_hosts`)."""
    decide(layout_here(backend, launcher, tp, local_world=nodes.nproc_per_node if nodes else None), transport)


def check_impl(impl: str, backend: str, launcher: str) -> None:
    """Refuse, before anything launches, an implementation this run cannot check: one that does
    not import or provides none of the seeds' modules, one whose tails need a process group on
    virtual ranks, or any `--impl` on the CPU model (which runs no implementation)."""
    from musebench.harness.impl import DEFAULT_IMPL, load_impl

    if backend != "cute":
        if impl != DEFAULT_IMPL:
            raise ValueError(f"--impl {impl}: the {backend} backend runs the CPU model, not an implementation; "
                             "an implementation needs the cute backend")
        return
    load_impl(impl).require_process_group(launcher)


def make_tail_job(
    *,
    name: str,
    tp: int,
    modes: Sequence[str],
    tokens: Sequence[int],
    capacity: int,
    weights: Sequence[str],
    norms: Sequence[str],
    inputs: Sequence[str],
    seeds: Sequence[int],
    launcher: str,
    backend: str,
    iters: int,
    warmup: int,
    timeout_s: float,
    nsm: int | None = None,
    transport: str = "auto",
    faults: Faults = Faults(),
    check_machine: bool = True,
    ep_launch: str = "two",
    impl: str = "musebench",
    measurement: str = "check",
    bench: BenchOptions | None = None,
    nodes: Nodes | None = None,
) -> Job:
    """Validate everything and build the job; ValueError names the first bad value.

    `check_machine=False` (dry runs) validates the values but not what this machine can run: the
    backend stays as requested. `nodes` (the torchrun launcher only): the job's nodes.world ranks
    run every case on groups of tp; faults then name ranks of the whole job.
    """
    validate_tp(tp)
    if transport not in REQUESTS:
        raise ValueError(f"transport must be one of {', '.join(REQUESTS)}, got {transport!r}")
    validate_tokens(tuple(tokens), capacity)
    if launcher not in ("virtual", "torchrun"):
        raise ValueError(f"launcher must be virtual or torchrun, got {launcher!r}")
    if ep_launch not in EP_LAUNCHES:
        raise ValueError(f"ep_launch must be one of {', '.join(EP_LAUNCHES)}, got {ep_launch!r}")
    if iters < 1 or warmup < 0:
        raise ValueError("iters must be >= 1 and warmup >= 0")
    if timeout_s <= 0:
        raise ValueError("timeout must be positive")
    if measurement not in MEASUREMENTS:
        raise ValueError(f"measurement must be one of {', '.join(MEASUREMENTS)}, got {measurement!r}")
    if nodes is not None:
        if launcher != "torchrun":
            raise ValueError("--nnodes / --nproc-per-node need --launcher torchrun")
        check_tp(nodes, tp)
    ranks = nodes.world if nodes is not None else tp
    if faults.max_rank() >= ranks:
        raise ValueError(f"fault rank {faults.max_rank()} does not exist at tp={tp}"
                         + (f" on {ranks} ranks" if nodes is not None else ""))
    if faults.exit_rank is not None and launcher != "torchrun":
        raise ValueError("the exit fault needs --launcher torchrun")
    if ep_launch == "single" and backend == "cpu":  # a dry run refuses it too; auto is resolved below
        raise ValueError("the single-launch EP tail is a cute kernel; the cpu backend has only one EP tail "
                         "(--ep-launch two)")
    if check_machine:
        resolved, note = resolve_backend(backend)
        check_transport(transport, resolved, launcher, tp, nodes)
        if ep_launch == "single" and resolved != "cute":
            raise ValueError(f"the single-launch EP tail is a cute kernel; the {resolved} backend has only one EP tail "
                             "(--ep-launch two)")
        if measurement == "bench" and resolved != "cute":
            raise ValueError("benches time the cute kernels: they need a CUDA GPU with SM >= 90 and CuTe DSL")
        check_impl(impl, resolved, launcher)
    else:
        resolved, note = backend, "not resolved (dry run)"
    cases = tail_cases(modes=tuple(modes), tp=tp, tokens=tuple(tokens), weight_dtypes=tuple(weights),
                       norms=tuple(norms), inputs=tuple(inputs), seeds=tuple(seeds))
    if nsm is None:  # the stock dispatches on the group's SM count: this GPU's on a GPU run
        nsm = gpu_sm_count() if resolved == "cute" else DEFAULT_NSM
    options = RunOptions(backend=resolved, launcher=launcher, iters=iters, warmup=warmup, timeout_s=timeout_s,
                         nsm=nsm, transport=transport, faults=faults, ep_launch=ep_launch, impl=impl,
                         capacity=capacity)
    return Job(name=name, cases=tuple(cases), options=options, backend_note=note, measurement=measurement,
               bench=bench, resolved=check_machine, nodes=nodes)


def resolve_one_gpu_backend(requested: str, kernel: str = "routing") -> tuple[str, str, str | None]:
    """(backend, note, skip reason) of a family that runs on virtual ranks of one GPU and has no
    CPU model (routing, qkv_front, attn2): cute where the kernel runs, else "skipped" and why.

    ValueError where cute is asked for and cannot run, or for an unknown backend.
    """
    if requested == "cpu":
        return "skipped", "", f"{kernel} has no CPU model (backend cpu); it {ROUTING_NEEDS}"
    if requested == "cute":
        resolved, note = resolve_backend("auto")  # why cute cannot run, without the tails' "use --backend cpu"
        if resolved != "cute":
            raise ValueError(f"{kernel} {ROUTING_NEEDS} ({_ROUTING_WHY_NOT.get(note, note)}); it has no CPU model")
        return resolved, note, None
    resolved, note = resolve_backend(requested)
    if resolved == "cute":
        return resolved, note, None
    return "skipped", "", f"{ROUTING_NEEDS} ({_ROUTING_WHY_NOT.get(note, note)})"


def resolve_routing_backend(requested: str) -> tuple[str, str, str | None]:
    """`resolve_one_gpu_backend` for the routing kernel."""
    return resolve_one_gpu_backend(requested, "routing")


def _one_gpu_backend(kernel: str, *, name: str, backend: str, check_machine: bool, faults: Faults,
                     injectable: Sequence[str], tp: int, timeout_s: float) -> tuple[str, str, str | None]:
    """What the one-GPU families' jobs refuse alike (ValueError, before anything launches): a
    non-positive timeout, a fault the family cannot inject or on a rank past tp, an unknown
    backend, cute where it cannot run. (backend, note, skip reason); a dry run resolves nothing."""
    if timeout_s <= 0:
        raise ValueError("timeout must be positive")
    unsupported = [kind for kind in faults.kinds() if kind not in injectable]
    if unsupported:
        raise ValueError(f"{kernel} injects only {', '.join(injectable)} faults, not {', '.join(unsupported)}")
    if faults.max_rank() >= tp:
        raise ValueError(f"a fault names rank {faults.max_rank()}, but tp is {tp}")
    if not check_machine:
        if backend not in ("auto", "cpu", "cute"):
            raise ValueError(f"unknown backend {backend!r}")
        return backend, "not resolved (dry run)", None
    try:
        return resolve_one_gpu_backend(backend, kernel)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def make_routing_job(
    *,
    name: str,
    tp: int,
    tokens: Sequence[int],
    tiles: Sequence[int],
    renormalize: Sequence[bool],
    inputs: Sequence[str],
    seeds: Sequence[int],
    backend: str,
    check_machine: bool = True,
    timeout_s: float = 10.0,
    faults: Faults = Faults(),
    impl: str = "musebench",
    launcher: str = "virtual",
    measurement: str = "check",
    bench: BenchOptions | None = None,
) -> Job:
    """Validate everything and build the job; ValueError names the first bad value.

    Cases in `musebench routing`'s order within each renormalize flag. `check_machine=False` (dry
    runs) leaves the backend as requested and skips nothing. Each rank makes two calls per case
    (the kernel compiles at bind), so a result that changes between calls fails `deterministic`.
    """
    from musebench.cases.routing import RoutingCase, faults as routing_faults
    from musebench.cases.tail_inputs import ROUTING_INPUT_FAMILIES

    validate_tp(tp)
    validate_routing_tokens(tuple(tokens))
    validate_tiles(tuple(tiles))
    bad = [family for family in inputs if family not in ROUTING_INPUT_FAMILIES]
    if bad or not inputs:
        raise ValueError(f"inputs must be among {', '.join(ROUTING_INPUT_FAMILIES)}, got {list(inputs)}")
    if not seeds or not renormalize:
        raise ValueError("no seeds or no renormalize flags given")
    resolved, note, skip_reason = _one_gpu_backend("routing", name=name, backend=backend, check_machine=check_machine,
                                                   faults=faults, injectable=routing_faults, tp=tp, timeout_s=timeout_s)
    if check_machine and skip_reason is None:
        check_impl(impl, resolved, launcher)
    cases = tuple(RoutingCase(tp=tp, tokens=m, tile_n=tile, renormalize=renorm, inputs=family, seed=seed)
                  for renorm in renormalize for family in inputs for tile in tiles for m in tokens for seed in seeds)
    options = RunOptions(backend=resolved if resolved != "skipped" else backend, launcher=launcher, iters=2,
                         warmup=0, timeout_s=timeout_s, faults=faults, impl=impl)  # two calls: repeatability is checked
    return Job(name=name, cases=cases, options=options, backend_note=note, skip_reason=skip_reason,
               resolved=check_machine, kernel="routing", measurement=measurement, bench=bench)


def jobs_from_scenario(runs: Sequence[ScenarioRun | RoutingScenarioRun], *, overrides: dict[str, str] | None = None,
                       check_machine: bool = True, nodes: Nodes | None = None) -> list[Job]:
    """One job per (run, tp), in file order; `overrides` (launcher, backend, transport) replace the
    file's values (a routing run takes only backend: it always runs on virtual ranks of one GPU).
    `nodes`: every tail run's launch (each must use the torchrun launcher; every tp divides the
    job's ranks)."""
    overrides = overrides or {}
    jobs: list[Job] = []
    for run in runs:
        backend = overrides.get("backend") or run.backend
        for tp in run.tp:
            if isinstance(run, RoutingScenarioRun):
                jobs.append(make_routing_job(
                    name=f"{run.name} (tp={tp})", tp=tp, tokens=run.tokens, tiles=run.tile,
                    renormalize=run.renormalize, inputs=run.inputs, seeds=run.seeds, backend=backend,
                    check_machine=check_machine,
                ))
                continue
            jobs.append(make_tail_job(
                name=f"{run.name} (tp={tp})", tp=tp, modes=run.modes, tokens=run.tokens, capacity=run.capacity,
                weights=run.weights, norms=run.norm, inputs=run.inputs, seeds=run.seeds,
                launcher=overrides.get("launcher") or run.launcher, backend=backend,
                transport=overrides.get("transport") or run.transport, iters=run.iters, warmup=run.warmup,
                timeout_s=run.timeout, nsm=run.nsm, check_machine=check_machine, ep_launch=run.ep_launch,
                nodes=nodes,
            ))
    return jobs


def run_job(job: Job, on_case: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """The job's rows through the one driver; a skipped job has none (report it with `Job.skipped`)."""
    if job.skip_reason is not None:
        return []
    if not job.resolved:
        raise ValueError(f"{job.name}: backend {job.options.backend!r} was not resolved; build the job with "
                         "check_machine")
    from musebench.harness import launch
    from musebench.harness.driver import run_virtual

    if job.options.launcher == "virtual":
        return run_virtual(job.cases, job.options, on_case, measurement=job.measurement, bench=job.bench)
    if launch.in_torchrun_job():
        return launch.run_in_job(job.cases, job.options, on_case, bench=job.bench, measurement=job.measurement)
    return launch.run_torchrun(job.cases, job.options, on_case, bench=job.bench, measurement=job.measurement,
                               nodes=job.nodes)


def run_jobs(jobs: Sequence[Job], on_case: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Every job's rows, in order. Consecutive torchrun jobs with nodes (their tps differ) run in
    one launch of the nodes' ranks, started once (`launch.run_launch`); the others as `run_job`.
    Raises `nodes.NodesRefused` (exit 2) where a launch across nodes cannot serve a group."""
    from musebench.harness import launch

    rows: list[CaseResult] = []
    index = 0
    while index < len(jobs):
        job = jobs[index]
        batch = [job]
        if (job.nodes is not None and job.skip_reason is None and job.options.launcher == "torchrun"
                and not launch.in_torchrun_job()):
            while (index + len(batch) < len(jobs) and jobs[index + len(batch)].nodes == job.nodes
                   and jobs[index + len(batch)].skip_reason is None
                   and jobs[index + len(batch)].options.launcher == "torchrun"):
                batch.append(jobs[index + len(batch)])
        if len(batch) > 1:
            runs = [launch.Spec(b.cases, b.options, b.measurement, b.bench) for b in batch]
            for part in launch.run_launch(runs, job.nodes, on_case):
                rows.extend(part)
        else:
            rows.extend(run_job(job, on_case))
        index += len(batch)
    return rows


def build_report(rows: Sequence[CaseResult], *, command: str, backend_note: str,
                 skipped: Sequence[SkippedRun] = ()) -> RunReport:
    from musebench.harness import report

    return RunReport(
        command=command, backend_note=backend_note, created=report.now_utc(), machine=report.machine_info(),
        versions=report.version_info(), git_commit=report.git_commit(), cases=list(rows), skipped=list(skipped),
    )


# ---------------------------------------------------------------------------------------------
# qkv_front (`musebench front`, `musebench bench front`).


def make_front_job(
    *,
    name: str,
    tp: int,
    tokens: Sequence[int],
    rope: Sequence[bool],
    inputs: Sequence[str],
    seeds: Sequence[int],
    backend: str = "cute",
    check_machine: bool = True,
    timeout_s: float = 10.0,
    faults: Faults = Faults(),
    impl: str = "musebench",
    measurement: str = "check",
    bench: BenchOptions | None = None,
    cold_weights: bool = False,
) -> Job:
    """Validate everything and build a QKV front job (virtual ranks of one GPU); ValueError names
    the first bad value: tp outside 4, 8, 16 (N = 4608, 2304, 1152), tokens outside 1..16, an
    unknown input family, a fault the family cannot inject. Two calls per rank: repeatability.
    A bench job's cases call the deployment's launch (`FrontCase.bench`: no tap, PDL); with
    `cold_weights` they also time it on one weight copy per call of the graph
    (`cases.qkv_front.cold_copies_for`: refused, before the machine is looked at, outside a bench
    or where bench.calls cannot keep a copy out of L2)."""
    from musebench.cases.qkv_front import (INPUT_FAMILIES, MAX_TOKENS, FrontCase, cold_copies_for,
                                           faults as front_faults, kv_heads_for)

    kv_heads_for(tp)
    cold_copies = 0
    if cold_weights:
        if measurement != "bench" or bench is None:
            raise ValueError("--cold-weights times the bench's launches: it needs a bench job")
        cold_copies = cold_copies_for(tp, bench.calls)
    bad_tokens = [m for m in tokens if not 1 <= m <= MAX_TOKENS]
    if bad_tokens or not tokens:
        raise ValueError(f"qkv_front takes 1 to {MAX_TOKENS} tokens, got {list(tokens)}")
    bad = [family for family in inputs if family not in INPUT_FAMILIES]
    if bad or not inputs:
        raise ValueError(f"inputs must be among {', '.join(INPUT_FAMILIES)}, got {list(inputs)}")
    if not seeds or not rope:
        raise ValueError("no seeds or no rope flags given")
    resolved, note, skip_reason = _one_gpu_backend("qkv_front", name=name, backend=backend,
                                                   check_machine=check_machine, faults=faults,
                                                   injectable=front_faults, tp=tp, timeout_s=timeout_s)
    if check_machine and skip_reason is None:
        from musebench.harness.impl import cute_ops_with

        cute_ops_with(impl, "launch_qkv_front")  # ImplError (exit 2) before anything launches
    cases = tuple(FrontCase(tp=tp, tokens=m, rope=r, inputs=family, seed=seed, bench=measurement == "bench",
                            cold_copies=cold_copies)
                  for r in rope for family in inputs for m in tokens for seed in seeds)
    options = RunOptions(backend=resolved if resolved != "skipped" else backend, launcher="virtual", iters=2,
                         warmup=0, timeout_s=timeout_s, faults=faults, impl=impl)
    return Job(name=name, cases=cases, options=options, backend_note=note, skip_reason=skip_reason,
               resolved=check_machine, kernel="qkv_front", measurement=measurement, bench=bench)


# ---------------------------------------------------------------------------------------------
# attn2 (`musebench attn`, `musebench bench attn`).


def make_attn2_job(
    *,
    name: str,
    tp: int,
    lengths: Sequence[int],
    max_model_len: int,
    windows: Sequence[int],
    inputs: Sequence[str],
    seeds: Sequence[int],
    backend: str = "cute",
    check_machine: bool = True,
    timeout_s: float = 10.0,
    faults: Faults = Faults(),
    impl: str = "musebench",
    measurement: str = "check",
    bench: BenchOptions | None = None,
    enforce_accuracy: bool = True,
) -> Job:
    """Validate everything and build an attn2 job (virtual ranks of one GPU); ValueError names the
    first bad value (`cases.attn2.check_case`: a tp that does not split 16 KV heads, tp 32 with its
    reason, L outside [8, max_model_len], a window outside [0, max_model_len), unknown inputs), or
    a fault the family cannot inject. Two calls per rank: repeatability."""
    from musebench.cases.attn2 import ENTRY_POINTS, Attn2Case, check_case, faults as attn2_faults

    if not lengths or not windows or not inputs or not seeds:
        raise ValueError("no lengths, windows, inputs or seeds given")
    cases = tuple(Attn2Case(tp=tp, tokens=length, max_model_len=max_model_len, window=window, inputs=family,
                            seed=seed, enforce_accuracy=enforce_accuracy)
                  for window in windows for family in inputs for length in lengths for seed in seeds)
    for case in cases:
        check_case(case)
    resolved, note, skip_reason = _one_gpu_backend("attn2", name=name, backend=backend, check_machine=check_machine,
                                                   faults=faults, injectable=attn2_faults, tp=tp, timeout_s=timeout_s)
    if check_machine and skip_reason is None:
        from musebench.harness.impl import cute_ops_with

        cute_ops_with(impl, *ENTRY_POINTS)  # ImplError (exit 2) before anything launches
    options = RunOptions(backend=resolved if resolved != "skipped" else backend, launcher="virtual", iters=2,
                         warmup=0, timeout_s=timeout_s, faults=faults, impl=impl)
    return Job(name=name, cases=cases, options=options, backend_note=note, skip_reason=skip_reason,
               resolved=check_machine, kernel="attn2", measurement=measurement, bench=bench)
