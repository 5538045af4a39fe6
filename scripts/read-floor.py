"""The read floor: what a plain HBM read of a kernel's byte count costs on this GPU, timed as the
benches time (CUDA-graph medians of back-to-back launches), cold and warm.

Why: issues 15 (attn2) and 16 (qkv_front) set goals against bytes / 4.2 TB/s, and both kernels
stream at 60-65 % of DRAM peak. The best plain read of exactly those bytes, timed the same way,
says whether a goal is reachable and how far each kernel is from the hardware.

Byte counts (`--bytes`, plain ints, multiples of 16): 18874368, 37748736, 75497472 (qkv_front's
weight at N 1152 / 2304 / 4608 x 8192 x 2 B) and 33554432, 67108864 (attn2's K + V at 128k with
one and two KV heads). States (`--states`):
- cold: every call of the graph reads its own copy of the bytes (--calls copies, the rotation of
  `bench front --cold-weights`): between two reads of a copy lie --calls - 1 other copies, at
  least COLD_L2_FACTOR x the 50 MiB L2 of traffic (fewer calls exit 2: `check_cold_calls`);
- warm: every call reads the same buffer (L2-resident where it fits).

Readers, each checked after its replays: its partials (sums) are zeroed after the warm-up and
capture, before the first replay, so the check reads what the last replay's launches wrote, one
launch a copy; a reader that skips bytes, or whose captured launches write nothing, fails the run
(exit 1):
- triton: `musebench.stock.read_floor`'s persistent streaming read (`FloorRead.over` the copies,
  `triton_read`): `programs_per_sm` x SMs programs (`reader_programs`) stride the buffer's int32 words in chunks of loads_in_flight x
  num_warps x 32 x 4 words (each thread issues loads_in_flight 16-byte loads a chunk, all in
  flight before their adds), add them into an int32 vector and write one wrapped int32 sum per
  program; the wrapped sum of a copy's partials must equal the copy's int32 words summed mod 2^32
  (`check_partials`). Every configuration of --programs-per-sm x --loads-in-flight x --num-warps
  is timed; the best (lowest median) per (bytes, state) is marked. The benches' `read floor`
  columns use one of them, `read_floor.FLOOR_CONFIG`, chosen from this sweep.
- torch: `torch.sum(words, dtype=torch.int64)` over the int32 view (`TORCH_READER`): torch's own
  reduction, reading every byte once; its int64 result must equal the copy's sum exactly.

Timing: `harness.measure.graph_median_us`, the benches' method: an eager warm-up (Triton compiles
there, outside the capture), --calls launches captured in one CUDA graph, warm replays, then
--replays timed replays; per launch the median (replay / calls), min and max over the replays, in
µs, the GB/s of the median and its ratio to the roofline (bytes / 4.2 TB/s). The graph's empty
launch (`bench_empty_kernel`) is reported beside, the floor every launch sits on.

    python3 scripts/read-floor.py [--bytes 18874368,67108864] [--states cold,warm] [--calls 20] \\
        [--replays 20] [--programs-per-sm 1,2,4,8] [--loads-in-flight 1,2,4,8] [--num-warps 4,8] [--json PATH]

Prints one line per (bytes, state, reader configuration), then the best per (bytes, state);
--json writes every number, the GPU, its SM count, torch and Triton versions and
MUSEBENCH_GIT_COMMIT. Every option is checked before the GPU is touched (exit 2 with the reason);
without a CUDA GPU or Triton it exits 2 naming what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from musebench.cases.attn2 import ROOFLINE_BYTES_PER_S  # the issues' HBM read bandwidth, 4.2 TB/s
from musebench.cases.qkv_front import COLD_L2_FACTOR, L2_BYTES, WeightRotation, check_cold_calls
from musebench.stock.read_floor import (WORD_BYTES, FloorRead, ReaderConfig, check_nbytes, check_partials,
                                        words_total)

DEFAULT_BYTES = (18874368, 37748736, 75497472, 33554432, 67108864)
STATES = ("cold", "warm")
DEFAULT_PROGRAMS_PER_SM = (1, 2, 4, 8)
DEFAULT_LOADS_IN_FLIGHT = (1, 2, 4, 8)
DEFAULT_NUM_WARPS = (4, 8)
POWERS_OF_TWO_TO_16 = (1, 2, 4, 8, 16)  # Triton's block must be a power of two
MAX_PROGRAMS_PER_SM = 32
TORCH_READER = "torch.sum(int32 view, dtype=torch.int64)"


@dataclass(frozen=True)
class Plan:
    """The checked options: what to read, how, and how to time it."""

    sizes: tuple[int, ...]
    states: tuple[str, ...]
    configs: tuple[ReaderConfig, ...]
    calls: int
    replays: int
    json_path: str | None


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """A comma list of plain positive ints, each once (ValueError naming `what` otherwise)."""
    pieces = [p.strip() for p in text.split(",") if p.strip()]
    if not pieces:
        raise ValueError(f"{what}: give at least one value")
    bad = [p for p in pieces if not p.isdigit()]
    if bad:
        raise ValueError(f"{what}: {bad[0]!r} is not a plain positive int (no suffixes, no decimals)")
    values = tuple(int(p) for p in pieces)
    if 0 in values:
        raise ValueError(f"{what}: 0 is not a positive int")
    if len(set(values)) != len(values):
        raise ValueError(f"{what}: name each value once")
    return values


def parse_states(text: str) -> tuple[str, ...]:
    states = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in states if s not in STATES]
    if not states or bad or len(set(states)) != len(states):
        raise ValueError(f"--states: {bad or list(states)} is not a list of {', '.join(STATES)}, each once")
    return states


def check_options(args: argparse.Namespace) -> Plan:
    """Every option checked (ValueError with the reason) before anything touches a GPU."""
    sizes = parse_ints(args.bytes, "--bytes")
    for nbytes in sizes:
        try:
            check_nbytes(nbytes)
        except ValueError as e:
            raise ValueError(f"--bytes: {e}") from None
    states = parse_states(args.states)
    per_sm = parse_ints(args.programs_per_sm, "--programs-per-sm")
    if max(per_sm) > MAX_PROGRAMS_PER_SM:
        raise ValueError(f"--programs-per-sm: at most {MAX_PROGRAMS_PER_SM}, got {max(per_sm)}")
    loads = parse_ints(args.loads_in_flight, "--loads-in-flight")
    warps = parse_ints(args.num_warps, "--num-warps")
    for what, values in (("--loads-in-flight", loads), ("--num-warps", warps)):
        bad = [v for v in values if v not in POWERS_OF_TWO_TO_16]
        if bad:
            raise ValueError(f"{what}: {bad[0]} is not one of {POWERS_OF_TWO_TO_16} (Triton's block is a power of two)")
    if args.calls < 1 or args.replays < 1:
        raise ValueError(f"--calls and --replays must be >= 1, got {args.calls} and {args.replays}")
    if "cold" in states:
        for nbytes in sizes:
            check_cold_calls(nbytes, args.calls, f"--states cold reads one copy per call of the graph, --bytes {nbytes}")
    if args.json is not None:
        folder = pathlib.Path(args.json).resolve().parent
        if not folder.is_dir():
            raise ValueError(f"--json: the folder {folder} does not exist")
    configs = tuple(ReaderConfig(p, lif, w) for p in per_sm for lif in loads for w in warps)
    return Plan(sizes, states, configs, args.calls, args.replays, args.json)


def gb_per_s(nbytes: int, us: float) -> float:
    """Bytes per µs as GB/s (10^9 B/s)."""
    return nbytes / us / 1e3


def roofline_us(nbytes: int) -> float:
    """The issues' roofline: `nbytes` at 4.2 TB/s, in µs."""
    return nbytes / ROOFLINE_BYTES_PER_S * 1e6


