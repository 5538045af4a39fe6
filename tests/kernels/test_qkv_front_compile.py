"""The QKV front kernel compiles for sm_90a and sm_100a (no GPU needed), and its PTX says so.

Every variant (N = 1152, 2304, 4608; RoPE or NoPE; tap on or off) on both targets, with PTX
assertions: the MMAs (2 per n-tile, 2 n-tiles per warp, 2 warp-steps per stage, 16 stages), the
ring's copies (`cp.async.cg`, 4 weight + 1 x per thread and stage; one wait and one barrier per
stage), its 16-byte fragment reads, the cluster's reduction (8 remote stores per thread, 7 x 8
peer reads in CTA 0, two cluster barriers), the epilogue's inputs read once, the epilogue's arithmetic (one `rsqrt.approx.f32`, never `.ftz`, every add/mul/fma the explicit `.rn`
form, the butterfly's 3 shuffles, 8 BF16 packs of the projection + 4 of the epilogue), RoPE
instructions only with RoPE, tap stores only with the tap; and ptxas assembles without spills.
PDL (the default build): one `griddepcontrol.wait` after the first STAGES - 1 stages' weight
copies and before any read of x, positions, slots or the table and before any store to global
memory, one `griddepcontrol.launch_dependents` after the stream; the build without PDL has
neither and today's prologue. Compile time here: about 1-3 s per variant.
"""

from __future__ import annotations

import functools
import glob
import re
import tempfile

import pytest

from tests._ptxas import assemble, assert_no_spills

pytest.importorskip("cutlass")

from musebench.kernels import qkv_front  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")
KV = (1, 2, 4)  # N = 1152 (tp 16), 2304 (tp 8), 4608 (tp 4)


@functools.lru_cache(maxsize=None)
def front_ptx(arch: str, kv: int, rope: bool, tap: bool, pdl: bool = True, trace: bool = False,
              loads_only: bool = False) -> str:
    folder = tempfile.mkdtemp(prefix="musebench-qkv-front-ptx-")
    qkv_front.compile_qkv_front(num_kv_heads=kv, rope=rope, tap=tap, eps=1e-5, enable_pdl=pdl, trace=trace,
                                loads_only=loads_only, arch=arch, ptx_dir=folder)
    (path,) = glob.glob(f"{folder}/*.ptx")
    with open(path) as f:
        return f.read()


def count(text: str, pattern: str) -> int:
    return len(re.findall(pattern, text))


