"""The Case protocol: what a kernel family tells the one driver.

A *case* is a frozen dataclass naming one parity point (its `family`, `tp`, `tokens`, input
family, seed and the family's own knobs). A *family* is a module under `musebench.cases` that
implements `Family` for its cases; the driver (`harness.driver`) looks it up by `case.family`
in `musebench.cases.FAMILIES` and never branches on the family itself. A call's way, on every
rank, whatever the launcher (virtual ranks, torchrun processes) and the measurement (check,
bench):

1. `family.make_inputs(case)`: every rank's inputs, deterministic in the case (seed included),
   so any rank in any process draws its own or a peer's without communication;
2. `family.mailboxes(case, capacity)`: the Lamport mailboxes a case needs, by name
   (`MailboxSpec`), allocated collectively by the driver for the transport `comm` decided; none
   for a family without communication (routing);
3. `family.bind(case, impl, rank, boxes, inputs, options)`: this rank's `Runner`, built through
   the seeds' API of the implementation under test (`impl`, `--impl`); binding compiles, so the
   driver binds every rank before any rank runs and never inside CUDA-graph capture;
4. the driver poisons `runner.outputs`, calls `runner.call()` (one collective call on the
   current stream), and reads the outputs back;
5. `family.expected(case, inputs, options, approximations)`: the stock reference's bits, per rank
   and output (ranks the stock gives equal bits of an output must agree on it), and the stock
   path taken; `approximations` are the GPU's own instructions on the cute backend;
6. benches also time `runner.parts()` (kernels of a call timed apart) and
   `family.baselines(...)` (what a user would run instead), in the same process and run.

Options travel as frozen dataclasses (`RunOptions`, `Faults`), never as module globals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

DEFAULT_NSM = 148  # B200 / GB200 SM count: the TP stock's dispatch on the racks musebench targets
FAULT_KINDS = ("flip", "silent", "raise", "hang", "exit")  # each a `<kind>_rank` field of Faults
MEASUREMENTS = ("check", "bench")


@dataclass(frozen=True)
class Faults:
    """Fault injection, for proving that every check can fail (each field a rank or None)."""

    flip_rank: int | None = None  # flips one bit of its output (host copy)
    silent_rank: int | None = None  # never launches: its peers' bounded waits must report it
    raise_rank: int | None = None  # raises inside its call
    hang_rank: int | None = None  # stops making progress (host thread, or its stream held busy)
    exit_rank: int | None = None  # its process dies (process launcher only)

    @classmethod
    def parse(cls, specs: Sequence[str]) -> Faults:
        """From `KIND:RANK` strings (`flip:1`, `silent:0`, `raise:2`, `hang:1`, `exit:3`)."""
        values: dict[str, int] = {}
        for spec in specs:
            kind, _, rank = spec.partition(":")
            if kind not in FAULT_KINDS or not rank.isdigit():
                raise ValueError(f"bad fault {spec!r}: expected KIND:RANK with KIND in {', '.join(FAULT_KINDS)}")
            values[f"{kind}_rank"] = int(rank)
        return cls(**values)

    def kinds(self) -> tuple[str, ...]:
        """The kinds of fault injected, in FAULT_KINDS order."""
        return tuple(kind for kind in FAULT_KINDS if getattr(self, f"{kind}_rank") is not None)

    def any(self) -> bool:
        return any(v is not None for v in vars(self).values())

    def max_rank(self) -> int:
        return max((v for v in vars(self).values() if v is not None), default=-1)


@dataclass(frozen=True)
class RunOptions:
    """How a job runs, for every family: the backend and launcher, the calls a check makes, the
    bound on every wait, the stock's SM count, the transport request, faults, the EP tail's form,
    the implementation under test (`impl`: a module path providing the seeds' API) and the
    mailboxes' capacity in tokens."""

    backend: str = "cpu"
    launcher: str = "virtual"
    iters: int = 3
    warmup: int = 1
    timeout_s: float = 10.0
    nsm: int = DEFAULT_NSM
    transport: str = "auto"  # requested: auto | local | ipc | unicast | multicast
    faults: Faults = field(default_factory=Faults)
    ep_launch: str = "two"  # the cute EP tail: "two" kernels (publisher, reduction) or a "single" one
    impl: str = "musebench"
    capacity: int = 0  # tokens the mailboxes hold (--capacity); 0: the largest token count of the run


@dataclass(frozen=True)
class MailboxSpec:
    """One named mailbox every rank of a case group holds: `slots` source slots of `rows` rows of
    `width` 16-bit words (per generation; `comm` adds the generations)."""

    slots: int
    rows: int
    width: int


@dataclass
class Expected:
    """The stock's bits for one case: `per_rank[r][name]` for every output of every rank; the
    ranks the stock gives equal bits must agree with each other (`rank_identical` of the row)."""

    per_rank: list[dict[str, Any]]
    stock_path: str


class Runner(Protocol):
    """One rank's bound case. `outputs` are the tensors a call writes (the driver poisons them
    before each call and reads them after); `call` is one collective call on the current stream,
    graph-capturable where the backend is a GPU one and allocating nothing."""

    outputs: dict[str, Any]

    def call(self) -> None: ...

    def check_fault(self) -> None:
        """Raise (RuntimeError naming rank, peer, slot, generation) if a bounded wait ran out."""

    def parts(self) -> dict[str, Callable[[], None]]:
        """Kernels of a call a bench times apart (name -> launch), e.g. the EP publisher alone."""

    def launch_demands(self) -> list:
        """This rank's launches (`kernels.occupancy.LaunchDemand`) for the co-residency check of
        virtual ranks sharing one GPU; [] for a runner whose ranks never wait on each other."""


class Family(Protocol):
    """What a kernel family's case module provides (see the module docstring for the order)."""

    name: str  # the family's registry key, e.g. "ep_tail"
    Case: type  # its case dataclass (a process launch rebuilds cases from their fields)
    faults: tuple[str, ...]  # fault kinds it can inject
    PARTS: tuple[str, ...]  # kernels of a call a bench times apart (names of `Runner.parts`)
    VIRTUAL_STOCK: str  # the baseline that is a row's stock on virtual ranks
    PROCESS_STOCK: str  # ... and with a process per GPU

    def make_inputs(self, case: Any) -> Any: ...

    def mailboxes(self, case: Any, capacity: int) -> dict[str, MailboxSpec]: ...

    def bind(self, case: Any, impl: Any, rank: int, boxes: dict[str, Any], inputs: Any,
             options: RunOptions) -> Runner: ...

    def expected(self, case: Any, inputs: Any, options: RunOptions, approximations: Any) -> Expected: ...

    def bytes_moved(self, case: Any) -> int: ...

    def row_fields(self, case: Any, options: RunOptions) -> dict[str, Any]: ...

    def variants(self, case: Any, options: RunOptions) -> dict[str, RunOptions]:
        """Other forms of the kernel a bench times and checks like the call (name -> options)."""

    def baselines(self, case: Any, inputs: Any, rank: int, runner: Runner, comms: Any) -> dict[str, Any]:
        """name -> `cases.tail.Baseline` (a call, collective or not): what a bench times beside
        the case on the same inputs; `comms` (a process bench's: `group`, an NCCL group with
        SymmetricMemory, or None where processes share GPUs; `mailboxes`, this rank's, with those
        of the optional `baseline_mailboxes(case, capacity)` a family may define; `timeout_ns`)
        or None (virtual ranks). A baseline's ratio is the tail's µs over its own, unless the
        family's optional BASELINE_RATIO_OF (name -> another baseline's name) names the path whose
        µs it divides instead (the row's `baseline_ratio_of`)."""
