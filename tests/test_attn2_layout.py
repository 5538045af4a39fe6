"""The attn2 split plan (musebench.attn2_layout): every page of every L is visited exactly once,
by a split fixed by the page alone; the window's keys."""

from __future__ import annotations

import pytest

from musebench import attn2_layout as lay


@pytest.mark.parametrize("num_splits", [1, 2, 8, 64])
@pytest.mark.parametrize("first, end", [(0, 1), (0, 129), (3, 4), (5, 200), (130, 131)])
def test_split_pages_partition_the_range(num_splits, first, end):
    seen = []
    for split in range(num_splits):
        pages = list(lay.split_pages(split, num_splits, first, end))
        assert pages == sorted(pages)
        assert all(p % num_splits == split for p in pages)  # the page alone decides its split
        seen.extend(pages)
    assert sorted(seen) == list(range(first, end))


@pytest.mark.parametrize("seq_len, window, want", [
    (8, 0, (0, 8)),
    (100, 0, (0, 100)),
    (100, 50, (43, 100)),  # row 0 (position 92) sees 43..92; row 7 sees 50..99
    (8, 2048, (0, 8)),
    (2055, 2048, (0, 2055)),  # row 0 at 2047 sees keys 0..2047: exactly the window
    (2056, 2048, (1, 2056)),
])
def test_visible_keys(seq_len, window, want):
    assert lay.visible_keys(seq_len, window) == want


def test_max_pages():
    assert [lay.max_pages(n) for n in (1, 16, 17, 131072)] == [1, 1, 2, 8192]


def test_partial_layout():
    assert lay.PARTIAL_BYTES == 18432 and lay.CTA_THREADS == 128 and lay.ROWS_PER_KV_HEAD == 64


