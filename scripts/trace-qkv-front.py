"""Where a QKV front launch spends its time, CTA by CTA: the traced build (`kernels.qkv_front`,
`trace`) in a CUDA graph of back-to-back launches, as `bench front --cold-weights` times them.

    python3 scripts/trace-qkv-front.py [--tp 16,8,4] [--tokens 1,16] [--calls 20] [--json PATH]

Why: the bench gives one number a launch (N 1152: 7.1 µs against a 4.49 µs weight-read roofline)
and Nsight Compute times a launch alone, without the PDL overlap of the graph. The trace says, per
CTA, when it started, how long it waited for the preceding launch (PDL), streamed its weight slice,
waited for its cluster's reduction, and finished, and on which SM it ran; so the fixed cost can be
split into launch skew, PDL wait, stream, reduction and epilogue, and the stream compared between
SMs holding one CTA of the launch and SMs holding two.

Per (tp, tokens): `--calls` launches, each reading another weight copy (cold in L2, as the bench's
`cold weights` column: `cases.qkv_front.cold_copies_for`) and writing its own rows of one int64
[calls, CTAS, TRACE_WORDS] trace, captured in one graph after an eager warm-up (which compiles),
replayed twice; the second replay's trace is read. Launch 0 is left out (its predecessor is the
previous replay's last launch, or nothing).

Clocks: %globaltimer (ns, shared by every SM) places CTAs in time; %clock64 (cycles, per SM)
times a CTA's phases, converted at the ratio of the summed cycles to the summed nanoseconds of
every CTA's whole life (so no clock-rate guess). Printed per configuration: the launch span
(first entry to last end), the overlap with the previous launch (its last end minus this one's
first entry: positive where PDL overlaps them), each phase's median and maximum over CTAs, and
the stream split by how many CTAs of the launch shared the SM. `--json` writes every number.
Exit 2 on a bad option or without a GPU, before any work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

PHASES = (("pdl_wait", "clock_entry", "clock_waited"), ("stream", "clock_waited", "clock_streamed"),
          ("reduction", "clock_streamed", "clock_reduced"), ("finish", "clock_reduced", "clock_end"))
TPS = (16, 8, 4)


def _csv(text: str, allowed: tuple, what: str) -> tuple:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        values = ()
    if not values or any(v not in allowed for v in values):
        print(f"{what}: {text!r} is not a comma list of {', '.join(map(str, allowed))}", file=sys.stderr)
        sys.exit(2)
    return values


def summarize(rows: list[dict], fields: tuple[str, ...]) -> dict:
    """One launch's trace rows (dicts of TRACE_FIELDS) -> spans, phases (ns) and SM loads."""
    col = {f: [r[f] for r in rows] for f in fields}
    life_cycles = sum(r["clock_end"] - r["clock_entry"] for r in rows)
    life_ns = sum(r["globaltimer_end"] - r["globaltimer_entry"] for r in rows)
    per_sm: dict[int, int] = {}
    for r in rows:
        per_sm[r["smid"]] = per_sm.get(r["smid"], 0) + 1
    return dict(first_entry=min(col["globaltimer_entry"]), last_end=max(col["globaltimer_end"]),
                cycles_per_ns=life_cycles / life_ns if life_ns > 0 else float("nan"),
                entry_skew_ns=max(col["globaltimer_entry"]) - min(col["globaltimer_entry"]),
                sm_load=[per_sm[r["smid"]] for r in rows], rows=rows)


