"""attn2 on a GPU: against the CPU model of its algorithm (`cpu.attn2.agreement`: within 2 BF16
ULPs at each head row's scale, mean element error small; ex2.approx and the tensor cores' guard
bits are not emulated), against the FP64 reference beside the stock
(max and mean ULP each at most the stock's), bitwise determinism across calls and graph replays,
rank identity across tp, same keys same bits across L, poison never read. The traced build
(`Attn2Build.trace`): the same bits, every CTA's row written with its clocks in order, in a graph
too; a workspace without room for the rows refused."""

from __future__ import annotations

import pytest
import torch

from musebench import cute_ops
from musebench.cases.attn2_inputs import INPUT_FAMILIES, for_rank, make_problem
from musebench import attn2_layout as lay
from musebench.cpu.attn2 import agreement, attn2_model
from musebench.stock.attn2 import attn2_reference, stock_attn2, ulp_error

pytestmark = pytest.mark.gpu


def _run(problem, out=None):
    p = problem.to("cuda")
    heads = p.num_kv_heads
    splits = cute_ops.attn2_splits(p.max_model_len, p.window, heads)
    workspace = torch.zeros(max(16, cute_ops.attn2_workspace_bytes(p.num_reqs, heads, splits)), dtype=torch.uint8,
                            device="cuda")
    out = torch.full_like(p.q, float("nan")) if out is None else out
    cute_ops.prepare_attn2(heads, p.max_model_len, p.window)
    cute_ops.launch_attn2(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace,
                          max_model_len=p.max_model_len, window=p.window)
    torch.cuda.synchronize()
    return out.cpu(), (p, workspace, out)


# L at page and split boundaries, the window's edges: max_model_len 64 runs one split (SHORT_MAX_LEN),
# 128, 256 and 2048 the small split plans (4, 8 and 64 splits; 128 with a 64-key window 2, 2048 with a
# 100-key window 4), 4096 the split kernel (`tests/test_attn2_layout.py` checks each case's plan)
MODEL_CASES = [
    (8, 64, 0), (15, 64, 0), (16, 64, 0), (17, 64, 0), (63, 64, 0), (64, 64, 0), (40, 64, 32),
    (8, 128, 0), (17, 128, 0), (127, 128, 0), (128, 128, 0), (100, 128, 64),
    (17, 256, 0), (129, 256, 0), (256, 256, 0),
    (8, 2048, 0), (17, 2048, 0), (2047, 2048, 0), (2048, 2048, 0), (2047, 2048, 100),
    (2049, 4096, 0), (17, 4096, 0), (2055, 4096, 2048), (2056, 4096, 2048), (4000, 4096, 2048),
]


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@pytest.mark.parametrize("seq_len, max_model_len, window", MODEL_CASES)
def test_matches_model_and_beats_stock(request, family, seq_len, max_model_len, window):
    if (family, seq_len, max_model_len, window) == ("large", 15, 64, 0):
        # measured on the H200 at 925c6fb (records/2026-12-02-h200-925c6fb-pytest-gpu-attn2.summary.json):
        # attn2 max 1.590 mean 0.2495 BF16 ULPs against the stock's max 1.424 mean 0.2501 on the inputs
        # drawn for max_model_len 64. The element (row 7, column 754) is the FP32 scores' resolution:
        # its exact o lies 2.9 FP32 ULPs below a BF16 midpoint, closer than FP32 scores near 4096
        # can place it; the CPU model rounds it the same way with correctly rounded FP32 scores and
        # right with FP64 ones (tests/cpu/test_attn2_model.py::test_large_l15_error_is_the_fp32_scores_resolution)
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "max error 1.59 ULP against the stock's 1.42 (mean 0.2495 against 0.2501) on these inputs: one "
            "element 2.9 FP32 ULPs from a BF16 rounding midpoint, decided by the FP32 scores' last bits "
            "(an open accuracy finding of issue 15)")))
    problem = make_problem(family, seq_len, max_model_len, window=window, num_kv_heads=2)
    got, _ = _run(problem)
    model = attn2_model(problem)
    _, exact = attn2_reference(problem)
    agree = agreement(got, model)
    mine, stock = ulp_error(got, exact), ulp_error(stock_attn2(problem.to("cuda")), exact)
    of_model = ulp_error(model, exact)
    splits = cute_ops.attn2_splits(max_model_len, window, 2)
    first, end = lay.visible_keys(seq_len, window)
    pages = lay.max_pages(end) - first // lay.PAGE_TOKENS
    print(f"\n[attn2 {family} L={seq_len} max_model_len={max_model_len} W={window} splits={splits} "
          f"pages={pages} (<= {-(-pages // splits)} a split)] vs model: {agree.describe()}\n"
          f"  vs FP64: attn2 max {mine.max:.2f} mean {mine.mean:.4f} | model max {of_model.max:.2f} "
          f"mean {of_model.mean:.4f} | stock max {stock.max:.2f} mean {stock.mean:.4f}")
    assert agree.ok, agree.describe()
    assert mine.nonfinite == 0
    assert mine.within(stock), (mine, stock)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a.view(torch.int16) != b.view(torch.int16)).nonzero()
    if diff.numel() == 0:
        return "equal"
    r, c = (int(x) for x in diff[0])
    return f"{diff.shape[0]} elements differ, first at row {r} col {c} (head {c // 64}): {a[r, c].item()} vs {b[r, c].item()}"


def test_deterministic_across_calls_and_graph_replays():
    problem = make_problem("random", 3000, 8192, num_kv_heads=2)
    first, (p, workspace, out) = _run(problem)
    for _ in range(3):
        again, _ = _run(problem)
        assert torch.equal(first.view(torch.int16), again.view(torch.int16)), _first_difference(first, again)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute_ops.launch_attn2(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace,
                              max_model_len=p.max_model_len, window=0)
    for _ in range(5):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(first.view(torch.int16), out.cpu().view(torch.int16)), _first_difference(first, out.cpu())


