"""attn2 compiles for sm_90a and sm_100a with no GPU; PTX assertions: 24 mma.sync per page (8 for
Q K^T, 16 for P V as two BF16 terms), cp.async only, no local memory (no spills), PDL's wait
before the first global read and the release after the main loop; ptxas (where installed) reports
no spill (its own test). Refusals of bad deployments."""

from __future__ import annotations

import re

import pytest

from tests._ptxas import assemble, assert_no_spills

pytest.importorskip("cutlass")

from musebench.kernels import attn2  # noqa: E402


def _ptx(tmp_path, arch, heads, max_model_len, window):
    attn2.compile_attn2(heads, max_model_len, window, attn2.Attn2Build(arch=arch, ptx_dir=str(tmp_path)))
    files = sorted(tmp_path.glob(f"*{arch}*.ptx")) or sorted(tmp_path.glob("*.ptx"))
    assert files, "no PTX kept"
    return files[-1].read_text()


# (KV heads, max_model_len, window): one split (short), the split kernel (tp 8, tp 16), the window
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window", [(2, 2048, 0), (2, 131072, 0), (1, 131072, 0),
                                                          (2, 131072, 2048)])
def test_compiles_with_ptx_assertions(tmp_path, arch, heads, max_model_len, window):
    ptx = _ptx(tmp_path, arch, heads, max_model_len, window)
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 24
    assert "cp.async.cg.shared.global" in ptx
    assert ".local" not in ptx  # no stack: nothing spilled before ptxas
    wait = ptx.index("griddepcontrol.wait")
    first_load = min(m.start() for m in re.finditer(r"ld\.global|cp\.async", ptx))
    assert wait < first_load  # PDL: nothing the previous kernel writes is read before the wait
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.index("mma.sync")  # released after the main loop
    split = max_model_len > 2048
    assert ("atom.acq_rel.gpu.global.add.u32" in ptx) == split
    assert ("ld.global.cg.v4.u32" in ptx) == split


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window", [(2, 2048, 0), (2, 131072, 0), (1, 131072, 0),
                                                          (2, 131072, 2048)])
def test_ptxas_assembles_without_spills(tmp_path, arch, heads, max_model_len, window):
    ptx = _ptx(tmp_path, arch, heads, max_model_len, window)
    assert_no_spills(assemble(ptx, arch, tmp_path, "attn2"))


@pytest.mark.parametrize("args", [(0, 4096, 0), (2, 4, 0), (2, 4096, -1), (2.0, 4096, 0)])
def test_refuses_bad_deployments(args):
    with pytest.raises(ValueError):
        attn2.compile_attn2(*args, attn2.Attn2Build(arch="sm_90a"))
