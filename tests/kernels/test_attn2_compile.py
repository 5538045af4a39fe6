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
kernel; the combine's wait before the partials' loads and its shared-memory tree; ptxas (where
installed) reports no spill (its own test). Refusals of bad deployments, builds and tensor-core
paths. On ints, no compile: the K and V fragment addresses (`k_fragment_row`, `v_fragment_row`)
give every lane its mma B fragments through an emulated
ldmatrix (.trans for V), bank-conflict free (and both checks fail on wrong address functions)."""

from __future__ import annotations

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
ISSUES = {"all": attn2.SplitIssue(), "none": attn2.SplitIssue.none(), "sync": attn2.SplitIssue(),
          "ring": attn2.SplitIssue.named("all+ring"), "ring@sync": attn2.SplitIssue.named("all+ring"),
          "overlap": attn2.SplitIssue.named("all+ring+overlap")}
TENSOR_OPS = {"sync": "sync", "ring@sync": "sync"}
WGMMA_ONLY = {"overlap"}  # refused on sm_100a (test_overlap_mma_refused_without_wgmma)
_PTX: dict[tuple, tuple[str, str | None]] = {}


def _ptx(tmp_path_factory, arch, heads, max_model_len, window, issue="all"):
    """(split kernel PTX, combine kernel PTX or None), compiled once per module."""
    key = (arch, heads, max_model_len, window, issue)
    if key not in _PTX:
        folder = tmp_path_factory.mktemp("attn2")
        attn2.compile_attn2(heads, max_model_len, window,
                            attn2.Attn2Build(arch=arch, ptx_dir=str(folder), issue=ISSUES[issue],
                                             tensor_ops=TENSOR_OPS.get(issue)))
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

def _wgmma_page(ptx: str, copies: int) -> bool:
    """The wgmma path's page, read off the split kernel's PTX: Q K^T four k16 steps per copy of the
    scores, P V p_lo's and p_hi's step over V and the ones (N = 72), B by descriptor (no mma.sync,
    no ldmatrix), the proxy fence (the copies and the ones, seen by wgmma), a commit per fence."""
    return (ptx.count(WGMMA_S) == copies * attn2.K_TILES and ptx.count(WGMMA_PV) == 2
            and "mma.sync" not in ptx and "ldmatrix" not in ptx
            and "fence.proxy.async.shared::cta" in ptx
            and ptx.count("wgmma.fence.sync.aligned") == ptx.count("wgmma.commit_group.sync.aligned"))


DEPLOYMENTS = [(2, 2048, 0), (2, 131072, 0), (1, 131072, 0), (2, 131072, 2048)]
# (arch, KV heads, max_model_len, window, issue) where ptxas spills under the register cap: none
# (the one-KV-head sm_90a baseline spilled 108 bytes until V's fragments came through ldmatrix,
# which holds 4 address registers where the word loads held 8, and needs no prmt temporaries)
KNOWN_SPILLS: set[tuple] = set()


ARCH_ISSUES = [(arch, issue) for arch in ("sm_90a", "sm_100a") for issue in sorted(ISSUES)
               if arch == "sm_90a" or issue not in WGMMA_ONLY]


def _ring_failures(ptx: str, wgmma: bool) -> list[str]:
    """What `SplitIssue.mbarrier_ring`'s PTX lacks (empty: nothing): a full and an empty mbarrier
    per stage, the copies' arrivals (STAGES - RING_REFILL_DISTANCE before the loop, one in it), the
    consumers' arrivals, bounded waits (try_wait, the timer, trap), no cp.async group bookkeeping,
    one CTA barrier (the prologue's: none a page), and on the wgmma path a proxy fence between the
    last wait before each Q K^T chain and that chain."""
    failures = []
    if ptx.count("mbarrier.init.shared::cta.b64") != 2 * lay.PIPELINE_STAGES:
        failures.append("a full and an empty mbarrier per stage")
    if ptx.count("cp.async.mbarrier.arrive.noinc.shared::cta.b64") != lay.PIPELINE_STAGES - attn2.RING_REFILL_DISTANCE + 1:
        failures.append("the copies' arrivals")
    if "mbarrier.arrive.shared::cta.b64" not in ptx:
        failures.append("the consumers' arrivals on empty")
    if "mbarrier.try_wait.parity.shared::cta.b64" not in ptx or "%globaltimer" not in ptx or "trap;" not in ptx:
        failures.append("bounded waits (try_wait, the timer, trap)")
    if "cp.async.wait_group" in ptx or "cp.async.commit_group" in ptx:
        failures.append("cp.async groups left")
    if ptx.count("bar.sync") != 1:
        failures.append(f"{ptx.count('bar.sync')} CTA barriers (the prologue's only)")
    if wgmma:
        waits = [m.start() for m in re.finditer(r"mbarrier\.try_wait", ptx)]
        for chain in (m.start() for m in re.finditer(re.escape(WGMMA_S), ptx)):
            before = [w for w in waits if w < chain]
            if before and "fence.proxy.async.shared::cta" not in ptx[before[-1]:chain]:
                failures.append("a Q K^T chain after a ring wait without a proxy fence")
                break
    return failures


def _overlap_failures(ptx: str) -> list[str]:
    """What `SplitIssue.overlap_mma`'s PTX lacks: page 0's Q K^T before the loop and the next
    page's in it (one copy each: the scores' masked / unmasked halves take them waited), P V's two
    steps, and the waits that leave one group in flight (P V's O, then the next page's S)."""
    failures = []
    if ptx.count(WGMMA_S) != 2 * attn2.K_TILES or ptx.count(WGMMA_PV) != 2:
        failures.append("Q K^T before the loop and in it, P V once")
    if ptx.count("wgmma.wait_group.sync.aligned 1;") != 2:
        failures.append("two waits leaving one group in flight")
    if ptx.count("wgmma.commit_group.sync.aligned") != 3:
        failures.append("three commit groups (S before the loop, S and P V in it)")
    return failures


# (KV heads, max_model_len, window): one split (short), the split kernel (tp 8, tp 16), the window
@pytest.mark.parametrize("arch, issue", ARCH_ISSUES)
@pytest.mark.parametrize("heads, max_model_len, window", DEPLOYMENTS)
def test_compiles_with_ptx_assertions(tmp_path_factory, arch, heads, max_model_len, window, issue):
    ptx, combine = _ptx(tmp_path_factory, arch, heads, max_model_len, window, issue)
    on = ISSUES[issue]
    copies = 2 if on.mask_edges_only else 1  # of the scores: masked and unmasked
    wgmma = attn2.tensor_ops_for(arch, TENSOR_OPS.get(issue)) == "wgmma"
    assert wgmma == (arch == "sm_90a" and issue not in TENSOR_OPS)
    if on.mbarrier_ring:
        assert _ring_failures(ptx, wgmma) == []
    else:
        assert "mbarrier" not in ptx and "trap;" not in ptx
    if on.overlap_mma:
        assert _overlap_failures(ptx) == []
    elif wgmma:
        assert "wgmma.wait_group.sync.aligned 1;" not in ptx
    if wgmma and on.overlap_mma:
        assert "mma.sync" not in ptx and "ldmatrix" not in ptx
        assert ptx.count("wgmma.fence.sync.aligned") == ptx.count("wgmma.commit_group.sync.aligned")
    elif wgmma:
        assert _wgmma_page(ptx, copies)
    else:
        # Q K^T: 2 n-tiles x 4 k-steps per copy; P V: p_lo and p_hi over 8 n-tiles of V and the ones'
        assert ptx.count(MMA) == copies * 2 * attn2.K_TILES + 2 * (attn2.V_TILES + 1)
        assert ptx.count(LDMATRIX_TRANS) == attn2.V_TILE_PAIRS  # P V's B fragments, two n-tiles each
        # Q K^T's B fragments with ldmatrix_keys: two k-steps of 8 keys an ldmatrix, per copy of the scores
        assert ptx.count(LDMATRIX) == on.ldmatrix_keys * copies * 2 * attn2.K_TILES // 2
        assert "wgmma" not in ptx
    assert ("vote.sync.all.pred" in ptx) == on.skip_unit_rescale
    assert "ld.shared.u32" in ptx  # the page-table entries only: no fragment word loads left
    assert "prmt" not in ptx  # the natural layout needs no joining of V's words
    assert "cp.async.cg.shared.global" in ptx
    assert ".local" not in ptx  # no stack: nothing spilled before ptxas
    assert _reads_after_wait(ptx, r"ld\.global|cp\.async")  # PDL: nothing the previous kernel writes is read before
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.index("mma")  # released after the main loop
    assert f".minnctapersm {lay.split_ctas_per_sm(arch)}" in ptx  # the register cap of CTAs an SM
    assert "atom." not in ptx  # no counters: nothing inside a launch waits on another CTA
    split = max_model_len > lay.SHORT_MAX_LEN
    assert ("st.global.v4.u32" in ptx) == split  # the partial; one split stores its output (v2) itself
    assert (combine is not None) == split
    if split:
        assert "mma.sync" not in combine and "atom." not in combine and ".local" not in combine
        # the partials (16-byte loads) only after the wait; the gate and L (the split kernel's
        # own inputs, finished before it released this grid) may come before it
        assert _reads_after_wait(combine, PARTIAL_LOADS)
        assert combine.index("griddepcontrol.launch_dependents") > combine.index("griddepcontrol.wait")
        assert "st.shared.v4.u32" in combine and "ld.shared.v4.u32" in combine  # the tree across groups
        assert "bar.sync" in combine


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


def test_ring_and_overlap_checks_fail_on_broken_ptx(tmp_path_factory):
    """Fault injection: each PTX assertion of the ring and the overlap can fail. The compiled PTX,
    edited: a CTA barrier a page back in, the spin's trap gone, the proxy fence gone, a stage's
    barrier not initialised; a wait_group 1 turned into 0, a second P V chain."""
    ring, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, "ring")
    overlap, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, "overlap")
    assert _ring_failures(ring, True) == [] and _ring_failures(overlap, True) == [] and _overlap_failures(overlap) == []
    edits = {
        "barrier": ring.replace("mbarrier.arrive.shared::cta.b64", "bar.sync 0;\n\tmbarrier.arrive.shared::cta.b64", 1),
        "trap": ring.replace("trap;", ""),
        "fence": re.sub(r"fence\.proxy\.async\.shared::cta;", "", ring),
        "init": ring.replace("mbarrier.init.shared::cta.b64", "// removed", 1),
        "arrive": ring.replace("mbarrier.arrive.shared::cta.b64", "// removed"),
        "groups": ring.replace("trap;", "trap;\n\tcp.async.commit_group;", 1),
    }
    for name, edited in edits.items():
        assert _ring_failures(edited, True), name
    assert _overlap_failures(overlap.replace("wgmma.wait_group.sync.aligned 1;", "wgmma.wait_group.sync.aligned 0;", 1))
    assert _overlap_failures(overlap + WGMMA_PV)
    assert _overlap_failures(ring)  # the ring alone overlaps nothing


def test_overlap_mma_refused_without_wgmma_or_ring():
    """overlap_mma is refused, before any compile, on mma.sync (sm_100a's path, or sm_90a's forced)
    and without the ring; unknown and repeated names are refused."""
    overlap = attn2.SplitIssue.named("all+ring+overlap")
    with pytest.raises(ValueError, match="needs the wgmma path"):
        attn2.compile_attn2(2, 4096, 0, attn2.Attn2Build(arch="sm_100a", issue=overlap))
    with pytest.raises(ValueError, match="needs the wgmma path"):
        attn2.compile_attn2(2, 4096, 0, attn2.Attn2Build(arch="sm_90a", issue=overlap, tensor_ops="sync"))
    with pytest.raises(ValueError, match="needs mbarrier_ring"):
        attn2.SplitIssue(overlap_mma=True)
    with pytest.raises(ValueError, match="needs mbarrier_ring"):
        attn2.SplitIssue.named("all+overlap")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_lean_addressing_drops_the_source_selects(tmp_path_factory, arch):
    """lean_addressing: no 64-bit select of the cp.async source at any of the PIPELINE_STAGES page
    loads (7 before the loop, one in it), two chunks each."""
    on, _ = _ptx(tmp_path_factory, arch, 2, 131072, 0, "all")
    off, _ = _ptx(tmp_path_factory, arch, 2, 131072, 0, "none")
    assert off.count("selp.b64") - on.count("selp.b64") == 2 * lay.PIPELINE_STAGES


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
    wgmma, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0)
    sync, _ = _ptx(tmp_path_factory, "sm_90a", 2, 131072, 0, "sync")
    assert _wgmma_page(wgmma, 2) and not _wgmma_page(sync, 2)
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
    assert named("all") == attn2.SplitIssue() and not named("all").mbarrier_ring and not named("all").overlap_mma
    assert named("all+ring") == attn2.SplitIssue(mbarrier_ring=True)
    assert named("all+ring+overlap") == attn2.SplitIssue(mbarrier_ring=True, overlap_mma=True)
    assert named("ring+overlap") == attn2.SplitIssue(False, False, False, False, True, True)
    for bad in ("", "mask+", "Mask", "all+mask", "fast", "key", "all+ring+ring", "ring+all", "none+ring"):
        with pytest.raises(ValueError, match="SplitIssue"):
            named(bad)


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
# The ring's phase bookkeeping, on ints: threads following `ring_pages_overlapped`'s order (and
# `ring_pages`', the same with the arrival one step earlier) under a random schedule, copies
# landing at random later steps, mbarriers modelled by phase and arrivals (try_wait by parity).


class _Barrier:
    def __init__(self, count):
        self.count, self.phase, self.arrived = count, 0, 0

    def arrive(self):
        self.arrived += 1
        if self.arrived == self.count:
            self.phase, self.arrived = self.phase + 1, 0

    def passed(self, parity):
        return self.phase % 2 != parity


def _ring_run(pages, threads, seed, distance, full_parity, empty_parity, overlap):
    """None if every thread's every read of page p found page p in its stage and nothing
    deadlocked, else what went wrong."""
    import random

    rng = random.Random(seed)
    stages = lay.PIPELINE_STAGES
    full = [_Barrier(threads) for _ in range(stages)]
    empty = [_Barrier(threads) for _ in range(stages)]
    stage_page = [None] * stages
    readers = [set() for _ in range(stages)]  # threads whose reads of a stage are not complete
    landing = []  # (thread, stage, page): copies issued, not landed

    def program(t):
        def refill(ahead):
            if ahead < pages:
                s = ahead % stages
                while not empty[s].passed(empty_parity(ahead)):
                    yield "wait"
                if readers[s]:
                    yield f"page {ahead} copied into stage {s} while it was read"
                landing.append((t, s, ahead))

        def read(page):
            while not full[page % stages].passed(full_parity(page)):
                yield "wait"
            if stage_page[page % stages] != page:
                yield f"thread {t} read stage {page % stages} for page {page}, found {stage_page[page % stages]}"
            readers[page % stages].add(t)

        for st in range(stages - distance):
            yield from refill(st)
        if pages:
            yield from read(0)
        for i in range(pages):
            yield from refill(i + stages - distance)
            if i + 1 < pages:
                yield from read(i + 1)
            yield "step"
            done = i - 1 if overlap else i  # the reads completed now: P V of page i - 1 (overlap) or i
            if done >= 0:
                readers[done % stages].discard(t)
                empty[done % stages].arrive()

    running = {t: program(t) for t in range(threads)}
    stalls = 0
    while running or landing:
        if landing and rng.random() < 0.3:
            t, s, page = landing.pop(rng.randrange(len(landing)))
            stage_page[s] = page  # one thread's chunks stand for all: the stage is the page once all landed
            full[s].arrive()
            continue
        if not running:
            continue
        t = rng.choice(sorted(running))
        event = next(running[t], None)
        if event is None:
            del running[t]
        elif event == "wait":
            stalls += 1
            if stalls > 100000:
                return "deadlock"
        elif event != "step":
            return event
    return None


@pytest.mark.parametrize("overlap", [False, True])
def test_ring_phases_keep_every_page_and_never_deadlock(overlap):
    for pages in (0, 1, 5, 6, 7, 8, 9, 17, 40):
        for seed in range(6):
            assert _ring_run(pages, 4, seed, attn2.RING_REFILL_DISTANCE, attn2.ring_full_parity,
                             attn2.ring_empty_parity, overlap) is None, (pages, seed)


def test_ring_model_catches_wrong_phases():
    """Fault injection: the empty parity one phase off lets a copy overwrite a stage still read;
    refilling at distance 1 with overlap waits on the thread's own arrival (deadlock)."""
    outcomes = {_ring_run(40, 4, seed, attn2.RING_REFILL_DISTANCE, attn2.ring_full_parity,
                          lambda ahead: attn2.ring_empty_parity(ahead) ^ 1, True) for seed in range(6)}
    assert outcomes - {None}
    assert _ring_run(40, 4, 0, 1, attn2.ring_full_parity, attn2.ring_empty_parity, True) == "deadlock"
    full_off = {_ring_run(40, 4, seed, attn2.RING_REFILL_DISTANCE, lambda p: attn2.ring_full_parity(p) ^ 1,
                          attn2.ring_empty_parity, False) for seed in range(6)}
    assert full_off - {None}


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_trim_combine_compiles_its_own_combine_without_spills(tmp_path, arch):
    """`trim_combine` builds another combine (its key holds the switch; the split kernel is the
    default's): the tree's levels behind a CTA-uniform test, the +0.0 pass-through, no spill."""
    folder = tmp_path / "trim"
    folder.mkdir()
    attn2.compile_attn2(2, 131072, 2048, attn2.Attn2Build(arch=arch, ptx_dir=str(folder),
                                                          issue=attn2.SplitIssue.named("all+trim")))
    combine = next(folder.glob("*_Attn2CombineKernel_*.ptx")).read_text()
    default = tmp_path / "default"
    default.mkdir()
    attn2.compile_attn2(2, 131072, 2048, attn2.Attn2Build(arch=arch, ptx_dir=str(default)))
    plain = next(default.glob("*_Attn2CombineKernel_*.ptx")).read_text()
    assert combine.count("add.rn.f32") > plain.count("add.rn.f32")  # the pass-through's + 0.0
    assert combine.count("bra") > plain.count("bra")  # the levels behind the test
    assert_no_spills(assemble(combine, arch, tmp_path, "attn2_combine_trim"))