def test_lane_dims_are_the_mma_accumulator_layout():
    """lane_dims(c) is what lane c holds of a row in the m16n8k16 C fragment with n-tile t = dims
    8t .. 8t + 7 (columns 2c, 2c + 1 of each tile), t ascending; the 4 lanes cover the row once."""
    for c in range(4):
        want = [8 * t + col for t in range(lay.HEAD_DIM // lay.TILE_DIMS) for col in (2 * c, 2 * c + 1)]
        assert lay.lane_dims(c) == want and len(want) == lay.LANE_DIMS
    assert sorted(d for c in range(4) for d in lay.lane_dims(c)) == list(range(lay.HEAD_DIM))


def test_partial_vectors_of_a_row_are_the_lanes_order():
    """A row's vectors (2p + half for p = 0 .. 3, the combine's leaf order) concatenate to
    lane_dims(c), for both halves; each vector is two n-tiles' pairs."""
    for c in range(4):
        for half in range(2):
            leaf = [d for p in range(lay.PARTIAL_O_VECTORS // 2) for d in lay.partial_vector_dims(2 * p + half, c)]
            assert leaf == lay.lane_dims(c)
    assert lay.partial_vector_dims(2, 3) == [22, 23, 30, 31]
    assert lay.COMBINE_ROW_FLOATS == lay.LANE_DIMS + 2


def test_combine_groups_are_complete_subtrees():
    for partials in (1, 2, 4, 64, 128, 256, 512):
        groups = lay.combine_groups(partials)
        assert lay.is_power_of_two(groups) and groups <= lay.COMBINE_GROUPS and partials % groups == 0
        if partials > 1:
            assert lay.COMBINE_QUADS * groups >= 8  # the epilogue's butterfly needs the quad's 4 lanes
    assert lay.combine_groups(512) == 64 and lay.combine_groups(256) == 64 and lay.combine_groups(2) == 2


def test_split_table_entries_cover_every_page_a_split_visits():
    for max_model_len, window in ((128, 0), (129, 0), (256, 0), (2048, 0), (2048, 100), (4096, 0), (131072, 0),
                                  (131072, 2048), (4096, 64), (2200, 64)):
        splits = lay.splits(max_model_len, window, 2)
        entries = lay.split_table_entries(max_model_len, window, splits)
        for seq_len in range(8, max_model_len + 1, max(1, max_model_len // 97)):
            first, end = lay.visible_keys(seq_len, window)
            first_page, end_page = first // lay.PAGE_TOKENS, lay.max_pages(end)
            for split in range(splits):
                assert len(lay.split_pages(split, splits, first_page, end_page)) <= entries
    assert lay.split_table_entries(131072, 0, 256) == 32
    assert lay.split_table_entries(131072, 0, 512) == 16  # per split: a CTA of two splits holds 32
    # one split (SHORT_MAX_LEN: 4 pages at most); the small split plans: 2 to 4 pages a split
    assert [lay.split_table_entries(n, 0, lay.splits(n, 0, 2)) for n in (64, 65, 112, 113, 128, 129, 240, 256, 2048)] == [
        4, 3, 4, 2, 2, 3, 4, 2, 2]


def test_split_ctas_per_sm():
    assert lay.split_ctas_per_sm("sm_90a") == 4 and lay.split_ctas_per_sm("sm_100a") == 3
    assert lay.CTA_THREADS * 128 * lay.SPLIT_CTAS_PER_SM <= 65536  # the register cap it implies: 128


def test_split_plan_constants():
    """256 split CTAs a KV head (about two of 4 warps on each of the H200's 132 SMs), every KV head
    that many leaves; a CTA runs one or two sibling splits (two from PAIRED_LEAVES leaves a request:
    more than one wave of 4 CTAs an SM otherwise), the first held in shared memory in a partial's
    size (a thread's 32 values of O, its two rows' m and l)."""
    assert lay.SPLIT_TARGET_CLUSTERS == lay.MAX_SPLITS == 256
    assert lay.PAIRED_LEAVES == 1024  # tp 4 and 2 at 256 splits
    assert lay.SPLITS_PER_CTA_CHOICES == (1, 2)
    assert lay.PENDING_VALUES == 36 and lay.PENDING_BYTES == 36 * 4 * 128 == lay.PARTIAL_BYTES == 18432


@pytest.mark.parametrize("max_model_len, window, tp, splits, per_cta", [
    (131072, 0, 2, 256, 2),  # 8 KV heads x 256 = 2048 leaves: 1024 CTAs of two
    (131072, 0, 4, 256, 2),  # 1024 leaves: one wave of 512 CTAs of two
    (131072, 0, 8, 256, 1),  # 2 KV heads: 512 CTAs of one split already
    (131072, 0, 16, 256, 1),
    (131072, 2048, 2, 64, 1),  # the window's plan: 8 x 64 = 512 CTAs, below two a target
    (131072, 2048, 8, 64, 1),
    (131072, 2048, 16, 64, 1),
    (64, 0, 8, 1, 1),  # one split: nothing to pair
    (64, 0, 2, 1, 1),
    (128, 0, 2, 4, 1),  # a split plan since SHORT_MAX_LEN 64: 8 KV heads x 4 leaves do not pair
    (65, 0, 2, 2, 1),
    (2048, 0, 1, 64, 2),  # the small split plans: 16 KV heads x 64 = 1024 leaves pair; 8 x 64 do not
    (2048, 0, 2, 64, 1),
    (2048, 0, 16, 64, 1),
    (256, 0, 2, 8, 1),
    (129, 0, 16, 4, 1),
    (8192, 0, 4, 256, 2),
    (8192, 0, 8, 256, 1),  # 2 KV heads x 256 = 512
    (131072, 2048, 4, 64, 1),  # 4 x 64 = 256 leaves
])
def test_splits_per_cta(max_model_len, window, tp, splits, per_cta):
    heads = 16 // tp
    assert lay.splits(max_model_len, window, heads) == splits
    assert lay.splits_per_cta(heads, splits) == per_cta


@pytest.mark.parametrize("args", [(0, 512), (2, 0), (True, 512), (2, 2.0), (-1, 4)])
def test_splits_per_cta_refuses(args):
    with pytest.raises(ValueError, match="must be a positive int"):
        lay.splits_per_cta(*args)


def test_workspace_is_one_partial_per_split_cta():
    # one split a CTA (the default below two target's worth of CTAs): a partial per split
    assert lay.workspace_bytes(2, 3, 256) == 2 * 3 * 256 * lay.PARTIAL_BYTES
    assert lay.workspace_bytes(2, 1, 512) == 2 * 1 * 512 * lay.PARTIAL_BYTES  # tp 16
    assert lay.workspace_bytes(1, 1, 1) == 0
    assert lay.workspace_bytes(3, 8, 1, per_cta=1) == 0  # one split: nothing to merge, whatever per_cta
    # two a CTA (from PAIRED_LEAVES leaves, or forced): a partial per pair of siblings
    assert lay.workspace_bytes(1, 2, 512, per_cta=2) == 2 * 256 * lay.PARTIAL_BYTES
    assert lay.workspace_bytes(1, 4, 256) == 4 * 128 * lay.PARTIAL_BYTES  # tp 4: paired by default
    assert lay.workspace_bytes(1, 2, 512, per_cta=1) == 2 * 512 * lay.PARTIAL_BYTES
    assert lay.workspace_bytes(1, 2, 512) == lay.workspace_bytes(1, 2, 512, per_cta=2)  # 1024 leaves: paired
    assert lay.workspace_bytes(1, 2, 64, per_cta=2) == 2 * 32 * lay.PARTIAL_BYTES  # forced: half the default's
    assert lay.workspace_bytes(1, 2, 64) == 2 * 64 * lay.PARTIAL_BYTES
    assert lay.workspace_bytes(1, 2, 2, per_cta=2) == 2 * lay.PARTIAL_BYTES


@pytest.mark.parametrize("args, per_cta, match", [
    ((1, 2, 512), 3, "per_cta"),
    ((1, 2, 512), 0, "per_cta"),
    ((1, 2, 512), True, "per_cta"),
    ((1, 2, 512), 2.0, "per_cta"),
    ((1, 2, 512), 4, "per_cta"),
    ((0, 2, 512), 2, "num_reqs"),
    ((1, 2, 384), 2, "power of two"),
])
def test_workspace_bytes_refuses(args, per_cta, match):
    with pytest.raises(ValueError, match=match):
        lay.workspace_bytes(*args, per_cta=per_cta)


def test_split_steps_pair_the_splits_whole_list():
    """Pairs (2j, 2j + 1) by place in the split's whole list (page p's place: p // S), whatever the
    first page; a lone first page at an odd place, a lone last page; one page a step as visited."""
    assert lay.split_steps(1, 4, 0, 20, 2) == [(1, 5), (9, 13), (17,)]
    assert lay.split_steps(1, 4, 0, 20, 1) == [(1,), (5,), (9,), (13,), (17,)]
    assert lay.split_steps(1, 4, 3, 20, 2) == [(5,), (9, 13), (17,)]  # page 1 (place 0) not visited
    assert lay.split_steps(0, 1, 2, 7, 2) == [(2, 3), (4, 5), (6,)]
    assert lay.split_steps(0, 1, 3, 7, 2) == [(3,), (4, 5), (6,)]
    assert lay.split_steps(2, 4, 0, 2, 2) == []


@pytest.mark.parametrize("bad", [0, 3, True, 2.0, "2", None])
def test_pages_per_step_outside_the_choices_is_refused(bad):
    with pytest.raises(ValueError, match="pages_per_step"):
        lay.check_pages_per_step(bad)


def test_either_pages_per_step_is_accepted():
    """1 and 2 both pass the check (two pages a step runs with one or two splits a CTA)."""
    for per_step in lay.PAGES_PER_STEP_CHOICES:
        lay.check_pages_per_step(per_step)
    assert lay.PAGES_PER_STEP_CHOICES == (1, 2)


# (max_model_len, window): the short plans, the split plans without a window, the window's
DEPLOYMENT_PLANS = [(8, 0), (64, 0), (65, 0), (128, 0), (129, 0), (256, 0), (2048, 0), (4096, 0), (8192, 0), (32768, 0), (131072, 0),
                    (131072, 2048), (8192, 2048), (2048, 100), (4096, 1)]


@pytest.mark.parametrize("max_model_len, window", DEPLOYMENT_PLANS)
def test_pages_per_step_rule_is_two_for_split_plans_without_a_window(max_model_len, window):
    """`pages_per_step`: 2 exactly for a split plan (num_splits > 1) without a window, 1 for the
    window's plans and the one-split plans, the same at every tp (1, 2, 4, 8, 16 KV heads: the
    plan's splits do not depend on them, nor does the rule)."""
    values = {lay.pages_per_step(window, lay.splits(max_model_len, window, heads)) for heads in (1, 2, 4, 8, 16)}
    splits = lay.splits(max_model_len, window, 1)
    assert values == {2 if splits > 1 and window == 0 else 1}


def test_pages_per_step_rule_values():
    """The deployments' values: 2 at 65 .. 128k without a window (128 and 2048 included: split
    plans), 1 at 64 (one split) and with the 2048 window; a forced plan follows its own split count."""
    assert [lay.pages_per_step(0, lay.splits(n, 0, 2)) for n in (64, 65, 128, 129, 256, 2048, 4096, 8192, 131072)] == [
        1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert lay.pages_per_step(2048, lay.splits(131072, 2048, 2)) == 1
    assert lay.pages_per_step(0, 1) == 1 and lay.pages_per_step(0, 2) == 2
    assert lay.pages_per_step(2048, 256) == 1


@pytest.mark.parametrize("max_model_len, window", DEPLOYMENT_PLANS)
def test_spread_splits_rule_is_on_for_split_plans_without_a_window(max_model_len, window):
    """`spread_splits`: True exactly for a split plan (max_model_len past SHORT_MAX_LEN) without a
    window, at every tp."""
    expected = max_model_len > lay.SHORT_MAX_LEN and window == 0
    assert {lay.spread_splits(window, lay.splits(max_model_len, window, heads)) for heads in (1, 2, 4, 8, 16)} == {
        expected}


def test_spread_splits_rule_values_and_refusals():
    assert [lay.spread_splits(0, lay.splits(n, 0, 2)) for n in (64, 65, 2048, 131072)] == [False, True, True, True]
    assert lay.spread_splits(2048, lay.splits(131072, 2048, 2)) is False
    assert lay.spread_splits(0, 1) is False and lay.spread_splits(1, 256) is False
    for window in (-1, True, 2.0):
        with pytest.raises(ValueError, match="window"):
            lay.spread_splits(window, 256)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        lay.spread_splits(0, 0)


def test_spread_splits_rule_can_fail():
    """Fault injection for the expectation above: a rule ignoring the window (spread in every split
    plan, as 0239372 deployed it) and one for the 256-split plans alone each differ from it on some
    deployment plan."""
    def ignoring_the_window(window, splits):
        return splits > 1

    def full_plans_alone(window, splits):
        return splits == lay.MAX_SPLITS and window == 0

    for wrong in (ignoring_the_window, full_plans_alone):
        assert any(wrong(window, lay.splits(n, window, 2)) != (n > lay.SHORT_MAX_LEN and window == 0)
                   for n, window in DEPLOYMENT_PLANS)


def test_pages_per_step_rule_can_fail():
    """Fault injection: a rule keyed on tp (two pages only where one split runs a CTA, as the
    refusal before it had it) gives tp 4 and tp 8 different values, which the tp-independence
    check above sees; a rule ignoring the window gives the window's plan 2."""
    def by_tp(max_model_len, window, heads):
        splits = lay.splits(max_model_len, window, heads)
        return 2 if splits > 1 and not window and lay.splits_per_cta(heads, splits) == 1 else 1

    assert len({by_tp(131072, 0, heads) for heads in (1, 2, 4, 8, 16)}) == 2
    assert lay.pages_per_step(2048, 64) != lay.pages_per_step(0, 64)


@pytest.mark.parametrize("args", [(-1, 256), (0, 0), (True, 256), (0, 2.0), (1.0, 256)])
def test_pages_per_step_rule_refuses_bad_plans(args):
    with pytest.raises(ValueError):
        lay.pages_per_step(*args)


def test_ring_stages_rule():
    """The deep ring where a launch has at most two split CTAs an SM (1 KV head at 256 splits: 256
    CTAs; 2 KV heads at 128 splits), PIPELINE_STAGES elsewhere: 512 CTAs and more, a window, one
    split; the CTA count is per_cta's (two a CTA halve it, and take PAIRED_DEEP_RING_STAGES)."""
    deep, plain = lay.DEEP_RING_STAGES, lay.PIPELINE_STAGES
    assert lay.ring_stages(0, 1, 256) == deep and lay.ring_stages(0, 2, 128) == deep
    assert lay.ring_stages(0, 2, 256) == plain and lay.ring_stages(0, 4, 256) == plain  # 512 CTAs (4: paired)
    # 256 CTAs of two splits: the paired depth (the held split's shared memory on top of the ring)
    assert lay.ring_stages(0, 2, 256, 2) == lay.PAIRED_DEEP_RING_STAGES != deep
    assert lay.ring_stages(0, 2, 256, 2, deferred=True) == lay.PAIRED_DEEP_RING_STAGES
    assert lay.ring_stages(2048, 1, 64) == plain and lay.ring_stages(0, 1, 1) == plain
    # the small split plans (max_model_len 65 .. 2048: 2 .. 64 splits) have few CTAs: the deep ring
    # up to 4 KV heads at 64 splits (256 CTAs; 8 heads' 512 keep PIPELINE_STAGES); one split
    # (max_model_len <= 64) keeps PIPELINE_STAGES
    for heads in (1, 2, 4):
        assert lay.ring_stages(0, heads, lay.splits(2048, 0, heads)) == deep
    assert lay.ring_stages(0, 8, lay.splits(2048, 0, 8)) == plain
    assert {lay.ring_stages(0, heads, lay.splits(n, 0, heads)) for heads in (1, 8) for n in (65, 128, 129, 256)} == {deep}
    assert {lay.ring_stages(0, heads, lay.splits(64, 0, heads)) for heads in (1, 8)} == {plain}
    # deferred P V waits: the deep plans take DEFERRED_DEEP_RING_STAGES, the others stay as they are
    deferred = lay.DEFERRED_DEEP_RING_STAGES
    assert deferred != deep
    assert lay.ring_stages(0, 1, 256, deferred=True) == deferred and lay.ring_stages(0, 2, 128, deferred=True) == deferred
    assert lay.ring_stages(0, 2, 256, deferred=True) == plain and lay.ring_stages(2048, 1, 64, deferred=True) == plain
    for bad in (dict(window=-1), dict(window=True), dict(num_kv_heads=0), dict(num_splits=0)):
        args = dict(window=0, num_kv_heads=1, num_splits=256) | bad
        with pytest.raises(ValueError):
            lay.ring_stages(**args)


def _check_short_plans() -> None:
    """The plans themselves: one split up to 64 tokens (4 pages), a split plan from the next
    token on (two splits, four from 113 tokens: 128 is a split plan), at every tp."""
    for heads in (1, 2, 4, 8, 16):
        assert [lay.splits(n, 0, heads) for n in (8, 16, 17, 63, 64)] == [1] * 5
        assert [lay.splits(n, 0, heads) for n in (65, 112, 113, 127, 128, 129, 256, 2047, 2048)] == [
            2, 2, 4, 4, 4, 4, 8, 64, 64]


def test_short_max_len_is_four_pages():
    """One split up to SHORT_MAX_LEN (64 tokens, 4 pages: where one CTA's serial pages still run
    under SDPA, and within a microsecond of a split plan), a split plan from the next token on, at
    every tp."""
    assert lay.SHORT_MAX_LEN == 4 * lay.PAGE_TOKENS == 64
    _check_short_plans()


def test_short_max_len_check_can_fail(monkeypatch):
    """Fault injection: the old thresholds (2048 tokens, then 128) put max_model_len 2048, or 65 ..
    128, back on one split, and the check above refuses each."""
    monkeypatch.setattr(lay, "SHORT_MAX_LEN", 2048)
    with pytest.raises(AssertionError):
        _check_short_plans()
    assert lay.splits(2048, 0, 2) == 1 and lay.splits(256, 0, 2) == 1 and lay.splits(2049, 0, 2) == 64
    monkeypatch.setattr(lay, "SHORT_MAX_LEN", 128)
    with pytest.raises(AssertionError):
        _check_short_plans()
    assert lay.splits(128, 0, 2) == 1 and lay.splits(65, 0, 2) == 1 and lay.splits(129, 0, 2) == 4


# The GPU tests' short-plan cases (`tests/kernels/test_attn2_gpu.py`, skipped without a GPU): the
# plan each (max_model_len, window) runs (the `attn2_plan_splits` fixture), checked here where the
# tests run on the CPU.
def _check_gpu_short_plans(plan_splits: dict) -> None:
    from tests.kernels import test_attn2_gpu as gpu

    cases = [(m, w) for _, m, w in gpu.MODEL_CASES] + [(m, 0) for _, m in gpu.SHORT_PLAN_TP_CASES]
    cases += [(m, 0) for _, m in gpu.SHORT_PLAN_LENGTH_CASES]
    cases += [(m, w) for _, m, w in gpu.STEP_CASES if m <= 4096]
    for max_model_len, window in cases:
        got = {lay.splits(max_model_len, window, heads) for heads in (1, 2, 4, 8, 16)}
        assert got == {plan_splits[max_model_len, window]}, (max_model_len, window)
    # one split is covered up to SHORT_MAX_LEN's last token, and the next plan (128) as a split plan
    one_split = [(n, m) for n, m, w in gpu.MODEL_CASES if lay.splits(m, w, 2) == 1]
    assert {n for n, _ in one_split} >= {8, 15, 16, 17, lay.SHORT_MAX_LEN - 1, lay.SHORT_MAX_LEN}
    assert {n for n, m, _ in gpu.MODEL_CASES if m == 2 * lay.SHORT_MAX_LEN} >= {8, 17, 127, 128}


def test_gpu_tests_run_the_plans_they_name(attn2_plan_splits):
    _check_gpu_short_plans(attn2_plan_splits)


def test_gpu_plan_check_can_fail(monkeypatch, attn2_plan_splits):
    """Fault injection: the old threshold (128) puts max_model_len 128 back on one split."""
    monkeypatch.setattr(lay, "SHORT_MAX_LEN", 128)
    with pytest.raises(AssertionError):
        _check_gpu_short_plans(attn2_plan_splits)
