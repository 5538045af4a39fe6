"""The QKV front's plan arithmetic (musebench.qkv_front_plan): CTAs, balance on 132 SMs, the
balanced ring's depth within an SM's shared memory, the workspace layout, and the refusals."""

from __future__ import annotations

import pytest

from musebench import qkv_front_plan as plan


def test_the_balance_table_of_the_docstring():
    """The numbers the module docstring's table gives (busiest SM over the mean)."""
    cluster = {kv: plan.plan_balance("cluster", kv) for kv in (1, 2, 4)}
    assert [(b.ctas, b.busiest) for b in cluster.values()] == [(144, 2), (288, 3), (576, 5)]
    assert [round(b.ratio, 3) for b in cluster.values()] == [1.833, 1.375, 1.146]
    one = {kv: plan.balance(plan.balanced_ctas(kv, 1)) for kv in (1, 2, 4)}
    assert [(b.ctas, b.busiest) for b in one.values()] == [(1152, 9), (2304, 18), (4608, 35)]
    assert [round(b.ratio, 3) for b in one.values()] == [1.031, 1.031, 1.003]
    two = {kv: plan.balance(plan.balanced_ctas(kv, 2)) for kv in (1, 2, 4)}
    assert [(b.ctas, b.busiest) for b in two.values()] == [(576, 5), (1152, 9), (2304, 18)]
    # the default plan is at most 3.2% over the mean at every N
    assert all(plan.plan_balance("balanced", kv).ratio <= 1.032 for kv in (1, 2, 4))
    assert plan.DEFAULT_PLAN == "cluster" and set(plan.PLANS) == {"cluster", "balanced"}


def test_the_ring_fits_every_resident_cta_in_shared_memory():
    """ceil(CTAs / 132) CTAs (capped at 32, and at 2048 threads) share an SM: their rings, the
    slack and the 1 KB reserved per CTA fit in 228 KB; at least 2 stages; the docstring's depths."""
    depths = {(kv, w): plan.balanced_stages(kv, w) for kv in (1, 2, 4) for w in plan.UNIT_WARPS}
    assert [depths[kv, 1] for kv in (1, 2, 4)] == [8, 3, 2]
    assert [depths[kv, 2] for kv in (1, 2, 4)] == [8, 6, 2]
    for (kv, w), stages in depths.items():
        per_sm = plan.resident_ctas_per_sm(kv, w)
        assert per_sm * (plan.balanced_smem_bytes(kv, w) + plan.CTA_RESERVED_BYTES) <= plan.SM_SHARED_BYTES
        assert 2 <= stages <= plan.MAX_STAGES
        assert per_sm <= 32 and per_sm * 32 * w <= 2048
    # 1-warp CTAs at N = 4608 exceed an SM's 32 resident CTAs: not every one resident at once
    assert plan.resident_ctas_per_sm(4, 1) == 32 < -(-plan.balanced_ctas(4, 1) // 132)
    # one stage in flight per CTA at least 1 KB of weight per warp: >= 32 KB per SM at every default
    for kv in (1, 2, 4):
        w = plan.DEFAULT_WARPS[kv]
        in_flight = (plan.balanced_stages(kv, w) - 1) * 8 * w * plan.LINE_BYTES * plan.resident_ctas_per_sm(kv, w)
        assert in_flight >= 32 * 1024, (kv, in_flight)


def test_the_workspace_layout():
    for kv in (1, 2, 4):
        heads = 18 * kv
        layout = plan.workspace_layout(kv)
        assert layout.partials == 0
        assert layout.projection == heads * 8 * 8 * 32 * 4 * 4  # FP32 [heads, 8 tiles, 8 slices, 32 lanes, 4]
        assert layout.group_counters == layout.projection + heads * 16 * 64 * 2  # BF16 [heads, 16, 64]
        assert layout.head_counters == layout.group_counters + heads * 8 * 4
        assert layout.total >= layout.head_counters + heads * 4 and layout.total % 16 == 0
        assert plan.workspace_bytes(kv) == layout.total
    assert [plan.workspace_bytes(kv) for kv in (1, 2, 4)] == [627_344, 1_254_672, 2_509_344]


@pytest.mark.parametrize("call, match", [
    (lambda: plan.heads(3), "num_kv_heads"),
    (lambda: plan.heads(True), "num_kv_heads"),
    (lambda: plan.groups(3), "warps"),
    (lambda: plan.balanced_ctas(1, 8), "warps"),
    (lambda: plan.plan_balance("fast", 1), "plan"),
    (lambda: plan.balance(0), "positive"),
    (lambda: plan.workspace_bytes(8), "num_kv_heads"),
])
def test_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call()
