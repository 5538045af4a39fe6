"""attn2 compiles for sm_90a and sm_100a with no GPU, with the split kernel's instruction savings
(`SplitIssue`) all on (the default) and all off (the A/B baseline), on the target's tensor-core
path (wgmma on sm_90a) and on mma.sync forced ("sync"). PTX assertions: wgmma's steps per page
(4 m64n16k16 for Q K^T per copy of the scores, 2 m64n72k16 for P V over V and the ones), no
mma.sync or ldmatrix there, the proxy fence, fences matching commits; mma.sync's per page (8 for
Q K^T per copy, 18 for P V: p_lo and p_hi over 8 n-tiles of V and the ones'), V's B fragments
through four `ldmatrix.x4.trans` and K's through `ldmatrix.x4` with `ldmatrix_keys`; on both:
no `prmt`, the warp vote of `skip_unit_rescale`, the cp.async source select `lean_addressing`
drops, cp.async only, no local memory (no spills), PDL's wait before the first global read and
the release after the main loop, its CTAs per SM, no atomics, the partials stored by the split
kernel; the combine's wait before the partials' loads and its tree (shuffles within warps, one barrier); ptxas (where
installed) reports no spill (its own test). Two sibling splits a CTA (`splits_per_cta` 2, the
default at 128k with 2+ KV heads; forced through `Attn2Build`): the page loop twice, the first
split's state held in shared memory between the loops and merged after them (`_pairing_failures`),
no spill, registers and shared memory within the CTAs an SM. Refusals of bad deployments, builds,
tensor-core paths and splits_per_cta. Two pages a softmax step (`pages_per_step` 2: the rule's
for every split plan without a window, so the deployment matrix runs it there; `_page_bodies`)
at tp 2, 4, 8 and 16, 128k, with and without the window, one or two splits a CTA: the two-page
step's MMAs and one barrier a step besides the one-page loops, per split (`_step_failures`), PDL
as the deployments', the hold and merge with two splits a CTA, no spill, registers within the
cap; the build's default is the rule; its refusals. On ints, no compile: the K and V fragment addresses (`k_fragment_row`, `v_fragment_row`)
give every lane its mma B fragments through an emulated
ldmatrix (.trans for V), bank-conflict free (and both checks fail on wrong address functions).
The traced build (`Attn2Build.trace`): its clocks read by every thread, its rows stored by thread 0
only after the kernel's own stores, no spill (the check fails on edited PTX); no deployment reads a
clock; the traced workspace's layout and the refusals of a non-bool trace."""

from __future__ import annotations

import dataclasses
import re

import pytest

from tests._ptxas import assemble, assert_no_spills

pytest.importorskip("cutlass")

from musebench import attn2_layout as lay  # noqa: E402
from musebench.kernels import attn2  # noqa: E402

MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
LDMATRIX_TRANS = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
LDMATRIX = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
WGMMA_S = "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
WGMMA_PV = "wgmma.mma_async.sync.aligned.m64n72k16.f32.bf16.bf16"
# variant name: (SplitIssue, tensor_ops): every saving on or off with the target's tensor-core path
# (wgmma on sm_90a), and every saving on with mma.sync forced (sm_90a's other path; on sm_100a
# the same kernel as "all")
ISSUES = {"all": attn2.SplitIssue(), "none": attn2.SplitIssue.none(), "sync": attn2.SplitIssue()}
# `_ptx`'s default: the deployment's build (`Attn2Build.issue` None: `attn2.deployment_issue`, which
# defers P V where a CTA runs one split of wgmma two-page steps)
DEPLOYMENT = "deployment"
TENSOR_OPS = {"sync": "sync"}
_PTX: dict[tuple, tuple[str, str | None]] = {}


def _ptx(tmp_path_factory, arch, heads, max_model_len, window, issue=DEPLOYMENT, per_cta=None, per_step=None):
    """(split kernel PTX, combine kernel PTX or None), compiled once per module; `issue`: an ISSUES
    name or DEPLOYMENT (the deployment's SplitIssue); `per_cta`:
    `Attn2Build.splits_per_cta` (None: the layout's); `per_step`: `Attn2Build.pages_per_step`
    (None: the deployment's rule, `attn2_layout.pages_per_step`)."""
    key = (arch, heads, max_model_len, window, issue, per_cta, per_step)
    if key not in _PTX:
        folder = tmp_path_factory.mktemp("attn2")
        attn2.compile_attn2(heads, max_model_len, window,
                            attn2.Attn2Build(arch=arch, ptx_dir=str(folder), issue=ISSUES.get(issue),
                                             tensor_ops=TENSOR_OPS.get(issue), splits_per_cta=per_cta,
                                             pages_per_step=per_step))
        split = sorted(folder.glob(f"*_Attn2Kernel_*{arch}*.ptx")) or sorted(folder.glob("*_Attn2Kernel_*.ptx"))
        combine = sorted(folder.glob("*_Attn2CombineKernel_*.ptx"))
        assert split, "no split kernel PTX kept"
        _PTX[key] = (split[-1].read_text(), combine[-1].read_text() if combine else None)
    return _PTX[key]


def _first(ptx, pattern):
    return min((m.start() for m in re.finditer(pattern, ptx)), default=len(ptx))


def _reads_after_wait(ptx, pattern):
    """Whether every instruction matching `pattern` comes after the PTX's griddepcontrol.wait."""
    return ptx.index("griddepcontrol.wait") < _first(ptx, pattern)


PARTIAL_LOADS = r"ld\.global\.v4"  # the combine's 16-byte loads: the partials

def _splits_per_cta(heads: int, max_model_len: int, window: int, per_cta: int | None = None) -> int:
    """The splits a CTA runs in a build: `per_cta`, or the layout's for the deployment's plan; the
    split kernel holds that many copies of the page loop (one per split, one ring)."""
    return per_cta or lay.splits_per_cta(heads, lay.splits(max_model_len, window, heads))


def _pages_per_step(heads: int, max_model_len: int, window: int, per_step: int | None = None) -> int:
    """The pages a softmax step takes in a build: `per_step`, or the deployment's rule."""
    return per_step or lay.pages_per_step(window, lay.splits(max_model_len, window, heads))


def _page_bodies(heads: int, max_model_len: int, window: int, per_cta: int | None = None,
                 per_step: int | None = None) -> int:
    """Copies of a page's body (its MMAs, one copy of the scores each) in the split kernel. One
    page a step: one page loop, or with two splits a CTA three (the first split's pages in two
    ranges, by the split their copies belong to, then the second split's; where no split has
    more pages than the ring holds ahead, table_entries <= STAGES - 1: 8192 at 256 splits, the
    first range is empty and LLVM drops it: two). Two pages a step, per split: the step's two
    pages and the one-page loops (`_one_page_loops`: the lone last page, and with a window the
    lone first page)."""
    pairs = _splits_per_cta(heads, max_model_len, window, per_cta)
    splits = lay.splits(max_model_len, window, heads)
    if _pages_per_step(heads, max_model_len, window, per_step) == 2:
        return pairs * (2 + _one_page_loops(window))
    if pairs == 2:
        return 3 if lay.split_table_entries(max_model_len, window, splits) > lay.PIPELINE_STAGES - 1 else 2
    return 1


def _wgmma_page(ptx: str, copies: int, loops: int = 1) -> bool:
    """The wgmma path's page, read off the split kernel's PTX (`loops` page loops): Q K^T four k16
    steps per copy of the scores, P V p_lo's and p_hi's step over V and the ones (N = 72), B by
    descriptor (no mma.sync, no ldmatrix), the proxy fence (the copies and the ones, seen by
    wgmma), a commit per fence."""
    return (ptx.count(WGMMA_S) == loops * copies * attn2.K_TILES and ptx.count(WGMMA_PV) == 2 * loops
            and "mma.sync" not in ptx and "ldmatrix" not in ptx
            and "fence.proxy.async.shared::cta" in ptx
            and ptx.count("wgmma.fence.sync.aligned") == ptx.count("wgmma.commit_group.sync.aligned"))


# (KV heads, max_model_len, window): the short plan (one split, max_model_len <= SHORT_MAX_LEN: 64), the
# smallest split plans past it (96: 2 splits, an 8-thread combine; 128: 4 splits), a small split plan (2048: 64 splits, the deep ring), the 4096-token plan (128 partials), tp 4 (two
# splits a CTA), tp 8 and 16 at 128k, the window; two pages a step where the rule takes them
# (every split plan without a window)
DEPLOYMENTS = [(2, 64, 0), (2, 96, 0), (2, 128, 0), (2, 2048, 0), (2, 4096, 0), (4, 131072, 0), (2, 131072, 0), (1, 131072, 0), (2, 131072, 2048)]
# (arch, KV heads, max_model_len, window, issue) where ptxas spills under the register cap: none
# (the one-KV-head sm_90a baseline spilled 108 bytes until V's fragments came through ldmatrix,
# which holds 4 address registers where the word loads held 8, and needs no prmt temporaries)
KNOWN_SPILLS: set[tuple] = set()


ARCH_ISSUES = [(arch, issue) for arch in ("sm_90a", "sm_100a") for issue in sorted(ISSUES)]
MMA_STEP = r"mma\.sync\.aligned|wgmma\.mma_async"  # a tensor-core step of either path
MERGE_WEIGHT = r"ex2\.approx\.f32"  # merge_into's 2^x (the page loop's is ex2.approx.ftz.f32)


def _pairing_failures(ptx: str, per_cta: int, order: bool = True) -> list[str]:
    """What the split kernel's PTX lacks for `per_cta` sibling splits a CTA (empty: nothing). With 2:
    the first split's state held between its page loops and the second split's (PENDING_VALUES
    shared-memory word stores after the first MMA, one or two loops' MMAs before them, one loop's
    after), read back after the last MMA
    (PENDING_VALUES word loads) and merged there (merge_into's two weights for each of a thread's
    two rows: ex2.approx.f32 without ftz, which the page loop never uses). With 1: none of these
    (the page table's prefetch stores come before any MMA). `order` False: the MMAs' places
    around the hold are not counted (where LLVM lays a block of the first split out after it,
    reached by a branch and jumping back: `test_two_pages_a_step_compiles_without_spills`)."""
    steps = [m.start() for m in re.finditer(MMA_STEP, ptx)]
    if not steps:
        return ["no tensor-core step"]
    first, last = min(steps), max(steps)
    held = [m.start() for m in re.finditer(r"st\.shared\.u32", ptx) if m.start() > first]
    read = [m.start() for m in re.finditer(r"ld\.shared\.u32", ptx) if m.start() > last]
    weights = [m.start() for m in re.finditer(MERGE_WEIGHT, ptx)]
    pending = lay.PENDING_VALUES if per_cta == 2 else 0
    failures = []
    if len(held) != pending:
        failures.append(f"{len(held)} shared word stores after the first MMA (the held split: {pending})")
    if len(read) != pending:
        failures.append(f"{len(read)} shared word loads after the last MMA (the held split read back: {pending})")
    if len(weights) != 2 * 2 * (per_cta - 1):
        failures.append(f"{len(weights)} merge weights (2 rows x 2 children a merge: {4 * (per_cta - 1)})")
    if weights and min(weights) < last:
        failures.append("a merge weight before the last page's MMA")
    if held and order:
        # the first split's copies of the page loop (`_Attn2Kernel.kernel`: two ranges, one where
        # LLVM drops an empty first range), the hold, then the second split's one copy
        before = sum(x < min(held) for x in steps)
        after = sum(x > max(held) for x in steps)
        if not after or before not in (after, 2 * after) or before + after != len(steps):
            failures.append(f"the hold not after the first split's page loops and before the second's ({before} "
                            f"MMAs before, {after} after, {len(steps)} in all)")
    return failures


