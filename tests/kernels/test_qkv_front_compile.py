"""The QKV front kernel compiles for sm_90a and sm_100a (no GPU needed), and its PTX says so.

Every variant (N = 1152, 2304, 4608; RoPE or NoPE; tap on or off) on both targets, with PTX
assertions: the MMAs (2 per n-tile, 2 n-tiles per warp, 2 warp-steps per stage, 16 stages), the
ring's copies (`cp.async.cg`, 4 weight + 1 x per thread and stage; one wait and one barrier per
stage), its 16-byte fragment reads, the cluster's reduction (8 remote stores per thread, 7 x 8
peer reads in CTA 0, two cluster barriers), the epilogue's inputs read once, the epilogue's arithmetic (one `rsqrt.approx.f32`, never `.ftz`, every add/mul/fma the explicit `.rn`
form, the butterfly's 3 shuffles, 8 BF16 packs of the projection + 4 of the epilogue), RoPE
instructions only with RoPE, tap stores only with the tap; and ptxas assembles without spills.
Compile time here: about 1-3 s per variant.
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
def front_ptx(arch: str, kv: int, rope: bool, tap: bool) -> str:
    folder = tempfile.mkdtemp(prefix="musebench-qkv-front-ptx-")
    qkv_front.compile_qkv_front(num_kv_heads=kv, rope=rope, tap=tap, eps=1e-5, arch=arch, ptx_dir=folder)
    (path,) = glob.glob(f"{folder}/*.ptx")
    with open(path) as f:
        return f.read()


def count(text: str, pattern: str) -> int:
    return len(re.findall(pattern, text))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "nope"])
@pytest.mark.parametrize("tap", [False, True], ids=["plain", "tap"])
def test_variant_compiles_with_the_contracts_instructions(arch, kv, rope, tap):
    text = front_ptx(arch, kv, rope, tap)
    stages = qkv_front.STAGES_PER_CTA
    assert stages == 16
    assert count(text, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == stages * 8
    assert count(text, r"cp\.async\.cg\.shared\.global") == stages * 5
    assert count(text, r"cp\.async\.commit_group") == stages + qkv_front.STAGES[kv] - 1
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


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", KV)
def test_ptxas_assembles_without_spills_within_the_residency_registers(arch, kv, tmp_path):
    """No spills, and few enough registers that ceil(CTAs / 132) CTAs of 128 threads share an SM."""
    report = assemble(front_ptx(arch, kv, True, True), arch, tmp_path, "qkv_front")
    assert_no_spills(report)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    per_sm = -(-qkv_front.CTAS[kv] // qkv_front.H200_SMS)
    assert registers <= (65536 // (per_sm * qkv_front.THREADS)) // 8 * 8, report


def test_knobs_are_validated():
    with pytest.raises(ValueError, match="num_kv_heads"):
        qkv_front.compile_qkv_front(num_kv_heads=3, rope=True, tap=False, eps=1e-5, arch="sm_90a")
    with pytest.raises(ValueError, match="eps"):
        qkv_front.compile_qkv_front(num_kv_heads=2, rope=True, tap=False, eps=0.0, arch="sm_90a")


def test_every_cta_is_resident_at_once_on_an_h200():
    """8 CTAs per head at every N; the ring's stages leave room for every CTA on 132 SMs."""
    for kv in KV:
        ctas = qkv_front.CTAS[kv]
        assert ctas == qkv_front.SPLIT * 18 * kv
        assert qkv_front.ctas_per_sm(kv) * qkv_front.H200_SMS >= ctas, (kv, qkv_front.ctas_per_sm(kv))
        assert qkv_front.smem_bytes(kv) <= 227 * 1024
        # CTA 0's ring takes the 7 peers' FP32 partials [16, 64] after the stream
        assert qkv_front.STAGES[kv] * qkv_front.STAGE_BYTES >= 7 * 16 * 64 * 4