def timing_row(nbytes: int, state: str, name: str, samples_us: list[float], copies: int,
               config: ReaderConfig | None = None) -> dict[str, Any]:
    """One (bytes, state, reader) row from its replays' µs per launch: median, min, max, the
    median's GB/s and its ratio to the roofline (above 1: slower than 4.2 TB/s). `name` is the
    reader's display name; `config` the Triton reader's (None: the torch reader)."""
    median = statistics.median(samples_us)
    row: dict[str, Any] = dict(bytes=nbytes, state=state, reader="triton" if config is not None else "torch",
                               name=name, copies=copies, us_median=round(median, 3),
                               us_min=round(min(samples_us), 3), us_max=round(max(samples_us), 3),
                               gb_per_s=round(gb_per_s(nbytes, median), 1), roofline_us=round(roofline_us(nbytes), 3),
                               ratio_to_roofline=round(median / roofline_us(nbytes), 3), best=False)
    if config is not None:
        row.update(programs_per_sm=config.programs_per_sm, loads_in_flight=config.loads_in_flight,
                   num_warps=config.num_warps)
    return row


def mark_best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark, per (bytes, state), the Triton row with the lowest median `best`; returns those rows."""
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["bytes"], row["state"])
        if row["reader"] == "triton" and (key not in best or row["us_median"] < best[key]["us_median"]):
            best[key] = row
    for row in best.values():
        row["best"] = True
    return list(best.values())


def record(rows: list[dict[str, Any]], plan: Plan, facts: dict[str, Any]) -> dict[str, Any]:
    """The --json document: the machine's facts, the options, every row and the best rows."""
    return dict(facts, calls=plan.calls, replays=plan.replays, l2_bytes=L2_BYTES, cold_l2_factor=COLD_L2_FACTOR,
                roofline_bytes_per_s=ROOFLINE_BYTES_PER_S, torch_reader=TORCH_READER,
                git_commit=os.environ.get("MUSEBENCH_GIT_COMMIT"), rows=rows,
                best=[r for r in rows if r["best"]])