def _check_split_ptx(ptx: str, combine: str | None, arch: str, issue: str, heads: int, max_model_len: int,
                     window: int, per_cta: int | None = None, per_step: int | None = None) -> None:
    """The split kernel's PTX assertions (and the combine's where there is one), for a build of
    `issue`, `per_cta` (None: the layout's) splits a CTA and `per_step` (None: the rule's) pages a
    step."""
    on = ISSUES[issue]
    copies = 2 if on.mask_edges_only else 1  # of the scores: masked and unmasked
    pairs = _splits_per_cta(heads, max_model_len, window, per_cta)
    loops = _page_bodies(heads, max_model_len, window, per_cta, per_step)  # page bodies: see `_page_bodies`
    wgmma = attn2.tensor_ops_for(arch, TENSOR_OPS.get(issue)) == "wgmma"
    assert wgmma == (arch == "sm_90a" and issue not in TENSOR_OPS)
    assert "mbarrier" not in ptx and "trap;" not in ptx  # one CTA barrier a page, no ring mbarriers
    if wgmma:
        assert _wgmma_page(ptx, copies, loops)
        assert "wgmma.wait_group.sync.aligned 1;" not in ptx  # every chain waited for: nothing overlapped
    else:
        # Q K^T: 2 n-tiles x 4 k-steps per copy; P V: p_lo and p_hi over 8 n-tiles of V and the ones'
        assert ptx.count(MMA) == loops * (copies * 2 * attn2.K_TILES + 2 * (attn2.V_TILES + 1))
        assert ptx.count(LDMATRIX_TRANS) == loops * attn2.V_TILE_PAIRS  # P V's B fragments, two n-tiles each
        # Q K^T's B fragments with ldmatrix_keys: two k-steps of 8 keys an ldmatrix, per copy of the scores
        assert ptx.count(LDMATRIX) == loops * on.ldmatrix_keys * copies * 2 * attn2.K_TILES // 2
        assert "wgmma" not in ptx
    assert ("vote.sync.all.pred" in ptx) == on.skip_unit_rescale
    assert "ld.shared.u32" in ptx  # the page-table entries (and the held split): no fragment word loads left
    assert "prmt" not in ptx  # the natural layout needs no joining of V's words
    assert "cp.async.cg.shared.global" in ptx
    assert ".local" not in ptx  # no stack: nothing spilled before ptxas
    assert _reads_after_wait(ptx, r"ld\.global|cp\.async")  # PDL: nothing the previous kernel writes is read before
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.index("mma")  # released after the main loop
    assert f".minnctapersm {lay.split_ctas_per_sm(arch)}" in ptx  # the register cap of CTAs an SM
    assert "atom." not in ptx  # no counters: nothing inside a launch waits on another CTA
    split = lay.splits(max_model_len, window, heads) > 1  # one split up to SHORT_MAX_LEN (or a tiny window)
    assert ("st.global.v4.u32" in ptx) == split  # the partial; one split stores its output (v2) itself
    assert ptx.count("st.global.v4.u32") == (lay.PARTIAL_O_VECTORS + 1) * split  # one partial a CTA, either way
    assert (combine is not None) == split
    if split:
        assert _pairing_failures(ptx, pairs) == []
        assert "mma.sync" not in combine and "atom." not in combine and ".local" not in combine
        assert f".minnctapersm {attn2.COMBINE_CTAS_PER_SM}" in combine  # ptxas free to take its registers
        # the partials (16-byte loads) only after the wait; the gate and L (the split kernel's
        # own inputs, finished before it released this grid) may come before it
        assert _reads_after_wait(combine, PARTIAL_LOADS)
        assert combine.index("griddepcontrol.launch_dependents") > combine.index("griddepcontrol.wait")
        # the tree above the groups: log2(groups a warp) levels by shuffles within each warp (18
        # values a node: 16 of O, m, l; three levels from 8 groups on), then, with more than one warp,
        # warp 0 merges the warps' nodes from shared memory behind one barrier (a plan of 4 splits:
        # 4 groups, 16 threads, one warp: two levels, no shared memory, no barrier)
        groups = lay.combine_groups(lay.splits(max_model_len, window, heads) // pairs)
        warps = max(1, lay.COMBINE_QUADS * groups // 32)
        levels = (groups // warps).bit_length() - 1
        assert levels == (3 if groups >= 8 else {4: 2, 2: 1}[groups])
        assert combine.count("shfl.sync.down") == levels * (lay.LANE_DIMS + 2)
        assert ("st.shared.v4.u32" in combine and "ld.shared.v4.u32" in combine) == (warps > 1)
        assert combine.count("bar.sync") + combine.count("barrier.sync") == (warps > 1)


# (KV heads, max_model_len, window): one split (short), the small split plans, the split kernel (tp 8
# and tp 16, one split a CTA), the window
@pytest.mark.parametrize("arch, issue", ARCH_ISSUES)
@pytest.mark.parametrize("heads, max_model_len, window", DEPLOYMENTS)
def test_compiles_with_ptx_assertions(tmp_path_factory, arch, heads, max_model_len, window, issue):
    ptx, combine = _ptx(tmp_path_factory, arch, heads, max_model_len, window, issue)
    _check_split_ptx(ptx, combine, arch, issue, heads, max_model_len, window)


def test_ptx_order_check_catches_an_early_partial_read(tmp_path_factory):
    """The order assertions can fail: a partial's 16-byte load moved before the combine's wait,
    or a cp.async before the split kernel's, trips them (the compiled PTX, edited)."""
    split, combine = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0)
    load = re.search(r"ld\.global\.v4\.u32[^\n]*\n", combine).group(0)
    moved = combine.replace(load, "", 1).replace("griddepcontrol.wait;", load + "griddepcontrol.wait;", 1)
    assert _reads_after_wait(combine, PARTIAL_LOADS) and not _reads_after_wait(moved, PARTIAL_LOADS)
    copy = re.search(r"cp\.async\.cg[^\n]*\n", split).group(0)
    early = split.replace("griddepcontrol.wait;", copy + "griddepcontrol.wait;", 1)
    assert not _reads_after_wait(early, r"ld\.global|cp\.async")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_lean_addressing_drops_the_source_selects(tmp_path_factory, arch):
    """lean_addressing: no 64-bit select of the cp.async source at any page load, two chunks each.
    One page a step: ring - 1 before the loop (the ring's depth `attn2_layout.ring_stages`: 8, or
    `attn2_layout.PAIRED_DEEP_RING_STAGES` with two splits a CTA, 256 CTAs), one in each copy of the
    page loop (three with two splits a CTA). Two pages a step (the deployment's): ring - 2 before, two in each step loop and one in
    each one-page loop (a split's: `_page_bodies`). One and two splits a CTA, both step sizes."""
    for per_cta in (None, 2):
        for per_step in (1, 2):
            on, _ = _ptx(tmp_path_factory, arch, 2, 131072, 0, "all", per_cta, per_step)
            off, _ = _ptx(tmp_path_factory, arch, 2, 131072, 0, "none", per_cta, per_step)
            splits = lay.splits(131072, 0, 2)
            # two a CTA: 256 CTAs, the paired deep ring
            ring = lay.ring_stages(0, 2, splits, per_cta or lay.splits_per_cta(2, splits))
            loads = ring - per_step + _page_bodies(2, 131072, 0, per_cta, per_step)
            assert off.count("selp.b64") - on.count("selp.b64") == 2 * loads, (per_cta, per_step)


@pytest.mark.parametrize("arch, issue", ARCH_ISSUES)
@pytest.mark.parametrize("heads, max_model_len, window", DEPLOYMENTS)
def test_ptxas_assembles_without_spills(request, tmp_path, tmp_path_factory, arch, heads, max_model_len, window,
                                       issue):
    if (arch, heads, max_model_len, window, issue) in KNOWN_SPILLS:
        request.applymarker(pytest.mark.xfail(strict=True, reason="ptxas spills here under the register cap"))
    ptx, combine = _ptx(tmp_path_factory, arch, heads, max_model_len, window, issue)
    report = assemble(ptx, arch, tmp_path, "attn2")
    assert_no_spills(report)
    assert "Performance Loss" not in report  # e.g. wgmma serialized: ptxas waited where the code did not
    if combine is not None:
        assert_no_spills(assemble(combine, arch, tmp_path, "attn2_combine"))


def test_issue_knobs_name_distinct_variants():
    """Each SplitIssue setting is its own compiled variant (the compile cache key holds it)."""
    before = len(attn2.compilation.CACHE)
    for issue in (attn2.SplitIssue(), attn2.SplitIssue.none(), attn2.SplitIssue(mask_edges_only=False)):
        attn2.compile_attn2(2, 4096, 0, attn2.Attn2Build(arch="sm_90a", issue=issue))
    split_keys = [k for k in attn2.compilation.CACHE.keys() if k[0].endswith("_Attn2Kernel")
                  and dict(k[3])["max_model_len"] == 4096 and k[1] == "sm_90a" and k[2] is None]
    assert len({tuple(sorted(dict(k[3]).items())) for k in split_keys}) >= 3
    assert len(attn2.compilation.CACHE) >= before + 3


def test_the_wgmma_page_check_can_fail(tmp_path_factory):
    """`_wgmma_page` holds for sm_90a's default kernel and fails on the mma.sync kernel, on a
    missing proxy fence, and on a dropped P V step (the compiled PTX, edited)."""
    wgmma, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, "all", 1, 1)
    sync, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, "sync", 1, 1)
    paired, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, "all", 2, 1)
    assert _wgmma_page(wgmma, 2) and not _wgmma_page(sync, 2)
    assert _wgmma_page(paired, 2, loops=3) and not _wgmma_page(paired, 2) and not _wgmma_page(wgmma, 2, loops=3)
    assert not _wgmma_page(wgmma.replace("fence.proxy.async.shared::cta", "membar.cta"), 2)
    step = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n72k16[^;]*;", wgmma).group(0)
    assert not _wgmma_page(wgmma.replace(step, "", 1), 2)


def test_tensor_ops_per_target_and_refusals():
    """wgmma is sm_90a's default and only sm_90a's: asked for elsewhere it is refused before any
    compile, and an unknown path name is refused when the build is made."""
    assert attn2.tensor_ops_for("sm_90a", None) == "wgmma" and attn2.tensor_ops_for("sm_90a", "sync") == "sync"
    assert attn2.tensor_ops_for("sm_100a", None) == "sync"
    with pytest.raises(ValueError, match="needs sm_90a"):
        attn2.tensor_ops_for("sm_100a", "wgmma")
    with pytest.raises(ValueError, match="needs sm_90a"):
        attn2.compile_attn2(2, 4096, 0, attn2.Attn2Build(arch="sm_100a", tensor_ops="wgmma"))
    with pytest.raises(ValueError, match="tensor_ops must be"):
        attn2.Attn2Build(tensor_ops="hgmma")


@pytest.mark.parametrize("args", [(0, 4096, 0), (2, 4, 0), (2, 4096, -1), (2.0, 4096, 0)])
def test_refuses_bad_deployments(args):
    with pytest.raises(ValueError):
        attn2.compile_attn2(*args, attn2.Attn2Build(arch="sm_90a"))