# heads_per_cta (`Attn2Build.heads_per_cta`): (arch, issue, KV heads, heads_per_cta, max_model_len, window,
# num_splits); issue "all" is the target's tensor-core path, "sync" mma.sync forced on sm_90a
HEADS_VARIANTS = [(arch, issue, heads, per_cta, mml, window, splits)
                  for arch in ("sm_90a", "sm_100a") for issue in ("all", "sync", "none")
                  if not (arch == "sm_100a" and issue == "sync")
                  for heads, per_cta, mml, window, splits in [(2, 2, 131072, 0, None), (4, 4, 131072, 0, 512),
                                                               (4, 2, 131072, 2048, None), (2, 2, 2048, 0, None)]]
_HEADS_PTX: dict[tuple, str] = {}


def _heads_ptx(tmp_path_factory, arch, issue, heads, per_cta, max_model_len, window, splits):
    """The split kernel's PTX with `per_cta` KV heads a CTA (compiled once per module)."""
    key = (arch, issue, heads, per_cta, max_model_len, window, splits)
    if key not in _HEADS_PTX:
        folder = tmp_path_factory.mktemp("attn2_heads")
        attn2.compile_attn2(heads, max_model_len, window,
                            attn2.Attn2Build(arch=arch, ptx_dir=str(folder), issue=ISSUES[issue],
                                             tensor_ops=TENSOR_OPS.get(issue), num_splits=splits,
                                             heads_per_cta=per_cta))
        split = sorted(folder.glob("*_Attn2Kernel_*.ptx"))
        assert split, "no split kernel PTX kept"
        _HEADS_PTX[key] = split[-1].read_text()
    return _HEADS_PTX[key]