def line(row: dict[str, Any]) -> str:
    return (f"{row['bytes']:>11} B {row['state']:<4} {row['name']:<44} {row['us_median']:8.2f} µs "
            f"(min {row['us_min']:.2f}, max {row['us_max']:.2f}) {row['gb_per_s']:7.1f} GB/s "
            f"{row['ratio_to_roofline']:.3f} x roofline {row['roofline_us']:.2f} µs")


def read_size(nbytes: int, plan: Plan, stream: Any, generator: Any) -> list[dict[str, Any]]:
    """Time and check every state and reader of `plan` on `nbytes`: random int32 copies (cold:
    --calls of them, one a call; warm: the first) live on the GPU until this returns. Each reader's
    results (partials, sums) are zeroed before its first replay (`before_replays`) and checked
    after its replays: every copy's, as the last replay's launches wrote them."""
    import torch

    from musebench.harness.measure import BenchOptions, graph_median_us

    options = BenchOptions(calls=plan.calls, replays=plan.replays)
    count = plan.calls if "cold" in plan.states else 1
    copies = [torch.randint(-2 ** 31, 2 ** 31, (nbytes // WORD_BYTES,), dtype=torch.int32, device=stream.device,
                            generator=generator) for _ in range(count)]
    totals = [words_total(c) for c in copies]  # exact: <= 2^30 words of magnitude <= 2^31
    rows: list[dict[str, Any]] = []
    for state in plan.states:
        used = len(copies) if state == "cold" else 1
        for config in plan.configs:
            floor = FloorRead.over(copies[:used], totals[:used], config)  # call j reads copy j mod used
            samples: list[float] = []
            graph_median_us(floor, stream, options, before_replays=floor.partials.zero_, samples=samples)
            torch.cuda.synchronize()
            for j in range(used):  # the last replay's writes: every copy's partials
                check_partials(floor.partials[j], totals[j], f"{config.name()}, {nbytes} B {state}, copy {j}")
            rows.append(timing_row(nbytes, state, config.name(), samples, used, config))
            print(line(rows[-1]), flush=True)
        sums = torch.zeros(used, dtype=torch.int64, device=stream.device)
        pick = WeightRotation(list(range(used))).next  # the copy index, as bench front's cold rotation

        def torch_call(sums=sums, pick=pick) -> None:
            j = pick()
            torch.sum(copies[j], 0, dtype=torch.int64, out=sums[j])

        samples = []
        graph_median_us(torch_call, stream, options, before_replays=sums.zero_, samples=samples)
        torch.cuda.synchronize()
        for j in range(used):
            if int(sums[j]) != totals[j]:
                raise RuntimeError(f"{TORCH_READER}, {nbytes} B {state}, copy {j}: {int(sums[j])} != {totals[j]}")
        rows.append(timing_row(nbytes, state, TORCH_READER, samples, used))
        print(line(rows[-1]), flush=True)
    return rows


def measure(plan: Plan) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Time every (bytes, state, reader) of `plan` on the current CUDA GPU; check every reader's
    result after its replays (RuntimeError on a wrong sum). Returns the rows and the machine's facts."""
    import torch
    import triton

    from musebench.harness.measure import BenchOptions, bench_empty_kernel

    device = torch.device("cuda", torch.cuda.current_device())
    properties = torch.cuda.get_device_properties(device)
    sms = properties.multi_processor_count
    stream = torch.cuda.Stream(device)
    facts = dict(gpu=properties.name, sm_count=sms, torch=torch.__version__, triton=triton.__version__,
                 empty_launch_us=round(bench_empty_kernel(BenchOptions(calls=plan.calls, replays=plan.replays)), 3))
    print(f"{properties.name}, {sms} SMs; empty launch {facts['empty_launch_us']:.2f} µs; "
          f"{plan.calls} calls a graph, {plan.replays} replays", flush=True)
    generator = torch.Generator(device=device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for nbytes in plan.sizes:
        rows += read_size(nbytes, plan, stream, generator)
        torch.cuda.empty_cache()  # the copies are gone: the next size's fit
    return rows, facts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", default=",".join(map(str, DEFAULT_BYTES)), help="comma list of byte counts (plain ints)")
    p.add_argument("--states", default=",".join(STATES), help="cold, warm or both")
    p.add_argument("--calls", type=int, default=20, help="launches a graph (cold: one copy each)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--programs-per-sm", default=",".join(map(str, DEFAULT_PROGRAMS_PER_SM)))
    p.add_argument("--loads-in-flight", default=",".join(map(str, DEFAULT_LOADS_IN_FLIGHT)),
                   help="16-byte loads a thread issues a chunk (1, 2, 4, 8, 16)")
    p.add_argument("--num-warps", default=",".join(map(str, DEFAULT_NUM_WARPS)), help="1, 2, 4, 8, 16")
    p.add_argument("--json", default=None, help="write every number here")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        plan = check_options(args)
    except ValueError as e:
        print(f"read-floor.py: {e}", file=sys.stderr)
        sys.exit(2)
    import torch

    if not torch.cuda.is_available():  # after every option's check: those refusals come first
        print("read-floor.py: needs a CUDA GPU; none is visible", file=sys.stderr)
        sys.exit(2)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("read-floor.py: needs Triton (import triton failed)", file=sys.stderr)
        sys.exit(2)
    try:
        rows, facts = measure(plan)
    except RuntimeError as e:
        print(f"read-floor.py: FAIL: {e}", file=sys.stderr)
        sys.exit(1)
    for row in mark_best(rows):
        print(f"best: {line(row)}")
    if plan.json_path is not None:
        with open(plan.json_path, "w") as f:
            json.dump(record(rows, plan, facts), f, indent=1)


if __name__ == "__main__":
    main()