def check_contract_instructions(text: str, kv: int, rope: bool, tap: bool, pdl: bool) -> None:
    stages = qkv_front.STAGES_PER_CTA
    prologue = qkv_front.STAGES[kv] - 1  # stages in flight before the loop
    assert stages == 16
    assert count(text, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == stages * 8
    # with PDL the prologue's x goes through registers: 16-byte ld.global.cg + st.shared per stage
    assert count(text, r"cp\.async\.cg\.shared\.global") == stages * 5 - (prologue if pdl else 0)
    assert count(text, r"ld\.global\.cg\.v4\.u32") == (prologue if pdl else 0)
    assert count(text, r"st\.shared\.v4\.u32") == (prologue if pdl else 0)
    assert count(text, r"cp\.async\.commit_group") == stages + prologue
    assert count(text, r"cp\.async\.wait_group") == stages + 1
    assert count(text, r"ld\.shared\.v4\.u32") == stages * 8  # x rows g, g + 8 and 2 weight rows, 2 steps
    assert count(text, r"ld\.global\.nc") == 0  # the weight and x go through the ring
    # the epilogue's inputs: the slot and, with RoPE, the position and the cos / sin words
    assert count(text, r"ld\.global\.s64") == (2 if rope else 1)
    assert count(text, r"ld\.global\.v4\.u32") == (2 if rope else 0)
    assert re.findall(r"rsqrt\.[\w.]+", text) == ["rsqrt.approx.f32"]
    assert ".ftz" not in text
    for op in ("add", "mul", "fma", "sub"):
        plain = re.findall(rf"\b{op}\.f32\b", text)
        assert not plain, f"{op}.f32 without .rn"
    assert count(text, r"shfl\.sync\.bfly") == 3
    # 4 projection pairs per thread (2 n-tiles x rows g, g + 8), 4 of the epilogue
    assert count(text, r"cvt\.rn\.bf16x2\.f32") == 4 + 4
    assert count(text, r"mapa\.shared::cluster") == qkv_front.ACCUMULATORS
    assert count(text, r"st\.shared::cluster\.f32") == qkv_front.ACCUMULATORS
    assert count(text, r"ld\.shared\.u32") == (qkv_front.SPLIT - 1) * qkv_front.ACCUMULATORS
    assert count(text, r"add\.rn\.f32") == (qkv_front.SPLIT - 1) * qkv_front.ACCUMULATORS + 3
    assert count(text, r"barrier\.cluster\.arrive") == 2 and count(text, r"barrier\.cluster\.wait") == 2
    # the epilogue's fma: 8 sum of squares + 1 rsqrt argument (+ 8 RoPE)
    assert count(text, r"fma\.rn\.f32") == 9 + (8 if rope else 0)
    assert count(text, r"st\.global\.u32") == (4 if tap else 0)
    assert count(text, r"st\.global\.v4\.u32") == 2  # out, and the cache slot
    assert count(text, r"griddepcontrol\.wait") == (1 if pdl else 0)
    assert count(text, r"griddepcontrol\.launch_dependents") == (1 if pdl else 0)


def pdl_order_violations(text: str, kv: int) -> list[str]:
    """What the PDL prologue's order breaks: the wait must follow the first STAGES - 1 stages'
    weight copies (4 per stage, src-size the constant 16's register) and precede every x copy
    (src-size the x register), every global load and every global store; the release must follow
    the last cp.async and precede the cluster's reduction."""
    lines = [line.strip() for line in text.splitlines()]
    wait = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    if len(wait) != 1:
        return [f"{len(wait)} griddepcontrol.wait"]
    wait = wait[0]
    copies = [(i, line.rstrip(";").split(",")[-1].strip()) for i, line in enumerate(lines)
              if line.startswith("cp.async.cg.shared.global")]
    weight_size = copies[0][1]
    problems = []
    before = [i for i, _ in copies if i < wait]
    if len(before) != qkv_front.WEIGHT_COPIES * (qkv_front.STAGES[kv] - 1):
        problems.append(f"{len(before)} cp.async before the wait")
    if any(size != weight_size for i, size in copies if i < wait):
        problems.append("an x copy before the wait")
    if not any(size != weight_size for i, size in copies if i > wait):
        problems.append("no x copy after the wait")
    for i, line in enumerate(lines[:wait]):
        if re.match(r"(ld|st|red|atom)\.(global|volatile\.global)|st\.global|ld\.global", line):
            problems.append(f"line {i} before the wait: {line}")
    release = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents")]
    reduction = [i for i, line in enumerate(lines) if line.startswith("barrier.cluster.arrive")]
    if len(release) != 1 or release[0] < copies[-1][0] or release[0] > reduction[0]:
        problems.append(f"launch_dependents at {release}, last copy at {copies[-1][0]}, reduction at {reduction[:1]}")
    return problems


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("tap", [False, True], ids=["plain", "tap"])
def test_variant_compiles_with_the_contracts_instructions(arch, kv, rope, tap):
    text = front_ptx(arch, kv, rope, tap)
    check_contract_instructions(text, kv, rope, tap, pdl=True)
    assert pdl_order_violations(text, kv) == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
def test_the_build_without_pdl_has_no_griddepcontrol(arch, kv):
    check_contract_instructions(front_ptx(arch, kv, True, False, pdl=False), kv, True, False, pdl=False)


def test_the_pdl_order_check_catches_a_read_or_copy_before_the_wait():
    """Fault injection: the order check fails on PTX whose wait is moved after the first x load,
    or before the weight copies, or whose release is moved to the start."""
    text = front_ptx("sm_90a", 2, True, False)
    lines = text.splitlines()
    wait = next(i for i, line in enumerate(lines) if line.strip().startswith("griddepcontrol.wait"))
    first_load = next(i for i, line in enumerate(lines) if "ld.global" in line)
    late = lines[:wait] + lines[wait + 1: first_load + 1] + [lines[wait]] + lines[first_load + 1:]
    assert any("before the wait" in p for p in pdl_order_violations("\n".join(late), 2))
    first_copy = next(i for i, line in enumerate(lines) if "cp.async.cg" in line)
    early = lines[:first_copy] + [lines[wait]] + lines[first_copy:wait] + lines[wait + 1:]
    assert any("cp.async before the wait" in p for p in pdl_order_violations("\n".join(early), 2))
    release = next(i for i, line in enumerate(lines) if "launch_dependents" in line)
    moved = lines[:first_copy] + [lines[release]] + lines[first_copy:release] + lines[release + 1:]
    assert any("launch_dependents" in p for p in pdl_order_violations("\n".join(moved), 2))
    assert pdl_order_violations(text, 2) == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
def test_ptxas_assembles_without_spills_within_the_residency_registers(arch, kv, pdl, tmp_path):
    """No spills, and few enough registers that ceil(CTAs / 132) CTAs of 128 threads share an SM."""
    report = assemble(front_ptx(arch, kv, True, True, pdl), arch, tmp_path, "qkv_front")
    assert_no_spills(report)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    per_sm = -(-qkv_front.CTAS[kv] // qkv_front.H200_SMS)
    assert registers <= (65536 // (per_sm * qkv_front.THREADS)) // 8 * 8, report


def test_knobs_are_validated():
    with pytest.raises(ValueError, match="num_kv_heads"):
        qkv_front.compile_qkv_front(num_kv_heads=3, rope=True, tap=False, eps=1e-5, arch="sm_90a")
    with pytest.raises(ValueError, match="eps"):
        qkv_front.compile_qkv_front(num_kv_heads=2, rope=True, tap=False, eps=0.0, arch="sm_90a")
    with pytest.raises(ValueError, match="enable_pdl"):
        qkv_front.compile_qkv_front(num_kv_heads=2, rope=True, tap=False, eps=1e-5, enable_pdl=1, arch="sm_90a")
    with pytest.raises(ValueError, match="trace"):
        qkv_front.compile_qkv_front(num_kv_heads=2, rope=True, tap=False, eps=1e-5, trace=1, arch="sm_90a")
    with pytest.raises(ValueError, match="loads_only"):
        qkv_front.compile_qkv_front(num_kv_heads=2, rope=True, tap=False, eps=1e-5, loads_only=1, arch="sm_90a")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
def test_the_loads_only_probe_streams_without_the_mmas(arch, kv, tmp_path):
    """The timing probe (`loads_only`) keeps the deployment's copies, waits, barriers and cluster
    reduction and drops every MMA; it assembles without a spill."""
    probe = front_ptx(arch, kv, True, False, loads_only=True)
    deployed = front_ptx(arch, kv, True, False)
    assert count(probe, r"mma\.sync") == 0 and count(deployed, r"mma\.sync") > 0
    for pattern in (r"cp\.async\.cg", r"cp\.async\.wait_group", r"bar\.sync|barrier\.sync", r"barrier\.cluster\.wait"):
        assert count(probe, pattern) == count(deployed, pattern), pattern
    assert_no_spills(assemble(probe, arch, tmp_path))


SPECIAL_REGISTERS = r"%clock64|%globaltimer|%smid"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
def test_trace_reads_the_clocks_and_writes_one_row_a_cta(arch, pdl, tmp_path):
    """The traced build (an experiment): 5 %clock64 reads (entry, the wait, the stream's end, the
    reduction, the end), 2 %globaltimer, 1 %smid, TRACE_WORDS 64-bit stores; with PDL the second
    clock right after griddepcontrol.wait; the rest of the kernel's contract instructions as the
    untraced build's; no spills."""
    text = front_ptx(arch, 1, True, False, pdl, True)
    assert count(text, r"%clock64") == 5 and count(text, r"%globaltimer") == 2 and count(text, r"%smid") == 1
    assert count(text, r"st\.global\.u64") == qkv_front.TRACE_WORDS == len(qkv_front.TRACE_FIELDS) == 8
    check_contract_instructions(text, 1, True, False, pdl)
    if pdl:
        after_wait = text[text.index("griddepcontrol.wait;"):]
        assert after_wait.index("%clock64") < after_wait.index("ld.global")
    assert_no_spills(assemble(text, arch, tmp_path, "qkv_front_trace"))


@pytest.mark.parametrize("arch", ARCHS)
def test_deployed_builds_read_no_clock(arch):
    """Without the trace, no special-register read and no 64-bit store (the trace costs nothing)."""
    for kv in KV:
        text = front_ptx(arch, kv, True, False)
        assert count(text, SPECIAL_REGISTERS) == 0 and count(text, r"st\.global\.u64") == 0


def test_launch_refuses_a_bad_trace_buffer_before_compiling():
    """A trace buffer of the wrong shape, dtype or layout is a ValueError before anything compiles."""
    import torch

    kv, t = 1, 2
    x = torch.zeros(t, 8192, dtype=torch.bfloat16)
    args = (x, torch.zeros(1152 * kv, 8192, dtype=torch.bfloat16), torch.zeros(t, dtype=torch.int64),
            torch.zeros(16, 64), torch.zeros(t, dtype=torch.int64), torch.zeros(4, kv, 16, 128, dtype=torch.bfloat16),
            torch.zeros(t, 1152 * kv, dtype=torch.bfloat16))
    ctas = qkv_front.CTAS[kv]
    for bad in (torch.zeros(ctas, 7, dtype=torch.int64), torch.zeros(ctas, 8, dtype=torch.int32),
                torch.zeros(8, ctas, dtype=torch.int64).T, torch.zeros(ctas + 8, 8, dtype=torch.int64), "trace"):
        with pytest.raises(ValueError, match="trace must be"):
            qkv_front.launch(*args, trace=bad)


def test_every_cta_is_resident_at_once_on_an_h200():
    """8 CTAs per head at every N; the ring's stages leave room for every CTA on 132 SMs."""
    for kv in KV:
        ctas = qkv_front.CTAS[kv]
        assert ctas == qkv_front.SPLIT * 18 * kv
        assert qkv_front.ctas_per_sm(kv) * qkv_front.H200_SMS >= ctas, (kv, qkv_front.ctas_per_sm(kv))
        assert qkv_front.smem_bytes(kv) <= 227 * 1024
        # CTA 0's ring takes the 7 peers' FP32 partials [16, 64] after the stream
        assert qkv_front.STAGES[kv] * qkv_front.STAGE_BYTES >= 7 * 16 * 64 * 4
