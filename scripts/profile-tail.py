"""Launch the EP tail's kernels and the stock finalize eagerly, for a profiler to time kernel by kernel.

Run under Nsight Compute on a GPU machine (the evidence script's bench part does, where `ncu`
reads the counters):

    ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/profile-tail.py

Why: on two H200s (one rank per GPU, `bench tail --launcher torchrun`) the EP publisher alone
takes 3.8-4.9 µs a call and the stock finalize 3.1-3.2 µs, though the publisher's arithmetic is
the finalize's plus the stores to the peers. Kernel durations say how much of that gap is inside
the GPU. Paths, for m = 1 and 8, BF16 weights, weight before the norm, two virtual ranks on this
GPU: the stock finalize of rank 0 (`stock.triton_finalize`), rank 0's publisher alone, and one
whole call of both ranks (publishers first, then the reductions, so a profiler that serialises
kernels never runs a reduction before the publisher it waits for). Each path prints a marker line
before its launches so the profiler's report can be read in order; the mailboxes are re-armed
between paths.
"""

from __future__ import annotations

import torch

from musebench.harness.cases import TailCase, make_tail_inputs
from musebench.harness.driver import RunOptions, bind_tail, device_mailboxes
from musebench.stock.triton_finalize import triton_finalize

LAUNCHES = 3  # per path and m, after one warm-up launch
TP = 2


def main() -> None:
    device = torch.device("cuda")
    options = RunOptions(backend="cute", launcher="virtual", timeout_s=2.0)
    for tokens in (1, 8):
        case = TailCase(mode="ep", tp=TP, tokens=tokens, weight_dtype="bf16", norm="before", inputs="random")
        inputs = make_tail_inputs(case)
        boxes = device_mailboxes(("ep",), TP, case.tokens, case.width, case.top_k)
        tails = [bind_tail(case, rank, boxes[rank], inputs, options) for rank in range(TP)]
        unfinalized = [u.to(device) for u in inputs.per_rank]
        outs = [torch.empty(tokens, case.width, dtype=torch.bfloat16, device=device) for _ in range(TP)]
        norm_weight = inputs.norm_weight.to(device)
        streams = [torch.cuda.Stream(device) for _ in range(TP)]

        def finalize() -> None:
            triton_finalize(unfinalized[0], norm_weight, outs[0], eps=case.eps, gain_center=case.gain_center,
                            weight_before_norm=case.weight_before_norm)

        def publisher() -> None:
            tails[0].run_publisher(unfinalized[0], outs[0])

        def whole_call() -> None:
            for rank in range(TP):
                with torch.cuda.stream(streams[rank]):
                    tails[rank].run_publisher(unfinalized[rank], outs[rank])
            for rank in range(TP):
                with torch.cuda.stream(streams[rank]):
                    tails[rank].run_reduce(outs[rank])

        for name, call in (("finalize", finalize), ("publisher", publisher), ("publishers, then reductions", whole_call)):
            for launch in range(LAUNCHES + 1):  # the first compiles and loads outside the count
                if launch == 1:
                    print(f"== {name}, m = {tokens}: {LAUNCHES} launches", flush=True)
                call()
                torch.cuda.synchronize()
                for box in boxes:
                    box.device_ep.reset()
        for tail in tails:
            tail.check_fault()


if __name__ == "__main__":
    main()
