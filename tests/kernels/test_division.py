"""`kernels.division` on the CPU: the quotient's instruction sequence as compiled (the fast path's
MUFU seed, its FMAs, the range test and the fallback's `div.rn.f32` in a branch of its own), and
attn2's epilogue built on it: its straight-line fast path, no `div.rn.f32` outside the fallbacks.
The bits are the GPU test's (`test_division_gpu.py`)."""

from __future__ import annotations

import re

import pytest

from musebench.kernels import approx, division


def _ptx_ops(text: str) -> list[str]:
    body = [line.split("//")[0].strip() for line in text.splitlines()]
    return [line.split()[0] for line in body if line and not line.startswith(("$", ".", "{", "}"))]


def _ptx_text(compiled) -> str:
    text = compiled.artifacts.PTX
    return text if "\n" in text else open(text).read()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_fast_quotient_is_one_seed_and_five_fmas(tmp_path, arch):
    ops = _ptx_ops(_ptx_text(approx.compile_elementwise("fast_quotient_f32", arch=arch, ptx_dir=str(tmp_path))))
    arithmetic = [op for op in ops if op.startswith(("rcp.", "fma.", "mul.", "div.", "add.", "sub.")) and op.endswith(".f32")]
    assert arithmetic == ["rcp.approx.ftz.f32"] + ["fma.rn.f32"] * 5


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_guarded_quotient_falls_back_to_ieee_division_in_a_branch(tmp_path, arch):
    text = _ptx_text(approx.compile_elementwise("quotient_rn_f32", arch=arch, ptx_dir=str(tmp_path)))
    ops = _ptx_ops(text)
    assert ops.count("div.rn.f32") == 1 and ops.count("rcp.approx.ftz.f32") == 1
    # the division sits after a conditional branch that skips it (the fallback), not on the fast path
    division_at = ops.index("div.rn.f32")
    assert any(op == "bra" or op.startswith("@") for op in ops[division_at - 3:division_at]), ops[division_at - 3:division_at + 1]
    # the range: biased exponents 67 .. 187 (2^-60 <= |x| < 2^61)
    assert division.FAST_EXPONENT_MIN == 67 and division.FAST_EXPONENT_MAX == 187
    assert re.search(r"\b(23)\b", text) and "255" in text


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_attn2_combine_epilogue_runs_its_quotients_on_the_fast_path(tmp_path, arch):
    """The combine's epilogue: 33 `div.rn.f32` remain (the two lists' fallbacks and 1 / sqrt), and
    17 MUFU seeds (one for l, 16 for the sigmoids) come before any of the lists' fallbacks."""
    from musebench.kernels import attn2

    attn2.compile_attn2(2, 131072, 0, attn2.Attn2Build(arch=arch, ptx_dir=str(tmp_path)))
    combine = [p for p in tmp_path.iterdir() if p.suffix == ".ptx" and "Combine" in p.name]
    assert len(combine) == 1
    ops = _ptx_ops(combine[0].read_text())
    assert ops.count("rcp.approx.ftz.f32") == 17
    assert ops.count("div.rn.f32") == 33
