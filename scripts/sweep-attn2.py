"""Time attn2 split plans side by side in one run: CUDA-graph medians per (split count, PDL, tp, L),
with torch SDPA (flash) on the same keys in the same run, and how many output elements of each plan
differ from the first plan's (another merge tree gives other bits: a signal, not a check; the
deployment's plan is checked by tests/kernels/test_attn2_gpu.py).

An experiment, not a bench: `musebench bench attn` times the deployment's plan
(`attn2_layout.splits`); this script picks that plan. Run on a GPU machine:

    python3 scripts/sweep-attn2.py --splits 64,128,256 --lengths 512,8192,32768,131072 --tp 8,16

`--issue none,all,auto` times the split kernel's switches (`kernels.attn2.SplitIssue`: "all",
"none", "auto" (the deployment's, `kernels.attn2.deployment_issue`), or the short names of
`SplitIssue.SHORT_NAMES`, mask / rescale / lean / keys / defer / prefetch, joined by "+"; a setting
may end in @wgmma or @sync) against each other on the same plan; they must not change a bit, so
each point also counts the elements that differ from the first --issue setting of its plan
(`bits_differing_from_first_issue`), and the run exits 1 if any does.

`--splits-per-cta 1,2,auto` times the split kernel with one or two sibling splits a CTA
(`Attn2Build.splits_per_cta`; "auto": the deployment's, `attn2_layout.splits_per_cta`) on the same
plan; the bits must not depend on it, so each point counts the elements that differ from the
first --splits-per-cta value's (`bits_differing_from_first_splits_per_cta`), and KV head 0's output
(rank 0 holds it at every tp) is compared with the first --tp's on the same plan
(`head0_bits_differing_from_first_tp`); the run exits 1 if either is ever non-zero. A value outside
1, 2, auto, or 2 with a one-split plan, exits 2 before any launch.

`--pages-per-step 1,2,auto` times the split kernel whose softmax step takes one or two pages
(`Attn2Build.pages_per_step`; "auto", the default: the deployment's for the plan,
`attn2_layout.pages_per_step`: 2 for split plans without a window) on the same plan; a plan's
values run in ascending order of the pages they take. Two pages a step gives other bits (the max
moves once for two pages), so this axis is not checked: each point reports
`bits_differing_from_pages_per_step_1` (the elements that differ from the point of its setting
that takes 1; null without one) as information only; the other axes' checks are made within one
--pages-per-step value. A value outside 1, 2, auto exits 2 before any launch.

`--ring-stages 8,16,24` times the split kernel's ring depth (`Attn2Build.ring_stages`; "auto", the
default: the deployment's) on the same plan; the ring moves no arithmetic, so each point's output
must equal the first --issue setting's at the first --ring-stages value (counted in
`bits_differing_from_first_issue`, the run exits 1 otherwise). A value outside
`attn2.RING_STAGES_CHOICES` or auto exits 2 before any launch.

`--full-tree` (`Attn2Build.full_tree`: the combine's whole upper tree even where one merge gives its
bits) and `--early-release` (`Attn2Build.early_release`: each kernel releases its dependents right
after its own PDL wait) apply to every point of the run; run the sweep with and without one in the
same lease to compare (each point's `full_tree` and `early_release` say which); their bits are
held to the deployment's by tests/kernels/test_attn2_gpu.py, not by this script. `--early-release`
with a 0 in --pdl, and either flag with a 1 in --splits (no combine), exit 2 before any launch.

`--empty-ctas-stay` (`Attn2Build.empty_ctas_exit` False) keeps every split CTA without pages running
its whole prologue: the baseline of the deployment's early end (the same bits). `--grid-order`
(`Attn2Build.spread_splits` False) runs partial y at grid index y: the baseline of the deployment's
bitrev(y) without a window; with a window, grid order is the deployment's and `--spread-splits`
(`Attn2Build.spread_splits` True) its baseline (the same bits). With a 1 in --splits any of them exits 2,
and the two orders together too.

Prints one line per point (µs per call, K + V GB/s, the roofline at 4.2 TB/s) and, with --json,
writes them as a list of dicts; a dict's `split_order` is the order the point ran ("spread" or
"grid", the flags or the deployment's rule), its `grid_order` and `spread_splits` the flags alone
(since 2026-12-02 session 12: before it, `spread_splits` true was the experiment and false grid order).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from musebench import attn2_layout as lay
from musebench import config
from musebench.cases.attn2 import ROOFLINE_BYTES_PER_S, sdpa_call
from musebench.cases.attn2_inputs import for_rank, make_problem
from musebench.harness.measure import BenchOptions, graph_median_us
from musebench.kernels import attn2
from musebench.stock.attn2 import gather_kv


def _csv(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _axis_names(text: str) -> list[str]:
    """The values of a comma-list option, each named once, at least one (ValueError otherwise)."""
    names = [n for n in text.split(",") if n]
    if not names or len(set(names)) != len(names):
        raise ValueError("name each value once, at least one")
    return names


def _axis_value(name: str, auto, check) -> int:
    """A value of a comma list of 1, 2, auto: "auto" is the deployment's (`auto()`), an int is
    taken as written once `check` accepts it (ValueError for anything else, or what `check`
    refuses)."""
    if name == "auto":
        return auto()
    if not name.isdigit():
        raise ValueError(f"{name!r} is neither an int nor auto")
    check(int(name))
    return int(name)


def _splits_per_cta(name: str, heads: int, splits: int) -> int:
    """A --splits-per-cta value at `heads` KV heads and `splits` splits (`attn2_layout.splits_per_cta`
    for auto; `check_splits_per_cta` refuses what a plan cannot run)."""
    return _axis_value(name, lambda: lay.splits_per_cta(heads, splits), lambda v: lay.check_splits_per_cta(v, splits))


def _pages_per_step(name: str, window: int, splits: int) -> int:
    """A --pages-per-step value for a plan (`attn2_layout.pages_per_step` for auto;
    `check_pages_per_step` refuses what no build runs)."""
    return _axis_value(name, lambda: lay.pages_per_step(window, splits), lay.check_pages_per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", default="64,128,256")
    parser.add_argument("--pdl", default="1", help="1, 0 or 1,0")
    parser.add_argument("--lengths", default="512,8192,32768,131072")
    parser.add_argument("--tp", default="8,16")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--window", type=int, default=0)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--issue", default="all",
                        help="comma list of SplitIssue settings: auto (the deployment's), all, none, or "
                             f"{' / '.join(attn2.SplitIssue.SHORT_NAMES)} joined by +; a setting may end in @wgmma "
                             "or @sync (Attn2Build.tensor_ops; default the target's)")
    parser.add_argument("--splits-per-cta", default="auto", help="comma list of 1, 2, auto (the deployment's)")
    parser.add_argument("--pages-per-step", default="auto",
                        help="comma list of 1, 2, auto (the deployment's: 2 for split plans without a window)")
    parser.add_argument("--ring-stages", default="auto",
                        help="comma list of ring depths (attn2.RING_STAGES_CHOICES) or auto (the deployment's)")
    parser.add_argument("--full-tree", action="store_true",
                        help="the combine's whole upper tree at every point (Attn2Build.full_tree)")
    parser.add_argument("--early-release", action="store_true",
                        help="dependents released right after each kernel's PDL wait (Attn2Build.early_release)")
    parser.add_argument("--empty-ctas-stay", action="store_true",
                        help="split CTAs without pages run their whole prologue (Attn2Build.empty_ctas_exit False: "
                             "the baseline of the deployment's early end) at every point")
    parser.add_argument("--grid-order", action="store_true",
                        help="grid index y runs partial y (Attn2Build.spread_splits False: the baseline of the "
                             "deployment's bitrev(y)) at every point")
    parser.add_argument("--spread-splits", action="store_true",
                        help="grid index y runs partial bitrev(y) (Attn2Build.spread_splits True: the baseline of "
                             "the window plans' grid order) at every point")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        issues = {}
        for name in (n for n in args.issue.split(",") if n):
            setting, _, ops = name.partition("@")
            issues[name] = (attn2.named_issue(setting), attn2.Attn2Build(tensor_ops=ops or None).tensor_ops)
    except ValueError as e:
        print(f"--issue: {e}", file=sys.stderr)
        sys.exit(2)
    if not issues:
        print("--issue: name at least one setting", file=sys.stderr)
        sys.exit(2)
    try:
        per_cta_names = _axis_names(args.splits_per_cta)
        for tp in _csv(args.tp):
            if tp < 1 or config.NUM_KV_HEADS % tp:
                raise ValueError(f"--tp {tp} does not divide the {config.NUM_KV_HEADS} KV heads")
            for splits in _csv(args.splits):
                if not lay.is_power_of_two(splits):
                    raise ValueError(f"--splits {splits} is not a power of two")
                for name in per_cta_names:
                    _splits_per_cta(name, config.NUM_KV_HEADS // tp, splits)
    except ValueError as e:
        print(f"--splits-per-cta: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        per_step_names = _axis_names(args.pages_per_step)
        for name in per_step_names:
            for splits in _csv(args.splits):
                _pages_per_step(name, args.window, splits)
    except ValueError as e:
        print(f"--pages-per-step: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        rings = {n: None if n == "auto" else int(n) if n.isdigit() else n for n in _axis_names(args.ring_stages)}
        for ring in rings.values():
            attn2.Attn2Build(ring_stages=ring)  # refuses what no build takes
    except ValueError as e:
        print(f"--ring-stages: {e}", file=sys.stderr)
        sys.exit(2)
    if args.early_release and 0 in _csv(args.pdl):
        print("--early-release: releases dependents after the PDL wait; --pdl 0 has none to release", file=sys.stderr)
        sys.exit(2)
    if args.empty_ctas_stay and 1 in _csv(args.splits):
        print("--empty-ctas-stay: a one-split plan (--splits 1) has no CTA without pages", file=sys.stderr)
        sys.exit(2)
    if args.grid_order and args.spread_splits:
        print("--grid-order and --spread-splits: one split order at a time", file=sys.stderr)
        sys.exit(2)
    for flag, asked in (("--grid-order", args.grid_order), ("--spread-splits", args.spread_splits)):
        if asked and 1 in _csv(args.splits):
            print(f"{flag}: a one-split plan (--splits 1) has one CTA a KV head: no order", file=sys.stderr)
            sys.exit(2)
    order = False if args.grid_order else True if args.spread_splits else None  # None: the deployment's
    if (args.early_release or args.full_tree) and 1 in _csv(args.splits):
        print("--full-tree / --early-release: a one-split plan (--splits 1) has no combine", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():  # after every option's check: those refusals come first
        print("sweep-attn2.py: needs a CUDA GPU (sm_90a / sm_100a); none is visible", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    bench = BenchOptions(calls=args.calls, replays=args.replays)
    rows = []
    first_tp: dict = {}  # (L, splits, pdl, issue, ring, splits_per_cta name, pages_per_step name): KV head 0, first --tp
    for tp in _csv(args.tp):
        for length in _csv(args.lengths):
            p = for_rank(make_problem("random", length, args.max_model_len, args.window), 0, tp).to(device)
            heads = p.num_kv_heads
            keys, values = gather_kv(p.kv_cache, p.page_table[0].cpu(), length)
            first, _ = lay.visible_keys(length, args.window)
            keys, values = keys[None, :, first:].contiguous(), values[None, :, first:].contiguous()
            q = p.q.view(lay.QUERY_LEN, heads, lay.HEADS_PER_KV_HEAD, lay.HEAD_DIM).permute(1, 2, 0, 3)
            q = q.reshape(1, heads, lay.ROWS_PER_KV_HEAD, lay.HEAD_DIM).contiguous()
            sdpa_us = graph_median_us(sdpa_call(q, keys, values), stream, bench)
            kv_bytes = 2 * keys.numel() * keys.element_size()
            reference = None
            for splits in _csv(args.splits):
                for pdl in _csv(args.pdl):
                    first_issue: dict = {}  # per (splits_per_cta name, pages_per_step name): the first --issue's output
                    first_per_cta: dict = {}  # per (--issue, ring, pages_per_step name): the first --splits-per-cta value's
                    one_page: dict = {}  # per (--issue, ring, splits_per_cta name): the output with 1 page a step
                    per_steps = sorted(((_pages_per_step(n, args.window, splits), n)
                                        for n in per_step_names))
                    for (issue_name, issue), (ring_name, ring) in ((i, r) for i in issues.items()
                                                                   for r in rings.items()):
                        for per_cta_name, (per_step, per_step_name) in ((n, k) for n in per_cta_names
                                                                         for k in per_steps):
                            per_cta = _splits_per_cta(per_cta_name, heads, splits)
                            workspace = torch.empty(max(16, lay.workspace_bytes(1, heads, splits, per_cta)),
                                                    dtype=torch.uint8, device=device)
                            out = torch.full_like(p.q, float("nan"))

                            def call(splits=splits, pdl=pdl, workspace=workspace, out=out, issue=issue,
                                     per_cta=per_cta, per_step=per_step, ring=ring) -> None:
                                attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace,
                                             max_model_len=p.max_model_len, window=p.window, enable_pdl=bool(pdl),
                                             num_splits=splits, issue=issue[0], tensor_ops=issue[1],
                                             splits_per_cta=per_cta, pages_per_step=per_step, ring_stages=ring,
                                             full_tree=args.full_tree, early_release=args.early_release,
                                             empty_ctas_exit=False if args.empty_ctas_stay else None,
                                             spread_splits=order)

                            us = graph_median_us(call, stream, bench)
                            torch.cuda.synchronize()
                            finite = bool(torch.isfinite(out.float()).all())
                            if reference is None:
                                reference = out.clone()
                            first_issue.setdefault((per_cta_name, per_step_name), out.clone())
                            first_per_cta.setdefault((issue_name, ring_name, per_step_name), out.clone())
                            if per_step == 1:
                                one_page[(issue_name, ring_name, per_cta_name)] = out.clone()
                            # KV head 0 (rank 0's first head at every tp): its 8 query heads' columns
                            head0 = out[:, :lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM].clone()
                            tp_key = (length, splits, pdl, issue_name, ring_name, per_cta_name, per_step_name)
                            first_tp.setdefault(tp_key, head0)

                            def differing(a: torch.Tensor, b: torch.Tensor) -> int:
                                return int((a.view(torch.int16) != b.view(torch.int16)).sum())

                            split_order = "spread" if attn2.resolved_spread_splits(order, args.window, splits) \
                                else "grid"
                            row = dict(tp=tp, L=length, splits=splits, pdl=pdl, issue=issue_name, ring_stages=ring_name,
                                       full_tree=args.full_tree, early_release=args.early_release,
                                       empty_ctas_stay=args.empty_ctas_stay, grid_order=args.grid_order,
                                       spread_splits=args.spread_splits,
                                       split_order=split_order,
                                       splits_per_cta=per_cta_name, splits_per_cta_value=per_cta,
                                       pages_per_step=per_step_name, pages_per_step_value=per_step,
                                       ctas=heads * splits // per_cta,
                                       us=round(us, 2), sdpa_us=round(sdpa_us, 2), ratio_to_sdpa=round(us / sdpa_us, 3),
                                       gbps=round(kv_bytes / us / 1e3, 1),
                                       roofline_us=round(kv_bytes / ROOFLINE_BYTES_PER_S * 1e6, 2), finite=finite,
                                       bits_differing_from_first_plan=differing(out, reference),
                                       bits_differing_from_first_issue=differing(out, first_issue[(per_cta_name,
                                                                                                   per_step_name)]),
                                       bits_differing_from_first_splits_per_cta=differing(
                                           out, first_per_cta[(issue_name, ring_name, per_step_name)]),
                                       bits_differing_from_pages_per_step_1=(
                                           differing(out, one_page[(issue_name, ring_name, per_cta_name)])
                                           if (issue_name, ring_name, per_cta_name) in one_page else None),
                                       head0_bits_differing_from_first_tp=differing(head0, first_tp[tp_key]))
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    by_plan: dict = {}
    for r in rows:
        by_plan.setdefault((r["splits"], r["pdl"], r["issue"], r["ring_stages"], r["splits_per_cta"], r["pages_per_step"]),
                           []).append(r["ratio_to_sdpa"])
    for (splits, pdl, issue_name, ring_name, per_cta_name, per_step), ratios in sorted(by_plan.items()):
        print(f"splits {splits} pdl {pdl} issue {issue_name} ring {ring_name} splits_per_cta {per_cta_name} "
              f"pages_per_step {per_step}: "
              f"median attn2/SDPA "
              f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}")
    changed = [r for r in rows if r["bits_differing_from_first_issue"]]
    if changed:
        print(f"FAIL: {len(changed)} points where a SplitIssue setting or ring depth changed bits, first: {changed[0]}",
              file=sys.stderr)
        sys.exit(1)
    for key, what in (("bits_differing_from_first_splits_per_cta", "a splits_per_cta value"),
                      ("head0_bits_differing_from_first_tp", "another tp (KV head 0, the same plan)")):
        changed = [r for r in rows if r[key]]
        if changed:
            print(f"FAIL: {len(changed)} points where {what} changed bits, first: {changed[0]}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
