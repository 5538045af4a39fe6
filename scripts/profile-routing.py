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

from musebench import config
from musebench.harness.routing import RoutingCase, local_experts, make_routing_inputs, routing_paths
from musebench.kernels.routing import metadata_size, prepare

LAUNCHES = 3  # per path and batch, after one warm-up launch
TILE_N = 8


def main() -> None:
    device = torch.device("cuda")
    prepare()
    offset, count = local_experts(0, 8)
    for tokens in (1, 8):
        logits, bias = (t.to(device) for t in make_routing_inputs(RoutingCase(tp=8, tokens=tokens, tile_n=TILE_N)))
        ids = torch.empty(tokens, config.TOP_K, dtype=torch.int32, device=device)
        weights = torch.empty(tokens, config.TOP_K, dtype=torch.float32, device=device)
        metadata = torch.empty(metadata_size(TILE_N), dtype=torch.int32, device=device)
        paths = routing_paths(logits, bias, ids, weights, metadata, local_expert_offset=offset,
                              num_local_experts=count, tile_n=TILE_N)
        for name, call in paths.items():
            call()  # compiles and loads outside the profiled launches' count
            torch.cuda.synchronize()
            print(f"== {name}, b = {tokens}: {LAUNCHES} launches", flush=True)
            for _ in range(LAUNCHES):
                call()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
