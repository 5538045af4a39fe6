"""Count the SASS instructions of qkv_front's stages, per variant (no GPU: compiles for a target,
disassembles the cubin with nvdisasm; ptxas -v on the kept PTX reports registers and spills).

    PYTHONPATH=. python3 scripts/qkv-front-sass.py --arch sm_90a --kv 1,2,4
    PYTHONPATH=. python3 scripts/qkv-front-sass.py --kv 2 --rope nope --tap --no-pdl --dump /tmp/front.sass

Segments of the (fully unrolled, straight-line until the reduction) kernel, in program order:
  prologue   the start up to the first stage's wait (cp.async.wait_group: the DEPBAR.LE SB0 before the
             first BAR.SYNC): address set-up, the ring's first STAGES - 1 stages, the PDL wait (ACQBULK),
             the epilogue's inputs;
  stream     from there to the last HMMA: 16 stages, each a wait, a barrier, the next stage's
             copies (LDGSTS), 8 fragment reads (LDS.128) and 8 HMMAs, per thread; "per stage" is
             stream / 16 (the stages differ only in the copies of the last STAGES - 1);
  reduction  after the last HMMA up to the epilogue's tile barrier (BAR.SYNC after the second
             cluster barrier): PDL's release, the cluster barriers, the peers' DSMEM stores, CTA
             0's rank-order adds and BF16 packs;
  epilogue   the rest: qk-norm, RoPE, the stores of out and the cache.
The reduction and epilogue hold branches (rank > 0, rank == 0, row < tokens, a k / v head, the
slot's range): their counts are static, every instruction once. Classes: HMMA, PAD (ptxas's
never-executed `@!PT LDS RZ, [RZ]` before copies and barriers: issued, no work), LDS (shared loads),
LDGSTS (cp.async), MOV (MOV, IMAD.MOV: register copies, e.g. into an MMA's operand tuple), SEL,
INT (integer / address arithmetic: IADD3, LEA, IMAD, SHF, LOP3, ...), FP (FADD, FMUL, FFMA, MUFU,
F2FP), other.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
CLASSES = (
    ("HMMA", re.compile(r"^HMMA\b")),
    ("PAD", re.compile(r"^PAD\b")),
    ("LDS", re.compile(r"^LDS\b")),
    ("LDGSTS", re.compile(r"^LDGSTS\b")),
    ("MOV", re.compile(r"^(MOV|IMAD\.MOV|UMOV)\b")),
    ("SEL", re.compile(r"^(SEL|FSEL|USEL)\b")),
    ("INT", re.compile(r"^U?(IADD3|IADD|LEA|IMAD|SHF|LOP3|ISETP|PRMT|VIADD|IABS|IMNMX|VIMNMX|BMSK|SGXT)\b")),
    ("FP", re.compile(r"^(FADD|FMUL|FFMA|MUFU|F2FP|FSETP|FMNMX)\b")),
)
STAGES_PER_CTA = 16


def nvdisasm() -> str:
    from musebench.kernels.compilation import nvdisasm as find

    return find() or sys.exit("nvdisasm not found (PATH, or the nvidia-cuda-nvdisasm wheel)")


def instructions(sass: str) -> list[str]:
    """The listing's instructions in program order, predicate guards stripped, NOPs dropped."""
    out = []
    for line in sass.splitlines():
        m = LINE.search(line)
        if m:
            text = m.group(2)
            if text.startswith("@!PT "):  # never executed: ptxas's padding (before LDGSTS, barriers)
                out.append("PAD " + text)
                continue
            text = re.sub(r"^@!?U?P\w+\s+", "", text)
            if not text.startswith("NOP"):
                out.append(text)
    return out


def segments(instrs: list[str]) -> dict[str, list[str]]:
    """prologue / stream / reduction / epilogue as the module docstring defines them."""
    first_barrier = next(i for i, t in enumerate(instrs) if t.startswith("BAR.SYNC"))
    first_wait = max(i for i in range(first_barrier) if instrs[i].startswith("DEPBAR.LE SB0"))
    last_mma = max(i for i, t in enumerate(instrs) if t.startswith("HMMA"))
    cluster_waits = [i for i, t in enumerate(instrs) if t.startswith("UCGABAR_WAIT")]
    tile_barrier = next(i for i in range(cluster_waits[-1] + 1, len(instrs)) if instrs[i].startswith("BAR.SYNC")
                        and any(t.startswith("F2FP") for t in instrs[cluster_waits[-1]:i]))
    return {"prologue": instrs[:first_wait], "stream": instrs[first_wait:last_mma + 1],
            "reduction": instrs[last_mma + 1:tile_barrier + 1], "epilogue": instrs[tile_barrier + 1:]}


