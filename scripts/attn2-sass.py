"""Count the SASS instructions one page costs in attn2's split kernel, per path through the page
loop, for `SplitIssue` settings side by side (no GPU: compiles for a target, disassembles the
cubin with nvdisasm; ptxas -v on the kept PTX reports registers and spills).

    PYTHONPATH=. python3 scripts/attn2-sass.py --arch sm_90a --issue none,all,mask,rescale,lean,keys,mask+lean

Paths: every route from the loop's head to its back edge (the masked / unmasked page, the
rescale / no rescale; the page load's predicated block counts either way). A predicated-off
instruction still takes an issue slot, so the counts are what a warp issues per page. No backward
branch inside the page loop other than its back edge is followed.

`--splits-per-cta 1|2` builds the split kernel running that many sibling splits a CTA
(`Attn2Build.splits_per_cta`; default: the layout's, `attn2_layout.splits_per_cta`). With 2 the
CTA runs two page loops (one per split) through one ring: the loop counted is the one with the
most tensor-core instructions, the first found among equals.

`--pages-per-step 1|2` builds the split kernel whose softmax step takes that many pages
(`Attn2Build.pages_per_step`; default: the deployment's, `attn2_layout.pages_per_step`: 2 for
split plans without a window). With 2 the loop counted is the two-page step's (the one with the
most tensor-core instructions), and the counts printed are per page, the step's counts / 2 (the
line says so).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
TARGET = re.compile(r"`\(\.(L_x_\d+)\)")


def nvdisasm() -> str:
    from musebench.kernels.compilation import nvdisasm as find

    return find() or sys.exit("nvdisasm not found (PATH, or the nvidia-cuda-nvdisasm wheel)")


def loop_paths(sass: str) -> list[int]:
    """Instruction counts of every path through the page loop (the last backward branch's body)."""
    labels, instrs = {}, []
    for line in sass.splitlines():
        m = re.match(r"\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = LINE.search(line)
        if m:
            instrs.append(m.group(2))
    back = [(i, labels[TARGET.search(t).group(1)]) for i, t in enumerate(instrs)
            if "BRA" in t and TARGET.search(t) and labels[TARGET.search(t).group(1)] < i]
    # the page loop: the backward branch whose body holds the most tensor-core instructions
    # (HMMA: mma.sync; HGMMA: wgmma)
    end, head = max(back, key=lambda b: sum("MMA" in t for t in instrs[b[1]:b[0] + 1]))
    counts: list[int] = []

    def walk(pc: int, n: int, depth: int) -> None:
        """Follow the code from pc (blocks ptxas moved out of line included) to the back edge."""
        while 0 <= pc < len(instrs) and depth < 32:
            t = instrs[pc]
            n += 1
            if pc == end:
                counts.append(n)
                return
            if "EXIT" in t and not t.lstrip().startswith("@"):
                return
            m = TARGET.search(t) if "BRA" in t else None
            if m:
                target = labels[m.group(1)]
                if target == pc:  # a trap loop
                    return
                if t.lstrip().startswith("@") and target < pc:
                    pass  # a backward branch inside the page: not taken
                elif t.lstrip().startswith("@"):
                    walk(target, n, depth + 1)  # taken; then fall through
                else:
                    pc = target
                    depth += 1
                    continue
            pc += 1

    walk(head, 0, 0)
    return sorted(set(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--issue", default="none,all",
                        help="comma list of SplitIssue names: auto (the deployment's), all, none, or mask / rescale / "
                             "lean / keys / defer / prefetch (SplitIssue.SHORT_NAMES) joined by + ('mask+lean': those "
                             "two on, the rest off)")
    parser.add_argument("--splits-per-cta", type=int, default=None, choices=(1, 2),
                        help="sibling splits a split CTA runs (default: the layout's for the deployment)")
    parser.add_argument("--pages-per-step", type=int, default=None, choices=(1, 2),
                        help="pages a softmax step takes (default: the deployment's; 2: counts are per step / 2)")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--window", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", args.arch)
    from musebench.kernels import attn2

    from musebench import attn2_layout as lay

    try:
        per_step = args.pages_per_step or lay.pages_per_step(
            args.window, lay.splits(args.max_model_len, args.window, args.heads))
    except ValueError as e:
        print(f"attn2-sass: {e}", file=sys.stderr)
        sys.exit(2)
    names = [n for n in args.issue.split(",") if n]
    try:
        issues = {name: attn2.named_issue(name) for name in names}
    except ValueError as e:
        print(f"--issue: {e}", file=sys.stderr)
        sys.exit(2)

    disasm = nvdisasm()
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            try:  # a deployment or splits_per_cta outside the plan (2 with one split) is refused before compiling
                attn2.compile_attn2(args.heads, args.max_model_len, args.window,
                                    attn2.Attn2Build(arch=args.arch, ptx_dir=tmp, issue=issues[name],
                                                     splits_per_cta=args.splits_per_cta,
                                                     pages_per_step=per_step))
            except ValueError as e:
                print(f"attn2-sass: {e}", file=sys.stderr)
                sys.exit(2)
            cubin = next(p for p in Path(tmp).glob("*_Attn2Kernel_*.cubin"))
            ptx = next(p for p in Path(tmp).glob("*_Attn2Kernel_*.ptx"))
            sass = subprocess.run([disasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            report = subprocess.run(["ptxas", f"-arch={args.arch}", "-O3", "-v", str(ptx), "-o", os.devnull],
                                    capture_output=True, text=True).stderr if shutil.which("ptxas") else ""
            regs = re.search(r"Used (\d+) registers", report)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
            paths = loop_paths(sass)
            if per_step > 1:  # the loop is a step of per_step pages
                paths = f"{[n / per_step for n in paths]} (a step's / {per_step})"
            print(f"{name:14s} per-page SASS paths {paths}  registers {regs.group(1) if regs else '?'}  "
                  f"spill st/ld {spill.group(1) + '/' + spill.group(2) if spill else '?'}", flush=True)


if __name__ == "__main__":
    main()
