"""What a run produces: per-rank results, per-case rows, and the run report (schema-versioned).

Every row carries its correctness (`mismatches`, `max_ulp`, `first_mismatch`) beside its timings,
as nccl-tests rows carry `#wrong`. A run this machine cannot execute (routing without a GPU) is no
row: it is a `SkippedRun` in `RunReport.skipped`, with its case count and the reason, so a skip
never reads as a pass. The JSON form is `RunReport.to_dict()`; `RunReport.from_dict` reads any
file written with the same `SCHEMA_VERSION` major.

Schema history: 1.0 the cases; 1.1 adds the top-level `skipped` list (a 1.0 file reads with none,
and a 1.0 reader, which reads top-level fields by name, ignores it) and, on rows, `baselines_us`
(other paths timed in the same bench run) and `notes` (a 1.0 file reads with neither); 1.2 adds,
on rows, `kernels_us` (the tail's own kernels timed apart); 1.3 adds, on rows, `measurement`:
"check" (bits checked, nothing timed: `tail_us`, `stock_us` and the ranks' µs are None) or
"bench" (µs are CUDA-graph medians). A file before 1.3 reads with its rows' measurement inferred
(`infer_measurement`): "bench" where the row has `baselines_us` or `kernels_us` or the report's
command is a `musebench bench ...`, else "check"; the host wall-clock µs that 1.2 check rows
carry are read but mean nothing, and the report layer ignores them. 1.4 adds, on rows, `group`
(a job of WORLD_SIZE ranks runs a case of tp < WORLD_SIZE on WORLD_SIZE / tp groups of
consecutive ranks, one row per group: group g holds ranks g*tp .. g*tp + tp - 1, and the row's
`ranks` are numbered within it; None where one group is the whole job) and, on rank results,
`host` (the host name the rank ran on; None for virtual ranks). Readers ignore row fields they do
not know, so a file of a later minor reads with an earlier one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEMA_VERSION = "1.4"
MEASUREMENTS = ("check", "bench")


@dataclass
class Mismatch:
    """The first element where a rank's output differs from the expected bits."""

    rank: int
    index: tuple[int, ...]
    got_bits: int
    want_bits: int
    got: float
    want: float


@dataclass
class RankResult:
    rank: int
    digest: str = ""  # sha256 of the output's raw bytes
    mismatches: int = 0  # elements whose bits differ from the stock
    max_ulp: int = 0
    first_mismatch: Mismatch | None = None
    tail_us: float | None = None  # benches: median per call
    stock_us: float | None = None
    error: str | None = None  # crash, timeout or fault record, as one line
    host: str | None = None  # the host name a process rank ran on (gathered over the process group)


@dataclass
class CaseResult:
    kernel: str  # "ep_tail" | "tp_tail" | "routing"
    mode: str  # "ep" | "tp" | "routing"
    tp: int
    tokens: int
    weight_dtype: str  # "bf16" | "fp32"
    norm: str  # "before" | "after" (weight applied before / after the norm)
    inputs: str  # input family: "random" | "adversarial"
    seed: int
    backend: str  # "cpu" | "cute"
    launcher: str  # "virtual" | "torchrun"
    transport: str  # "local" | "shm" | "ipc" | "unicast" | "multicast"
    stock: str  # what the row was checked against: "reference" (stock/), "triton" (routing)
    stock_path: str = ""  # which stock code path the case was checked against
    mismatches: int = 0  # summed over ranks
    max_ulp: int = 0
    first_mismatch: Mismatch | None = None
    rank_identical: bool = True
    deterministic: bool = True
    error: str | None = None
    # benches (measurement "bench"): CUDA-graph median per call, max over ranks; checks: None
    tail_us: float | None = None
    stock_us: float | None = None
    bytes_moved: int = 0  # per rank per call, payload bytes written to peers
    # the family's roofline for the row's bytes (qkv_front: the weight at 4.2 TB/s), µs; None: none named
    roofline_us: float | None = None
    iters: int = 0
    ranks: list[RankResult] = field(default_factory=list)
    # benches: other paths timed in the same run (name -> µs per call, max over ranks), e.g.
    # "finalize", "finalize+nccl"; `stock_us` is the one the ratio compares against
    baselines_us: dict[str, float] = field(default_factory=dict)
    # benches: baseline -> another path of `baselines_us` whose µs its ratio divides instead of the
    # tail's (the family's BASELINE_RATIO_OF, e.g. qkv_front's cold cuBLAS against the cold launch);
    # a file without it reads with {} (every ratio the tail's)
    baseline_ratio_of: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was not timed and why
    # benches: the tail's kernels apart (name -> µs per call, max over ranks), e.g. the EP
    # "publisher" alone and "reduce (call - publisher)"; `tail_us` is the whole call
    kernels_us: dict[str, float] = field(default_factory=dict)
    measurement: str = "check"  # "check": bits only, untimed; "bench": µs are CUDA-graph medians
    group: int | None = None  # which group of tp consecutive ranks of a larger job (None: the whole job)

    def group_label(self) -> str:
        """`group 1 (ranks 4-7)`, or "" where the row's ranks are the whole job."""
        if self.group is None:
            return ""
        first = self.group * self.tp
        return f"group {self.group} (ranks {first}-{first + self.tp - 1})"

    @property
    def passed(self) -> bool:
        return self.error is None and self.mismatches == 0 and self.rank_identical and self.deterministic

    @property
    def ratio(self) -> float | None:
        if self.tail_us is None or self.stock_us is None or self.stock_us == 0:
            return None
        return self.tail_us / self.stock_us

    @property
    def baseline_ratios(self) -> dict[str, float]:
        """tail / each baseline of the same run (each the max over ranks), where both were timed;
        a baseline named in `baseline_ratio_of`: that other baseline / it instead."""
        ratios = {}
        for name, us in self.baselines_us.items():
            over = self.baseline_ratio_of.get(name)
            top = self.tail_us if over is None else self.baselines_us.get(over)
            if us and top is not None:
                ratios[name] = top / us
        return ratios

    @property
    def key(self) -> tuple:
        """Identity of a case across runs (for `report --compare`)."""
        return (self.kernel, self.tp, self.tokens, self.weight_dtype, self.norm, self.inputs, self.transport)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        data["ratio"] = self.ratio
        data["baseline_ratios"] = self.baseline_ratios  # derived, like "ratio": readers ignore it
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], command: str = "") -> CaseResult:
        """A row from its JSON; without `measurement` (before 1.3) it is inferred from the row and
        the report's `command` (`infer_measurement`)."""
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data.setdefault("measurement", infer_measurement(data, command))
        if data["measurement"] not in MEASUREMENTS:
            raise ValueError(f"unknown measurement {data['measurement']!r} (expected one of {', '.join(MEASUREMENTS)})")
        ranks = [_rank_from_dict(r) for r in data.pop("ranks", [])]
        first = data.pop("first_mismatch", None)
        return cls(**data, ranks=ranks, first_mismatch=_mismatch_from_dict(first))


