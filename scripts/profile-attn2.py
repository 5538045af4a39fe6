"""Launch attn2 eagerly, a few times per context length, for a profiler to read kernel by kernel.

Run under Nsight Compute on a GPU machine, for example the durations alone:

    ncu --clock-control none --metrics gpu__time_duration.sum python3 scripts/profile-attn2.py

or where the time goes (warp stall reasons, issue activity, memory throughput) of one launch:

    ncu --clock-control none --section WarpStateStats --section SchedulerStats \
        --section MemoryWorkloadAnalysis --section Occupancy --launch-skip 1 --launch-count 1 \
        python3 scripts/profile-attn2.py --lengths 131072

`--issue mask+lean` (a `SplitIssue` name, optionally `@wgmma` / `@sync`) profiles the split kernel
with other compile-time switches than the deployment's (`kernels.attn2.launch`'s experiment
arguments); the default is the deployment's build, through `cute_ops`. `--loads-only` profiles the
split kernel's page stream alone (`Attn2Build.loads_only`: its ring, copies, waits and barriers,
without MMAs or softmax; the output is not attention): the time the memory side sets, to hold
against the full kernel's, with the deployment's issue setting or `--issue`'s. `--sequential-pages`
lays the request's pages out in logical order (the cache permuted to match, the table the identity:
the same values, the same bits) instead of the bench's shuffled table, so the two runs side by side
say what scattering 4 KB pages over HBM costs.

Why: the bench times a CUDA graph of attn2 calls; it cannot say whether a call is bound by its
HBM stream, by its per-page arithmetic or by its merge. Each length prints a marker line before its
launches. Inputs are the bench's (`cases.attn2_inputs.make_problem`, random family, one request),
this rank's KV heads at `--tp`.
"""

from __future__ import annotations

import argparse
import sys

import torch

from musebench import cute_ops
from musebench.cases.attn2 import OUT, out_rows, runner_for
from musebench.kernels import attn2
from musebench.cases.attn2_inputs import for_rank, make_problem

LAUNCHES = 3  # per length, after one warm-up launch


def in_logical_order(problem):
    """The same request with its cache pages permuted into table order: page i of the new cache is
    the one the table named at i (entries past the request's pages follow, the pool's rest after),
    and the table is the identity. Every page a launch reads holds what it held: the same bits."""
    import dataclasses

    table = problem.page_table[0].long()
    pool = problem.kv_cache.shape[0]
    named = list(dict.fromkeys(table.tolist()))  # first use order, each page once
    taken = set(named)
    rest = [page for page in range(pool) if page not in taken]
    order = torch.tensor(named + rest)
    where = torch.empty(pool, dtype=torch.long)
    where[order] = torch.arange(pool)
    return dataclasses.replace(problem, kv_cache=problem.kv_cache[order].contiguous(),
                               page_table=where[table].int()[None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,32768,131072", help="context lengths L, comma-separated")
    parser.add_argument("--tp", type=int, default=8, help="2, 4, 8 or 16 (8 .. 1 KV heads)")
    parser.add_argument("--issue", default=None, help="a SplitIssue name (auto: the deployment's, all, none, mask+lean, ...), optionally @wgmma|@sync")
    parser.add_argument("--loads-only", action="store_true",
                        help="the split kernel's page stream alone (Attn2Build.loads_only): a timing probe")
    parser.add_argument("--sequential-pages", action="store_true",
                        help="the request's pages in logical order in the cache (table = identity)")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--window", type=int, default=0)
    args = parser.parse_args()
    build = None
    if args.issue or args.loads_only:
        setting, _, ops = (args.issue or "auto").partition("@")
        try:
            build = (attn2.named_issue(setting), attn2.Attn2Build(tensor_ops=ops or None).tensor_ops)
        except ValueError as e:
            sys.exit(f"--issue: {e}")  # exit 1 with the reason, before any GPU work
    if not torch.cuda.is_available():  # after the --issue check: its refusal comes first
        sys.exit("profile-attn2.py: needs a CUDA GPU (sm_90a / sm_100a); none is visible")
    device = torch.device("cuda")
    for length in (int(x) for x in args.lengths.split(",")):
        problem = for_rank(make_problem("random", length, args.max_model_len, args.window), 0, args.tp)
        if args.sequential_pages:
            problem = in_logical_order(problem)
        runner = runner_for(cute_ops, problem, device)
        p = runner.problem

        def call() -> None:
            if build is None:
                runner.call()
            else:
                attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out_rows(runner.outputs[OUT]),
                             runner.workspace, max_model_len=p.max_model_len, window=p.window, issue=build[0],
                             tensor_ops=build[1], loads_only=args.loads_only)

        for launch in range(LAUNCHES + 1):  # the first compiles and loads outside the count
            if launch == 1:
                what = (args.issue or "deployment") + (" loads only" if args.loads_only else "")
                print(f"== attn2 tp {args.tp} L {length} {what}: {LAUNCHES} launches",
                      flush=True)
            call()
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
