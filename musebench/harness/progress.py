"""Rank progress: where every rank of a launch is, and which rank to blame when they all stop.

Every rank keeps one record (`RankProgress`): the case it is in, the phase of that case, the call
it began (`call` of `calls`), how long it promises to take before its next record (`bound_s`),
and, once its calls are over, its outcome's error. A process rank replaces its record whole
(`ProgressFile`: `<job folder>/progress/rank-R.json`, written beside and renamed, so a reader
never sees half a record); virtual ranks hand theirs to their launcher in memory.

Phases of a case, in order: `bind` (compile and bind its tail), `barrier` (wait for the peers),
`call` (one per call, written by the rank's thread before the call begins), `gather` (calls
over, outcome on its way to rank 0: a wait), `evaluate` (rank 0 checks the outcomes), `reset`
(re-arm after a failed case: a wait). Around the cases: `start` (process up, before the
rendezvous), `bench` (a bench's cases, one opaque phase) and `finished` (a process rank: tearing
down, within its bound; a virtual rank: its thread returned).

The watch (`Watch`) notes when each rank's record last changed, on its own clock. The job has
stalled when either
- no working rank keeps its promise: each record of a rank at work is older than its `bound_s`
  (a call: the poll timeout and a grace; a compile: the compile bound; a rank that never reported:
  the startup bound), the waiting ranks waiting for them; or, every rank waiting, none has
  moved within its `bound_s` (None: `WAIT_GRACE_S`), or
- a rank that peers timed out waiting for (their errors name it: "waiting for rank R") is still in
  the very call they gave up in, its record older than the poll timeout and a short grace: the
  peers' timeouts are the evidence (the CuTe tails' calls may wait twice, so their call bound is
  two timeouts; the evidence ends the watch after one).
`Watch.blame` then names the rank behind: the one the peers' timeouts name, else the rank(s)
whose promise ran out while the others waited, else the least advanced rank(s).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

PHASES = ("start", "bind", "barrier", "call", "gather", "evaluate", "reset", "bench", "finished")
WAITING = frozenset({"barrier", "gather", "reset", "finished"})  # waits on peers: the peers hold the promise
CALL_GRACE_S = 5.0  # beyond the poll timeout: a call's host work after its last wait, on a loaded host
EVIDENCE_GRACE_S = 1.0  # for a rank its peers timed out waiting for, to post its next record
WAIT_GRACE_S = 10.0  # every rank waiting and none moving: the collective itself is stuck
PROGRESS_DIR_ENV = "MUSEBENCH_PROGRESS_DIR"

_WAITING_FOR = re.compile(r"waiting for rank (\d+)")


@dataclass(frozen=True)
class RankProgress:
    """One rank's latest record: where it is and how long until its next record at the latest."""

    rank: int
    phase: str = "start"
    case: int = -1  # index of the case in the launch; -1 before the first
    call: int = -1  # the call begun last (0-based), -1 before the first of the case
    calls: int = 0  # calls of the case (warmup + iters)
    bound_s: float | None = None  # None: no promise of its own
    error: str | None = None  # the outcome's error, once its calls are over
    pid: int = 0
    seq: int = 0  # grows by one per record
    group_base: int = 0  # the first rank of the rank's group: its case's errors number ranks within the group

    def where(self) -> str:
        """`case 0 (call 2 of 4)`, `case 1 (bind)`, `startup`."""
        if self.case < 0:
            return "startup" if self.phase == "start" else self.phase
        if self.phase == "call":
            return f"case {self.case} (call {self.call + 1} of {self.calls})"
        return f"case {self.case} ({self.phase})"

    def position(self) -> tuple[int, int, int]:
        """How far the rank got: case, phase, call (larger is further)."""
        order = PHASES.index(self.phase) if self.phase in PHASES else 0
        if self.phase == "finished":
            return (1 << 30, order, 0)
        return (self.case, order, self.call)

    def waiting_for(self) -> set[int]:
        """The peers its error says it timed out waiting for, as ranks of the job (an error numbers
        the ranks of the rank's group, which begins at `group_base`)."""
        return {self.group_base + int(rank) for rank in _WAITING_FOR.findall(self.error or "")}


class ProgressFile:
    """A process rank's record in `folder/rank-R.json`; `folder` None: records go nowhere."""

    def __init__(self, folder: str | os.PathLike[str] | None, rank: int) -> None:
        self.path = Path(folder) / f"rank-{rank}.json" if folder else None
        self.record = RankProgress(rank=rank, pid=os.getpid())

    @classmethod
    def from_environment(cls, rank: int) -> ProgressFile:
        """The record its launcher watches (`MUSEBENCH_PROGRESS_DIR`), else one that goes nowhere."""
        return cls(os.environ.get(PROGRESS_DIR_ENV) or None, rank)

    def update(self, **fields) -> None:
        """Replace the record: the fields given change, the others stay; `error` resets unless given."""
        fields.setdefault("error", None)
        self.record = replace(self.record, seq=self.record.seq + 1, **fields)
        if self.path is None:
            return
        staging = self.path.with_name(f".{self.path.name}.tmp")
        with contextlib.suppress(OSError):  # progress is diagnostics: it never fails the rank
            staging.write_text(json.dumps(asdict(self.record)))
            os.replace(staging, self.path)