def classify(seg: list[str]) -> Counter:
    counts: Counter = Counter()
    for t in seg:
        counts[next((name for name, pattern in CLASSES if pattern.match(t)), "other")] += 1
    counts["total"] = len(seg)
    return counts


def registers_and_spills(ptx: Path, arch: str) -> str:
    if not shutil.which("ptxas"):
        return "registers ? (no ptxas)"
    report = subprocess.run(["ptxas", f"-arch={arch}", "-O3", "-v", str(ptx), "-o", os.devnull],
                            capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return (f"registers {regs.group(1) if regs else '?'}, spill st/ld "
            f"{spill.group(1) + '/' + spill.group(2) if spill else '?'}")


def report(name: str, sass: str, regs: str) -> list[str]:
    parts = segments(instructions(sass))
    keys = ["total"] + [name for name, _ in CLASSES] + ["other"]
    lines = [f"{name}: {regs}", "  " + f"{'segment':11s}" + "".join(f"{k:>8s}" for k in keys)]
    for seg_name, seg in parts.items():
        c = classify(seg)
        lines.append("  " + f"{seg_name:11s}" + "".join(f"{c[k]:8d}" for k in keys))
        if seg_name == "stream":
            lines.append("  " + f"{'per stage':11s}" + "".join(f"{c[k] / STAGES_PER_CTA:8.1f}" for k in keys))
    whole = classify([t for seg in parts.values() for t in seg])
    lines.append("  " + f"{'kernel':11s}" + "".join(f"{whole[k]:8d}" for k in keys))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a", help="sm_90a or sm_100a")
    parser.add_argument("--kv", default="1,2,4", help="KV heads per rank (N = 1152 kv), comma list of 1, 2, 4")
    parser.add_argument("--rope", default="rope", help="rope or nope")
    parser.add_argument("--tap", action="store_true", help="the tap variant (tests' projection view)")
    parser.add_argument("--no-pdl", action="store_true", help="the build without PDL")
    parser.add_argument("--dump", help="also write the (last) variant's SASS listing here")
    args = parser.parse_args()
    if args.arch not in ("sm_90a", "sm_100a") or args.rope not in ("rope", "nope"):
        print("--arch must be sm_90a or sm_100a, --rope rope or nope", file=sys.stderr)
        sys.exit(2)
    try:
        kvs = [int(k) for k in args.kv.split(",") if k]
    except ValueError:
        kvs = []
    if not kvs or any(k not in (1, 2, 4) for k in kvs):
        print(f"--kv: a comma list of 1, 2, 4, got {args.kv!r}", file=sys.stderr)
        sys.exit(2)
    os.environ.setdefault("CUTE_DSL_ARCH", args.arch)
    from musebench.kernels import qkv_front

    disasm = nvdisasm()
    for kv in kvs:
        with tempfile.TemporaryDirectory() as tmp:
            qkv_front.compile_qkv_front(num_kv_heads=kv, rope=args.rope == "rope", tap=args.tap, eps=1e-5,
                                        enable_pdl=not args.no_pdl, arch=args.arch, ptx_dir=tmp)
            cubin = next(Path(tmp).glob("*QkvFrontKernel*.cubin"))
            ptx = next(Path(tmp).glob("*QkvFrontKernel*.ptx"))
            sass = subprocess.run([disasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
            if args.dump:
                Path(args.dump).write_text(sass)
            name = (f"N {1152 * kv} ({args.arch}, {args.rope}{', tap' if args.tap else ''}"
                    f"{', no PDL' if args.no_pdl else ', PDL'})")
            print("\n".join(report(name, sass, registers_and_spills(ptx, args.arch))), flush=True)


if __name__ == "__main__":
    main()
