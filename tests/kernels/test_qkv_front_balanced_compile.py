"""The balanced QKV front kernel compiles for sm_90a and sm_100a (no GPU needed), and its PTX says so.

Every default variant (N = 1152, 2304, 4608 with `qkv_front_plan.DEFAULT_WARPS`; RoPE or NoPE; tap
on or off; PDL or not) and the other CTA widths at one N, on both targets, with PTX assertions:
the warp's MMA chain (64 m16n8k16 per warp: 16 stages x 2 steps x 2), the ring (cp.async.cg, 2
weight + 16 / (4 warps) x copies per thread and stage; one wait per stage), no local memory, no
clusters, the reduction through global memory (one partial store, exactly two
`atom.acq_rel.gpu.global.add.u32` and two re-arming stores, 8 L2 loads of the slices and the
projection's loads, 7 add.rn per accumulator), the epilogue's arithmetic in 4 / warps passes
(FrontEpilogue's: rsqrt.approx, the butterfly, .rn forms), tap stores only with the tap; PDL:
one `griddepcontrol.wait` after exactly the prologue's weight copies and before any x copy, any
global load, store or atomic; one `launch_dependents` after the last cp.async and before the
first atomic. ptxas assembles without spills within the registers of the CTAs an SM must hold.
"""

from __future__ import annotations

import functools
import glob
import re
import tempfile

import pytest

from tests._ptxas import assemble, assert_no_spills

pytest.importorskip("cutlass")

from musebench import qkv_front_plan as plan  # noqa: E402
from musebench.kernels import qkv_front_balanced as balanced  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")
KV = (1, 2, 4)


@functools.lru_cache(maxsize=None)
def balanced_ptx(arch: str, kv: int, rope: bool, tap: bool, pdl: bool = True, warps: int | None = None) -> str:
    folder = tempfile.mkdtemp(prefix="musebench-qkv-front-balanced-ptx-")
    balanced.compile_balanced_front(num_kv_heads=kv, rope=rope, tap=tap, eps=1e-5, enable_pdl=pdl, warps=warps,
                                    arch=arch, ptx_dir=folder)
    (path,) = glob.glob(f"{folder}/*.ptx")
    with open(path) as f:
        return f.read()


def count(text: str, pattern: str) -> int:
    return len(re.findall(pattern, text))