HEAD_LOOP_COUNTS = (WGMMA_S, WGMMA_PV, MMA, LDMATRIX, LDMATRIX_TRANS, "st.global.v4.u32", "st.global.u32",
                    "ld.global.u32", "cp.async.cg.shared.global", "cp.async.wait_group 0;")


def _heads_failures(ptx: str, one: str) -> list[str]:
    """What the heads_per_cta > 1 split kernel's PTX `ptx` lacks against the same kernel with one
    head a CTA (`one`): the heads run as a loop around one copy of the head's work (the same
    number of MMAs, fragment loads, Q and table loads, copies, partial or output stores, one drain
    of the copies), one barrier more (every warp done with the ring before the next head's
    prologue refills it), PDL's release after the last store, no spill before ptxas."""
    failures = [f"{what}: {ptx.count(what)} against {one.count(what)}" for what in HEAD_LOOP_COUNTS
                if ptx.count(what) != one.count(what)]
    if ptx.count("bar.sync") != one.count("bar.sync") + 1:
        failures.append(f"bar.sync: {ptx.count('bar.sync')}, one more than {one.count('bar.sync')} expected")
    stores = [m.start() for m in re.finditer(r"st\.global\.", ptx)]  # partials (v4) or the output (u32)
    if not stores or ptx.index("griddepcontrol.launch_dependents") < max(stores):
        failures.append("PDL's release before the last head's stores")
    if ".local" in ptx:
        failures.append("local memory (a spill before ptxas)")
    return failures