def test_kv_head_bits_whatever_the_tp():
    """A KV head's bits are the same at tp 2, 4, 8 and 16 (the split count ignores the heads; at
    8192, 256 splits: tp 2 and 4 run two sibling splits a CTA, tp 8 and 16 one, so the pairing of
    the deployments is checked here too; every tp takes the rule's two pages a step, so two pages
    a step with two splits a CTA meets one split a CTA here)."""
    whole = make_problem("random", 2100, 8192, num_kv_heads=16)
    per_tp = {tp: torch.cat([_run(for_rank(whole, r, tp))[0] for r in range(tp)], dim=1) for tp in (2, 4, 8, 16)}
    for tp in (4, 8, 16):
        assert torch.equal(per_tp[2].view(torch.int16), per_tp[tp].view(torch.int16)), (tp, _first_difference(per_tp[2], per_tp[tp]))


def test_kv_head_bits_whatever_the_tp_at_128k():
    """KV heads 0 and 1 at 128k (256 splits): tp 8 (both in one launch) and tp 16 (one each) agree."""
    whole = make_problem("random", 100000, 131072, num_kv_heads=2)
    tp8, _ = _run(whole)
    tp16 = torch.cat([_run(for_rank(whole, r, 2))[0] for r in range(2)], dim=1)
    assert torch.equal(tp8.view(torch.int16), tp16.view(torch.int16)), _first_difference(tp8, tp16)


SHORT_PLAN_TP_CASES = [(50, 64), (100, 128), (200, 256), (2000, 2048)]


def test_kv_head_bits_whatever_the_tp_on_the_short_plans():
    """The same at one split (64) and on the small split plans (128: 4 splits; 256: 8; 2048: 64,
    where tp 16, 8 and 4 take the deep ring and the deferred P V waits and tp 2, 512 CTAs, does not)."""
    for seq_len, max_model_len in SHORT_PLAN_TP_CASES:
        whole = make_problem("random", seq_len, max_model_len, num_kv_heads=16)
        per_tp = {tp: torch.cat([_run(for_rank(whole, r, tp))[0] for r in range(tp)], dim=1) for tp in (2, 4, 8, 16)}
        for tp in (4, 8, 16):
            assert torch.equal(per_tp[2].view(torch.int16), per_tp[tp].view(torch.int16)), (
                (max_model_len, tp), _first_difference(per_tp[2], per_tp[tp]))


SHORT_PLAN_LENGTH_CASES = [(15, 64), (16, 64), (63, 64), (15, 128), (127, 128), (128, 256), (129, 256), (2047, 2048)]


def test_same_keys_same_bits_on_the_short_plans():
    """Row t at L and row t - 1 at L + 1: equal bits with one split (max_model_len 64, up to its
    last token) and on the small split plans (128, 256, 2048), across page boundaries."""
    from tests.cpu.test_attn2_model import _extended

    for seq_len, max_model_len in SHORT_PLAN_LENGTH_CASES:
        problem = make_problem("random", seq_len, max_model_len, num_kv_heads=2)
        now, _ = _run(problem)
        then, _ = _run(_extended(problem))
        assert torch.equal(now[1:].view(torch.int16), then[:-1].view(torch.int16)), (
            (seq_len, max_model_len), _first_difference(now[1:], then[:-1]))


def test_same_keys_same_bits_at_every_length():
    """Row t at L and row t - 1 at L + 1 (same keys, same query and gate): equal bits, across a
    page boundary, with the split kernel."""
    from tests.cpu.test_attn2_model import _extended

    for seq_len in (2063, 2064, 3000):
        problem = make_problem("random", seq_len, 8192, num_kv_heads=2)
        now, _ = _run(problem)
        then, _ = _run(_extended(problem))
        assert torch.equal(now[1:].view(torch.int16), then[:-1].view(torch.int16)), (seq_len, _first_difference(now[1:], then[:-1]))


def _launch(problem, num_splits=None, **experiment):
    """(output bf16, workspace bytes) on the CPU of the split plan (`num_splits`, None: the
    deployment's) with the experiment arguments of `kernels.attn2.launch` (`issue`, `tensor_ops`:
    None is the GPU's default, wgmma on an H200; `splits_per_cta`); the workspace starts zeroed, so
    it holds exactly the partials the split kernel wrote."""
    from musebench.kernels import attn2

    p = problem.to("cuda")
    heads = p.num_kv_heads
    splits = num_splits or cute_ops.attn2_splits(p.max_model_len, p.window, heads)
    per_cta = experiment.get("splits_per_cta") or lay.splits_per_cta(heads, splits)  # pages_per_step: None, the rule
    workspace = torch.zeros(max(16, lay.workspace_bytes(p.num_reqs, heads, splits, per_cta)), dtype=torch.uint8,
                            device="cuda")
    out = torch.full_like(p.q, float("nan"))
    attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace, max_model_len=p.max_model_len,
                 window=p.window, num_splits=num_splits, **experiment)
    torch.cuda.synchronize()
    return out.cpu(), workspace.cpu()


# Attn2Build.empty_ctas_exit (the deployment's split CTAs without pages end after L's load) and
# Attn2Build.spread_splits (the deployment's grid index y runs partial bitrev(y) without a window,
# y with one) against their baselines (every CTA's whole prologue; the other order), alone and
# together. Few splits with pages (L 8, 17, 128 at 128k: 1, 2, 8 of 256), every split (4099,
# 131072), windows (3017 / 100 and 2055 / 2048: every split has pages, its first live split past 0;
# 300 / 2048 at 4096: 19 pages of the window's split plan, the rest empty), tp 8, 16, 4 (two splits
# a CTA), the 64-split plan at 2048
EMPTY_EXIT_CASES = [(8, 131072, 0, 2), (17, 131072, 0, 2), (128, 131072, 0, 2), (4099, 131072, 0, 2),
                    (131072, 131072, 0, 2), (128, 131072, 0, 1), (70001, 131072, 0, 4), (300, 131072, 0, 4),
                    (3017, 131072, 100, 2), (2055, 4096, 2048, 2), (300, 4096, 2048, 2), (129, 2048, 0, 2)]