def test_refuses_an_issue_that_is_not_a_split_issue():
    with pytest.raises(ValueError, match="SplitIssue"):
        attn2.Attn2Build(issue={"mask_edges_only": False})  # type: ignore[arg-type]


def test_split_issue_names():
    named = attn2.SplitIssue.named
    assert named("all") == attn2.SplitIssue() and named("none") == attn2.SplitIssue.none()
    assert named("mask+lean") == attn2.SplitIssue(mask_edges_only=True, skip_unit_rescale=False, lean_addressing=True,
                                                  ldmatrix_keys=False)
    assert named("rescale") == attn2.SplitIssue(False, True, False, False)
    assert named("lean+keys") == attn2.SplitIssue(False, False, True, True)
    assert named("mask+rescale+lean+keys") == named("all")
    assert [f.name for f in dataclasses.fields(attn2.SplitIssue)] == ["mask_edges_only", "skip_unit_rescale",
                                                                       "lean_addressing", "ldmatrix_keys",
                                                                       "defer_values", "prefetch_pages"]
    # the experiments are off in "all" (the default) and on only where named
    assert not named("all").defer_values and not named("none").defer_values
    assert named("mask+rescale+lean+keys+defer") == dataclasses.replace(named("all"), defer_values=True)
    assert not named("all").prefetch_pages and not named("none").prefetch_pages
    assert named("mask+rescale+lean+keys+defer+prefetch") == dataclasses.replace(named("all"), defer_values=True,
                                                                                  prefetch_pages=True)
    assert attn2.deployment_issue(True, 2, 1).prefetch_pages is False
    assert named("defer") == attn2.SplitIssue(False, False, False, False, True)
    # the measured-and-removed switches are unknown names now
    for bad in ("", "mask+", "Mask", "all+mask", "fast", "key", "ring", "all+ring", "ring+overlap", "all+trim",
                "mask+mask", "none+mask"):
        with pytest.raises(ValueError, match="SplitIssue"):
            named(bad)


# ---------------------------------------------------------------------------------------------
# Two sibling splits a CTA (`attn2_layout.splits_per_cta`, `Attn2Build.splits_per_cta`).

# (KV heads, max_model_len, window, splits_per_cta, pages_per_step): the one-split-a-CTA kernel of
# tp 8 at 128k (forced), two a CTA forced where the layout also picks it (4 KV heads at 128k) and
# where it does not (2 KV heads at 8192: 256 splits, one a CTA by default); the rule's pages a step
# (None: 2 here), and the two-splits builds again with one page a step forced (an experiment)
PAIRED_BUILDS = [(2, 131072, 0, 1, None), (4, 131072, 0, 2, None), (2, 8192, 0, 2, None), (4, 131072, 0, 2, 1),
                 (2, 8192, 0, 2, 1)]
PAIRED_ARCH_ISSUES = [("sm_90a", "all"), ("sm_90a", "sync"), ("sm_100a", "all")]
REGISTERS_PER_SM = 65536


def test_deployments_pair_splits_from_1024_leaves():
    """tp 4 and 2 at 128k (1024, 2048 leaves) run two splits a CTA, tp 8 and 16 one
    (`attn2_layout.PAIRED_LEAVES`)."""
    assert lay.PAIRED_LEAVES == 1024 and lay.splits(131072, 0, 2) == 256
    assert [_splits_per_cta(heads, 131072, 0) for heads in (1, 2, 4, 8)] == [1, 1, 2, 2]


@pytest.mark.parametrize("arch, issue", PAIRED_ARCH_ISSUES)
@pytest.mark.parametrize("heads, max_model_len, window, per_cta, per_step", PAIRED_BUILDS)
def test_splits_per_cta_builds_compile_without_spills(tmp_path_factory, tmp_path, arch, issue, heads, max_model_len,
                                                      window, per_cta, per_step):
    """Forced splits_per_cta on both targets and both tensor-core paths: the PTX assertions of the
    deployments (page loops, pairing, PDL, partial), ptxas assembles it without spills or
    serialization, within the register cap of the target's CTAs an SM (128 a thread on sm_90a)."""
    ptx, combine = _ptx(tmp_path_factory, arch, heads, max_model_len, window, issue, per_cta, per_step)
    _check_split_ptx(ptx, combine, arch, issue, heads, max_model_len, window, per_cta, per_step)
    report = assemble(ptx, arch, tmp_path, "attn2_paired")
    assert_no_spills(report)
    assert "Performance Loss" not in report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers <= REGISTERS_PER_SM // (lay.CTA_THREADS * lay.split_ctas_per_sm(arch)), report


@pytest.mark.parametrize("arch, issue", PAIRED_ARCH_ISSUES)
@pytest.mark.parametrize("heads, max_model_len, window, per_cta, per_step", PAIRED_BUILDS)
def test_splits_per_cta_combines_assemble_without_spills(tmp_path_factory, tmp_path, arch, issue, heads,
                                                         max_model_len, window, per_cta, per_step):
    """The combine of S / splits_per_cta partials assembles without spills (128 partials spilled 4
    bytes until the combine's launch bound, `attn2.COMBINE_CTAS_PER_SM`)."""
    _, combine = _ptx(tmp_path_factory, arch, heads, max_model_len, window, issue, per_cta, per_step)
    assert_no_spills(assemble(combine, arch, tmp_path, "attn2_paired_combine"))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_tp8_deployment_stays_within_the_register_cap(tmp_path_factory, tmp_path, arch):
    """tp 8 at 128k, the deployment: ptxas's registers within the CTAs an SM's cap."""
    ptx, _ = _ptx(tmp_path_factory, arch, 2, 131072, 0)
    report = assemble(ptx, arch, tmp_path, "attn2_default")
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers <= REGISTERS_PER_SM // (lay.CTA_THREADS * lay.split_ctas_per_sm(arch)), report


def test_the_pairing_check_fails_on_the_other_variants_ptx(tmp_path_factory):
    """Fault injection for `_pairing_failures`: it holds for each kernel and fails on the other's
    PTX (1 checked as 2 and 2 as 1, both paths), on a held value's store dropped, on a merge
    weight taken with ftz (the page loop's instruction), and on the hold moved before the first
    split's page loop (the compiled PTX, edited)."""
    for issue in ("all", "sync"):
        one, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, issue, 1)
        two, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, issue, 2)
        assert _pairing_failures(one, 1) == [] and _pairing_failures(two, 2) == []
        assert _pairing_failures(one, 2) and _pairing_failures(two, 1)
    held = [m for m in re.finditer(r"\tst\.shared\.u32[^\n]*\n", two)][-1]
    assert _pairing_failures(two[:held.start()] + two[held.end():], 2)
    assert _pairing_failures(two.replace("ex2.approx.f32", "ex2.approx.ftz.f32", 1), 2)
    first_step = re.search(MMA_STEP, two).start()
    line_start = two.rindex("\n", 0, first_step) + 1
    stores = "".join(m.group(0) for m in re.finditer(r"\tst\.shared\.u32[^\n]*\n", two[first_step:]))
    early = re.sub(r"\tst\.shared\.u32[^\n]*\n", "", two[first_step:])
    assert _pairing_failures(two[:line_start] + stores + two[line_start:first_step] + early, 2)


def _split_kernel(heads, max_model_len, window, per_cta, wgmma):
    """The split kernel object of a build (no compile)."""
    knobs = attn2._variant(heads, max_model_len, window, None, per_cta)
    return attn2._Attn2Kernel(**knobs, enable_pdl=True, wgmma=wgmma)


# sm_90a: 227 KB of shared memory a CTA at most, the SM's 228 KB shared by its CTAs, 1 KB of each
# CTA's reserved: four CTAs fit when each asks for at most 227 KB / 4 - 1 KB
SM90_SMEM_FOR_FOUR = 227 * 1024 // 4 - 1024  # 57088
SM90_SMEM_FOR_TWO = 227 * 1024 // 2 - 1024  # 115200: the deep rings' two CTAs an SM


@pytest.mark.parametrize("heads, max_model_len, window", [(2, 131072, 0), (4, 131072, 0), (8, 131072, 0),
                                                          (2, 8192, 0), (2, 131072, 2048)])
