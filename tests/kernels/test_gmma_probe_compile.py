"""The wgmma page probe (`kernels.gmma_probe`) compiles for sm_90a with no GPU. PTX assertions: the
4 m64n16k16 steps of Q K^T (K-major, the first from scale-d 0 unless `explicit_zero`) and the 2
m64n64k16 steps of P V (transpose-b 1), each chain behind a `wgmma.fence` and closed by a commit
and a wait; `fence.proxy.async.shared::cta` between the cp.async wait and the barrier that precede
the first wgmma; the mma.sync reference (8 + 16); no local memory. ptxas (where installed)
assembles it without spills and without a wgmma serialization warning; the warning check is
shown to fire on a report that has one."""

from __future__ import annotations

import re

import pytest

from tests._ptxas import assemble, assert_no_spills

pytest.importorskip("cutlass")

from musebench.kernels import gmma_probe  # noqa: E402

S_STEP = "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
PV_STEP = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
MMA_SYNC = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
_PTX: dict[tuple, str] = {}


def _ptx(tmp_path_factory, fault="none", explicit_zero=False) -> str:
    key = (fault, explicit_zero)
    if key not in _PTX:
        folder = tmp_path_factory.mktemp("gmma_probe")
        gmma_probe.compile_probe(fault=fault, explicit_zero=explicit_zero, ptx_dir=str(folder))
        files = sorted(folder.glob("*GmmaPageProbe*.ptx"))
        assert files, "no probe PTX kept"
        _PTX[key] = files[-1].read_text()
    return _PTX[key]


def _steps(ptx: str, step: str) -> list[tuple[int, int]]:
    """(scale-d predicate immediate, transpose-b) of each wgmma of shape `step`, in order."""
    found = re.findall(r"setp\.ne\.b32 p, (\d), 0;\s*" + re.escape(step) + r" \{[^}]*\}, \{[^}]*\}, %rd\d+, p, 1, 1, (\d);",
                       ptx)
    return [(int(a), int(b)) for a, b in found]


@pytest.mark.parametrize("explicit_zero", [False, True])
def test_probe_compiles_with_ptx_assertions(tmp_path_factory, explicit_zero):
    ptx = _ptx(tmp_path_factory, explicit_zero=explicit_zero)
    first = 1 if explicit_zero else 0
    assert _steps(ptx, S_STEP) == [(first, 0), (1, 0), (1, 0), (1, 0)]  # K-major, chained
    assert _steps(ptx, PV_STEP) == [(first, 1), (1, 1)]  # p_lo then p_hi, V N-major
    assert ptx.count(S_STEP) == 4 and ptx.count(PV_STEP) == 2
    assert ptx.count("wgmma.fence.sync.aligned;") == 2
    assert ptx.count("wgmma.commit_group.sync.aligned;") == 2
    assert ptx.count("wgmma.wait_group.sync.aligned 0;") == 2
    assert ptx.count(MMA_SYNC) == 8 + 16
    assert ".local" not in ptx
    # the page reaches the async proxy before any wgmma: cp.async wait, proxy fence, barrier, fence
    order = [ptx.index(s) for s in ("cp.async.wait_group", "fence.proxy.async.shared::cta", "bar.sync",
                                    "wgmma.fence.sync.aligned", S_STEP)]
    assert order == sorted(order), order
    for step in (S_STEP, PV_STEP):
        assert_fenced_chain(ptx, step)


def assert_fenced_chain(ptx: str, step: str) -> None:
    """The chain of `step`: a fence, nothing between it and the first step but that step's own
    predicate (a zeroed accumulator's mov belongs before the fence), then a commit and a wait."""
    start = ptx.index(step)
    fence = ptx.rindex("wgmma.fence.sync.aligned;", 0, start)
    between = [line.strip() for line in ptx[fence:start].splitlines()[1:]]
    assert not [line for line in between if line and not line.startswith(("//", "{", ".reg", "setp"))], between
    assert ptx.index("wgmma.commit_group", start) < ptx.index("wgmma.wait_group", start)


def test_fenced_chain_check_catches_a_register_write_after_the_fence(tmp_path_factory):
    """The check can fail: a zeroing mov moved between the fence and the first step."""
    ptx = _ptx(tmp_path_factory, explicit_zero=True)
    broken = ptx.replace("wgmma.fence.sync.aligned;", "wgmma.fence.sync.aligned;\n\tmov.b32 \t%r1, 0;", 1)
    with pytest.raises(AssertionError):
        assert_fenced_chain(broken, S_STEP)


def test_fault_variants_change_only_the_descriptors(tmp_path_factory):
    clean = _ptx(tmp_path_factory)
    for fault in ("sbo", "no_swizzle"):
        faulty = _ptx(tmp_path_factory, fault=fault)
        assert faulty != clean
        assert faulty.count(S_STEP) == 4 and faulty.count(PV_STEP) == 2


def test_probe_refuses_an_unknown_fault():
    with pytest.raises(ValueError, match="fault must be"):
        gmma_probe.compile_probe(fault="lbo")


SERIALIZATION = re.compile(r"wgmma.*serializ", re.IGNORECASE)


def assert_no_wgmma_serialization(report: str) -> None:
    assert not SERIALIZATION.search(report), report


@pytest.mark.parametrize("explicit_zero", [False, True])
def test_ptxas_assembles_without_spills_or_serialization(tmp_path_factory, tmp_path, explicit_zero):
    report = assemble(_ptx(tmp_path_factory, explicit_zero=explicit_zero), "sm_90a", tmp_path, "gmma_probe")
    assert_no_spills(report)
    assert_no_wgmma_serialization(report)


def test_serialization_check_fires_on_a_warning():
    """The warning check can fail: ptxas's wording for a serialized wgmma."""
    warning = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
               "due to the presence of Extern calls in the function")
    with pytest.raises(AssertionError):
        assert_no_wgmma_serialization(warning)