BASELINES = ("empty_ctas_stay", "other_order", "both")


def _baseline(name: str, max_model_len: int, window: int) -> dict:
    """The build switches of a BASELINES entry: every CTA's whole prologue, the split order the
    deployment does not take (grid order without a window, spread with one), or both."""
    splits = cute_ops.attn2_splits(max_model_len, window, 1)  # the plan's: not a function of the KV heads
    other_order = dict(spread_splits=not lay.spread_splits(window, splits))
    return {"empty_ctas_stay": dict(empty_ctas_exit=False), "other_order": other_order,
            "both": dict(empty_ctas_exit=False, **other_order)}[name]


@pytest.mark.parametrize("baseline", BASELINES)
@pytest.mark.parametrize("family", ["random", "tiny"])
@pytest.mark.parametrize("seq_len, max_model_len, window, num_kv_heads", EMPTY_EXIT_CASES)
def test_empty_exit_and_spread_splits_keep_every_bit(baseline, family, seq_len, max_model_len, window,
                                                     num_kv_heads):
    """The deployment (empty CTAs end early; partials spread over the grid without a window) and each
    baseline (every CTA's whole prologue, the other order, both) give the same out and the same
    workspace bytes (zeroed first: every partial in its own slot), and the deployment leaves the
    slot of every partial without pages zero (no such CTA writes)."""
    problem = make_problem(family, seq_len, max_model_len, window=window, num_kv_heads=num_kv_heads)
    deployed, deployed_workspace = _launch(problem)
    other, other_workspace = _launch(problem, **_baseline(baseline, max_model_len, window))
    assert torch.equal(deployed.view(torch.int16), other.view(torch.int16)), _first_difference(deployed, other)
    assert torch.equal(deployed_workspace, other_workspace)
    splits = cute_ops.attn2_splits(max_model_len, window, num_kv_heads)
    per_cta = lay.splits_per_cta(num_kv_heads, splits)
    first, end = lay.visible_keys(seq_len, window)
    first_page, end_page = first // lay.PAGE_TOKENS, lay.max_pages(end)
    slots = deployed_workspace[:lay.workspace_bytes(1, num_kv_heads, splits)].view(num_kv_heads, -1, lay.PARTIAL_BYTES)
    empty = [p for p in range(splits // per_cta)
             if not any(len(lay.split_pages(p * per_cta + j, splits, first_page, end_page)) for j in range(per_cta))]
    for p in empty:
        assert int(slots[:, p].count_nonzero()) == 0, f"partial {p} has no pages but its slot was written"


def _launch_issue(problem, issue, num_splits=None, tensor_ops=None):
    """The split plan's output with one `SplitIssue` setting and tensor-core path (`_launch`)."""
    return _launch(problem, num_splits, issue=issue, tensor_ops=tensor_ops)[0]


# pages at the causal edge, the window's first pages, splits without pages, one split (64), the small
# split plans (128, 256, 2048), many pages a split (most alphas 1.0); "equal" keys keep every alpha at 1.0
# after the first page, "large" moves it
@pytest.mark.parametrize("family", INPUT_FAMILIES)
@pytest.mark.parametrize("seq_len, max_model_len, window", [
    (8, 64, 0), (23, 64, 0), (64, 64, 0), (8, 128, 0), (128, 128, 0), (200, 256, 0), (23, 2048, 0), (2047, 2048, 0), (17, 4096, 0), (2049, 4096, 0), (2055, 4096, 2048),
    (4000, 4096, 2048), (3001, 8192, 100), (131072, 131072, 0), (70001, 131072, 4096),
])
def test_split_issue_settings_keep_every_bit(family, seq_len, max_model_len, window):
    """Every SplitIssue switch, alone and together, on the GPU's tensor-core path (wgmma on an
    H200) and on mma.sync, gives the bits of the mma.sync kernel without them."""
    from musebench.kernels.attn2 import SplitIssue

    problem = make_problem(family, seq_len, max_model_len, window=window, num_kv_heads=2)
    baseline = _launch_issue(problem, SplitIssue.none(), tensor_ops="sync")
    for name in ("all", "mask", "rescale", "lean", "keys", "lean+keys", "mask+rescale", "all@sync", "none@sync"):
        setting, _, ops = name.partition("@")
        got = _launch_issue(problem, SplitIssue.named(setting), tensor_ops=ops or None)
        assert torch.equal(got.view(torch.int16), baseline.view(torch.int16)), (name, _first_difference(got, baseline))


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@pytest.mark.parametrize("seq_len, max_model_len, num_kv_heads", [
    (129, 256, 2), (2047, 2048, 2), (2048, 2048, 1), (17, 4096, 2), (2049, 4096, 2), (8200, 131072, 2), (70001, 131072, 1), (131072, 131072, 2), (131072, 131072, 4),
])
def test_deferred_values_keep_every_bit(family, seq_len, max_model_len, num_kv_heads):
    """SplitIssue.defer_values (the two-page step's P V waited for at the next step's Q K^T wait,
    two more ring stages) gives the deployment's bits, with one split a CTA and with two (4 KV
    heads at 128k), across step counts odd and even and a lone last page; the small split plans
    (256, 2048: one or two pages a split) deploy it."""
    import dataclasses

    from musebench.kernels.attn2 import SplitIssue

    problem = make_problem(family, seq_len, max_model_len, num_kv_heads=num_kv_heads)
    baseline = _launch_issue(problem, SplitIssue())
    got = _launch_issue(problem, dataclasses.replace(SplitIssue(), defer_values=True))
    assert torch.equal(got.view(torch.int16), baseline.view(torch.int16)), _first_difference(got, baseline)


@pytest.mark.parametrize("seq_len, max_model_len, window, num_kv_heads", [
    (60, 64, 0, 2), (120, 128, 0, 2), (2000, 2048, 0, 2), (3001, 8192, 0, 2), (2055, 4096, 2048, 2), (100001, 131072, 0, 2), (70001, 131072, 0, 1), (9001, 131072, 0, 4),
])
def test_bad_table_entries_read_as_a_page_of_zeros(seq_len, max_model_len, window, num_kv_heads):
    """Table entries outside [0, cache pages) on visible pages (-1, the page count, far past it,
    INT32's extremes: a caller's bug) fault nothing and read as zeros: the launch gives the bits
    of the same problem whose entries name a real page of zeros. (Before the bounds were two
    signed compares, a negative entry passed as inside and addressed memory before the cache.)"""
    import dataclasses

    problem = make_problem("random", seq_len, max_model_len, window=window, num_kv_heads=num_kv_heads)
    pool = problem.kv_cache.shape[0]
    first = lay.visible_keys(seq_len, window)[0] // lay.PAGE_TOKENS
    last = lay.max_pages(seq_len) - 1  # the page holding L - 1
    middle = (first + last) // 2
    rows = list(dict.fromkeys([first, last, middle, middle + 1, first + 1]))  # distinct visible pages, in order
    values = [-1, pool, pool + 1000, 2**31 - 1, -(2**31)]
    cache = torch.cat([problem.kv_cache, torch.zeros_like(problem.kv_cache[:1])])
    # every value on its own page; a plan with fewer visible pages (one split at 64: 4) takes them
    # in rounds of as many as it has
    for start in range(0, len(values), len(rows)):
        broken, zeroed = problem.page_table.clone(), problem.page_table.clone()
        for row, value in zip(rows, values[start:start + len(rows)]):
            broken[0, row] = value
            zeroed[0, row] = pool  # the appended page of zeros
        got = _launch(dataclasses.replace(problem, page_table=broken))[0]
        want = _launch(dataclasses.replace(problem, kv_cache=cache, page_table=zeroed))[0]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), _first_difference(got, want)
        assert bool(torch.isfinite(got.float()).all())