@pytest.mark.parametrize("arch, issue, heads, per_cta, max_model_len, window, splits", HEADS_VARIANTS)
def test_heads_per_cta_loops_over_one_copy_of_the_head(tmp_path_factory, tmp_path, arch, issue, heads, per_cta,
                                                       max_model_len, window, splits):
    """heads_per_cta 2 and 4 on both targets and both tensor-core paths: the PTX is the one-head
    kernel's work in a loop (`_heads_failures`), and ptxas assembles it without spills."""
    ptx = _heads_ptx(tmp_path_factory, arch, issue, heads, per_cta, max_model_len, window, splits)
    one = _heads_ptx(tmp_path_factory, arch, issue, heads, 1, max_model_len, window, splits)
    assert _heads_failures(ptx, one) == []
    report = assemble(ptx, arch, tmp_path, "attn2_heads")
    assert_no_spills(report)
    assert "Performance Loss" not in report


def test_heads_check_fails_on_the_one_head_kernel_and_on_an_unrolled_loop(tmp_path_factory):
    """`_heads_failures` fails on the one-head kernel itself (no extra barrier), on a kernel whose
    head loop is unrolled (twice the MMAs: the edited PTX), and on a release moved before a store."""
    args = ("sm_90a", "all", 2, 2, 131072, 0, None)
    ptx = _heads_ptx(tmp_path_factory, *args)
    one = _heads_ptx(tmp_path_factory, *args[:3], 1, *args[4:])
    assert _heads_failures(ptx, one) == []
    assert _heads_failures(one, one)
    step = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n72k16[^;]*;", ptx).group(0)
    assert _heads_failures(ptx.replace(step, step + "\n" + step, 1), one)
    release = "griddepcontrol.launch_dependents;"
    early = ptx.replace(release, "", 1).replace("griddepcontrol.wait;", "griddepcontrol.wait;\n" + release, 1)
    assert _heads_failures(early, one)


