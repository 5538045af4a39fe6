"""The EP tail's generation protocol (two launches), as a model explored under random schedules.

`musebench.kernels.ep_tail` documents the order each CTA follows; `test_ep_tail_compile.py` checks that
the PTX keeps that order. This model checks the order itself: CTAs of every rank's publisher and
reduction grids take atomic steps in a random interleaving, with the launch rules of PDL (the
reduction may start once every publisher CTA passed its wait; the next publisher waits for the
whole reduction). Across calls of changing m it must hold that every reduction reads exactly
this call's data from every rank, that no store overwrites a slot not yet consumed, that nothing
deadlocks, and that the stage words end as [calls % 3, 0]. Variants that break the protocol (an
advance before every CTA has read NEXT_STAGE, or before the publisher's grid is done) must be
caught, so the model's checks can fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

GENERATIONS = 3
SENTINEL = None
PARTS = 2  # reduction CTAs per token (4 at width 4096; 2 keep the schedules short)


@dataclass
class Rank:
    tp: int
    next_stage: int = 0
    arrivals: int = 0
    slots: dict = field(default_factory=dict)  # (generation, source, token, part) -> value

    def slot(self, key):
        return self.slots.get(key, SENTINEL)


class Violation(AssertionError):
    pass


def _publisher(rank_index: int, call: int, m: int, ranks: list[Rank]):
    """One CTA per token: read NEXT_STAGE after the wait, then store to every rank (one step each)."""
    def cta(token):
        generation = ranks[rank_index].next_stage
        yield
        for target in range(len(ranks)):
            for part in range(PARTS):
                key = (generation, rank_index, token, part)
                if ranks[target].slot(key) is not SENTINEL:
                    raise Violation(f"call {call}: rank {rank_index} overwrote an unconsumed slot {key} of rank {target}")
                ranks[target].slots[key] = (call, rank_index, token, part)
                yield
    return [cta(token) for token in range(m)]


def _reduction(rank_index: int, call: int, m: int, ranks: list[Rank], publisher_done, variant: str):
    """Grid (m, PARTS): thread 0 reads NEXT_STAGE and arrives; poll; consume and re-arm; wait for
    the publisher grid; the last arriver advances."""
    box = ranks[rank_index]
    total = m * PARTS

    def cta(token, part):
        generation = box.next_stage
        if variant == "advance-first" and token == 0 and part == 0:  # the old hand-off without ACTIVE_STAGE
            box.next_stage = (generation + 1) % GENERATIONS
        arrived = box.arrivals
        box.arrivals += 1
        yield
        for source in range(box.tp):
            key = (generation, source, token, part)
            while box.slot(key) is SENTINEL:
                yield "blocked"
            if box.slot(key) != (call, source, token, part):
                raise Violation(f"call {call}: rank {rank_index} read {box.slot(key)} from slot {key}")
        for source in range(box.tp):
            box.slots[(generation, source, token, part)] = SENTINEL  # re-arm what was read
        yield
        if variant != "advance-before-wait":
            while not publisher_done():
                yield "blocked"
        if arrived == total - 1 and variant != "advance-first":
            box.next_stage = (generation + 1) % GENERATIONS
            box.arrivals = 0
        yield

    return [cta(token, part) for token in range(m) for part in range(PARTS)]


@dataclass
class Grid:
    rank: int
    call: int
    kind: str  # "publisher" or "reduction"
    ctas: list


def run_schedule(tp: int, calls: list[int], seed: int, variant: str = "as-built") -> list[Rank]:
    """Every rank runs `calls` (m per call) as publisher then reduction under PDL's launch rules,
    one random CTA step at a time: a publisher launches once the rank's previous reduction is
    complete (its griddepcontrol.wait; nothing else of the previous call is waited for), the
    reduction as soon as its publisher launched (earlier than the early trigger allows)."""
    rng = random.Random(seed)
    ranks = [Rank(tp=tp) for _ in range(tp)]
    grids: list[Grid] = []
    launched = [0] * tp  # calls whose publisher has launched, per rank

    def complete(rank, call, kind):
        return not any(g.rank == rank and g.call == call and g.kind == kind for g in grids)

    def launch(rank):
        call = launched[rank]
        m = calls[call]
        publisher = Grid(rank, call, "publisher", _publisher(rank, call, m, ranks))
        grids.append(publisher)
        done = lambda: publisher not in grids  # noqa: E731 - the reduction's griddepcontrol.wait
        grids.append(Grid(rank, call, "reduction", _reduction(rank, call, m, ranks, done, variant)))
        launched[rank] += 1

    for rank in range(tp):
        launch(rank)
    for _ in range(500_000):
        steps = [(grid, cta) for grid in grids for cta in grid.ctas]
        if not steps:
            return ranks
        rng.shuffle(steps)
        for grid, cta in steps:
            try:
                if next(cta) == "blocked":
                    continue
            except StopIteration:
                grid.ctas.remove(cta)
                if not grid.ctas:
                    grids.remove(grid)
            break
        else:
            raise Violation(f"deadlock: every CTA waits (calls launched {launched})")
        for rank in range(tp):
            previous = launched[rank] - 1
            if launched[rank] < len(calls) and complete(rank, previous, "reduction"):
                launch(rank)
    raise Violation("no end")


CALLS = [1, 3, 2, 2, 3, 1, 2]  # m changes between calls, as in decode


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("tp", [2, 3])
def test_the_protocol_holds_under_random_schedules(tp, seed):
    ranks = run_schedule(tp, CALLS, seed)
    for rank in ranks:
        assert (rank.next_stage, rank.arrivals) == (len(CALLS) % GENERATIONS, 0)
        assert all(value is SENTINEL for value in rank.slots.values()), "every slot re-armed"


@pytest.mark.parametrize("variant", ["advance-first", "advance-before-wait"])
def test_the_model_catches_an_early_advance(variant):
    """An advance before every CTA read NEXT_STAGE, or before the publisher grid is done, breaks
    some schedule: the model's checks can fail."""
    caught = 0
    for seed in range(60):
        try:
            run_schedule(2, CALLS, seed, variant)
        except Violation:
            caught += 1
    assert caught > 0
