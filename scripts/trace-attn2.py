"""Where an attn2 launch spends its time, CTA by CTA: the traced build (`kernels.attn2`,
`Attn2Build.trace`) in a CUDA graph of back-to-back launches, as `musebench bench attn` times them.

    python3 scripts/trace-attn2.py [--tp 8,16] [--lengths 8,8192,131072] [--max-model-len 131072]
        [--window W] [--grid-order | --spread-splits] [--splits N] [--calls 20] [--json PATH]
        [--rows PATH] [--loads-only]

Why: the bench (`musebench bench attn`, CUDA graphs) gives one number a call, and Nsight Compute
the split kernel alone (records/2026-12-02-h200-3407b29-ncu-attn2-pipes.txt), without the PDL
overlap of the graph. The trace says, per CTA, where the rest goes: the split kernel's PDL wait,
its prologue (Q fragments, the page-table prefetch, the ring's first copies issued), its page
chain(s) and its partial write; the combine's PDL wait (the split grid's end), its partial loads
with its group's subtree, the tree above the groups (shuffles, shared memory) and the epilogue;
and when the grids start and end.

Per (tp, L) (the bench's inputs: `cases.attn2_inputs`, random family, one request, rank 0's KV
heads, max_model_len 131072 unless `--max-model-len` names another plan, without a window unless
`--window` names one; the deployment's split order unless `--grid-order` or `--spread-splits` forces
one, each point's `split_order` says which ran):
`--calls` traced launches, each with its own workspace (the partials,
then every CTA's trace row: `attn2.traced_workspace_bytes`), captured in one graph on a side stream
after an eager warm-up (which compiles), replayed twice; the second replay's rows are read. Launch
0 is left out (its predecessor is the previous replay's last launch, or nothing).

Clocks: %globaltimer (ns, shared by every SM) places CTAs in time; %clock64 (cycles, per SM) times
a CTA's phases, converted per kernel at the ratio of the summed cycles to the summed nanoseconds of
every CTA's whole life (no clock-rate guess). Printed per configuration: the launch period and span
(first split entry to last combine end), each kernel's span, the gap from the split grid's last end
to the combine's first post-wait instant (its entry's globaltimer plus its wait in cycles), the
overlap with the previous launch (its last end minus this one's first entry: positive where PDL
overlaps them), each phase's median and max over CTAs (the split kernel's also over the CTAs with
pages only: at L 8 one split of 256 has any), CTAs per SM, the last launch's SMs grouped by their
split CTAs (`sm_loads`: when an SM's last chain ends, the pages it streams a microsecond), and how
the split CTAs sharing an SM fare against each other (`within_sm`: how far apart their prologues
and their chains end, and whether the last prologue ends its chain last).
`--json` writes every number; `--rows` every launch's raw rows (for analyses of their own);
`--loads-only` traces the split kernel's page stream alone (`Attn2Build.loads_only`).
Since 2026-12-02 (session 10) the combine computes its 16 sigmoids before its PDL wait: its
`pdl_wait` phase holds them and its `epilogue` no longer does, so traces before and after that
change differ in those two phases. Since session 11 a split CTA without pages ends after L's load
(`Attn2Build.empty_ctas_exit`): its prologue, chain and write phases are zero-length, so at small L
the medians over every split CTA differ from earlier traces; the `with_pages` ones do not. Since
session 12 split plans without a window run partial bitrev(y) at grid index y
(`attn2_layout.spread_splits`; grid order before): at small L the CTAs with pages sit on other SMs
than in earlier traces, so their prologue and per-SM figures differ.
Exit 2 on a bad option or without a GPU, before any GPU work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

SPLIT_PHASES = (("pdl_wait", "clock_entry", "clock_waited"), ("prologue", "clock_waited", "clock_prologue"),
                ("chain", "clock_prologue", "clock_chained"), ("partial_write", "clock_chained", "clock_written"))
COMBINE_PHASES = (("pdl_wait", "clock_entry", "clock_waited"), ("loads", "clock_waited", "clock_loaded"),
                  ("tree", "clock_loaded", "clock_merged"), ("epilogue", "clock_merged", "clock_end"))
LIFE = {"split": ("clock_entry", "clock_written"), "combine": ("clock_entry", "clock_end")}
TPS = (16, 8, 4, 2)
MAX_MODEL_LEN = 131072  # the bench's deployment (`bench attn --max-model-len`), the default plan


def _refuse(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def _csv(text: str, allowed, what: str) -> tuple:
    """Comma-separated ints, each `allowed(v)`, each once; exit 2 otherwise."""
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        values = ()
    if not values or not all(allowed(v) for v in values) or len(set(values)) != len(values):
        _refuse(f"{what}: {text!r} is not a comma list of {allowed.__doc__}, each once")
    return values


def _tp(v: int) -> bool:
    """16, 8, 4, 2"""
    return v in TPS


def _length(v: int) -> bool:
    """lengths in [8, 131072]"""
    return 8 <= v <= MAX_MODEL_LEN


def _max_model_len(v: int) -> bool:
    """max_model_len in [8, 131072]"""
    return 8 <= v <= MAX_MODEL_LEN


def ratio(rows: list[dict], kernel: str) -> float:
    """Cycles per ns of `kernel`'s rows: summed cycles over summed ns of the CTAs' whole lives."""
    start, end = LIFE[kernel]
    cycles = sum(r[end] - r[start] for r in rows)
    ns = sum(r["globaltimer_end"] - r["globaltimer_entry"] for r in rows)
    return cycles / ns if ns > 0 else float("nan")


def _stats(values: list[float]) -> dict:
    return dict(median_ns=round(statistics.median(values)), max_ns=round(max(values))) if values else {}


def _per_sm(rows: list[dict]) -> list[int]:
    """Each row's SM load: how many of the launch's CTAs of this kernel ran on its SM."""
    count: dict[int, int] = {}
    for r in rows:
        count[r["smid"]] = count.get(r["smid"], 0) + 1
    return [count[r["smid"]] for r in rows]


def sm_loads(split: list[dict], pages: list[int], ratio_split: float) -> dict:
    """One launch's split CTAs grouped by how many of them ran on their SM: per count (as a
    string), the SMs, the median and the max over them of when an SM's last chain ended (ns after
    the launch's first split entry), and the median over them of the pages an SM streamed per
    microsecond of its chains (its CTAs' pages over its first chain start to its last chain end).
    Where the SM, not the CTA, is the unit that runs out: an SM whose work bounds it streams the
    same pages/µs whatever its CTAs (records/2026-12-02-h200-4426823-trace-attn2-rows.json)."""
    first = min(r["globaltimer_entry"] for r in split)
    per_sm: dict[int, list[tuple[float, float, int]]] = {}
    for r, n in zip(split, pages):
        start = r["globaltimer_entry"] - first + (r["clock_prologue"] - r["clock_entry"]) / ratio_split
        end = r["globaltimer_entry"] - first + (r["clock_chained"] - r["clock_entry"]) / ratio_split
        per_sm.setdefault(r["smid"], []).append((start, end, n))
    groups: dict[int, list[tuple[float, float]]] = {}
    for ctas in per_sm.values():
        start, end = min(c[0] for c in ctas), max(c[1] for c in ctas)
        rate = sum(c[2] for c in ctas) / ((end - start) / 1e3) if end > start else 0.0
        groups.setdefault(len(ctas), []).append((end, rate))
    return {str(k): dict(sms=len(v), last_chain_end_ns=_stats([e for e, _ in v]),
                         pages_per_us_median=round(statistics.median(r for _, r in v), 2))
            for k, v in sorted(groups.items())}


def _median_p90(values: list[float]) -> dict:
    """Median and 90th percentile (nearest rank), rounded ns; {} for no values."""
    if not values:
        return {}
    ranked = sorted(values)
    return dict(median_ns=round(statistics.median(ranked)), p90_ns=round(ranked[-(-9 * len(ranked) // 10) - 1]))


def within_sm(launches: list[dict], ratio_split: float) -> dict:
    """How the split CTAs that share an SM (those with pages, two or more on it) fare against each
    other, over every launch and SM: how far apart their prologues and their chains end (ns), and
    how often the CTA whose prologue ended last also ends its chain last. A spread that grows from
    the prologues to the chains, in the same order, is one CTA favored over its neighbours
    (records/2026-12-02-h200-43832c5-attn2-trace.json: at tp 8 128k 0.35 -> 3.1 us, 89 %)."""
    prologue_spreads, chain_spreads, kept = [], [], 0
    for x in launches:
        first = min(r["globaltimer_entry"] for r in x["split"])  # integers until here: ns since it
        per_sm: dict[int, list[tuple[float, float]]] = {}
        for r, pages in zip(x["split"], x["split_pages"]):
            if pages > 0:
                entry = r["globaltimer_entry"] - first
                per_sm.setdefault(r["smid"], []).append(
                    (entry + (r["clock_prologue"] - r["clock_entry"]) / ratio_split,
                     entry + (r["clock_chained"] - r["clock_entry"]) / ratio_split))
        for ctas in per_sm.values():
            if len(ctas) < 2:
                continue
            prologues, chains = [c[0] for c in ctas], [c[1] for c in ctas]
            prologue_spreads.append(max(prologues) - min(prologues))
            chain_spreads.append(max(chains) - min(chains))
            kept += prologues.index(max(prologues)) == chains.index(max(chains))
    if not chain_spreads:
        return {}
    return dict(sm_launches=len(chain_spreads), prologue_end_spread=_median_p90(prologue_spreads),
                chain_end_spread=_median_p90(chain_spreads),
                last_prologue_ends_last=round(kept / len(chain_spreads), 3))


def summarize(launches: list[dict]) -> dict:
    """Launches (dicts: `split` and `combine` row lists of trace dicts, `split_pages` each split
    row's page count) -> phases (ns), spans, gaps, overlaps and SM loads. A launch without a
    combine (one split) has `combine` []. The launches are read, not changed."""
    out: dict = {}
    every = {k: [r for x in launches for r in x[k]] for k in ("split", "combine")}
    ratios = {k: ratio(rows, k) for k, rows in every.items() if rows}
    out["cycles_per_ns"] = {k: round(v, 4) for k, v in ratios.items()}
    for kernel, phases in (("split", SPLIT_PHASES), ("combine", COMBINE_PHASES)):
        if not every[kernel]:
            continue
        table = {name: _stats([(r[end] - r[start]) / ratios[kernel] for r in every[kernel]])
                 for name, start, end in phases}
        if kernel == "split":
            busy = [r for x in launches for r, pages in zip(x["split"], x["split_pages"]) if pages > 0]
            table["with_pages"] = dict(ctas=len(busy) // len(launches), **{
                name: _stats([(r[end] - r[start]) / ratios[kernel] for r in busy]) for name, start, end in phases})
        loads: dict[int, int] = {}
        for x in launches:
            for load in _per_sm(x[kernel]):
                loads[load] = loads.get(load, 0) + 1
        table["ctas_by_ctas_on_the_sm"] = {str(k): v // len(launches) for k, v in sorted(loads.items())}
        if kernel == "split":  # the last launch's SMs by their load (`sm_loads`); how an SM's CTAs fare
            table["sms_by_ctas_on_the_sm"] = sm_loads(launches[-1]["split"], launches[-1]["split_pages"],
                                                      ratios["split"])
            table["within_sm"] = within_sm(launches, ratios["split"])  # against each other (`within_sm`)
        table["ctas"] = len(launches[0][kernel])
        out[kernel] = table
    spans, split_spans, combine_spans, gaps, combine_after_split = [], [], [], [], []
    first_entries, last_ends = [], []  # per launch: its first split entry, its last end (either kernel)
    for x in launches:
        split, combine = x["split"], x["combine"]
        first = min(r["globaltimer_entry"] for r in split)
        split_end = max(r["globaltimer_end"] for r in split)
        last = max(r["globaltimer_end"] for r in split + combine)
        first_entries.append(first)
        last_ends.append(last)
        spans.append(last - first)
        split_spans.append(split_end - first)
        if combine:
            combine_first = min(r["globaltimer_entry"] for r in combine)
            combine_spans.append(max(r["globaltimer_end"] for r in combine) - combine_first)
            waited = min(r["globaltimer_entry"] + (r["clock_waited"] - r["clock_entry"]) / ratios["combine"]
                         for r in combine)
            gaps.append(waited - split_end)
            combine_after_split.append(combine_first - first)

    def med(values: list[float]) -> dict:
        return dict(median=round(statistics.median(values)), max=round(max(values))) if values else {}

    out["launch_span_ns"] = med(spans)
    out["split_span_ns"] = med(split_spans)
    out["combine_span_ns"] = med(combine_spans)
    out["combine_first_entry_after_split_first_entry_ns"] = med(combine_after_split)
    out["gap_split_end_to_combine_waited_ns"] = med(gaps)
    out["overlap_with_previous_ns"] = med([end - entry for end, entry in zip(last_ends, first_entries[1:])])
    out["launch_period_ns"] = med([b - a for a, b in zip(first_entries, first_entries[1:])])
    return out


def _us(ns) -> str:
    return f"{ns / 1e3:.2f}" if isinstance(ns, (int, float)) else "-"


def render(tp: int, length: int, table: dict) -> str:
    """The configuration's lines: the launch's spans and gaps, then each kernel's phases (µs)."""
    def median(key: str) -> str:
        return _us(table[key].get("median"))

    where = "".join(f", {text}" for text in (f"window {table['window']}" if table.get("window") else "",
                                             f"{table['split_order']} order" if "split_order" in table else "") if text)
    lines = [f"tp {tp} L {length}{where}: period {median('launch_period_ns')} µs, span "
             f"{median('launch_span_ns')} (split {median('split_span_ns')}, combine {median('combine_span_ns')}), "
             f"combine entry +{median('combine_first_entry_after_split_first_entry_ns')}, split end -> combine waited "
             f"{median('gap_split_end_to_combine_waited_ns')}, overlap with the previous "
             f"{median('overlap_with_previous_ns')} µs"]
    for kernel, phases in (("split", SPLIT_PHASES), ("combine", COMBINE_PHASES)):
        if kernel not in table:
            continue
        t = table[kernel]
        def phases_text(stats: dict) -> str:
            return "; ".join(f"{name} {_us(stats[name].get('median_ns'))} (max {_us(stats[name].get('max_ns'))})"
                             for name, _, _ in phases)

        text = phases_text(t)
        if kernel == "split":
            text += f" µs; {t['with_pages']['ctas']} CTAs with pages: " + phases_text(t["with_pages"])
        loads = ", ".join(f"{v} CTAs {k} an SM" for k, v in t["ctas_by_ctas_on_the_sm"].items())
        rate = table["cycles_per_ns"][kernel]
        lines.append(f"  {kernel} ({t['ctas']} CTAs; {loads}; {rate:.3f} cycles/ns): {text} µs")
        if "sms_by_ctas_on_the_sm" in t:
            lines.append("  SMs by their split CTAs (last launch): " + "; ".join(
                f"{k} an SM: {g['sms']} SMs, last chain end {_us(g['last_chain_end_ns'].get('median_ns'))} (max "
                f"{_us(g['last_chain_end_ns'].get('max_ns'))}) µs, {g['pages_per_us_median']} pages/µs"
                for k, g in t["sms_by_ctas_on_the_sm"].items()))
        if t.get("within_sm"):
            w = t["within_sm"]
            prologues, chains = w["prologue_end_spread"], w["chain_end_spread"]
            lines.append(f"  within an SM ({w['sm_launches']} SM-launches, CTAs with pages): prologues end "
                         f"{_us(prologues['median_ns'])} (p90 {_us(prologues['p90_ns'])}) µs apart, chains "
                         f"{_us(chains['median_ns'])} (p90 {_us(chains['p90_ns'])}) µs apart; the last prologue ends "
                         f"its chain last in {100 * w['last_prologue_ends_last']:.0f} %")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="8,16", help="16, 8, 4, 2 (1, 2, 4, 8 KV heads)")
    parser.add_argument("--lengths", default="8,8192,131072", help="request lengths L, 8 .. 131072")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN,
                        help="the deployment whose plan is traced (its split count: attn2_layout.splits); every "
                             "length must fit in it")
    parser.add_argument("--splits", type=int, default=None,
                        help="force the plan's split count (a power of two, 2 .. 256; default the deployment's, "
                             "attn2_layout.splits)")
    parser.add_argument("--window", type=int, default=0,
                        help="the sliding window (0: none; else in [1, max_model_len)): its plan and its keys")
    parser.add_argument("--grid-order", action="store_true",
                        help="grid index y runs partial y (Attn2Build.spread_splits False; the deployment's with a "
                             "window)")
    parser.add_argument("--spread-splits", action="store_true",
                        help="grid index y runs partial bitrev(y) (Attn2Build.spread_splits True; the deployment's "
                             "without a window)")
    parser.add_argument("--calls", type=int, default=20, help="traced launches in the graph (>= 3)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", default=None,
                        help="also write every launch's raw CTA rows (JSON: per configuration, per launch, the "
                             "split and combine rows with each split row's KV head, first split and page count)")
    parser.add_argument("--loads-only", action="store_true",
                        help="trace the split kernel's page stream alone (Attn2Build.loads_only): a timing probe")
    args = parser.parse_args()
    tps = _csv(args.tp, _tp, "--tp")
    lengths = _csv(args.lengths, _length, "--lengths")
    if not _max_model_len(args.max_model_len):
        _refuse(f"--max-model-len: {args.max_model_len} is not a {_max_model_len.__doc__}")
    if max(lengths) > args.max_model_len:
        _refuse(f"--lengths: {max(lengths)} is past --max-model-len {args.max_model_len}")
    if args.splits is not None and not (2 <= args.splits <= 256 and args.splits & (args.splits - 1) == 0):
        _refuse(f"--splits: {args.splits} is not a power of two in [2, 256]")
    if not (args.window == 0 or 1 <= args.window < args.max_model_len):
        _refuse(f"--window: {args.window} is not 0 or in [1, --max-model-len {args.max_model_len})")
    if args.grid_order and args.spread_splits:
        _refuse("--grid-order and --spread-splits: one split order at a time")
    from musebench import attn2_layout as lay

    one_split = args.splits is None and lay.splits(args.max_model_len, args.window, 1) == 1
    if (args.grid_order or args.spread_splits) and one_split:
        _refuse(f"--grid-order / --spread-splits: max_model_len {args.max_model_len} runs one split a KV head: "
                "no order")
    order = False if args.grid_order else True if args.spread_splits else None
    if args.calls < 3:
        _refuse(f"--calls: {args.calls} leaves fewer than two launches after the first (needs >= 3)")
    for flag, path in (("--json", args.json), ("--rows", args.rows)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            _refuse(f"{flag}: the folder of {path!r} does not exist")

    import torch

    if not torch.cuda.is_available():
        _refuse("trace-attn2.py needs a CUDA GPU (sm_90a / sm_100a); none is visible")

    from musebench.cases.attn2_inputs import for_rank, make_problem
    from musebench.kernels import attn2

    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    report, raw = [], []
    for tp in tps:
        for length in lengths:
            p = for_rank(make_problem("random", length, args.max_model_len, args.window), 0, tp).to(device)
            heads = p.num_kv_heads
            splits = args.splits or lay.splits(p.max_model_len, p.window, heads)
            per_cta = lay.splits_per_cta(heads, splits)
            need = attn2.traced_workspace_bytes(1, heads, splits, per_cta)
            workspaces = [torch.zeros(need, dtype=torch.uint8, device=device) for _ in range(args.calls)]
            out = torch.empty_like(p.q)

            def launches() -> None:
                for workspace in workspaces:
                    attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace,
                                 max_model_len=p.max_model_len, window=p.window, trace=True, num_splits=splits,
                                 loads_only=args.loads_only, spread_splits=order)

            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                launches()  # eager: compiles, outside the capture
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                launches()
            with torch.cuda.stream(stream):
                for _ in range(2):
                    graph.replay()
            stream.synchronize()
            # the pages each split CTA streams (its splits' pages), in trace-row order (one request)
            first_key, end_key = lay.visible_keys(length, p.window)
            first_page, end_page = first_key // lay.PAGE_TOKENS, -(-end_key // lay.PAGE_TOKENS)
            pages = [sum(len(lay.split_pages(cta * per_cta + j, splits, first_page, end_page)) for j in range(per_cta))
                     for cta in range(splits // per_cta)] * heads
            per_launch = []
            for workspace in workspaces[1:]:
                split_rows, combine_rows = attn2.trace_rows(workspace, 1, heads, splits, per_cta)
                per_launch.append(dict(
                    split=[dict(zip(attn2.SPLIT_TRACE_FIELDS, r)) for r in split_rows.cpu().tolist()],
                    combine=[dict(zip(attn2.COMBINE_TRACE_FIELDS, r)) for r in combine_rows.cpu().tolist()]
                    if combine_rows is not None else [],
                    split_pages=pages))
            split_order = "spread" if attn2.resolved_spread_splits(order, p.window, splits) else "grid"
            if args.rows:
                ctas = splits // per_cta
                raw.append(dict(tp=tp, seq_len=length, max_model_len=args.max_model_len, window=p.window,
                                split_order=split_order, kv_heads=heads, splits=splits, splits_per_cta=per_cta,
                                loads_only=args.loads_only, launches=[dict(
                                    split=[dict(r, kv_head=i // ctas, first_split=(i % ctas) * per_cta, pages=n)
                                           for i, (r, n) in enumerate(zip(x["split"], x["split_pages"]))],
                                    combine=x["combine"]) for x in per_launch]))
            table = summarize(per_launch)
            table.update(tp=tp, seq_len=length, max_model_len=args.max_model_len, window=p.window,
                         split_order=split_order, forced_splits=args.splits is not None,
                         kv_heads=heads, splits=splits, splits_per_cta=per_cta,
                         launches=len(per_launch), loads_only=args.loads_only)
            report.append(table)
            print(render(tp, length, table), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.rows:
        with open(args.rows, "w") as f:
            json.dump(raw, f)


if __name__ == "__main__":
    main()