def test_heads_per_cta_is_its_own_variant_and_one_is_the_default():
    """heads_per_cta None and 1 are the default kernel (the same compile key: no heads_per_cta in
    it); 2 is another variant."""
    before = set(attn2.compilation.CACHE.keys())
    for per_cta in (None, 1, 2):
        attn2.compile_attn2(2, 8192, 0, attn2.Attn2Build(arch="sm_90a", heads_per_cta=per_cta))
    new = [dict(k[3]) for k in set(attn2.compilation.CACHE.keys()) - before if k[0].endswith("_Attn2Kernel")]
    assert sorted(k.get("heads_per_cta", 1) for k in new) in ([2], [1, 2])
    assert all("heads_per_cta" not in k or k["heads_per_cta"] > 1 for k in new)


@pytest.mark.parametrize("heads, per_cta, issue, match", [
    (4, 3, "all", "does not divide"), (2, 4, "all", "does not divide"), (1, 2, "all", "does not divide"),
    (2, 2, "all+ring", "mbarrier_ring"), (2, 2, "all+ring+overlap", "mbarrier_ring")])
def test_heads_per_cta_refusals_before_compile(heads, per_cta, issue, match):
    before = len(attn2.compilation.CACHE)
    with pytest.raises(ValueError, match=match):
        attn2.compile_attn2(heads, 131072, 0, attn2.Attn2Build(arch="sm_90a", heads_per_cta=per_cta,
                                                               issue=attn2.SplitIssue.named(issue)))
    assert len(attn2.compilation.CACHE) == before  # nothing compiled


@pytest.mark.parametrize("per_cta", [0, -1, True, 2.0, "2"])
def test_heads_per_cta_must_be_a_positive_int(per_cta):
    with pytest.raises(ValueError, match="heads_per_cta must be"):
        attn2.Attn2Build(heads_per_cta=per_cta)
    with pytest.raises(ValueError, match="heads_per_cta must be"):
        attn2.check_heads_per_cta(per_cta, 4, False)
