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

from musebench.cases import ep_tail
from musebench.comm import mailboxes
from musebench.harness.case import RunOptions
from musebench.cases.tail_inputs import TailCase
from musebench.harness.driver import load_impl

LAUNCHES = 3  # per path and m, after one warm-up launch
TP = 2


def main() -> None:
    device = torch.device("cuda")
    options = RunOptions(backend="cute", launcher="virtual", timeout_s=2.0)
    impl = load_impl(options)
    for tokens in (1, 8):
        case = TailCase(mode="ep", tp=TP, tokens=tokens, weight_dtype="bf16", norm="before", inputs="random")
        inputs = ep_tail.make_inputs(case)
        boxes = mailboxes.allocate_virtual(ep_tail.mailboxes(case, case.tokens), TP, "local")
        runners = [ep_tail.bind(case, impl, rank, boxes[rank], inputs, options) for rank in range(TP)]
        finalize = ep_tail.baselines(case, inputs, 0, runners[0], None)["finalize"].call
        publisher = runners[0].parts()["publisher"]
        streams = [torch.cuda.Stream(device) for _ in range(TP)]

        def whole_call() -> None:
            for rank in range(TP):
                with torch.cuda.stream(streams[rank]):
                    runners[rank].parts()["publisher"]()
            for rank in range(TP):
                with torch.cuda.stream(streams[rank]):
                    runners[rank].tail.run_reduce(runners[rank].outputs["out"])

        for name, call in (("finalize", finalize), ("publisher", publisher), ("publishers, then reductions", whole_call)):
            for launch in range(LAUNCHES + 1):  # the first compiles and loads outside the count
                if launch == 1:
                    print(f"== {name}, m = {tokens}: {LAUNCHES} launches", flush=True)
                call()
                torch.cuda.synchronize()
                for rank_boxes in boxes:
                    mailboxes.reset(rank_boxes)
        for runner in runners:
            runner.check_fault()


if __name__ == "__main__":
    main()
