"""Launch the deployed QKV front (no tap, PDL) eagerly, per N, token count and L2 state, for a
profiler to read launch by launch.

Why: `bench front` replays one layer's weight, so at N 1152 and 2304 (18.9 / 37.7 MB, inside the
H200's 50 MB L2) the graph medians may stream the weight from L2, and their slope (2.9 µs for
18.9 MB) is above HBM's bandwidth: a fixed cost of about 4 µs a launch is suspected. The counters
below say, per configuration, how long the launch takes, how many bytes come from DRAM and from
L2, how busy the SMs are and why their warps stall.

Configurations, in this order: N = 1152, 2304, 4608 (`--n`), tokens 1 and 16 (`--tokens`), and the
weight `warm` (the same weight every launch: L2-resident where it fits) or `cold` (launch j reads
copy j mod C of C >= 4 x 50 MB / size copies, so the copy a launch reads was last touched
C - 1 launches, >= 200 MB of weight, ago; C = 13, 7, 4). A warm configuration runs one warm-up launch, a cold
one a pass over all its copies, then LAUNCHES counted launches; a marker line before them gives
their 0-based indices among this script's QKV front launches: the `--launch-skip` of the first.

Nsight Compute (GPU machine; `--cache-control none`, or ncu flushes every cache before each
launch and every configuration reads cold; `--clock-control none`: the bench's clocks):

    # every launch's duration, DRAM and L2 bytes and throughput
    ncu --cache-control none --clock-control none --kernel-name regex:QkvFront \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
    lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct \\
        python3 scripts/profile-qkv-front.py

    # one launch (the first counted launch of N 2304, 1 token, cold: the index its marker prints),
    # where the time goes: warps active, issue activity, every stall reason, instructions executed
    ncu --cache-control none --clock-control none --kernel-name regex:QkvFront \\
        --launch-skip SKIP --launch-count 1 \\
        --metrics gpu__time_duration.sum,sm__warps_active.avg.per_cycle_active,\\
    sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,\\
    sm__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
    lts__throughput.avg.pct_of_peak_sustained_elapsed,regex:smsp__warp_issue_stalled_.*_per_warp_active.pct \\
        python3 scripts/profile-qkv-front.py --n 2304 --tokens 1 --l2 cold

    # the same launch, Nsight Compute's sections (source-level stalls need --import-source yes
    # and a cubin with line info: not built here)
    ncu --cache-control none --clock-control none --kernel-name regex:QkvFront --launch-skip SKIP \\
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section Occupancy --section LaunchStats \\
        python3 scripts/profile-qkv-front.py --n 2304 --tokens 1 --l2 cold

`--loads-only` launches the same configurations with the timing probe (`kernels.qkv_front`
`compile_qkv_front(loads_only=True)`: the weight stream, its waits and barriers, the cluster's
reduction and the epilogue without any MMA; its outputs are not the projection), so that the
same counters say what the stream and the fixed phases cost without the arithmetic.

`--list` prints the configurations and their launch indices without a GPU. The inputs are random
(x N(0, 1), weights N(0, 1/8192), a random table, slots 0 .. T - 1): nothing is checked here
(`musebench front` and the GPU tests check the bits).
"""

from __future__ import annotations

import argparse
import math
import sys

SIZES = (1152, 2304, 4608)  # N per rank: tp 16, 8, 4
TOKENS = (1, 16)
L2_STATES = ("warm", "cold")
LAUNCHES = 3  # counted launches per configuration
L2_BYTES = 50 * 1024 * 1024  # the H200's L2
COLD_FACTOR = 4  # a cold launch's copy was last read >= this many L2s of weight ago
HIDDEN = 8192
MAX_POS = 4096


def weight_bytes(n: int) -> int:
    return n * HIDDEN * 2


def cold_copies(n: int) -> int:
    """Copies of the weight a cold configuration rotates through: >= COLD_FACTOR x L2 between two
    reads of one copy (13, 7, 4 for N = 1152, 2304, 4608)."""
    return math.ceil(COLD_FACTOR * L2_BYTES / weight_bytes(n)) + 1


def plan(sizes, tokens, states) -> list[tuple[int, int, str, int, int]]:
    """(N, T, state, warm-up launches, index of the first counted launch) per configuration."""
    rows, index = [], 0
    for n in sizes:
        for t in tokens:
            for state in states:
                warmups = 1 if state == "warm" else cold_copies(n)
                rows.append((n, t, state, warmups, index + warmups))
                index += warmups + LAUNCHES
    return rows


def _parse(text: str, allowed: tuple, what: str, kind=int) -> tuple:
    try:
        values = tuple(kind(v) for v in text.split(",") if v)
    except ValueError:
        sys.exit(f"{what}: not a comma list of {kind.__name__}: {text!r}")
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        print(f"{what}: {bad or values} not among {allowed}", file=sys.stderr)
        sys.exit(2)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default=",".join(map(str, SIZES)), help="N per rank: 1152, 2304, 4608")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts, 1..16")
    parser.add_argument("--l2", default=",".join(L2_STATES), help="warm, cold or both")
    parser.add_argument("--list", action="store_true", help="print the plan (launch indices) and exit")
    parser.add_argument("--loads-only", action="store_true",
                        help="the timing probe: the stream and fixed phases without the MMAs (not the projection)")
    args = parser.parse_args()
    sizes = _parse(args.n, SIZES, "--n")
    tokens = _parse(args.tokens, tuple(range(1, 17)), "--tokens")
    states = _parse(args.l2, L2_STATES, "--l2", str)
    rows = plan(sizes, tokens, states)
    if args.list:
        for n, t, state, warmups, first in rows:
            print(f"N {n} T {t} {state}: {warmups} warm-up launches, counted launches {first}..{first + LAUNCHES - 1}")
        return

    import torch

    from musebench import cute_ops
    from musebench.kernels import qkv_front

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90a / sm_100a)", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    angles = torch.randn(MAX_POS, 32, generator=g, device=device)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).float().contiguous()
    for n in sizes:
        kv = n // 1152
        copies = cold_copies(n) if "cold" in states else 1
        weights = [(torch.randn(n, HIDDEN, generator=g, device=device) * HIDDEN ** -0.5).bfloat16()
                   for _ in range(copies)]
        cache = torch.zeros(8, kv, 16, 128, dtype=torch.bfloat16, device=device)
        for t in tokens:
            x = torch.randn(t, HIDDEN, generator=g, device=device).bfloat16()
            positions = torch.randint(0, MAX_POS, (t,), generator=g, device=device)
            slots = torch.arange(t, device=device)
            out = torch.empty(t, n, dtype=torch.bfloat16, device=device)
            for n_, t_, state, warmups, first in rows:
                if (n_, t_) != (n, t):
                    continue
                rotation = len(weights) if state == "cold" else 1
                for launch in range(warmups + LAUNCHES):  # the warm-ups compile, load and set the L2 state
                    if launch == warmups:
                        print(f"== qkv_front{' loads only' if args.loads_only else ''} N {n} T {t} {state} (weight {weight_bytes(n) / 1e6:.1f} MB"
                              f"{f', {rotation} copies' if state == 'cold' else ''}): {LAUNCHES} launches, "
                              f"indices {first}..{first + LAUNCHES - 1} (--launch-skip {first})", flush=True)
                    if args.loads_only:
                        qkv_front.launch(x, weights[launch % rotation], positions, cos_sin, slots, cache, out,
                                         loads_only=True)
                    else:
                        cute_ops.launch_qkv_front(x, weights[launch % rotation], positions, cos_sin, slots, cache, kv,
                                                  out)
                    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
