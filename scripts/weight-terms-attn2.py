"""attn2 with P as one BF16 term against the deployment's two, side by side in one run: time and
accuracy (an experiment: `Attn2Build.weight_terms`).

    python3 scripts/weight-terms-attn2.py [--tp 8,16] [--lengths 8192,32768,131072]
        [--families random,large,equal,tiny] [--json PATH]

Why: the split kernel is bound by its own work an SM (records/2026-12-02-h200-4426823-trace-attn2-
rows.json: about 6.7 pages a microsecond an SM at tp 8 and 16), and P V with P = p_hi + p_lo (two
BF16 terms, P V near FP32) is two thirds of its tensor-core work. `weight_terms` 1 multiplies V by
p_hi = RN(p) alone, as FlashAttention rounds P: half the P V MMAs and the p_lo arithmetic gone, other
bits (no CPU model). Whether that may ship depends on the issue's accuracy contract: attn2's max and
mean error (BF16 ULPs of the FP64 reference) each at most the stock's on the same inputs.

Per (tp, L, family; max_model_len 131072, no window, rank 0's KV heads): CUDA-graph medians of the
deployment (weight_terms 2) and of weight_terms 1 (`harness.measure.graph_median_us`, the benches'
timing), and each one's error against the FP64 reference (`stock.attn2.attn2_reference`) beside the
stock's (`stock.attn2.stock_attn2`: SDPA flash, then the Triton gate's arithmetic), with the issue's
verdict (`cases.attn2.accuracy_verdict`, the case's own: no NaN or inf where the reference is
finite, and max and mean error `UlpError.within` the stock's). One line per point; `--json` writes
them. Exit 2 on a bad option (naming the values it takes) or without a GPU, before any GPU work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MAX_MODEL_LEN = 131072  # the bench's deployment (`bench attn --max-model-len`)


def _refuse(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def _csv(text: str, allowed, names: str, what: str) -> tuple[int, ...]:
    """Comma-separated ints, each `allowed(v)`, each once; exit 2 otherwise, the message naming
    `names` (the values `allowed` takes)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        values = ()
    if not values or not all(allowed(v) for v in values) or len(set(values)) != len(values):
        _refuse(f"{what}: {text!r} is not a comma list of {names}, each once")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="8,16", help="16, 8, 4, 2")
    parser.add_argument("--lengths", default="8192,32768,131072", help="request lengths L, 8 .. 131072")
    parser.add_argument("--families", default="random", help="attn2 input families (cases.attn2_inputs)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from musebench.cases.attn2 import TPS, accuracy_verdict
    from musebench.cases.attn2_inputs import INPUT_FAMILIES

    tps = _csv(args.tp, lambda v: v in TPS, ", ".join(str(tp) for tp in sorted(TPS, reverse=True)), "--tp")
    lengths = _csv(args.lengths, lambda v: 8 <= v <= MAX_MODEL_LEN, f"lengths in [8, {MAX_MODEL_LEN}]", "--lengths")

    families = [f for f in args.families.split(",") if f]
    if not families or any(f not in INPUT_FAMILIES for f in families) or len(set(families)) != len(families):
        _refuse(f"--families: {args.families!r}: a comma list of distinct {', '.join(INPUT_FAMILIES)}")
    if args.calls < 1 or args.replays < 1:
        _refuse("--calls and --replays must be >= 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        _refuse(f"--json: the folder of {args.json!r} does not exist")

    import torch

    if not torch.cuda.is_available():
        _refuse("weight-terms-attn2.py needs a CUDA GPU (sm_90a: weight_terms 1 is wgmma's); none is visible")

    from musebench import attn2_layout as lay
    from musebench.cases.attn2_inputs import for_rank, make_problem
    from musebench.harness.measure import BenchOptions, graph_median_us
    from musebench.kernels import attn2
    from musebench.stock.attn2 import attn2_reference, stock_attn2, ulp_error

    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    bench = BenchOptions(calls=args.calls, replays=args.replays)
    rows = []
    for tp in tps:
        for length in lengths:
            for family in families:
                p = for_rank(make_problem(family, length, MAX_MODEL_LEN), 0, tp).to(device)
                splits = lay.splits(p.max_model_len, p.window, p.num_kv_heads)
                workspace = torch.empty(max(16, lay.workspace_bytes(1, p.num_kv_heads, splits)), dtype=torch.uint8,
                                        device=device)
                _, exact = attn2_reference(p)
                stock = stock_attn2(p)
                stock_error = ulp_error(stock, exact)
                row = dict(tp=tp, L=length, family=family,
                           stock_max_ulp=round(stock_error.max, 4), stock_mean_ulp=round(stock_error.mean, 6))
                for terms in (2, 1):
                    out = torch.full_like(p.q, float("nan"))

                    def call(out=out, terms=terms) -> None:
                        attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace,
                                     max_model_len=p.max_model_len, window=p.window, weight_terms=terms)

                    us = graph_median_us(call, stream, bench)
                    torch.cuda.synchronize()
                    error = ulp_error(out, exact)
                    _, within_stock = accuracy_verdict(out, stock, exact)
                    row.update({f"terms{terms}_us": round(us, 2), f"terms{terms}_max_ulp": round(error.max, 4),
                                f"terms{terms}_mean_ulp": round(error.mean, 6),
                                f"terms{terms}_nonfinite": error.nonfinite,
                                f"terms{terms}_within_stock": within_stock})
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
