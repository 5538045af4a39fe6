"""Launch each routing path a few times, eagerly, for a profiler to time kernel by kernel.

Run under Nsight Compute on a GPU machine (the evidence script's routing part does, where `ncu`
reads the counters):

    ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/profile-routing.py

Kernel durations separate what the routing kernel spends inside the GPU from what a graph replay
adds around it (launch, PDL, the drain of the last stores): `musebench bench routing` times the
whole call, this the kernel alone. Paths, for b = 1 and 8, tile 8, rank 0 of tp 8: the kernel
alone, with metadata, the Triton stock, and the Triton stock plus the separate metadata pass.
Each path prints a marker line before its launches so the profiler's report can be read in order.
"""

from __future__ import annotations

import torch

from musebench.cases import routing
from musebench.harness.case import RunOptions
from musebench.harness.driver import load_impl

LAUNCHES = 3  # per path and batch, after one warm-up launch
TILE_N = 8


def main() -> None:
    options = RunOptions(backend="cute", launcher="virtual")
    impl = load_impl(options)
    for tokens in (1, 8):
        case = routing.RoutingCase(tp=8, tokens=tokens, tile_n=TILE_N)
        inputs = routing.make_inputs(case)
        runner = routing.bind(case, impl, 0, {}, inputs, options)
        paths = {"routing": runner.parts()["without metadata"], "routing+metadata": runner.call}
        paths.update({name: baseline.call for name, baseline in routing.baselines(case, inputs, 0, runner, None).items()})
        for name, call in paths.items():
            call()  # compiles and loads outside the profiled launches' count
            torch.cuda.synchronize()
            print(f"== {name}, b = {tokens}: {LAUNCHES} launches", flush=True)
            for _ in range(LAUNCHES):
                call()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
