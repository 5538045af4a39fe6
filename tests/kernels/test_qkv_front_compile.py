"""The QKV front kernel compiles for sm_90a and sm_100a (no GPU needed), and its PTX says so.

Every variant (N = 1152, 2304, 4608; RoPE or NoPE; tap on or off) on both targets, with PTX
assertions: the MMAs (2 per n-tile and warp-step: 8192 / (S 4 32) steps x 16), the streamed
weight loads (8 per step, `L1::no_allocate`), distributed shared memory exactly when S > 1, the
epilogue's arithmetic (one `rsqrt.approx.f32`, never `.ftz`, every add/mul/fma the explicit `.rn`
form, the butterfly's 3 shuffles, 8 BF16 packs of the projection + 4 of the epilogue), RoPE
instructions only with RoPE, tap stores only with the tap; and ptxas assembles without spills.
Compile time here: about 1-3 s per variant.
"""

from __future__ import annotations

import functools
import glob
import re
import shutil
import subprocess
import tempfile

import pytest

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
    split = qkv_front.split_for(kv)
    steps = 8192 // (split * qkv_front.WARPS * qkv_front.STEP_K)
    assert count(text, r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32") == steps * 16
    assert count(text, r"ld\.global\.nc\.L1::no_allocate\.v4\.u32") == steps * 8
    # x rows g and g + 8 per step, plus cos and sin with RoPE
    assert count(text, r"ld\.global\.nc\.v4\.u32") == steps * 2 + (2 if rope else 0)
    assert re.findall(r"rsqrt\.[\w.]+", text) == ["rsqrt.approx.f32"]
    assert ".ftz" not in text
    for op in ("add", "mul", "fma", "sub"):
        plain = re.findall(rf"\b{op}\.f32\b", text)
        assert not plain, f"{op}.f32 without .rn"
    assert count(text, r"shfl\.sync\.bfly") == 3
    assert count(text, r"cvt\.rn\.bf16x2\.f32") == qkv_front.PAIRS_PER_THREAD + 4
    assert (count(text, r"mapa\.shared::cluster") > 0) == (split > 1)
    assert (count(text, r"st\.shared::cluster\.f32") == 8) == (split > 1)
    # the epilogue's fma: 8 sum of squares + 1 rsqrt argument (+ 8 RoPE)
    assert count(text, r"fma\.rn\.f32") == 9 + (8 if rope else 0)
    assert count(text, r"st\.global\.u32") == (qkv_front.PAIRS_PER_THREAD if tap else 0)
    assert count(text, r"st\.global\.v4\.u32") == 2  # out, and the cache slot
    assert count(text, r"ld\.global\.nc\.s64") == (2 if rope else 1)  # position (RoPE), slot


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("kv", KV)
def test_ptxas_assembles_without_spills(kv, tmp_path):
    source = tmp_path / "qkv_front.ptx"
    source.write_text(front_ptx("sm_90a", kv, True, True))
    result = subprocess.run(["ptxas", "-arch=sm_90a", "-O3", "-v", str(source), "-o", str(tmp_path / "qkv_front.cubin")],
                            capture_output=True, text=True, check=True)
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", result.stderr), result.stderr


def test_knobs_are_validated():
    with pytest.raises(ValueError, match="num_kv_heads"):
        qkv_front.compile_qkv_front(num_kv_heads=3, rope=True, tap=False, eps=1e-5, arch="sm_90a")
    with pytest.raises(ValueError, match="split"):
        qkv_front.compile_qkv_front(num_kv_heads=2, rope=True, tap=False, eps=1e-5, split=3, arch="sm_90a")
    with pytest.raises(ValueError, match="eps"):
        qkv_front.compile_qkv_front(num_kv_heads=2, rope=True, tap=False, eps=0.0, arch="sm_90a")


def test_every_shape_launches_144_ctas():
    for kv in KV:
        assert qkv_front.split_for(kv) * 18 * kv == 144
    assert qkv_front.smem_bytes(8) <= 48 * 1024  # no opt-in needed at any split