def test_split_issue_comparison_sees_a_change():
    """The comparison above is not vacuous: another split plan (another merge tree) with every
    saving on differs from the deployment's plan without them in some bits."""
    from musebench.kernels.attn2 import SplitIssue

    problem = make_problem("random", 6000, 8192, num_kv_heads=2)
    deployment = _launch_issue(problem, SplitIssue.none())
    other_plan = _launch_issue(problem, SplitIssue(), num_splits=2)
    assert not torch.equal(other_plan.view(torch.int16), deployment.view(torch.int16))


# splits without pages, the causal and window edges, the small split plans (128, 256, 2048), 512 splits
# (the measured experiment), a full 128k request, 4 KV heads (one split, max_model_len <= 64, has
# nothing to pair: refused, `test_splits_per_cta_refused_before_launch`)
@pytest.mark.parametrize("family", INPUT_FAMILIES)
@pytest.mark.parametrize("seq_len, max_model_len, window, num_splits", [
    (120, 128, 0, None), (200, 256, 0, None), (2047, 2048, 0, None), (17, 4096, 0, None), (2049, 4096, 0, None), (4000, 4096, 2048, None), (3001, 8192, 100, 512),
    (70001, 131072, 4096, None), (131072, 131072, 0, None), (40000, 131072, 0, 512), (2100, 131072, 0, None),
])
def test_splits_per_cta_keeps_every_bit(family, seq_len, max_model_len, window, num_splits):
    """Two sibling splits a CTA (merged in the CTA) give the bits of one split a CTA (merged by the
    combine), with 2 and 4 KV heads, on the GPU's tensor-core path and on mma.sync, each plan with
    the rule's pages a step (two without a window, one with it)."""
    for heads in (2, 4):
        problem = make_problem(family, seq_len, max_model_len, window=window, num_kv_heads=heads)
        for ops in (None, "sync"):
            one, _ = _launch(problem, num_splits, tensor_ops=ops, splits_per_cta=1)
            two, _ = _launch(problem, num_splits, tensor_ops=ops, splits_per_cta=2)
            assert torch.equal(two.view(torch.int16), one.view(torch.int16)), ((heads, ops), _first_difference(two, one))
            assert not one.isnan().any()


def test_splits_per_cta_comparison_sees_a_change():
    """The comparison above is not vacuous: with KV heads 0 and 1 of the cache swapped, two splits a
    CTA differ from one split a CTA on the original cache."""
    problem = make_problem("random", 6000, 8192, num_kv_heads=2)
    one, _ = _launch(problem, splits_per_cta=1)
    swapped = problem.to("cuda")
    swapped.kv_cache.copy_(swapped.kv_cache.flip(1))
    two, _ = _launch(swapped, splits_per_cta=2)
    assert not torch.equal(two.view(torch.int16), one.view(torch.int16))


def test_splits_per_cta_refused_before_launch():
    """splits_per_cta outside (1, 2), or 2 with a one-split plan, is a ValueError before any compile
    or launch (nothing written)."""
    from musebench.kernels.attn2 import launch

    for seq_len, max_model_len, per_cta in ((1500, 4096, 3), (1500, 4096, True), (60, 64, 2)):
        p = make_problem("random", seq_len, max_model_len, num_kv_heads=2).to("cuda")
        splits = cute_ops.attn2_splits(p.max_model_len, p.window, 2)
        workspace = torch.zeros(max(16, lay.workspace_bytes(p.num_reqs, 2, splits, 1)), dtype=torch.uint8,
                                device="cuda")
        out = torch.full_like(p.q, float("nan"))
        with pytest.raises(ValueError, match="splits_per_cta"):
            launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace, max_model_len=p.max_model_len,
                   window=p.window, splits_per_cta=per_cta)
        torch.cuda.synchronize()
        assert out.isnan().all() and not workspace.any()