@pytest.mark.parametrize("wgmma", [True, False])
def test_two_splits_a_cta_fit_four_ctas_an_sm_on_sm90(heads, max_model_len, window, wgmma):
    """With two splits a CTA the split kernel's shared memory (ring, ones, two splits' page-table
    entries, the held split: PENDING_BYTES) still lets SPLIT_CTAS_PER_SM (4) CTAs share an H200 SM:
    54400 bytes on the wgmma path at 128k, 57088 allowed. One split a CTA: the ring, ones and
    table alone (PENDING_BYTES less)."""
    two = _split_kernel(heads, max_model_len, window, 2, wgmma).smem_bytes()
    one = _split_kernel(heads, max_model_len, window, 1, wgmma).smem_bytes()
    assert lay.split_ctas_per_sm("sm_90a") == 4 and SM90_SMEM_FOR_FOUR == 57088
    assert two <= SM90_SMEM_FOR_FOUR, two
    assert lay.PENDING_BYTES <= two - one <= lay.PENDING_BYTES + attn2.VECTOR_BYTES * (
        -(-lay.split_table_entries(max_model_len, window, lay.splits(max_model_len, window, heads)) * 4 // 16))



@pytest.mark.parametrize("per_cta", [3, 0, 4, True, "2"])
def test_splits_per_cta_outside_the_choices_is_refused_by_the_build(per_cta):
    with pytest.raises(ValueError, match="splits_per_cta"):
        attn2.Attn2Build(splits_per_cta=per_cta)


def test_a_float_splits_per_cta_is_refused_by_the_build():
    with pytest.raises(ValueError, match="splits_per_cta"):
        attn2.Attn2Build(splits_per_cta=2.0)


@pytest.mark.parametrize("heads, max_model_len, window", [(2, 64, 0), (8, 1024, 0), (2, 2048, 0), (2, 131072, 0)])
def test_two_splits_a_cta_of_a_one_split_plan_is_refused_before_compile(heads, max_model_len, window):
    """splits_per_cta 2 needs two splits to pair: with a 1-split plan (max_model_len <= SHORT_MAX_LEN,
    64, or num_splits 1 forced) compile_attn2 refuses it before compiling anything."""
    before = len(attn2.compilation.CACHE)
    num_splits = 1 if max_model_len > lay.SHORT_MAX_LEN else None
    with pytest.raises(ValueError, match="splits_per_cta"):
        attn2.compile_attn2(heads, max_model_len, window,
                            attn2.Attn2Build(arch="sm_90a", splits_per_cta=2, num_splits=num_splits))
    assert len(attn2.compilation.CACHE) == before  # nothing compiled


def _cpu_launch_args(max_model_len: int) -> dict:
    """`attn2.launch`'s arguments on CPU tensors (2 KV heads, one request of 40 tokens, no
    workspace): every refusal before the device check can be reached with them, nothing launches."""
    import torch

    width = 2 * 8 * 64
    return dict(q=torch.zeros(8, width, dtype=torch.bfloat16), gate=torch.zeros(8, width, dtype=torch.bfloat16),
                kv_cache=torch.zeros(3, 2, 16, 128, dtype=torch.bfloat16),
                page_table=torch.zeros(1, lay.max_pages(max_model_len), dtype=torch.int32),
                seq_lens=torch.tensor([40], dtype=torch.int32), out=torch.zeros(8, width, dtype=torch.bfloat16),
                workspace=None, max_model_len=max_model_len, window=0)


def test_launch_refuses_splits_per_cta_before_anything_launches():
    """`launch(..., splits_per_cta=)`: outside the choices, or 2 with one split, refused before the
    tensors are even checked for a device (CPU tensors here)."""
    args = _cpu_launch_args(lay.SHORT_MAX_LEN)
    before = len(attn2.compilation.CACHE)
    for per_cta in (2, 3):
        with pytest.raises(ValueError, match="splits_per_cta"):
            attn2.launch(**args, splits_per_cta=per_cta)
    with pytest.raises(ValueError, match="one CUDA device"):  # 1 is valid: the device check is next
        attn2.launch(**args, splits_per_cta=1)
    assert len(attn2.compilation.CACHE) == before


def test_splits_per_cta_is_its_own_variant_and_none_is_the_layouts():
    """None is the layout's choice (its compile key holds the resolved count): at 8192 with 2 KV
    heads that is 1, the same variant as 1; 2 is another."""
    before = set(attn2.compilation.CACHE.keys())
    for per_cta in (None, 1, 2):
        attn2.compile_attn2(2, 8192, 0, attn2.Attn2Build(arch="sm_90a", splits_per_cta=per_cta))
    new = [dict(k[3]) for k in set(attn2.compilation.CACHE.keys()) - before if k[0].endswith("_Attn2Kernel")]
    assert sorted(k["splits_per_cta"] for k in new) in ([2], [1, 2])
    combines = [dict(k[3]) for k in set(attn2.compilation.CACHE.keys()) - before
                if k[0].endswith("_Attn2CombineKernel")]
    assert sorted(k["splits_per_cta"] for k in combines) in ([2], [1, 2])  # the combine reads S / per_cta partials


# ---------------------------------------------------------------------------------------------
# V's fragment addresses, on ints: an emulated ldmatrix.x4.trans over a ring stage whose every
# 16-bit element says which (slot, dim) of V (or of K) it is.


def _stage_image() -> dict[int, tuple]:
    """byte offset in a stage -> ("K" | "V", slot, dim), laid out as page_load writes it (16-byte
    chunks of a slot XOR-swizzled by slot & 7)."""
    image = {}
    for slot in range(lay.PAGE_TOKENS):
        for chunk in range(attn2.CHUNKS_PER_SLOT):
            place = slot * attn2.SLOT_BYTES + (chunk ^ (slot & attn2.SWIZZLE_MASK)) * attn2.VECTOR_BYTES
            for e in range(attn2.VECTOR_BYTES // attn2.BF16_BYTES):
                dim = chunk * 8 + e
                part = "K" if dim < lay.HEAD_DIM else "V"
                image[place + attn2.BF16_BYTES * e] = (part, slot, dim % lay.HEAD_DIM)
    return image


def _ldmatrix_x4(image, address_of, trans):
    """Each lane's four results (each a (low, high) pair of elements) of ldmatrix.x4 (.trans when
    `trans`) whose lane l addresses row l % 8 of matrix l // 8 at address_of(l): lane 4g + c gets
    row g, columns 2c, 2c + 1; transposed, rows 2c, 2c + 1 of column g."""
    rows = [[address_of(8 * i + r) for r in range(8)] for i in range(4)]
    for row in (a for matrix in rows for a in matrix):
        assert row % attn2.VECTOR_BYTES == 0 and 0 <= row < lay.PAGE_BYTES
    if trans:
        return [[tuple(image[rows[i][2 * (lane % 4) + k] + attn2.BF16_BYTES * (lane // 4)] for k in range(2))
                 for i in range(4)] for lane in range(32)]
    return [[tuple(image[rows[i][lane // 4] + attn2.BF16_BYTES * (2 * (lane % 4) + k)] for k in range(2))
             for i in range(4)] for lane in range(32)]


def _k_fragments_are_mma_b(address_of) -> bool:
    """Whether result 2h (2h + 1) of (nt, quad) is, in every lane 4g + c, b0 (b1) of k-step
    kk = 2 quad + h for keys 8 nt ..: K's key 8 nt + g, dims 16 kk + 2c, + 1 (b1: 8 more)."""
    image = _stage_image()
    for nt in range(2):
        for quad in range(attn2.K_TILES // 2):
            got = _ldmatrix_x4(image, lambda lane: address_of(lane, nt, quad), trans=False)
            for lane in range(32):
                g, c = divmod(lane, 4)
                for h in range(2):
                    kk = 2 * quad + h
                    for b in range(2):
                        want = tuple(("K", 8 * nt + g, 16 * kk + 8 * b + 2 * c + k) for k in range(2))
                        if got[lane][2 * h + b] != want:
                            return False
    return True


def _fragments_are_mma_b(address_of) -> bool:
    """Whether result 2h (2h + 1) of pair p is, in every lane 4g + c, b0 (b1) of n-tile t = 2p + h:
    V's keys 2c, 2c + 1 (8 + 2c, 9 + 2c) of dim 8t + g, the lower key in the low half."""
    image = _stage_image()
    for pair in range(attn2.V_TILE_PAIRS):
        got = _ldmatrix_x4(image, lambda lane: address_of(lane, pair), trans=True)
        for lane in range(32):
            g, c = divmod(lane, 4)
            for h in range(2):
                t = 2 * pair + h
                for b in range(2):  # b0: keys 2c, 2c + 1; b1: 8 more
                    want = tuple(("V", 8 * b + 2 * c + k, lay.TILE_DIMS * t + g) for k in range(2))
                    if got[lane][2 * h + b] != want:
                        return False
    return True


def _conflict_free(address_of, *selectors) -> bool:
    """Whether each matrix's 8 rows lie in 8 different 16-byte bank groups (the 32 banks span 128
    bytes): one shared-memory wavefront per matrix, for every selector tuple (pair; nt, quad)."""
    return all(len({(address_of(8 * i + r, *sel) // attn2.VECTOR_BYTES) % 8 for r in range(8)}) == 8
               for sel in selectors for i in range(4))


V_SELECTORS = [(pair,) for pair in range(attn2.V_TILE_PAIRS)]
K_SELECTORS = [(nt, quad) for nt in range(2) for quad in range(attn2.K_TILES // 2)]


def test_v_fragment_rows_give_the_mma_b_fragments_without_bank_conflicts():
    assert _fragments_are_mma_b(attn2.v_fragment_row)
    assert _conflict_free(attn2.v_fragment_row, *V_SELECTORS)


def test_k_fragment_rows_give_the_mma_b_fragments_without_bank_conflicts():
    assert _k_fragments_are_mma_b(attn2.k_fragment_row)
    assert _conflict_free(attn2.k_fragment_row, *K_SELECTORS)


def test_k_fragment_checks_fail_on_wrong_addresses():
    """Fault injection: the k-steps of a quad swapped fails the fragment check; rows read
    unswizzled fail both."""
    def swapped(lane, nt, quad):
        return attn2.k_fragment_row((lane + 16) % 32, nt, quad)

    def unswizzled(lane, nt, quad):
        return (8 * nt + lane % 8) * attn2.SLOT_BYTES + (4 * quad + lane // 8) * attn2.VECTOR_BYTES

    assert _conflict_free(swapped, *K_SELECTORS) and not _k_fragments_are_mma_b(swapped)
    assert not _k_fragments_are_mma_b(unswizzled) and not _conflict_free(unswizzled, *K_SELECTORS)


def test_v_fragment_checks_fail_on_wrong_addresses():
    """Fault injection: matrices 1 and 2 swapped (keys 8-15 of n-tile 2p read as keys 0-7 of 2p + 1)
    fails the fragment check; the chunk read unswizzled fails both (other data, and every row of a
    matrix in one bank group: 8-way conflicts)."""
    def swapped(lane, pair):
        i = lane // 8
        return attn2.v_fragment_row(8 * {1: 2, 2: 1}.get(i, i) + lane % 8, pair)

    def unswizzled(lane, pair):
        slot = lane % 8 + 8 * (lane // 8 % 2)
        return slot * attn2.SLOT_BYTES + (attn2.V_CHUNK0 + 2 * pair + lane // 16) * attn2.VECTOR_BYTES

    assert _conflict_free(swapped, *V_SELECTORS) and not _fragments_are_mma_b(swapped)
    assert not _fragments_are_mma_b(unswizzled) and not _conflict_free(unswizzled, *V_SELECTORS)


# ---------------------------------------------------------------------------------------------
# Two pages a softmax step (`Attn2Build.pages_per_step` 2; the deployments' without a window):
# one or two splits a CTA.

# (KV heads, max_model_len, window, splits_per_cta): tp 8 and tp 16 at 128k (256 splits), without
# and with the window (64 splits), one split a CTA; tp 4 and tp 2 at 128k (two a CTA, the layout's),
# and two a CTA forced with the window (each split's lone first page) and at 8192 (short splits), the
# small split plan (2048: 64 splits of two pages, the deep ring)
STEP_DEPLOYMENTS = [(2, 131072, 0, None), (1, 131072, 0, None), (2, 131072, 2048, None), (1, 131072, 2048, None),
                    (4, 131072, 0, None), (8, 131072, 0, None), (2, 131072, 2048, 2), (4, 8192, 0, None),
                    (2, 2048, 0, None)]
STEP_ARCH_ISSUES = [("sm_90a", "all"), ("sm_90a", "sync"), ("sm_90a", "none"), ("sm_100a", "all")]


def _one_page_loops(window: int) -> int:
    """Copies of the one-page loop beside the two-page step's: the lone last page, and with a window
    the lone first page (a split's first page at an odd place; without a window every split starts
    at place 0, so LLVM drops that loop)."""
    return 2 if window else 1


def _step_failures(ptx: str, wgmma: bool, copies: int, single_loops: int, per_cta: int = 1) -> list[str]:
    """What the split kernel's PTX lacks for two pages a step (empty: nothing): for each of the
    CTA's `per_cta` splits, `single_loops` one-page loops and one two-page loop, each with `copies`
    copies of the scores (masked and unmasked). wgmma: Q K^T four m64n16k16 a page a copy, P V two
    m64n72k16 a page (the pair's one chain of four); mma.sync: 8 a page a copy for Q K^T, 18 a
    page for P V, V's fragments four ldmatrix.x4.trans a page; one CTA barrier a step (one before
    the ring and one a loop) and one proxy fence a wgmma fence's commit."""
    pages = per_cta * (single_loops + 2)  # page bodies: one a one-page loop, two in the step's
    failures = []
    if wgmma:
        want = {WGMMA_S: attn2.K_TILES * copies * pages, WGMMA_PV: 2 * pages, "mma.sync": 0, "ldmatrix": 0}
        if ptx.count("wgmma.fence.sync.aligned") != ptx.count("wgmma.commit_group.sync.aligned"):
            failures.append("a wgmma fence without its commit")
        if "wgmma.wait_group.sync.aligned 1;" in ptx:
            failures.append("a wgmma chain not waited for")
    else:
        want = {MMA: pages * (copies * 2 * attn2.K_TILES + 2 * (attn2.V_TILES + 1)), LDMATRIX_TRANS:
                pages * attn2.V_TILE_PAIRS, "wgmma": 0}
    want["bar.sync"] = 1 + per_cta * (single_loops + 1)
    for text, count in want.items():
        if ptx.count(text) != count:
            failures.append(f"{ptx.count(text)} {text} (want {count})")
    return failures


@pytest.mark.parametrize("arch, issue", STEP_ARCH_ISSUES)
@pytest.mark.parametrize("heads, max_model_len, window, per_cta", STEP_DEPLOYMENTS)
def test_two_pages_a_step_compiles_without_spills(tmp_path_factory, tmp_path, arch, issue, heads, max_model_len,
                                                  window, per_cta):
    """pages_per_step 2 on both targets and both tensor-core paths: the two-page step's PTX
    (`_step_failures`: a step loop and its one-page loops per split of the CTA), PDL's wait
    before every global read and its release after the MMAs, with two splits a CTA the first
    split's state held between its loops and the second's and merged after them
    (`_pairing_failures`), otherwise no hold and no merge; no local memory, the partial stored;
    ptxas assembles it without spills or serialization, within the register cap of the target's
    CTAs an SM."""
    ptx, combine = _ptx(tmp_path_factory, arch, heads, max_model_len, window, issue, per_cta, 2)
    on = ISSUES[issue]
    wgmma = attn2.tensor_ops_for(arch, TENSOR_OPS.get(issue)) == "wgmma"
    pairs = _splits_per_cta(heads, max_model_len, window, per_cta)
    assert _step_failures(ptx, wgmma, 2 if on.mask_edges_only else 1, _one_page_loops(window), pairs) == []
    assert "mbarrier" not in ptx and "atom." not in ptx and ".local" not in ptx and "prmt" not in ptx
    assert ("vote.sync.all.pred" in ptx) == on.skip_unit_rescale
    assert _reads_after_wait(ptx, r"ld\.global|cp\.async")
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.index("mma")  # as the deployments' (block order)
    assert f".minnctapersm {lay.split_ctas_per_sm(arch)}" in ptx
    assert ptx.count("st.global.v4.u32") == lay.PARTIAL_O_VECTORS + 1 and combine is not None
    # two splits a CTA with a window and no savings: LLVM lays the first split's lone first page
    # (at most one: an if, not a loop) out after the hold, reached by a branch that jumps back, so
    # the MMAs' text order around the hold is not the execution order there
    in_order = not (pairs == 2 and window and issue == "none")
    assert _pairing_failures(ptx, pairs, in_order) == []
    report = assemble(ptx, arch, tmp_path, "attn2_step")
    assert_no_spills(report)
    assert "Performance Loss" not in report
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    assert registers <= REGISTERS_PER_SM // (lay.CTA_THREADS * lay.split_ctas_per_sm(arch)), report


def test_the_step_check_fails_on_the_one_page_kernel_and_on_edits(tmp_path_factory):
    """Fault injection for `_step_failures`: it fails on the one-page kernel's PTX (both paths), on
    a P V step dropped, on a barrier added, and with the lone first page's loop expected where
    there is none (the compiled PTX, edited)."""
    for issue, wgmma in (("all", True), ("sync", False)):
        two, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, issue, None, 2)
        one, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, issue, None, 1)
        assert _step_failures(two, wgmma, 2, 1) == []
        assert _step_failures(one, wgmma, 2, 1) and _step_failures(two, wgmma, 2, 2)
        step = re.search(WGMMA_PV if wgmma else re.escape(MMA), two).group(0)
        line = re.search(r"[^\n]*" + re.escape(step) + r"[^\n]*\n", two).group(0)
        assert _step_failures(two.replace(line, "", 1), wgmma, 2, 1)
        assert _step_failures(two.replace("bar.sync", "bar.sync \t0;\n\tbar.sync", 1), wgmma, 2, 1)
    # two splits a CTA: its kernel passes with 2 and fails when checked as one split's (and the reverse)
    paired, _ = _ptx(tmp_path_factory, "sm_90a", 4, 131072, 0, "all", None, 2)
    assert _step_failures(paired, True, 2, 1, 2) == []
    assert _step_failures(paired, True, 2, 1) and _step_failures(two, True, 2, 1, 2)


@pytest.mark.parametrize("per_step", [0, 3, True, 2.0, "2"])
def test_pages_per_step_outside_the_choices_is_refused_by_the_build(per_step):
    with pytest.raises(ValueError, match="pages_per_step"):
        attn2.Attn2Build(pages_per_step=per_step)


def test_two_pages_a_step_with_two_splits_a_cta_is_accepted():
    """pages_per_step 2 runs with two splits a CTA (tp 4 and 2 take it): the build and the kernel
    object accept it, a bad value with it is still refused."""
    attn2.Attn2Build(pages_per_step=2, splits_per_cta=2)
    assert _split_kernel_with(4, 131072, 0, 2, pages_per_step=2).pages_per_step == 2
    with pytest.raises(ValueError, match="pages_per_step"):
        _split_kernel_with(4, 131072, 0, 2, pages_per_step=3)


@pytest.mark.parametrize("heads, max_model_len, window, want", [
    (2, 64, 0, 1), (2, 128, 0, 2), (2, 256, 0, 2), (8, 2048, 0, 2), (2, 4096, 0, 2), (1, 131072, 0, 2), (2, 131072, 0, 2), (4, 131072, 0, 2), (8, 131072, 0, 2),
    (2, 131072, 2048, 1), (4, 131072, 2048, 1)])
def test_the_builds_default_pages_per_step_is_the_rule(heads, max_model_len, window, want):
    """Attn2Build's None resolves to `attn2_layout.pages_per_step` of the build's plan (2 for split
    plans without a window, at every tp), forced values as given; a forced split count follows
    its own plan."""
    variant = attn2._variant(heads, max_model_len, window)
    assert attn2.resolved_pages_per_step(None, window, variant["num_splits"]) == want
    for forced in (1, 2):
        assert attn2.resolved_pages_per_step(forced, window, variant["num_splits"]) == forced
    assert attn2.resolved_pages_per_step(None, 0, 1) == 1
    with pytest.raises(ValueError, match="pages_per_step"):
        attn2.resolved_pages_per_step(3, window, variant["num_splits"])


@pytest.mark.parametrize("heads, max_model_len, window, want", [
    (2, 64, 0, False), (2, 128, 0, True), (8, 2048, 0, True), (1, 131072, 0, True), (4, 131072, 0, True),
    (2, 131072, 2048, False), (2, 4096, 2048, False)])
def test_the_builds_default_split_order_is_the_rule(heads, max_model_len, window, want):
    """Attn2Build.spread_splits None resolves to spread exactly for split plans without a window, at
    every tp; forced values as given; True refused on a one-split plan."""
    splits = attn2._variant(heads, max_model_len, window)["num_splits"]
    assert attn2.resolved_spread_splits(None, window, splits) is want
    assert attn2.resolved_spread_splits(False, window, splits) is False
    if splits > 1:
        assert attn2.resolved_spread_splits(True, window, splits) is True
    else:
        with pytest.raises(ValueError, match="spread_splits: a one-split plan"):
            attn2.resolved_spread_splits(True, window, splits)


def _split_kernel_with(heads, max_model_len, window, per_cta, **knobs):
    variant = attn2._variant(heads, max_model_len, window, None, per_cta)
    return attn2._Attn2Kernel(**variant, enable_pdl=True, **knobs)


def test_launch_refuses_pages_per_step_before_anything_launches():
    """`launch(..., pages_per_step=)` outside (1, 2): ValueError before the tensors are checked for
    a device (CPU tensors here); 2, 2 with two splits a CTA, 1 and None (the rule) pass to the
    device check."""
    args = _cpu_launch_args(8192)
    before = len(attn2.compilation.CACHE)
    for bad in (dict(pages_per_step=3), dict(pages_per_step=True), dict(pages_per_step=0, splits_per_cta=2)):
        with pytest.raises(ValueError, match="pages_per_step"):
            attn2.launch(**args, **bad)
    for good in (dict(pages_per_step=2), dict(pages_per_step=2, splits_per_cta=2), dict(pages_per_step=1), {}):
        with pytest.raises(ValueError, match="one CUDA device"):
            attn2.launch(**args, **good)
    assert len(attn2.compilation.CACHE) == before


def test_pages_per_step_is_its_own_variant():
    """1 and 2 are two compiled split kernels (the compile key holds the resolved pages_per_step:
    None at 8192 without a window is the rule's 2, the same variant as 2); the combine is the same
    variant for all."""
    for per_step in (None, 1, 2):
        attn2.compile_attn2(2, 8192, 0, attn2.Attn2Build(arch="sm_90a", pages_per_step=per_step,
                                                         issue=attn2.SplitIssue()))
    default_issue = attn2.SplitIssue().knobs()
    splits = [dict(k[3]) for k in attn2.compilation.CACHE.keys() if k[0].endswith("_Attn2Kernel")
              and k[1] == "sm_90a" and k[2] is None]
    splits = [k for k in splits if k["max_model_len"] == 8192 and k["num_kv_heads"] == 2 and k["window"] == 0
              and k["splits_per_cta"] == 1 and k["enable_pdl"] and k["wgmma"]
              and all(k[name] == on for name, on in default_issue.items())]
    assert sorted(k["pages_per_step"] for k in splits) == [1, 2]
    assert not any("pages_per_step" in dict(k[3]) for k in attn2.compilation.CACHE.keys()
                   if k[0].endswith("_Attn2CombineKernel"))


# ---------------------------------------------------------------------------------------------
# SplitIssue.defer_values: the two-page step's P V waited for at the next step's Q K^T wait

DEFER = dataclasses.replace(attn2.SplitIssue(), defer_values=True)


def _defer_ptx(tmp_path_factory, heads, per_cta=None, max_model_len=131072):
    key = ("defer", heads, per_cta, max_model_len)
    if key not in _PTX:
        folder = tmp_path_factory.mktemp("attn2-defer")
        attn2.compile_attn2(heads, max_model_len, 0, attn2.Attn2Build(arch="sm_90a", ptx_dir=str(folder), issue=DEFER,
                                                               splits_per_cta=per_cta))
        (split,) = folder.glob("*_Attn2Kernel_*.ptx")
        _PTX[key] = (split.read_text(), None)
    return _PTX[key][0]


@pytest.mark.parametrize("heads, per_cta", [(2, None), (1, None), (4, None), (4, 1)])
def test_deferred_values_build(tmp_path_factory, tmp_path, heads, per_cta):
    """With defer_values (sm_90a, two pages a step, one or two splits a CTA): the ring holds
    PIPELINE_STAGES + DEFER_EXTRA_STAGES stages (the shared memory says so), every P V chain of a
    two-page step is committed without a wait of its own (one wait a step: the Q K^T chain's, whose
    accumulators it ties with O's), and ptxas assembles it without a spill."""
    ptx = _defer_ptx(tmp_path_factory, heads, per_cta)
    kernel = attn2._Attn2Kernel(**{**attn2._variant(heads, 131072, 0, None, per_cta), "enable_pdl": True,
                                   "wgmma": True, "pages_per_step": 2, **DEFER.knobs()})
    assert kernel.stages == lay.PIPELINE_STAGES + attn2.DEFER_EXTRA_STAGES
    assert kernel.lookahead == lay.PIPELINE_STAGES - 2
    splits = _splits_per_cta(heads, 131072, 0, per_cta)
    plain = _ptx(tmp_path_factory, "sm_90a", heads, 131072, 0, "all", per_cta=per_cta)[0]
    # the two-page step's Q K^T once, before the mask branch (the plain build has a chain in each
    # copy): 8 m64n16k16 fewer a split; the same P V chains
    assert ptx.count(WGMMA_S) == plain.count(WGMMA_S) - 2 * attn2.K_TILES * splits
    assert ptx.count(WGMMA_PV) == plain.count(WGMMA_PV)
    # commits: the plain two-page step commits its Q K^T in each copy and its P V, each waited for;
    # deferred, one Q K^T commit and the P V's, whose wait is the next step's Q K^T wait or the
    # loop's end (one wait tying O after it): as many waits as commits, one commit fewer a split
    commits = ptx.count("wgmma.commit_group.sync.aligned")
    assert commits == ptx.count("wgmma.wait_group.sync.aligned 0") == plain.count("wgmma.commit_group.sync.aligned") - splits
    assert_no_spills(assemble(ptx, "sm_90a", tmp_path))


@pytest.mark.parametrize("build", [dict(tensor_ops="sync"), dict(pages_per_step=1)])
def test_deferred_values_refused_where_there_is_no_deferred_wait(build):
    """defer_values needs the wgmma two-page step: with mma.sync (sm_100a's path) or one page a
    step it is refused before compiling, naming what it needs."""
    before = len(attn2.compilation.CACHE)
    with pytest.raises(ValueError, match="defer_values"):
        attn2.compile_attn2(2, 131072, 0, attn2.Attn2Build(arch="sm_90a", issue=DEFER, **build))
    with pytest.raises(ValueError, match="defer_values"):
        attn2.compile_attn2(2, 131072, 0, attn2.Attn2Build(arch="sm_100a", issue=DEFER))
    assert len(attn2.compilation.CACHE) == before


# ---------------------------------------------------------------------------------------------
# The ring's depth (`attn2_layout.ring_stages`; `Attn2Build.ring_stages` for experiments)


def _ring_of(ptx: str) -> int:
    """The ring depth a split kernel's PTX was built with, from its deepest cp.async wait:
    wait_group (lookahead - 1) with one page a step, (lookahead - 2) with two, lookahead = ring -
    pages a step; the two-page build's one-page loop waits for lookahead - 1 = ring - 3."""
    return max(int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx)) + 3


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window, deep", [
    (1, 131072, 0, True), (2, 4096, 0, True), (2, 131072, 0, False), (4, 131072, 0, False), (1, 131072, 2048, False),
    (2, 2048, 0, True), (8, 2048, 0, False),  # the small split plan: 128 and 512 CTAs
    (2, 128, 0, True), (2, 64, 0, False),  # a 4-split plan (8 CTAs); one split
])
def test_the_deployment_takes_the_rules_ring(tmp_path_factory, tmp_path, arch, heads, max_model_len, window, deep):
    """A deployment's split kernel is built with `attn2_layout.ring_stages`' depth (where a launch
    has at most DEEP_RING_MAX_CTAS split CTAs, no window: 16 on sm_90a, whose deployment defers
    its P V waits there, 24 on sm_100a), and assembles without a spill."""
    splits = lay.splits(max_model_len, window, heads)
    deferred = arch == "sm_90a" and lay.pages_per_step(window, splits) == 2 and lay.splits_per_cta(heads, splits) == 1
    ring = lay.ring_stages(window, heads, splits, deferred=deferred)
    assert ring == ((lay.DEFERRED_DEEP_RING_STAGES if deferred else lay.DEEP_RING_STAGES) if deep
                    else lay.PIPELINE_STAGES)
    ptx, _ = _ptx(tmp_path_factory, arch, heads, max_model_len, window)
    if lay.pages_per_step(window, splits) == 2:
        assert _ring_of(ptx) == ring
    assert_no_spills(assemble(ptx, arch, tmp_path))


def test_deployment_issue_rule():
    """Every saving on; defer_values exactly where a CTA runs one split of wgmma two-page steps."""
    for wgmma in (True, False):
        for per_step in (1, 2):
            for per_cta in (1, 2):
                issue = attn2.deployment_issue(wgmma, per_step, per_cta)
                assert issue.defer_values == (wgmma and per_step == 2 and per_cta == 1)
                assert dataclasses.replace(issue, defer_values=False) == attn2.SplitIssue()
    assert attn2.named_issue("auto") is None and attn2.named_issue("all") == attn2.SplitIssue()
    with pytest.raises(ValueError, match="SplitIssue"):
        attn2.named_issue("auto+defer")


@pytest.mark.parametrize("arch, heads, max_model_len, window, defers", [
    ("sm_90a", 2, 131072, 0, True), ("sm_90a", 1, 131072, 0, True), ("sm_90a", 4, 131072, 0, False),
    ("sm_90a", 2, 131072, 2048, False), ("sm_100a", 2, 131072, 0, False),
    ("sm_90a", 2, 2048, 0, True),  # the small split plan: 64 splits, one a CTA, two pages a step
])
def test_the_deployment_defers_where_the_rule_says(tmp_path_factory, arch, heads, max_model_len, window, defers):
    """The deployment's split kernel (`Attn2Build.issue` None) is the deferred build where
    `deployment_issue` says (tp 8 and 16 on sm_90a: one wait a two-page step, as many waits as
    commits) and the "all" build elsewhere (tp 4: two splits a CTA; a window: one page a step;
    sm_100a: mma.sync): the same PTX text as the explicit setting's."""
    deployed, _ = _ptx(tmp_path_factory, arch, heads, max_model_len, window)
    every_saving, _ = _ptx(tmp_path_factory, arch, heads, max_model_len, window, "all")
    commits = "wgmma.commit_group.sync.aligned"
    if defers:
        explicit = _defer_ptx(tmp_path_factory, heads, max_model_len=max_model_len)
        # the deferred step commits its Q K^T once, before the mask branch: fewer commits than "all"
        assert deployed.count(commits) < every_saving.count(commits)
    else:
        explicit = every_saving
    assert _body(deployed) == _body(explicit)


def _body(ptx: str) -> str:
    """A PTX file without its header comments (the compiler's file names differ between builds)."""
    return "\n".join(line for line in ptx.splitlines() if not line.lstrip().startswith("//"))


def test_ring_stages_refused_outside_its_choices():
    for bad in (0, 3, 7, 32, True, 8.0, "8"):
        with pytest.raises(ValueError, match="ring_stages"):
            attn2.Attn2Build(ring_stages=bad)
    before = len(attn2.compilation.CACHE)
    with pytest.raises(ValueError, match="ring_stages"):
        attn2.launch(*([None] * 7), max_model_len=131072, window=0, ring_stages=5)
    assert len(attn2.compilation.CACHE) == before


# ---------------------------------------------------------------------------------------------
# The traced build (`Attn2Build.trace`, an experiment for scripts/trace-attn2.py): every thread
# reads the clocks, thread 0 of each CTA writes its row after its last store; the deployments
# read no clock at all.

# (KV heads, max_model_len, window): tp 8 and 16 at 128k (one split a CTA), tp 4 (two), one split
# (max_model_len <= SHORT_MAX_LEN)
TRACED = [(2, 131072, 0), (1, 131072, 0), (4, 131072, 0), (2, 64, 0)]
CLOCKS = ("%globaltimer", "%clock64", "%smid")


def _traced_ptx(tmp_path_factory, arch, heads, max_model_len, window):
    key = ("traced", arch, heads, max_model_len, window)
    if key not in _PTX:
        folder = tmp_path_factory.mktemp("attn2_traced")
        attn2.compile_attn2(heads, max_model_len, window, attn2.Attn2Build(arch=arch, ptx_dir=str(folder), trace=True))
        split = sorted(folder.glob("*_Attn2Kernel_*.ptx"))
        combine = sorted(folder.glob("*_Attn2CombineKernel_*.ptx"))
        _PTX[key] = (split[-1].read_text(), combine[-1].read_text() if combine else None)
    return _PTX[key]


def _thread0_failures(ptx: str, words: int = attn2.TRACE_WORDS) -> list[str]:
    """What the traced PTX lacks (empty: nothing): `words` 64-bit stores, all of them inside the
    one branch that %tid.x == 0 takes (a `setp.ne` of the %tid.x register against 0, a predicated
    jump over them to a label after the last), and every clock read before that branch (every
    thread reads them: no branch around them) but the SM's, which the row reads itself."""
    tid = re.search(r"mov\.u32\s+(%r\d+), %tid\.x;", ptx)
    if not tid:
        return ["no %tid.x read"]
    guard = re.search(rf"setp\.ne\.[bsu]32\s+(%p\d+), {re.escape(tid.group(1))}, 0;\s*@\1 bra\s+(\$L__BB\d+_\d+);", ptx)
    if not guard:
        return ["no branch on %tid.x != 0"]
    label = ptx.find(f"\n{guard.group(2)}:", guard.end())
    stores = [m.start() for m in re.finditer(r"st\.global\.u64", ptx)]
    failures = []
    if len(stores) != words:
        failures.append(f"{len(stores)} 64-bit stores (a row: {words})")
    if label < 0 or not all(guard.end() < s < label for s in stores):
        failures.append("a 64-bit store outside thread 0's branch")
    late = [m.group(0) for m in re.finditer(r"%globaltimer|%clock64", ptx) if m.start() > guard.start()]
    if late:
        failures.append(f"{len(late)} clock reads inside or after thread 0's branch")
    return failures


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window", TRACED)
def test_the_traced_build_reads_the_clocks_and_writes_from_thread_0(tmp_path_factory, tmp_path, arch, heads,
                                                                    max_model_len, window):
    """Split kernel: %globaltimer at entry and end, %clock64 at entry, after the PDL wait, after the
    prologue, after the chains and after the partial write (five), %smid once; in split plans one
    %globaltimer and one %clock64 more, the end of a CTA without pages (`empty_ctas_exit`), and one
    branch more (the traced build's else); combine: the same counts as the one-split split kernel
    (entry, wait, loads, tree, end). Eight 64-bit stores a CTA, all from thread 0's one branch, after
    the kernel's own last store; the partials' and out's stores as the deployment's, one branch more
    than the deployment's (thread 0's: none in the page loop), ptxas without spills and within the
    split kernel's register cap."""
    ptx, combine = _traced_ptx(tmp_path_factory, arch, heads, max_model_len, window)
    plain, plain_combine = _ptx(tmp_path_factory, arch, heads, max_model_len, window)
    for traced, deployed, name in ((ptx, plain, "split"), (combine, plain_combine, "combine")):
        if traced is None:
            assert deployed is None
            continue
        empty_end = 1 if name == "split" and combine is not None else 0  # split plans: an empty CTA's end
        assert traced.count("%globaltimer") == 2 + empty_end and traced.count("%clock64") == 5 + empty_end, name
        assert traced.count("%smid") == 1, name
        assert _thread0_failures(traced) == [], name
        assert traced.index("griddepcontrol.wait") < [m.start() for m in re.finditer("%clock64", traced)][1]
        for store in ("st.global.v4.u32", "st.global.u32", "st.global.v2.u32"):
            assert traced.count(store) == deployed.count(store), (name, store)
        last_own = max(m.start() for m in re.finditer(r"st\.global\.(v4|v2)?\.?u32", traced))
        assert last_own < traced.index("st.global.u64"), name
        assert len(re.findall(r"\bbra\b", traced)) == len(re.findall(r"\bbra\b", deployed)) + 1 + empty_end, name
        report = assemble(traced, arch, tmp_path, f"attn2_traced_{name}")
        assert_no_spills(report)
        if name == "split":
            registers = int(re.search(r"Used (\d+) registers", report).group(1))
            assert registers <= REGISTERS_PER_SM // (lay.CTA_THREADS * lay.split_ctas_per_sm(arch)), report


def test_the_thread_0_check_fails_on_edited_ptx(tmp_path_factory):
    """`_thread0_failures` can fail: without thread 0's branch, with a store moved before it, with
    a clock read moved into it, or with a row's word missing."""
    ptx, _ = _traced_ptx(tmp_path_factory, "sm_90a", 1, 131072, 0)
    assert _thread0_failures(ptx) == []
    unguarded = re.sub(r"(setp\.ne\.[bsu]32\s+%p\d+, %r\d+, 0;\s*)@%p\d+ bra\s+\$L__BB\d+_\d+;", r"\1", ptx, count=0)
    assert unguarded != ptx and _thread0_failures(unguarded) == ["no branch on %tid.x != 0"]
    early = "st.global.u64 [%rd0], %rd0;\n" + ptx
    assert "a 64-bit store outside thread 0's branch" in _thread0_failures(early, attn2.TRACE_WORDS + 1)
    last = ptx.rindex("st.global.u64")
    late_clock = ptx[:last] + "mov.u64 %rd0, %clock64;\n" + ptx[last:]
    assert _thread0_failures(late_clock) == ["1 clock reads inside or after thread 0's branch"]
    assert _thread0_failures(ptx, attn2.TRACE_WORDS + 1) == [f"{attn2.TRACE_WORDS} 64-bit stores (a row: "
                                                             f"{attn2.TRACE_WORDS + 1})"]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window", DEPLOYMENTS)
def test_the_deployments_read_no_clock(tmp_path_factory, arch, heads, max_model_len, window):
    """A deployment's kernels (split and combine) read no %globaltimer, %clock64 or %smid and
    store no 64-bit word: the trace is compiled out (`Attn2Build.trace` False)."""
    for ptx in _ptx(tmp_path_factory, arch, heads, max_model_len, window):
        if ptx is not None:
            assert not any(clock in ptx for clock in CLOCKS) and "st.global.u64" not in ptx


def test_the_no_clock_check_sees_a_traced_build(tmp_path_factory):
    """The deployments' check can fail: the traced build's PTX trips it."""
    ptx, combine = _traced_ptx(tmp_path_factory, "sm_90a", 1, 131072, 0)
    assert all(any(clock in text for clock in CLOCKS) for text in (ptx, combine))


def test_trace_is_its_own_variant_and_refuses_a_non_bool():
    """`trace` is in both kernels' compile keys (False for the deployments); a non-bool is refused
    by the build, and by `launch` before the tensors are checked for a device (CPU tensors here)."""
    before = set(attn2.compilation.CACHE.keys())
    for trace in (False, True):
        attn2.compile_attn2(1, 131072, 0, attn2.Attn2Build(arch="sm_90a", trace=trace))
    new = [(k[0].rsplit("_", 1)[-1], dict(k[3])["trace"]) for k in attn2.compilation.CACHE.keys()
           if k[1] == "sm_90a" and k[2] is None and dict(k[3]).get("num_kv_heads") == 1
           and dict(k[3]).get("max_model_len") == 131072 and dict(k[3]).get("window") == 0]
    assert {("Attn2Kernel", False), ("Attn2Kernel", True), ("Attn2CombineKernel", False),
            ("Attn2CombineKernel", True)} <= {(name.split(".")[-1], t) for name, t in new}, (new, before)
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="trace must be a bool"):
            attn2.Attn2Build(trace=bad)
        with pytest.raises(ValueError, match="trace must be a bool"):
            attn2.launch(**_cpu_launch_args(8192), trace=bad)
    with pytest.raises(ValueError, match="one CUDA device"):
        attn2.launch(**_cpu_launch_args(8192), trace=True)


@pytest.mark.parametrize("heads, splits, per_cta, split_ctas", [(2, 256, 1, 512), (1, 256, 1, 256), (4, 256, 2, 512),
                                                                (2, 1, 1, 2)])
def test_traced_workspace_holds_the_partials_then_every_ctas_row(heads, splits, per_cta, split_ctas):
    """`traced_workspace_bytes` = the partials + a row for every split CTA and (with splits) every
    combine CTA (64 a KV head); `trace_rows` views them in that order, and refuses a workspace
    without them (the deployment's)."""
    import torch

    combine_ctas = heads * lay.ROWS_PER_KV_HEAD if splits > 1 else 0
    partials = lay.workspace_bytes(1, heads, splits, per_cta)
    need = attn2.traced_workspace_bytes(1, heads, splits, per_cta)
    assert need == partials + (split_ctas + combine_ctas) * attn2.TRACE_ROW_BYTES
    workspace = torch.arange(need, dtype=torch.int64).to(torch.uint8)
    split_rows, combine_rows = attn2.trace_rows(workspace, 1, heads, splits, per_cta)
    assert tuple(split_rows.shape) == (split_ctas, attn2.TRACE_WORDS)
    assert split_rows.data_ptr() == workspace.data_ptr() + partials
    if splits > 1:
        assert tuple(combine_rows.shape) == (combine_ctas, attn2.TRACE_WORDS)
        assert combine_rows.data_ptr() == split_rows.data_ptr() + split_ctas * attn2.TRACE_ROW_BYTES
    else:
        assert combine_rows is None
    with pytest.raises(ValueError, match="traced_workspace_bytes"):
        attn2.trace_rows(workspace[:need - 8], 1, heads, splits, per_cta)
    with pytest.raises(ValueError, match="does not divide"):
        attn2.traced_workspace_bytes(1, heads, 1, 2)


# ---------------------------------------------------------------------------------------------
# Attn2Build.loads_only: a timing probe of the page stream alone


@pytest.mark.parametrize("arch, heads", [("sm_90a", 2), ("sm_90a", 1), ("sm_100a", 2)])
def test_loads_only_keeps_the_stream_and_drops_the_arithmetic(tmp_path_factory, tmp_path, arch, heads):
    """The loads-only split kernel keeps the deployment's copies (as many cp.async) and barriers and
    has no tensor-core step and no softmax exponent; its own variant; no spill."""
    folder = tmp_path_factory.mktemp("attn2-loads-only")
    attn2.compile_attn2(heads, 131072, 0, attn2.Attn2Build(arch=arch, ptx_dir=str(folder), loads_only=True))
    (split,) = folder.glob("*_Attn2Kernel_*.ptx")
    probe = split.read_text()
    deployed, _ = _ptx(tmp_path_factory, arch, heads, 131072, 0)
    assert not re.search(MMA_STEP, probe) and "ex2.approx.ftz.f32" not in probe
    assert re.search(MMA_STEP, deployed) and "ex2.approx.ftz.f32" in deployed
    assert probe.count("cp.async.cg.shared.global") == deployed.count("cp.async.cg.shared.global")
    assert probe.count("bar.sync") == deployed.count("bar.sync")
    assert_no_spills(assemble(probe, arch, tmp_path))


def test_loads_only_is_refused_unless_a_bool():
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="loads_only"):
            attn2.Attn2Build(loads_only=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Attn2Build.weight_terms: an experiment, P as one BF16 term


@pytest.mark.parametrize("heads", [2, 1])
def test_one_weight_term_halves_the_value_mmas_and_drops_p_lo(tmp_path_factory, tmp_path, heads):
    """weight_terms 1 (sm_90a): half the P V wgmmas of the deployment's two-page and one-page steps
    (Q K^T's unchanged), fewer BF16 conversions (no p_lo), no spill; the deployment's own variant
    and PTX are untouched (its key has no weight_terms)."""
    folder = tmp_path_factory.mktemp("attn2-one-term")
    attn2.compile_attn2(heads, 131072, 0, attn2.Attn2Build(arch="sm_90a", ptx_dir=str(folder), weight_terms=1))
    (split,) = folder.glob("*_Attn2Kernel_*.ptx")
    one = split.read_text()
    deployed, _ = _ptx(tmp_path_factory, "sm_90a", heads, 131072, 0)

    def values(text: str) -> int:  # P V: N = 72 (V's 64 dims and the ones' 8)
        return len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n72k16", text))

    def keys(text: str) -> int:
        return len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16", text))

    assert values(deployed) == 2 * values(one) > 0
    assert keys(one) == keys(deployed) > 0
    assert one.count("cvt.rn.bf16x2.f32") < deployed.count("cvt.rn.bf16x2.f32")
    assert_no_spills(assemble(one, "sm_90a", tmp_path))


def test_one_weight_term_is_refused_off_wgmma_and_outside_its_choices():
    for bad in (0, 3, True, 2.0, None):
        with pytest.raises(ValueError, match="weight_terms"):
            attn2.Attn2Build(weight_terms=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight_terms 1 needs tensor_ops 'wgmma'"):
        attn2.compile_attn2(2, 131072, 0, attn2.Attn2Build(arch="sm_100a", weight_terms=1))
    with pytest.raises(ValueError, match="weight_terms 1 needs tensor_ops 'wgmma'"):
        attn2.compile_attn2(2, 131072, 0, attn2.Attn2Build(arch="sm_90a", tensor_ops="sync", weight_terms=1))


# ---------------------------------------------------------------------------------------------
# SplitIssue.prefetch_pages: an experiment, L2 prefetches L2_PREFETCH_PAGES beyond the ring's copies


@pytest.mark.parametrize("arch, heads, per_cta, issue", [
    ("sm_90a", 2, 1, "mask+rescale+lean+keys+defer+prefetch"), ("sm_90a", 1, 1, "mask+rescale+lean+keys+defer+prefetch"),
    ("sm_90a", 4, 2, "mask+rescale+lean+keys+prefetch"), ("sm_100a", 2, 1, "mask+rescale+lean+keys+prefetch"),
])
def test_prefetch_pages_adds_l2_prefetches_and_nothing_else(tmp_path_factory, tmp_path, arch, heads, per_cta, issue):
    """The prefetching build keeps the deployment's copies and barriers (as many cp.async and
    bar.sync), adds 4 KB bulk L2 prefetches (one in the prologue, one a ring step of each step
    kind) and spills nothing; the deployment's own PTX has none."""
    folder = tmp_path_factory.mktemp("attn2-prefetch")
    attn2.compile_attn2(heads, 131072, 0, attn2.Attn2Build(arch=arch, ptx_dir=str(folder), splits_per_cta=per_cta,
                                                           issue=attn2.named_issue(issue)))
    (split,) = folder.glob("*_Attn2Kernel_*.ptx")
    probe = split.read_text()
    deployed, _ = _ptx(tmp_path_factory, arch, heads, 131072, 0)
    prefetches = re.findall(r"cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], (\d+);", probe)
    assert len(prefetches) >= 2 and set(prefetches) == {str(lay.PAGE_BYTES)}
    assert "cp.async.bulk.prefetch" not in deployed
    assert probe.count("cp.async.cg.shared.global") == deployed.count("cp.async.cg.shared.global")
    assert probe.count("bar.sync") == deployed.count("bar.sync")
    assert_no_spills(assemble(probe, arch, tmp_path))


# The combine's shortcut (only the upper tree's levels that can meet pages, then one merge with an
# empty node) and Attn2Build.full_tree, its experiment baseline


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len", [(2, 131072), (4, 131072), (2, 256), (2, 128), (2, 96)])
def test_the_combine_shortcut_runs_each_upper_level_behind_its_branch(tmp_path_factory, tmp_path, arch, heads,
                                                                     max_model_len):
    """The deployment's combine holds each level of the upper tree once (the same shuffles and, with
    more than one warp, the same barrier as the whole-tree build, each level now run or skipped by
    a CTA-uniform test) and the shortcut's one merge with an empty node: two ex2 more than the
    whole-tree build
    (`Attn2Build.full_tree`), the same shuffles and barriers, no spill in either."""
    folder = tmp_path_factory.mktemp("attn2-full-tree")
    attn2.compile_attn2(heads, max_model_len, 0, attn2.Attn2Build(arch=arch, ptx_dir=str(folder), full_tree=True))
    (whole,) = folder.glob("*_Attn2CombineKernel_*.ptx")
    whole = whole.read_text()
    _, deployed = _ptx(tmp_path_factory, arch, heads, max_model_len, 0)
    assert deployed != whole
    assert deployed.count("ex2.approx") == whole.count("ex2.approx") + 2
    for pattern in (r"shfl\.sync", r"bar\.sync|barrier\.sync"):
        assert len(re.findall(pattern, deployed)) == len(re.findall(pattern, whole))
    for text in (deployed, whole):
        assert_no_spills(assemble(text, arch, tmp_path))


# Attn2Build.empty_ctas_exit: a split CTA without pages ends after L's load


def _exit_branch(split_ptx: str) -> str | None:
    """The split kernel's branch between L's load (the first ld.global after griddepcontrol.wait)
    and the next ld.global (the Q fragments'), if that branch leads straight to `ret` (None
    otherwise): the empty CTAs' exit."""
    wait = split_ptx.index("griddepcontrol.wait")
    loads = [m.start() for m in re.finditer(r"ld\.global", split_ptx[wait:])][:2]
    if len(loads) < 2:
        return None
    between = split_ptx[wait + loads[0]:wait + loads[1]]
    branch = re.search(r"@%p\d+ bra\s+(\$L__BB\d+_\d+);", between)
    if branch is None:
        return None
    label = split_ptx.index(branch.group(1) + ":")
    after = [line.strip() for line in split_ptx[label:].splitlines()[1:4] if line.strip()]
    return branch.group(1) if after and after[0].startswith("ret") else None


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, window", [(2, 131072, 0), (1, 131072, 0), (4, 131072, 0),
                                                          (2, 131072, 2048), (2, 128, 0)])
def test_split_ctas_without_pages_end_after_the_length(tmp_path_factory, tmp_path, arch, heads, max_model_len,
                                                        window):
    """The deployment's split kernel of a split plan branches to its end right after L's load, before
    the Q fragments' loads; the baseline (`empty_ctas_exit=False`) does not; the one-split plan has
    no such branch; no spills."""
    deployed, _ = _ptx(tmp_path_factory, arch, heads, max_model_len, window)
    assert _exit_branch(deployed) is not None
    folder = tmp_path_factory.mktemp("attn2-stay")
    attn2.compile_attn2(heads, max_model_len, window,
                        attn2.Attn2Build(arch=arch, ptx_dir=str(folder), empty_ctas_exit=False))
    (stay,) = folder.glob("*_Attn2Kernel_*.ptx")
    assert _exit_branch(stay.read_text()) is None
    assert_no_spills(assemble(deployed, arch, tmp_path))
    one_split, _ = _ptx(tmp_path_factory, arch, heads, 64, 0)
    assert _exit_branch(one_split) is None


def test_the_exit_branch_check_can_fail(tmp_path_factory):
    """Fault injection for the check above: the deployment's PTX with the branch's target moved off
    its `ret` is not seen as the exit."""
    deployed, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0)
    label = _exit_branch(deployed)
    edited = deployed.replace(label + ":", label + ":\n\tbar.sync 0;", 1)
    assert _exit_branch(edited) is None


def _reverses_the_grid_index(split_ptx: str, shift: int) -> bool:
    """Whether the PTX reverses a register's bits (brev.b32) and shifts the result right, logically,
    by `shift` (32 - log2(partials): the partial of grid index y, `Attn2Build.spread_splits`)."""
    return re.search(rf"brev\.b32\s+(%r\d+), %r\d+;(?:.|\n){{0,200}}?shr\.u32\s+%r\d+, \1, {shift};",
                     split_ptx) is not None


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("heads, max_model_len, partials", [(2, 131072, 256), (4, 131072, 128), (2, 128, 4)])
def test_split_ctas_run_partials_in_bit_reversed_order(tmp_path_factory, arch, heads, max_model_len, partials):
    """The deployment's split kernel of a split plan without a window reverses the grid index's bits
    (brev.b32, then a logical shift right by 32 - log2(partials), `Attn2Build.spread_splits`); its
    baseline (`spread_splits=False`, grid order), the one-split plan and the window's plan do not,
    unless spread is asked for."""
    spread = _ptx(tmp_path_factory, arch, heads, max_model_len, 0)[0]
    shift = 32 - (partials.bit_length() - 1)
    assert _reverses_the_grid_index(spread, shift)
    # the check fails on an arithmetic shift and on a shift by another count
    assert not _reverses_the_grid_index(spread.replace("shr.u32", "shr.s32"), shift)
    assert not _reverses_the_grid_index(spread, shift - 1)
    folder = tmp_path_factory.mktemp("attn2-grid-order")
    attn2.compile_attn2(heads, max_model_len, 0, attn2.Attn2Build(arch=arch, ptx_dir=str(folder), spread_splits=False))
    (grid_order,) = folder.glob("*_Attn2Kernel_*.ptx")
    assert "brev.b32" not in grid_order.read_text()
    assert "brev.b32" not in _ptx(tmp_path_factory, arch, heads, 64, 0)[0]
    # a window's plan runs in grid order unless spread is asked for
    window = min(2048, max_model_len // 2)
    assert "brev.b32" not in _ptx(tmp_path_factory, arch, heads, max_model_len, window)[0]
    folder = tmp_path_factory.mktemp("attn2-window-spread")
    attn2.compile_attn2(heads, max_model_len, window,
                        attn2.Attn2Build(arch=arch, ptx_dir=str(folder), spread_splits=True))
    (window_spread,) = folder.glob("*_Attn2Kernel_*.ptx")
    window_partials = lay.splits(max_model_len, window, heads) // lay.splits_per_cta(
        heads, lay.splits(max_model_len, window, heads))
    assert _reverses_the_grid_index(window_spread.read_text(), 32 - (window_partials.bit_length() - 1))


def test_empty_ctas_exit_and_spread_splits_refusals():
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="empty_ctas_exit must be a bool or None"):
            attn2.Attn2Build(empty_ctas_exit=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty_ctas_exit: a one-split plan"):
        attn2.compile_attn2(2, 64, 0, attn2.Attn2Build(arch="sm_90a", empty_ctas_exit=True))
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="spread_splits must be a bool or None"):
            attn2.Attn2Build(spread_splits=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spread_splits: a one-split plan"):
        attn2.compile_attn2(2, 64, 0, attn2.Attn2Build(arch="sm_90a", spread_splits=True))


def test_full_tree_is_refused_unless_a_bool():
    for bad in (1, 0, None, "yes"):
        with pytest.raises(ValueError, match="full_tree must be a bool"):
            attn2.Attn2Build(full_tree=bad)  # type: ignore[arg-type]


def test_early_release_and_full_tree_are_refused_where_they_cannot_act():
    """`Attn2Build.early_release` without PDL, either switch as a non-bool, and either on a
    one-split plan (no combine to release or to build) are refused before any compile."""
    for bad in (1, "no", None):
        with pytest.raises(ValueError, match="early_release must be a bool"):
            attn2.Attn2Build(early_release=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="it needs enable_pdl"):
        attn2.Attn2Build(early_release=True, enable_pdl=False)
    for build in (attn2.Attn2Build(arch="sm_90a", early_release=True), attn2.Attn2Build(arch="sm_90a", full_tree=True)):
        with pytest.raises(ValueError, match="a one-split plan"):
            attn2.compile_attn2(2, 64, 0, build)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_early_release_releases_right_after_each_wait(tmp_path_factory, arch):
    """With `early_release` both kernels release their dependents right after their own PDL wait
    (nothing between the two but the instruction stream's bookkeeping), once; the deployments'
    split kernel releases after its main loop, its combine after its loads."""
    folder = tmp_path_factory.mktemp("attn2-early-release")
    attn2.compile_attn2(2, 131072, 0, attn2.Attn2Build(arch=arch, ptx_dir=str(folder), early_release=True))
    for path in folder.glob("*.ptx"):
        text = path.read_text()
        assert text.count("griddepcontrol.launch_dependents") == 1
        between = text[text.index("griddepcontrol.wait"):text.index("griddepcontrol.launch_dependents")]
        assert not re.search(r"\bld\.|\bst\.|mma|cp\.async|bar\.sync|shfl", between), between
    split, combine = _ptx(tmp_path_factory, arch, 2, 131072, 0)
    assert split.index("griddepcontrol.launch_dependents") > split.index("mma")
    assert combine.index("griddepcontrol.launch_dependents") > combine.index("ld.global", combine.index("griddepcontrol.wait"))



@pytest.mark.parametrize("per_cta", [1, 2])
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_deep_ring_leaves_two_split_ctas_an_sm(heads, per_cta):
    """Where `attn2_layout.ring_stages` gives a deep ring (at most DEEP_RING_MAX_CTAS split CTAs:
    at most two an SM), two split CTAs of that depth fit an SM's shared memory (SM90_SMEM_FOR_TWO),
    held split and deferred stages included, deferred or not, for one and two splits a CTA (with
    two the rule's PAIRED_DEEP_RING_STAGES: at DEEP_RING_STAGES one CTA an SM, which ran a forced
    pair build in two waves); a plan whose CTAs are not few keeps PIPELINE_STAGES, four CTAs an SM
    (SM90_SMEM_FOR_FOUR) with the deployment's issue."""
    checked = 0
    for max_model_len in (128, 2048, 8192, 131072):
        knobs = attn2._variant(heads, max_model_len, 0, None, per_cta)
        per_step = attn2.resolved_pages_per_step(None, 0, knobs["num_splits"])
        issue = attn2.deployment_issue(True, per_step, per_cta)
        for defer in ({False, True} if per_step == 2 else {False}):  # defer_values needs two-page steps
            ring = lay.ring_stages(0, heads, knobs["num_splits"], per_cta, deferred=defer)
            kernel = attn2._Attn2Kernel(**knobs, enable_pdl=True, wgmma=True, pages_per_step=per_step,
                                        defer_values=defer, ring_stages=ring)
            ctas = heads * knobs["num_splits"] // per_cta
            if ring != lay.PIPELINE_STAGES:
                assert ctas <= lay.DEEP_RING_MAX_CTAS, (max_model_len, defer, ring)
                assert kernel.smem_bytes() <= SM90_SMEM_FOR_TWO, (max_model_len, defer, ring, kernel.smem_bytes())
                checked += 1
            elif defer == issue.defer_values:  # (deferring costs a paired plain ring a CTA: `deployment_issue`)
                assert kernel.smem_bytes() <= SM90_SMEM_FOR_FOUR, (max_model_len, defer, kernel.smem_bytes())
    assert checked