def phase_table(launches: list[dict]) -> dict:
    """Median and max of each phase (ns) over every CTA of the launches, and the stream by SM load."""
    ratio = sum(x["cycles_per_ns"] for x in launches) / len(launches)
    out: dict = {"cycles_per_ns": round(ratio, 4)}
    for name, start, end in PHASES:
        values = [(r[end] - r[start]) / ratio for x in launches for r in x["rows"]]
        out[name] = dict(median_ns=round(statistics.median(values)), max_ns=round(max(values)))
    by_load: dict[int, list[float]] = {}
    for x in launches:
        for r, load in zip(x["rows"], x["sm_load"]):
            by_load.setdefault(load, []).append((r["clock_streamed"] - r["clock_waited"]) / ratio)
    out["stream_by_ctas_on_the_sm"] = {str(k): dict(ctas=len(v), median_ns=round(statistics.median(v)),
                                                    max_ns=round(max(v))) for k, v in sorted(by_load.items())}
    spans = [x["last_end"] - x["first_entry"] for x in launches]
    out["launch_span_ns"] = dict(median=round(statistics.median(spans)), max=max(spans))
    out["entry_skew_ns"] = dict(median=round(statistics.median(x["entry_skew_ns"] for x in launches)))
    overlaps = [prev["last_end"] - cur["first_entry"] for prev, cur in zip(launches, launches[1:])]
    out["overlap_with_previous_ns"] = dict(median=round(statistics.median(overlaps))) if overlaps else {}
    period = [(cur["first_entry"] - prev["first_entry"]) for prev, cur in zip(launches, launches[1:])]
    out["launch_period_ns"] = dict(median=round(statistics.median(period))) if period else {}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", default="16,8,4", help="16, 8, 4 (N = 1152, 2304, 4608)")
    parser.add_argument("--tokens", default="1,16", help="token counts, 1..16")
    parser.add_argument("--calls", type=int, default=20, help="launches in the graph, each its own weight copy")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tps = _csv(args.tp, TPS, "--tp")
    tokens = _csv(args.tokens, tuple(range(1, 17)), "--tokens")

    import torch

    from musebench.cases import qkv_front as case_mod
    from musebench.kernels import qkv_front

    for tp in tps:
        try:
            case_mod.cold_copies_for(tp, args.calls)
        except ValueError as e:
            print(f"--calls: {e}", file=sys.stderr)
            sys.exit(2)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (sm_90a / sm_100a)", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda")
    fields = qkv_front.TRACE_FIELDS
    report = []
    for tp in tps:
        kv = case_mod.kv_heads_for(tp)
        for t in tokens:
            inputs = case_mod.make_inputs(case_mod.FrontCase(tp=tp, tokens=t))
            x = inputs.x.to(device)
            positions, slots = inputs.positions.to(device), inputs.slots.to(device)
            cos_sin = inputs.cos_sin.to(device)
            weights = [inputs.weights[0].to(device) for _ in range(args.calls)]
            cache = case_mod.pool(case_mod.cache_buffer(kv, device))
            out = torch.empty(t, 1152 * kv, dtype=torch.bfloat16, device=device)
            trace = torch.zeros(args.calls, qkv_front.CTAS[kv], qkv_front.TRACE_WORDS, dtype=torch.int64, device=device)

            def launches() -> None:
                for j in range(args.calls):
                    qkv_front.launch(x, weights[j], positions, cos_sin, slots, cache, out, trace=trace[j])

            launches()  # compiles, outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launches()
            for _ in range(2):
                graph.replay()
            torch.cuda.synchronize()
            host = trace.cpu().tolist()
            per_launch = [summarize([dict(zip(fields, row)) for row in host[j]], fields) for j in range(1, args.calls)]
            table = phase_table(per_launch)
            table.update(tp=tp, n=1152 * kv, tokens=t, ctas=qkv_front.CTAS[kv], launches=len(per_launch))
            report.append(table)
            loads = ", ".join(f"{k} a SM: {v['ctas']} CTAs, stream median {v['median_ns'] / 1e3:.2f} max "
                              f"{v['max_ns'] / 1e3:.2f} µs" for k, v in table["stream_by_ctas_on_the_sm"].items())
            print(f"tp {tp} N {1152 * kv} T {t}: period {table['launch_period_ns'].get('median', 0) / 1e3:.2f} µs, span "
                  f"{table['launch_span_ns']['median'] / 1e3:.2f} µs, overlap with the previous "
                  f"{table['overlap_with_previous_ns'].get('median', 0) / 1e3:.2f} µs, entry skew "
                  f"{table['entry_skew_ns']['median'] / 1e3:.2f} µs; " + "; ".join(
                      f"{name} {table[name]['median_ns'] / 1e3:.2f} (max {table[name]['max_ns'] / 1e3:.2f})"
                      for name, _, _ in PHASES) + f" µs; {loads}; {table['cycles_per_ns']:.3f} cycles/ns", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