# Two pages a softmax step (`Attn2Build.pages_per_step` 2, the rule's for split plans without a
# window; forced here on every plan): other bits than one page a step, those of the CPU model with
# pages_per_step 2 (within its tolerance), with the same determinism (calls, tensor-core paths,
# tp, L, splits a CTA).

# one split (max_model_len 64: up to 2 pairs, lone last pages), the small split plans (128, 256, 2048: a
# pair or a lone page a split), the split kernel at 4096 with and without the window (a lone first
# page where the window starts at an odd place), 128k
STEP_CASES = [
    (8, 64, 0), (17, 64, 0), (63, 64, 0), (64, 64, 0), (8, 128, 0), (17, 128, 0), (127, 128, 0), (128, 128, 0),
    (129, 256, 0), (17, 2048, 0), (2047, 2048, 0),
    (2048, 2048, 0), (2049, 4096, 0), (4000, 4096, 0),
    (2055, 4096, 2048), (4000, 4096, 2048), (3002, 8192, 100), (100000, 131072, 0),
]


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@pytest.mark.parametrize("seq_len, max_model_len, window", STEP_CASES)
def test_two_pages_a_step_matches_model(family, seq_len, max_model_len, window):
    """pages_per_step 2 agrees with the CPU model run with pages_per_step 2 (`agreement`, the bound
    of `test_matches_model_and_beats_stock`) and is within the stock's error of the FP64 reference."""
    problem = make_problem(family, seq_len, max_model_len, window=window, num_kv_heads=2)
    got, _ = _launch(problem, pages_per_step=2)
    model = attn2_model(problem, pages_per_step=2)
    _, exact = attn2_reference(problem)
    agree = agreement(got, model)
    mine, stock = ulp_error(got, exact), ulp_error(stock_attn2(problem.to("cuda")), exact)
    print(f"\n[attn2 pages_per_step 2 {family} L={seq_len} max_model_len={max_model_len} W={window}] vs model: "
          f"{agree.describe()}\n  vs FP64: max {mine.max:.2f} mean {mine.mean:.4f} | stock max {stock.max:.2f} "
          f"mean {stock.mean:.4f}")
    assert agree.ok, agree.describe()
    assert mine.nonfinite == 0
    assert mine.within(stock), (mine, stock)


@pytest.mark.parametrize("seq_len, max_model_len, window", [(63, 64, 0), (127, 128, 0), (2047, 2048, 0), (4000, 4096, 2048),
                                                            (3002, 8192, 100),
                                                            (70001, 131072, 4096), (131072, 131072, 0)])
def test_two_pages_a_step_repeats_its_bits_on_both_tensor_core_paths(seq_len, max_model_len, window):
    """pages_per_step 2: the same bits on every call, and the GPU's tensor-core path (wgmma on an
    H200) gives mma.sync's bits, on 2 and 4 KV heads (the layout's splits a CTA: 4 KV heads at 128k
    run two sibling splits a CTA)."""
    for heads in (2, 4):
        problem = make_problem("random", seq_len, max_model_len, window=window, num_kv_heads=heads)
        first, _ = _launch(problem, pages_per_step=2)
        assert not first.isnan().any()
        for _ in range(2):
            again, _ = _launch(problem, pages_per_step=2)
            assert torch.equal(again.view(torch.int16), first.view(torch.int16)), _first_difference(again, first)
        sync, _ = _launch(problem, tensor_ops="sync", pages_per_step=2)
        assert torch.equal(sync.view(torch.int16), first.view(torch.int16)), (heads, _first_difference(sync, first))


def test_two_pages_a_step_kv_head_bits_whatever_the_tp_at_128k():
    """KV head 0 (and 1) at 128k with pages_per_step 2: tp 8 (both in one launch) and tp 16 (one
    each) give the same bits (the same 256-split plan)."""
    whole = make_problem("random", 100000, 131072, num_kv_heads=2)
    tp8, _ = _launch(whole, pages_per_step=2)
    tp16 = torch.cat([_launch(for_rank(whole, r, 2), pages_per_step=2)[0] for r in range(2)], dim=1)
    assert torch.equal(tp8.view(torch.int16), tp16.view(torch.int16)), _first_difference(tp8, tp16)


def test_two_pages_a_step_same_keys_same_bits_at_every_length():
    """Row t at L and row t - 1 at L + 1 with pages_per_step 2: equal bits, across a page boundary,
    with the split kernel, and at a window edge (3002, W 100: the window's first page moves on at
    L + 1; the steps' pairs do not, `attn2_layout.split_steps`)."""
    from tests.cpu.test_attn2_model import _extended

    for seq_len, window in ((2063, 0), (2064, 0), (3000, 0), (3002, 100), (3010, 100)):
        problem = make_problem("random", seq_len, 8192, window=window, num_kv_heads=2)
        now, _ = _launch(problem, pages_per_step=2)
        then, _ = _launch(_extended(problem), pages_per_step=2)
        assert torch.equal(now[1:].view(torch.int16), then[:-1].view(torch.int16)), (
            seq_len, window, _first_difference(now[1:], then[:-1]))