def infer_measurement(row: dict[str, Any], command: str = "") -> str:
    """A pre-1.3 row's measurement: "bench" if it holds other paths' or its kernels' µs (tail
    benches) or its report's command is `musebench bench ...` (routing benches), else "check"."""
    if row.get("baselines_us") or row.get("kernels_us"):
        return "bench"
    words = command.split()
    if words and words[0].rsplit("/", 1)[-1] == "musebench":
        words = words[1:]
    return "bench" if words[:1] == ["bench"] else "check"


def _mismatch_from_dict(data: dict[str, Any] | None) -> Mismatch | None:
    if data is None:
        return None
    data = dict(data)
    data["index"] = tuple(data["index"])
    return Mismatch(**data)


def _rank_from_dict(data: dict[str, Any]) -> RankResult:
    data = dict(data)
    data["first_mismatch"] = _mismatch_from_dict(data.get("first_mismatch"))
    return RankResult(**data)


@dataclass
class SkippedRun:
    """A run that was not executed here, and why (e.g. routing on a machine without a GPU)."""

    name: str  # the job's name, e.g. "routing (tp=8)"
    kernel: str  # "routing"
    cases: int  # how many cases it holds
    reason: str  # one line, e.g. "needs a CUDA GPU with SM >= 90 and CuTe DSL (no such GPU here)"


@dataclass
class RunReport:
    command: str
    backend_note: str = ""  # e.g. "CPU model (no GPU present)"
    created: str = ""  # ISO-8601 UTC
    machine: dict[str, Any] = field(default_factory=dict)  # hostname, platform, cpu, gpus
    versions: dict[str, Any] = field(default_factory=dict)  # musebench, python, torch, cuda, cutlass-dsl
    git_commit: str = ""
    cases: list[CaseResult] = field(default_factory=list)
    schema_version: str = SCHEMA_VERSION
    skipped: list[SkippedRun] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """No case failed and something was accounted for: run cases, or runs skipped with a reason."""
        return bool(self.cases or self.skipped) and all(case.passed for case in self.cases)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "command": self.command,
            "backend_note": self.backend_note,
            "created": self.created,
            "machine": self.machine,
            "versions": self.versions,
            "git_commit": self.git_commit,
            "passed": self.passed,
            "cases": [case.to_dict() for case in self.cases],
            "skipped": [asdict(run) for run in self.skipped],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        version = str(data.get("schema_version", ""))
        if version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise ValueError(f"unsupported report schema {version!r} (this musebench reads {SCHEMA_VERSION})")
        return cls(
            command=data["command"],
            backend_note=data.get("backend_note", ""),
            created=data.get("created", ""),
            machine=data.get("machine", {}),
            versions=data.get("versions", {}),
            git_commit=data.get("git_commit", ""),
            cases=[CaseResult.from_dict(case, command=data["command"]) for case in data.get("cases", [])],
            schema_version=version,
            skipped=[SkippedRun(**run) for run in data.get("skipped", [])],
        )