def check_contract_instructions(text: str, kv: int, rope: bool, tap: bool, pdl: bool, warps: int) -> None:
    stages = plan.balanced_stages(kv, warps)
    x_copies = 16 // (4 * warps)
    passes = 4 // warps
    assert count(text, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == 16 * 2 * 2
    assert count(text, r"cp\.async\.cg\.shared\.global") == 16 * (2 + x_copies)
    assert count(text, r"cp\.async\.commit_group") == 16 + (stages - 1) * (2 if pdl else 1)
    assert count(text, r"cp\.async\.wait_group") == 16 + 1
    assert count(text, r"ld\.shared\.v4\.u32") == 16 * 2 * 3  # x rows g, g + 8 and the weight row, 2 steps
    assert count(text, r"\.local\b") == 0 and "local_depot" not in text
    assert count(text, r"ld\.global\.nc") == 0
    assert count(text, r"barrier\.cluster|mapa|shared::cluster") == 0
    # the reduction through global memory
    assert count(text, r"atom\.") == 2
    assert count(text, r"atom\.acq_rel\.gpu\.global\.add\.u32") == 2
    assert count(text, r"ld\.global\.cg\.v4\.u32") == plan.SPLIT + passes  # the slices, then the projection
    assert count(text, r"add\.rn\.f32") == 4 * (plan.SPLIT - 1) + 3 * passes
    assert count(text, r"cvt\.rn\.bf16x2\.f32") == 2 + 4 * passes
    # stores: the partial, out and cache per pass (v4); two re-arms, two projection pairs, the tap
    assert count(text, r"st\.global\.v4\.u32") == 1 + 2 * passes
    assert count(text, r"st\.global\.u32") == 2 + 2 + (2 if tap else 0)
    # FrontEpilogue's arithmetic, once per pass
    assert re.findall(r"rsqrt\.[\w.]+", text) == ["rsqrt.approx.f32"] * passes
    assert ".ftz" not in text
    for op in ("add", "mul", "fma", "sub"):
        assert not re.findall(rf"\b{op}\.f32\b", text), f"{op}.f32 without .rn"
    assert count(text, r"shfl\.sync\.bfly") == 3 * passes
    assert count(text, r"fma\.rn\.f32") == passes * (9 + (8 if rope else 0))
    assert count(text, r"ld\.global\.s64") == passes * (2 if rope else 1)
    assert count(text, r"ld\.global\.v4\.u32") == (2 * passes if rope else 0)
    assert count(text, r"griddepcontrol\.wait") == (1 if pdl else 0)
    assert count(text, r"griddepcontrol\.launch_dependents") == (1 if pdl else 0)


def order_violations(text: str, kv: int, warps: int) -> list[str]:
    """What the PDL order breaks: the wait must follow exactly the prologue's weight copies (2 per
    stage, all with the constant size register) and precede every x copy, global load, store and
    atomic; the release must follow the last cp.async and precede the first atomic."""
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
    if len(before) != 2 * (plan.balanced_stages(kv, warps) - 1):
        problems.append(f"{len(before)} cp.async before the wait")
    if any(size != weight_size for i, size in copies if i < wait):
        problems.append("an x copy before the wait")
    after = [size for i, size in copies if i > wait]
    if not after or after[0] == weight_size:
        problems.append("the wait is not followed by x's copies")
    for i, line in enumerate(lines[:wait]):
        if re.match(r"(ld|st|red|atom)\.(global|volatile\.global|acq_rel|relaxed|release)", line):
            problems.append(f"line {i} before the wait: {line}")
    release = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents")]
    atomics = [i for i, line in enumerate(lines) if line.startswith("atom.")]
    if len(release) != 1 or release[0] < copies[-1][0] or release[0] > atomics[0]:
        problems.append(f"launch_dependents at {release}, last copy at {copies[-1][0]}, first atomic at {atomics[:1]}")
    return problems


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("tap", [False, True], ids=["plain", "tap"])
def test_default_variant_compiles_with_the_contracts_instructions(arch, kv, rope, tap):
    warps = plan.DEFAULT_WARPS[kv]
    text = balanced_ptx(arch, kv, rope, tap)
    check_contract_instructions(text, kv, rope, tap, pdl=True, warps=warps)
    assert order_violations(text, kv, warps) == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("warps", plan.UNIT_WARPS)
def test_every_cta_width_compiles(arch, warps):
    text = balanced_ptx(arch, 2, True, True, warps=warps)
    check_contract_instructions(text, 2, True, True, pdl=True, warps=warps)
    assert order_violations(text, 2, warps) == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
def test_the_build_without_pdl_has_no_griddepcontrol(arch, kv):
    check_contract_instructions(balanced_ptx(arch, kv, True, False, pdl=False), kv, True, False, pdl=False,
                                warps=plan.DEFAULT_WARPS[kv])


def test_the_order_check_catches_a_read_an_atomic_or_a_copy_before_the_wait():
    """Fault injection: the order check fails on the compiled PTX with the wait moved after the
    first global load, after the first atomic, or before the weight copies, or with the release
    moved after the first atomic."""
    kv, warps = 1, plan.DEFAULT_WARPS[1]
    text = balanced_ptx("sm_90a", kv, True, True)
    lines = text.splitlines()

    def index(pattern: str) -> int:
        return next(i for i, line in enumerate(lines) if re.match(pattern, line.strip()))

    def moved(source: int, target: int) -> str:
        """`lines` with line `source` moved just after line `target` (just before it if earlier)."""
        rest = lines[:source] + lines[source + 1:]
        return "\n".join(rest[:target] + [lines[source]] + rest[target:])

    wait = index(r"griddepcontrol\.wait")
    assert any("before the wait" in p for p in order_violations(moved(wait, index(r"ld\.global")), kv, warps))
    assert any("before the wait" in p for p in order_violations(moved(wait, index(r"atom\.")), kv, warps))
    assert any("cp.async before the wait" in p
               for p in order_violations(moved(wait, index(r"cp\.async\.cg")), kv, warps))
    release = index(r"griddepcontrol\.launch_dependents")
    assert any("launch_dependents" in p for p in order_violations(moved(release, index(r"atom\.") + 1), kv, warps))
    assert order_violations(text, kv, warps) == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
def test_ptxas_assembles_without_spills_within_the_residency_registers(arch, kv, pdl, tmp_path):
    """No spills, and few enough registers that the CTAs an SM must hold (`resident_ctas_per_sm`)
    fit its 64K registers."""
    warps = plan.DEFAULT_WARPS[kv]
    report = assemble(balanced_ptx(arch, kv, True, True, pdl), arch, tmp_path, "qkv_front_balanced")
    assert_no_spills(report)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    threads = plan.resident_ctas_per_sm(kv, warps) * 32 * warps
    assert registers <= (65536 // threads) // 8 * 8, report


def test_knobs_are_validated():
    kw = dict(rope=True, tap=False, eps=1e-5, arch="sm_90a")
    with pytest.raises(ValueError, match="num_kv_heads"):
        balanced.compile_balanced_front(num_kv_heads=3, **kw)
    with pytest.raises(ValueError, match="warps"):
        balanced.compile_balanced_front(num_kv_heads=2, warps=3, **kw)
    with pytest.raises(ValueError, match="eps"):
        balanced.compile_balanced_front(num_kv_heads=2, rope=True, tap=False, eps=0.0, arch="sm_90a")
    with pytest.raises(ValueError, match="enable_pdl"):
        balanced.compile_balanced_front(num_kv_heads=2, enable_pdl=1, **kw)


def test_the_kernel_reuses_the_cluster_kernels_epilogue_and_constants():
    """One copy of the epilogue's arithmetic: the balanced kernel is a FrontEpilogue and defines
    none of its methods itself; the ring's stage geometry is the cluster kernel's."""
    from musebench.kernels import qkv_front

    assert issubclass(balanced._BalancedFrontKernel, qkv_front.FrontEpilogue)
    shared = {"thread_program", "store_tap", "table_words", "slot_and_position"}
    assert shared <= set(vars(qkv_front.FrontEpilogue))
    assert not shared & set(vars(balanced._BalancedFrontKernel))
    assert (balanced.STAGE_K, balanced.STEP_K, balanced.K_CTA) == (qkv_front.STAGE_K, qkv_front.STEP_K, 1024)


def test_the_shared_workspace_is_never_allocated_during_capture(monkeypatch):
    """A launch without a workspace takes the per-device one, allocated at its first eager call; a
    first request during CUDA-graph capture is refused (allocate before capture)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(balanced, "_WORKSPACES", {})
    with pytest.raises(RuntimeError, match="workspace before CUDA graph capture"):
        balanced.shared_workspace(1, torch.device("cuda", 0))
    assert balanced._WORKSPACES == {}
    cached = torch.zeros(plan.workspace_bytes(1), dtype=torch.uint8)
    balanced._WORKSPACES[(0, 1)] = cached
    assert balanced.shared_workspace(1, torch.device("cuda", 0)) is cached  # found: no allocation, no refusal
    fresh = balanced.new_workspace(2, "cpu")
    assert fresh.numel() == plan.workspace_bytes(2) and not fresh.any()