# two splits a CTA with two pages a step: 128k (many pairs a split, the deployment's tp 4 / tp 2
# plan) and 8192 (short splits: lone last pages), without and with a window (a split's lone first
# page where the window starts at an odd place), and 512 splits
PAIRED_STEP_CASES = [
    (131072, 131072, 0, None), (100001, 131072, 0, None), (2100, 8192, 0, None), (6001, 8192, 0, None),
    (3002, 8192, 100, None), (70001, 131072, 4096, None), (40000, 131072, 0, 512),
]


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@pytest.mark.parametrize("seq_len, max_model_len, window, num_splits", PAIRED_STEP_CASES)
def test_two_pages_a_step_with_two_splits_a_cta_keeps_every_bit(family, seq_len, max_model_len, window, num_splits):
    """pages_per_step 2 with two sibling splits a CTA (each split's steps as a CTA running it alone,
    the first held and merged in the CTA) gives the bits of one split a CTA, with 2 and 4 KV heads,
    on the GPU's tensor-core path and on mma.sync."""
    for heads in (2, 4):
        problem = make_problem(family, seq_len, max_model_len, window=window, num_kv_heads=heads)
        for ops in (None, "sync"):
            one, _ = _launch(problem, num_splits, tensor_ops=ops, splits_per_cta=1, pages_per_step=2)
            two, _ = _launch(problem, num_splits, tensor_ops=ops, splits_per_cta=2, pages_per_step=2)
            assert torch.equal(two.view(torch.int16), one.view(torch.int16)), ((heads, ops), _first_difference(two, one))
            assert not one.isnan().any()


def test_two_pages_a_step_splits_per_cta_comparison_sees_a_change():
    """The comparison above is not vacuous: with KV heads 0 and 1 of the cache swapped, two splits a
    CTA with two pages a step differ from one split a CTA on the original cache (on both paths)."""
    problem = make_problem("random", 6000, 8192, num_kv_heads=2)
    swapped = problem.to("cuda")
    swapped.kv_cache.copy_(swapped.kv_cache.flip(1))
    for ops in (None, "sync"):
        one, _ = _launch(problem, tensor_ops=ops, splits_per_cta=1, pages_per_step=2)
        two, _ = _launch(swapped, tensor_ops=ops, splits_per_cta=2, pages_per_step=2)
        assert not torch.equal(two.view(torch.int16), one.view(torch.int16))


def test_the_deployments_pages_per_step_is_the_rules():
    """The deployment's launch (`cute_ops.launch_attn2`, no experiment argument) gives the bits of
    the rule's pages a step forced (`attn2_layout.pages_per_step`: 2 at 8192 and 128k without a
    window, 2048, 256 and 128 included; 1 with the window and with one split, at 64), at tp 4 (two
    splits a CTA at 128k) and tp 8."""
    for seq_len, max_model_len, window in ((3001, 8192, 0), (100000, 131072, 0), (3001, 8192, 100), (1500, 2048, 0),
                                           (200, 256, 0), (100, 128, 0), (50, 64, 0)):
        rule = lay.pages_per_step(window, lay.splits(max_model_len, window, 1))
        assert rule == (1 if window or max_model_len <= lay.SHORT_MAX_LEN else 2)
        for heads in (2, 4):
            problem = make_problem("random", seq_len, max_model_len, window=window, num_kv_heads=heads)
            deployed, _ = _run(problem)
            forced, _ = _launch(problem, pages_per_step=rule)
            assert torch.equal(deployed.view(torch.int16), forced.view(torch.int16)), (
                (seq_len, heads), _first_difference(deployed, forced))


# ---------------------------------------------------------------------------------------------
# The traced build (`Attn2Build.trace`, scripts/trace-attn2.py): the same bits, every CTA's row.


def _traced(problem):
    """(out, workspace) on the CPU of the traced launch of the deployment's plan; its workspace
    (`traced_workspace_bytes`) starts zeroed, so an unwritten trace row reads 0."""
    from musebench.kernels import attn2

    p = problem.to("cuda")
    heads = p.num_kv_heads
    splits = cute_ops.attn2_splits(p.max_model_len, p.window, heads)
    workspace = torch.zeros(attn2.traced_workspace_bytes(p.num_reqs, heads, splits), dtype=torch.uint8, device="cuda")
    out = torch.full_like(p.q, float("nan"))
    attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace, max_model_len=p.max_model_len,
                 window=p.window, trace=True)
    torch.cuda.synchronize()
    return out.cpu(), workspace.cpu()


def _clock_failures(rows: list[list[int]], fields: tuple[str, ...], sms: int) -> list[str]:
    """What is wrong with a kernel's trace rows (empty: nothing): a row whose clocks (the fields
    from clock_entry on, in order) decrease, whose globaltimer_entry is not before its
    globaltimer_end, or whose SM is not one of the GPU's `sms`."""
    failures = []
    clocks = [i for i, f in enumerate(fields) if f.startswith("clock_")]
    at = {f: i for i, f in enumerate(fields)}
    for n, row in enumerate(rows):
        if any(row[a] > row[b] for a, b in zip(clocks, clocks[1:])):
            failures.append(f"row {n}: clocks decrease {[row[i] for i in clocks]}")
        if not row[at["globaltimer_entry"]] < row[at["globaltimer_end"]]:
            failures.append(f"row {n}: entry {row[at['globaltimer_entry']]} not before end {row[at['globaltimer_end']]}")
        if not 0 <= row[at["smid"]] < sms:
            failures.append(f"row {n}: SM {row[at['smid']]} of {sms}")
    return failures


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("seq_len", [8, 9000, 131072])
def test_the_traced_build_keeps_every_bit_and_writes_every_row(tp, seq_len):
    """The traced launch's out and partials are the deployment's bit for bit (tp 8: 2 KV heads,
    tp 16: 1; 256 splits, one a CTA); every split and combine CTA's row is written, its clocks
    non-decreasing, its globaltimer entry before its end, its SM one of the GPU's. The row check
    fails on a row with two clocks swapped."""
    from musebench.kernels import attn2

    heads = 16 // tp  # a rank's KV heads at tp
    problem = make_problem("random", seq_len, 131072, num_kv_heads=heads)
    splits = cute_ops.attn2_splits(131072, 0, heads)
    want, plain_workspace = _launch(problem)
    got, workspace = _traced(problem)
    assert torch.equal(want.view(torch.int16), got.view(torch.int16)), _first_difference(want, got)
    partials = lay.workspace_bytes(1, heads, splits)
    assert torch.equal(plain_workspace[:partials], workspace[:partials])
    split_rows, combine_rows = attn2.trace_rows(workspace, 1, heads, splits)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows, fields in ((split_rows, attn2.SPLIT_TRACE_FIELDS), (combine_rows, attn2.COMBINE_TRACE_FIELDS)):
        rows = rows.tolist()
        assert all(row[fields.index("clock_entry")] != 0 for row in rows)  # every CTA wrote its row
        assert _clock_failures(rows, fields, sms) == []
        swapped = list(rows[0])
        a, b = fields.index("clock_entry"), fields.index("clock_end" if "clock_end" in fields else "clock_written")
        swapped[a], swapped[b] = swapped[b] + 1, swapped[a]
        assert _clock_failures([swapped], fields, sms) != []
    assert len(split_rows) == heads * splits and len(combine_rows) == heads * lay.ROWS_PER_KV_HEAD