def read_progress(folder: str | os.PathLike[str]) -> dict[int, RankProgress]:
    """Every rank's latest record in `folder` (ranks that wrote none are absent)."""
    records: dict[int, RankProgress] = {}
    for path in Path(folder).glob("rank-*.json"):
        try:
            record = RankProgress(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):  # replaced meanwhile: the next poll reads it
            continue
        records[record.rank] = record
    return records


def records_to_json(records: Mapping[int, RankProgress]) -> dict:
    """Records as JSON-ready dicts keyed by rank (what a node's launcher shares with the others)."""
    return {str(rank): asdict(record) for rank, record in records.items()}


def records_from_json(data: Mapping[str, dict]) -> dict[int, RankProgress]:
    return {int(rank): RankProgress(**fields) for rank, fields in data.items()}


def _ranks(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


class Watch:
    """When each of `tp` ranks last made progress, on this clock (`time.monotonic`), and whether
    the job has stalled (see the module docstring)."""

    def __init__(self, tp: int, timeout_s: float, startup_s: float, now: float | None = None,
                 place: Callable[[Sequence[int]], str] | None = None) -> None:
        self.tp, self.timeout_s, self.startup_s = tp, timeout_s, startup_s
        self.place = place  # where ranks sit, e.g. " on node 1 (host b)" (a launch of several nodes)
        self.started = time.monotonic() if now is None else now
        self.records: dict[int, RankProgress] = {}
        self.seen: dict[int, float] = {}  # rank -> when its latest record was first observed

    def observe(self, records: Mapping[int, RankProgress], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for rank, record in records.items():
            old = self.records.get(rank)
            if old is None or record != old:
                self.records[rank] = record
                self.seen[rank] = now

    def _promise_open(self, rank: int, now: float) -> bool:
        record = self.records.get(rank)
        if record is None:
            return now - self.started <= self.startup_s
        bound = WAIT_GRACE_S if record.bound_s is None else record.bound_s
        return now - self.seen[rank] <= bound

    def _named_by_evidence(self, now: float) -> set[int]:
        """Ranks peers timed out waiting for that are still in the call the peers gave up in,
        silent for longer than the poll timeout and the evidence grace."""
        named = set()
        for peer in self.records.values():
            if peer.phase not in WAITING:
                continue
            for rank in peer.waiting_for():
                record = self.records.get(rank)
                if (record is not None and record.phase == "call" and (record.case, record.call) == (peer.case, peer.call)
                        and now - self.seen[rank] > self.timeout_s + EVIDENCE_GRACE_S):
                    named.add(rank)
        return named

    def stalled(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if self._named_by_evidence(now):
            return True
        working = [rank for rank in range(self.tp) if rank not in self.records or self.records[rank].phase not in WAITING]
        # while some ranks work, the waiting ones wait for them: only the workers' promises count
        return not any(self._promise_open(rank, now) for rank in (working or range(self.tp)))

    def blame(self, now: float | None = None) -> str:
        """One line: the rank(s) that stopped making progress, where, and what the others did."""
        now = time.monotonic() if now is None else now
        silent = [rank for rank in range(self.tp) if rank not in self.records]
        culprits = sorted(self._named_by_evidence(now))
        if not culprits:
            accusers = {rank for record in self.records.values() if record.phase in WAITING
                        for rank in record.waiting_for()}
            culprits = sorted(rank for rank in accusers
                              if rank in self.records and self.records[rank].phase not in WAITING)
        if not culprits and silent:
            culprits = silent
        if not culprits:  # whoever's own promise ran out while the others waited
            culprits = sorted(rank for rank, record in self.records.items()
                              if record.phase not in WAITING and not self._promise_open(rank, now))
        if not culprits:  # every rank waits: the least advanced ones
            lowest = min(record.position() for record in self.records.values())
            culprits = sorted(rank for rank, record in self.records.items() if record.position() == lowest)
        if len(culprits) == self.tp:
            where = sorted({self.records[r].where() if r in self.records else "startup" for r in culprits})
            return f"every rank stopped making progress ({'; '.join(where)})"
        line = f"{_ranks(culprits)}{self.place(culprits) if self.place else ''} stopped making progress in " + "; ".join(
            (f"rank {r}: " if len(culprits) > 1 else "")
            + (f"{self.records[r].where()}, silent for {now - self.seen[r]:.1f}s" if r in self.records
               else f"startup (no progress reported in {now - self.started:.1f}s)")
            for r in culprits)
        others = [rank for rank in range(self.tp) if rank not in culprits]
        accusing = [rank for rank in others if rank in self.records
                    and self.records[rank].waiting_for() & set(culprits)]
        if accusing:
            line += f"; {_ranks(accusing)} timed out waiting for {'it' if len(culprits) == 1 else 'them'}"
        rest = [rank for rank in others if rank not in accusing]
        if rest:
            places = sorted({self.records[r].where() if r in self.records else "startup" for r in rest})
            line += f"; {_ranks(rest)} {'was' if len(rest) == 1 else 'were'} in {'; '.join(places)}"
        return line