def test_the_traced_comparison_sees_a_change():
    """The bit comparison above can fail: another seed's traced output differs from this one's."""
    ours = _traced(make_problem("random", 9000, 131072, num_kv_heads=2))[0]
    other = _traced(make_problem("random", 9000, 131072, seed=1, num_kv_heads=2))[0]
    assert not torch.equal(ours.view(torch.int16), other.view(torch.int16))


def test_traced_launches_replay_in_a_graph():
    """Three traced launches captured in one graph (compiled before capture), each with its own
    workspace: every replay rewrites every row (zeroed between replays), and the out bits are the
    eager launch's."""
    from musebench.kernels import attn2

    problem = make_problem("random", 8192, 131072, num_kv_heads=1)
    want, _ = _traced(problem)
    p = problem.to("cuda")
    splits = cute_ops.attn2_splits(131072, 0, 1)
    workspaces = [torch.zeros(attn2.traced_workspace_bytes(1, 1, splits), dtype=torch.uint8, device="cuda")
                  for _ in range(3)]
    out = torch.full_like(p.q, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in workspaces:
            attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, w, max_model_len=131072, window=0,
                         trace=True)
    for _ in range(2):
        for w in workspaces:
            w.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for w in workspaces:
            split_rows, combine_rows = attn2.trace_rows(w, 1, 1, splits)
            assert bool((split_rows[:, 3] != 0).all()) and bool((combine_rows[:, 3] != 0).all())
        assert torch.equal(want.view(torch.int16), out.cpu().view(torch.int16))


def test_a_traced_launch_refuses_a_workspace_without_the_rows():
    """`launch(trace=True)` with the deployment's workspace (no room for the rows), or with none at
    one split (max_model_len 64): ValueError naming `traced_workspace_bytes`, before anything
    compiles or launches."""
    from musebench.kernels import attn2

    before = len(attn2.compilation.CACHE)
    for max_model_len in (131072, 2048, 128, 64):
        p = make_problem("random", min(100, max_model_len), max_model_len, num_kv_heads=1).to("cuda")
        splits = cute_ops.attn2_splits(max_model_len, 0, 1)
        need = lay.workspace_bytes(1, 1, splits)
        workspace = torch.zeros(need, dtype=torch.uint8, device="cuda") if need else None
        with pytest.raises(ValueError, match="traced_workspace_bytes"):
            attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, torch.empty_like(p.q), workspace,
                         max_model_len=max_model_len, window=0, trace=True)
    assert len(attn2.compilation.CACHE) == before


@pytest.mark.parametrize("tp, seq_len", [(8, 9000), (16, 131072), (8, 17)])
def test_one_weight_term_stays_near_the_deployment(tp, seq_len):
    """`Attn2Build.weight_terms` 1 (an experiment: P V from p_hi = RN(p) alone, sm_90a): finite, other
    bits than the deployment's somewhere, every element within 2^-5 of the output's largest
    magnitude of it (P's rounding moves O by about 2^-9 relative, averaged over the keys; a P V
    missing a page's or a term's keys moves it by far more) and the mean within one BF16 ULP; the
    same bits on a second launch. The two-page and the one-page steps both run
    (L 17: two pages; 9000: pairs and a lone last page)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("weight_terms 1 is wgmma's (sm_90a)")
    problem = make_problem("random", seq_len, 131072, num_kv_heads=16 // tp)
    deployed = _launch(problem)[0]
    one = _launch(problem, weight_terms=1)[0]
    again = _launch(problem, weight_terms=1)[0]
    assert torch.isfinite(one.float()).all()
    assert torch.equal(one.view(torch.int16), again.view(torch.int16))
    assert not torch.equal(one.view(torch.int16), deployed.view(torch.int16))
    difference = (one.float() - deployed.float()).abs()
    assert difference.max() <= 2.0**-5 * deployed.float().abs().max(), float(difference.max())
    assert ulp_error(one, deployed.double()).mean <= 1.0


@pytest.mark.parametrize("family", ["random", "large"])
@pytest.mark.parametrize("seq_len, max_model_len, num_kv_heads", [
    (17, 4096, 2), (2047, 2048, 2), (9000, 131072, 2), (131072, 131072, 2), (70001, 131072, 1), (131072, 131072, 4),
])
def test_prefetched_pages_keep_every_bit(family, seq_len, max_model_len, num_kv_heads):
    """SplitIssue.prefetch_pages (L2 prefetches ahead of the ring's copies, an experiment) gives the
    deployment's bits: with defer_values where the deployment defers (one split a CTA), without it
    at 4 KV heads (two splits a CTA), short and long splits."""
    import dataclasses

    from musebench.kernels import attn2

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the deployment's issue is computed for sm_90a's wgmma here")
    problem = make_problem(family, seq_len, max_model_len, num_kv_heads=num_kv_heads)
    splits = cute_ops.attn2_splits(max_model_len, 0, num_kv_heads)
    deployed_issue = attn2.deployment_issue(True, lay.pages_per_step(0, splits), lay.splits_per_cta(num_kv_heads, splits))
    baseline = _launch(problem)[0]
    got = _launch_issue(problem, dataclasses.replace(deployed_issue, prefetch_pages=True))
    assert torch.equal(got.view(torch.int16), baseline.view(torch.int16)), _first_difference(got, baseline)


@pytest.mark.parametrize("family", INPUT_FAMILIES)
@pytest.mark.parametrize("seq_len, max_model_len, window, num_kv_heads, num_splits", [
    # 256 splits, 64 groups of 4 leaves, 8 groups a warp: the live groups 1 (L <= 64: one merge),
    # 2, 3, 4, 8 (L <= 512: no shared-memory stage), 9 and all
    (8, 131072, 0, 2, None), (17, 131072, 0, 1, None), (64, 131072, 0, 2, None), (65, 131072, 0, 2, None),
    (128, 131072, 0, 2, None), (129, 131072, 0, 1, None), (256, 131072, 0, 2, None), (512, 131072, 0, 1, None),
    (513, 131072, 0, 2, None), (4099, 131072, 0, 1, None),
    (64, 131072, 0, 4, None), (65, 131072, 0, 4, None), (513, 131072, 0, 4, None),  # two splits a CTA
    (3017, 131072, 100, 2, None),  # the window's own plan: 4 splits, pages from split 1, every level
    # 256 splits forced under a window of 40: pages 256 .. 258 (from split 0: one merge), 255 .. 257
    # (from split 255: every level); a window of 100 spans 8 pages (two groups)
    (4143, 131072, 40, 2, 256), (4127, 131072, 40, 2, 256), (4210, 131072, 100, 2, 256),
    (16, 2048, 0, 2, None), (17, 2048, 0, 2, None), (300, 2048, 0, 2, None),  # 64 splits: a group holds 1
    (9, 256, 0, 2, None), (40, 256, 0, 2, None), (100, 256, 0, 2, None),  # 8 splits: one warp, shuffles only
    (8, 128, 0, 2, None), (17, 128, 0, 2, None), (128, 128, 0, 2, None),  # 4 splits, 16 threads: 1, 2, 4 live
    (8, 96, 0, 2, None), (17, 96, 0, 2, None),  # 2 splits, 8 threads: level 0 skipped, then run
])
def test_the_combine_shortcut_keeps_every_bit(family, seq_len, max_model_len, window, num_kv_heads, num_splits):
    """The combine runs only the upper tree's levels that can meet pages and one merge with an
    empty node for the rest: exactly the bits of its whole upper tree (`Attn2Build.full_tree`), at
    every count of live groups (one merge; some shuffle levels; every shuffle level without the
    shared-memory stage; every level), with a window whose pages start at split 0 and one past it
    (every level), with two splits a CTA, on the 64-, 8-, 4- and 2-split plans (the last two are
    deployments since SHORT_MAX_LEN 64), and on every input family
    (the `large` family's huge scores included)."""
    problem = make_problem(family, seq_len, max_model_len, window=window, num_kv_heads=num_kv_heads)
    whole = _launch(problem, num_splits, full_tree=True)[0]
    got = _launch(problem, num_splits)[0]
    assert torch.equal(got.view(torch.int16), whole.view(torch.int16)), _first_difference(got, whole)


def test_the_combine_shortcut_comparison_catches_a_changed_bit():
    """Fault injection for the comparison above: one flipped bit of the whole tree's output fails
    it, so an equal pair is evidence."""
    problem = make_problem("random", 8, 131072, num_kv_heads=2)
    whole = _launch(problem, full_tree=True)[0]
    got = _launch(problem)[0]
    flipped = whole.clone()
    flipped.view(torch.int16)[3, 5] ^= 1
    assert torch.equal(got.view(torch.int16), whole.view(torch.int16))
    assert not torch.equal(got.view(torch.int16), flipped.view(torch.int16))


@pytest.mark.parametrize("seq_len, num_kv_heads", [(8, 2), (4099, 2), (131072, 2), (70001, 1), (20000, 4)])
def test_early_release_keeps_every_bit_back_to_back(seq_len, num_kv_heads):
    """`Attn2Build.early_release` (each kernel releases its dependents right after its own PDL wait):
    four launches captured back to back in one graph on ONE workspace, each launch's combine
    released to the next launch's split kernel while it still reads the partials, give the
    deployment's eager bits every time (a dependent reads nothing before its own wait but what
    finished earlier), replayed twice."""
    from musebench.kernels import attn2

    problem = make_problem("random", seq_len, 131072, num_kv_heads=num_kv_heads)
    baseline = _launch(problem)[0]
    p = problem.to("cuda")
    splits = cute_ops.attn2_splits(p.max_model_len, p.window, p.num_kv_heads)
    workspace = torch.zeros(lay.workspace_bytes(p.num_reqs, p.num_kv_heads, splits,
                                                lay.splits_per_cta(p.num_kv_heads, splits)),
                            dtype=torch.uint8, device="cuda")
    outs = [torch.full_like(p.q, float("nan")) for _ in range(4)]

    def launches() -> None:
        for out in outs:
            attn2.launch(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out, workspace,
                         max_model_len=p.max_model_len, window=p.window, early_release=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launches()  # compiles, outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        launches()
    for _ in range(2):
        for out in outs:
            out.fill_(float("nan"))
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        for out in outs:
            assert torch.equal(out.cpu().view(torch.int16), baseline.view(torch.int16)), \
                _first_difference(out.cpu(), baseline)
