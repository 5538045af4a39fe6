"""attn2's geometry: the split plan, the workspace layout and the launch constants, read by both
sides (the kernel, `musebench.kernels.attn2`, and its CPU model, `musebench.cpu.attn2`) and by the
deployment checks (`musebench.cute_ops`). Imports only `musebench.config`; no torch, no CuTe DSL.

Work decomposition. One CTA of `CTA_THREADS` threads per (request, KV head, split). Its 64 query
rows (8 heads x 8 tokens) are one M = 64 tile of four warps x 16 rows: warp w holds heads 2w and
2w + 1, the mma fragment's row g (lane // 4) is token g of head 2w and row g + 8 the same token of
head 2w + 1, so a thread's causal limit depends only on its lane. A request's pages are dealt to
the splits round robin: page p (the p-th entry of its page-table row) belongs to split
`p % num_splits`, whatever L is; a split visits its pages in ascending order, so the keys a row
sees and the order they are summed in depend only on the row's own key range, never on L (a row
that sees the same keys gets the same bits at every L). Round robin, not contiguous ranges, so
that every L from 8 to max_model_len and every window spreads its pages over all splits.

Merge. With `num_splits` > 1 (a power of two) each split CTA writes its partial (O in FP32, the
running max in the log2 domain and the sum) to its workspace slot and ends; a second kernel, the
combine, launched behind it (PDL: it waits for the split kernel to finish), merges the partials
of each row in a fixed binary tree: node (level k, j) merges its children (k - 1, 2j) and
(k - 1, 2j + 1), in that order. One combine CTA per (request, KV head, row): its threads are
COMBINE_QUADS lanes (the row's 4 x 16 dims) x groups of consecutive splits (a complete subtree
each, merged in registers), the groups' results then meet level by level through shared memory.
A split with no page (its partial never written) enters the tree as (0, -inf, 0), which a merge
passes through exactly, so the combine skips its read. No counter, no atomic, nothing waits on
anything inside a launch: nothing to bound, nothing to re-arm.
"""

from __future__ import annotations

from dataclasses import dataclass

from musebench import config

QUERY_LEN = config.VERIFY_QUERY_LEN  # 8 query rows per request: 1 + 7 draft tokens
PAGE_TOKENS = config.KV_PAGE_TOKENS  # 16 slots a page
HEAD_DIM = config.HEAD_DIM  # 64
HEADS_PER_KV_HEAD = config.NUM_QUERY_HEADS // config.NUM_KV_HEADS  # 8
SLOT_WIDTH = 2 * HEAD_DIM  # K | V of one slot: 128 BF16
ROWS_PER_KV_HEAD = QUERY_LEN * HEADS_PER_KV_HEAD  # 64: the kernel's one M tile
WARPS = 4  # 16 rows each: one m16n8k16 tile height
CTA_THREADS = 32 * WARPS

# The seeds' constants, musebench's values.
# ROW_GROUPS: CTAs per (request, KV head, split). The 64 query rows of a KV head are one M = 64
# mma tile, so one CTA reads each page once for all of them (the seeds' SM100 kernel splits rows
# over a cluster; reading a page twice would double the HBM traffic this kernel is bound by).
ROW_GROUPS = 1
# SPLIT_TARGET_CLUSTERS: split CTAs a request's launch aims for per KV head: a single KV head
# (tp 16) must keep about two CTAs of 4 warps on every one of the 132 SMs of an H200 (148 on a
# GB200), the issue rate one warp per scheduler cannot give (Nsight Compute on the H200, 64 splits:
# one warp per scheduler issued every 4.2 cycles, 0.5 TB/s). 256 is the nearest power of two.
#   512 (measured, not taken: records/2026-12-01-h200-{52af2d8,e481202}-sweep-attn2-splits.json):
#   one KV head fills all 4 CTA slots of an SM and runs 128k at 22.0 us against 30.0, but tp 8 (two
#   splits a CTA, 512 CTAs) runs it at 36.9 against 34.0 and 32k at 19.0 against 15.6, and 8k
#   costs 1.2-2.0 us more at both tp (twice the partials). The split count fixes a row's
#   summation order, so it may not depend on tp: one value serves both, and tp 8 is the issue's
#   bandwidth target.
SPLIT_TARGET_CLUSTERS = 256
# MAX_SPLITS: the merge tree's leaves. The tree is merged by the combine kernel (registers within a
# group, shared memory across groups): its depth costs a few hundred cycles, not a global round
# trip per level, so MAX_SPLITS is SPLIT_TARGET_CLUSTERS.
MAX_SPLITS = SPLIT_TARGET_CLUSTERS
# SPLITS_PER_CTA_CHOICES: sibling leaves (splits 2j, 2j + 1) one split CTA runs, one after the
# other through one ring, merging them as the combine would (the same node, the same bits). Where
# a launch would otherwise run a second wave of SPLIT_CTAS_PER_SM CTAs an SM it is faster: on the
# H200, 1024 leaves of 2 KV heads at 512 splits ran 128k at 36.9 us paired against 39.9 unpaired,
# 32k 19.0 against 20.0, 8k 15.1 against 16.7 (records/2026-12-01-h200-e481202-sweep-attn2-splits).
# The first leaf's state waits in shared memory (PENDING_BYTES), which bounds it at 2.
SPLITS_PER_CTA_CHOICES = (1, 2)
# PAGES_PER_STEP_CHOICES: pages one step of the split kernel's online softmax takes
# (`Attn2Build.pages_per_step`; a deployment's is `pages_per_step`'s). With 2 a step takes a pair of
# the split's pages (`split_steps`): one row max, one alpha and one rescale for 32 keys, so the
# per-step overhead and the chain's latency are paid once for two pages. Other bits than 1 (the
# max moves once for two pages), the same properties (a row's bits whatever L and tp).
PAGES_PER_STEP_CHOICES = (1, 2)
# MIN_PAGES_PER_SPLIT: below two pages a split's pipeline never fills and the merge dominates.
MIN_PAGES_PER_SPLIT = 2
# SHORT_MAX_LEN: up to 64 tokens (4 pages) one CTA per KV head reads the whole context and no
# merge runs; above it a deployment takes a split plan (`splits`: 128 tokens 4 splits, 256 8, 2048
# 64), with the 128k plans' rules (two pages a step, the deep ring up to DEEP_RING_MAX_CTAS split
# CTAs). One split reads its pages serially, about 0.38 us a page: the step from 2048 to 128 took
# max_model_len 2048's L 2048 from 51.6 us on one split to 6.0 on 64 splits (SDPA flash 10.2;
# records/2026-12-02-h200-081ea38-ab-attn2-quotients.json, -fb41107-attn2-short-plan-and-weight-terms.json).
# 128 -> 64: since the combine runs its epilogue on the root's quad 0 only, the split plans no
# longer pay about 2 us at small L. Measured on the H200 on one lease (tp 8, max_model_len 128,
# CUDA-graph medians), L 8 / 16 / 64 / 128: one split 3.92 / 3.88 / 4.96 / 6.44 us, two splits
# 4.02 / 4.00 / 4.25 / 4.77, four (the plan `splits` gives) 4.11 / 4.12 / 3.94 / 4.13
# (records/2026-12-02-h200-75f5410-attn2-experiments.json; SDPA flash 5.96-6.15 at these L,
# -ede3d4c-attn2-prefetch-trace-short.json). One split's worst case at 128 tokens (6.44) is slower
# than SDPA; at 64 (4 pages) it is 4.96, above the split plans' 3.9-4.3 by under a microsecond.
SHORT_MAX_LEN = 64
# The window a row sees spans at most window + QUERY_LEN - 1 keys across the 8 rows.

# SPLIT_CTAS_PER_SM: split CTAs one SM holds at once (registers capped at 65536 / (4 x 128) = 128
# a thread for it): 16 warps, four a scheduler, to hide the per-page chain's latency. sm_100a's
# code needs a few more registers (ptxas spills 4 bytes at 128), so it is built for three (168).
SPLIT_CTAS_PER_SM = 4
SPLIT_CTAS_PER_SM_SM100 = 3


def split_ctas_per_sm(arch: str) -> int:
    """The split kernel's CTAs per SM for a target ("sm_90a", "sm_100a", ...)."""
    return SPLIT_CTAS_PER_SM_SM100 if arch.startswith("sm_10") else SPLIT_CTAS_PER_SM
PIPELINE_STAGES = 8  # pages in flight per CTA (cp.async, 4 KB each): see SPLIT_TARGET_CLUSTERS


# PAIRED_LEAVES: leaves a request from which a deployment runs two splits a CTA: more leaves than
# one wave of split CTAs holds (4 an SM on the H200's 132 SMs: 528), so at 256 splits tp 4 and 2
# (1024 and 2048 leaves) pair and tp 8 and 16 (512, 256) do not. Measured on the H200 (records/
# 2026-12-01-h200-deb23b9-sweep-attn2-pairing.json, graph medians, 0 bits differing), one against
# two a CTA: tp 4 19.01 / 28.44 / 62.56 us against 15.93 / 24.96 / 61.76 at L 8k / 32k / 128k; tp 2
# 36.93 / 54.37 / 121.86 against 29.49 / 48.89 / 120.68. GB200 (148 SMs, 3 an SM: 444) is
# unmeasured; the threshold does not move the bits either way.
PAIRED_LEAVES = 1024


def splits_per_cta(num_kv_heads: int, num_splits: int) -> int:
    """Sibling splits one split CTA of a deployment runs (`SPLITS_PER_CTA_CHOICES`): 2 where a
    request has at least PAIRED_LEAVES leaves (num_kv_heads x num_splits), else 1. A performance
    choice only: the bits are the same either way."""
    _check_positive(num_kv_heads=num_kv_heads, num_splits=num_splits)
    return 2 if num_splits >= 2 and num_kv_heads * num_splits >= PAIRED_LEAVES else 1
PAGE_BYTES = PAGE_TOKENS * SLOT_WIDTH * 2  # 4096: one page of one KV head, K | V per slot

# The natural layout of a row's 64 dims over the 4 lanes of a quad (the mma's C fragment, and
# the wgmma accumulator's): n-tile t (t = 0 .. 7) of P V holds dims 8t .. 8t + 7, of which lane
# c = lane % 4 holds 8t + 2c and 8t + 2c + 1 of its rows g and g + 8. `lane_dims(c)` lists them in
# the lane's order (t ascending, the pair in order): the epilogue's sum of squares, the combine's
# leaves and the partial's vectors all follow it.
LANE_DIMS = 16  # dims of a row one lane holds
TILE_DIMS = 8  # dims of one n-tile


def lane_dims(c: int) -> list[int]:
    """The 16 dims lane c (0 .. 3) of a quad holds of each of its rows, in the lane's order:
    8t + 2c, 8t + 2c + 1 for t = 0 .. 7."""
    return [TILE_DIMS * t + 2 * c + k for t in range(HEAD_DIM // TILE_DIMS) for k in range(2)]


def partial_vector_dims(v: int, c: int) -> list[int]:
    """The dims of O in float4 vector `v` (0 .. PARTIAL_O_VECTORS - 1) of a partial, for lane c of
    its quad: vector 2p + half is row g (half 0) or g + 8 (half 1), n-tiles 2p and 2p + 1 (dims
    16p + 2c, 16p + 2c + 1, 16p + 8 + 2c, 16p + 8 + 2c + 1): a row's vectors p = 0 .. 3 in order
    are `lane_dims(c)`."""
    p = v // 2
    return lane_dims(c)[4 * p : 4 * p + 4]


# Workspace: one partial per (request, KV head, split) slot, in the split kernel's register order:
# PARTIAL_O_VECTORS float4 vectors of O per thread (`partial_vector_dims`), vector-major
# ([vector][thread][4]: a warp's store is 512 contiguous bytes), then one float4 per thread (max of
# row g, max of row g + 8, sum of row g, sum of row g + 8).
PARTIAL_O_VECTORS = 8  # 32 FP32 of O per thread: 2 rows x 16 dims
PARTIAL_FLOATS = CTA_THREADS * 4 * (PARTIAL_O_VECTORS + 1)
PARTIAL_BYTES = 4 * PARTIAL_FLOATS  # 18432
# The first of two sibling leaves, held in shared memory while the CTA runs the second: a thread's
# 32 values of O, its rows' m and l ([value][thread]: consecutive threads, consecutive words).
PENDING_VALUES = 2 * LANE_DIMS + 4
PENDING_BYTES = 4 * PENDING_VALUES * CTA_THREADS  # 18432
# The combine: one CTA per (request, KV head, row); COMBINE_QUADS threads per split group (the 4
# lanes of the split kernel that hold the row, `lane_dims(c)` each), at most COMBINE_GROUPS groups
# (256 threads), each a complete subtree of num_splits / groups consecutive splits. Measured on the
# H200 with the kernel's shuffle tree (records/2026-12-02-h200-3bb425a-ab-combine-shuffle.json):
# 32 groups within +-0.4 us of 64 at every L; 128 groups (the shared-memory tree) slower
# (records/2026-12-02-h200-2f72f10-ab-combine-groups.json). At 16 leaves a thread (16 groups at
# 256 partials) ptxas spills.
COMBINE_QUADS = 4
COMBINE_GROUPS = 64
COMBINE_ROW_FLOATS = LANE_DIMS + 2  # a thread's share of a row's partial: its 16 dims of O, m, l


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def max_pages(max_model_len: int) -> int:
    """Page-table entries per request for max_model_len tokens (the page table's width)."""
    return -(-max_model_len // PAGE_TOKENS)


def splits(max_model_len: int, window: int, num_kv_heads: int) -> int:
    """The splits of a launch (a power of two): 1 up to SHORT_MAX_LEN (64 tokens), else the most
    up to MAX_SPLITS with at least MIN_PAGES_PER_SPLIT pages each (of the pages a row can see: the
    window's with one): 65 .. 112 tokens 2, 113 .. 240 4, 241 .. 496 8, 2048 64, from 8177 256.

    Not divided by num_kv_heads (the seeds' SPLIT_TARGET_CLUSTERS // (ROW_GROUPS * heads)): the
    split count decides a row's summation order, and a KV head's bits must be the same whichever
    tp computes it (tp 2: 8 heads x 256 splits = 2048 CTAs, about four waves of four CTAs an SM;
    tp 8 and 16: 512 and 256 CTAs, one wave; the window's plan, 64 splits: 128 and 64 CTAs).
    num_kv_heads is validated only."""
    _check_positive(max_model_len=max_model_len, num_kv_heads=num_kv_heads)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: none), got {window!r}")
    if max_model_len <= SHORT_MAX_LEN:
        return 1
    pages = max_pages(max_model_len)
    if window:
        pages = min(pages, max_pages(window + QUERY_LEN - 1) + 1)  # + 1: the span may straddle a page
    fill = min(MAX_SPLITS, pages // MIN_PAGES_PER_SPLIT)
    count = 1
    while count * 2 <= fill:
        count *= 2
    return count


def live_groups(first_page: int, end_page: int, num_splits: int, group_splits: int, groups: int) -> int:
    """Host mirror of the combine's `kernels.attn2.live_groups`: how many of its first groups hold
    every split with pages (group_splits splits a group). The splits with pages are lo .. lo + n - 1
    mod S (lo = first_page mod S, n = end_page - first_page); from split 0 they fill the first
    ceil(min(n, S) / group_splits) groups, and a range that starts elsewhere counts as every group.
    The combine runs the merge levels above group 0 only up to that many groups (`upper_tree`)."""
    if first_page % num_splits:
        return groups
    return -(-min(end_page - first_page, num_splits) // group_splits)


def combine_groups(num_partials: int) -> int:
    """Partial groups of a combine CTA (a power of two): every partial its own group up to
    COMBINE_GROUPS, then num_partials / COMBINE_GROUPS consecutive partials a group (a partial is a
    split CTA's: one leaf of the merge tree, or with `splits_per_cta` 2 a level-1 node)."""
    return min(num_partials, COMBINE_GROUPS)


def check_splits_per_cta(per_cta: object, num_splits: int | None = None) -> None:
    """Refuse (ValueError) a splits-per-CTA value a launch cannot run: not an int of
    SPLITS_PER_CTA_CHOICES (a bool or a float included), or, given the plan's split count, not
    dividing it (2 with a one-split plan: nothing to pair). The one check behind `Attn2Build`, the
    kernels and `workspace_bytes`."""
    if type(per_cta) is not int or per_cta not in SPLITS_PER_CTA_CHOICES:
        raise ValueError(f"splits_per_cta must be one of {SPLITS_PER_CTA_CHOICES}, got {per_cta!r}")
    if num_splits is not None and num_splits % per_cta:
        raise ValueError(f"splits_per_cta {per_cta} does not divide the plan's {num_splits} splits")


def check_pages_per_step(per_step: object) -> None:
    """Refuse (ValueError) a pages-per-step value a build cannot run: not an int of
    PAGES_PER_STEP_CHOICES (a bool or a float included). Either value runs with one or two splits
    a CTA. The one check behind `Attn2Build`, the kernel, the CPU model and the scripts."""
    if type(per_step) is not int or per_step not in PAGES_PER_STEP_CHOICES:
        raise ValueError(f"pages_per_step must be one of {PAGES_PER_STEP_CHOICES}, got {per_step!r}")


# The deployments' pages a softmax step (`pages_per_step`): two on the split plans without a
# window. Measured on the H200 (CUDA-graph medians, 256 splits, one page a step
# against two; 0 bits differing in the BF16 output on those inputs, KV head 0 equal across tp):
# tp 8 L 8k / 32k / 128k 13.74 / 15.64 / 33.78 us against 13.62 / 14.61 / 29.76; tp 16 10.09 /
# 14.16 / 30.39 against 10.32 / 13.36 / 26.33. Not taken: the window's plans (2048: 64 splits),
# where two pages a step ran 0-6 % slower, and the one-split plans (max_model_len <= SHORT_MAX_LEN:
# 4 pages at most), unmeasured. The small split plans (65 .. 2048 tokens, 2 to 4 pages a split)
# take two pages a step without an A/B against one (like the window's plans, they have few pages a
# split). A row's bits follow the value, so it depends only on the plan (max_model_len, window,
# splits), never on tp or the splits a CTA runs: tp 4 and 2 (two splits a CTA) take it too.
# Deployed (records/2026-12-01-h200-50ccdea-*): bench attn tp 8 128k 29.97 us (34.40 with one page
# a step), tp 16 27.08 (30.47); tp 4 8k / 128k 16.37 / 53.16 against 16.17 / 61.86, tp 2 28.78 /
# 103.80 against 29.75 / 118.67; L 512 at tp 8 9.88 against 9.38 (lone pages take the one-page loop).


def pages_per_step(window: int, num_splits: int) -> int:
    """A deployment's pages a softmax step (the comment above): 2 for a split plan (num_splits > 1)
    without a window (window 0), else 1. Independent of num_kv_heads and tp by signature (a plan's
    split count, `splits`, does not depend on them either): a KV head's bits are the same at every
    tp of a deployment. ValueError for a bad value."""
    _check_positive(num_splits=num_splits)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: none), got {window!r}")
    return 2 if num_splits > 1 and window == 0 else 1


def spread_splits(window: int, num_splits: int) -> bool:
    """A deployment's split order (`kernels.attn2.Attn2Build.spread_splits`): True (grid index y runs
    partial bitrev(y)) for a split plan (num_splits > 1) without a window (window 0), else False (grid
    order). Order only: a partial's pages, slot and bits are the same either way. Measured on the
    H200, CUDA-graph medians: without a window, two rounds against grid order in one lease
    (records/2026-12-02-h200-43832c5-attn2-spread-splits-ab.json), tp 8 L 128 / 512 / 2048 5.36-5.42 /
    6.24-6.32 / 8.49-8.54 us against 6.65-6.68 / 7.57 / 8.86-8.90, the rest within noise; again at
    985db7b (records/2026-12-02-h200-985db7b-attn2-order-ab.json): L 128 / 512 5.52-5.73 / 6.31-6.48
    against 6.52-6.55 / 7.37-7.65, L 8 0.2 us slower spread; at tp 16 grid order ran 0.1-0.4 us faster
    at L 8 .. 32k in that lease and spread as much faster in 43832c5's, so tp 16 shows no order of its
    own. With the 2048 window (64 splits), the same lease, two rounds: tp 8 in grid order 8.48-9.11 /
    8.54-8.87 / 8.55-8.78 us at L 2048 / 8k / 128k against 9.24-9.41 / 9.34-9.58 / 9.34-9.54 spread,
    tp 16 within noise; so window plans keep grid order. The smaller split plans without a window
    (4 to 64 splits, max_model_len 128 to 2048) take the 256-split plan's order unmeasured.
    ValueError for a bad value."""
    _check_positive(num_splits=num_splits)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: none), got {window!r}")
    return num_splits > 1 and window == 0


# DEEP_RING_STAGES: the split kernel's ring depth (4 KB pages in flight a CTA, `ring_stages`) where a
# launch's split CTAs are few enough that an SM holds at most two (DEEP_RING_MAX_CTAS: two on each
# of the H200's 132 SMs; the GB200's 148 hold them as well): there the two CTAs' chains cannot hide
# the HBM latency behind each other, and a page must be requested further ahead. Measured on the
# H200 (records/2026-12-02-h200-6073cb6-sweep-attn2-ring.json, 0 bits differing; 1 KV head at
# 256 splits: 256 CTAs): 128k 19.83 us at 24 stages against 25.84-26.04 at 8 (22.57 at 16), 32k
# 11.72 against 12.83-12.85, 8k 9.69 against 9.51-9.62. With four CTAs an SM (2 KV heads, 512
# CTAs) a deeper ring costs them shared memory and occupancy (12 stages: 128k 31.94 against 29.22-
# 29.28), so PIPELINE_STAGES stays. Window plans (a few pages a split) keep PIPELINE_STAGES.
DEEP_RING_STAGES = 24
DEEP_RING_MAX_CTAS = 264
# DEFERRED_DEEP_RING_STAGES: the same plans' depth when the split kernel defers its P V waits
# (`kernels.attn2.SplitIssue.defer_values`, which adds two stages of its own: 18 in all). Measured
# on the H200 at tp 16, 256 CTAs (records/2026-12-02-h200-e1ecdeb-sweep-attn2-ring-defer.json, 0
# bits differing): 128k 18.80 us against 19.70 at 24 + defer and 20.44-20.55 at 24 without; 32k
# 11.27 against 11.24 / 12.05-12.07; 8k 9.80 against 9.26-9.42 / 9.88-9.93 (earlier lease,
# 6073cb6: 18.27 / 10.83 / 9.86 at 128k / 32k / 8k).
DEFERRED_DEEP_RING_STAGES = 16
# PAIRED_DEEP_RING_STAGES: the deep plans' depth when a CTA runs two splits (`splits_per_cta` 2: an
# experiment at these CTA counts; deployments pair only at PAIRED_LEAVES and more, 512 CTAs and up,
# which keep PIPELINE_STAGES). The held split's PENDING_BYTES (18 KB) come on top of the ring: at
# DEEP_RING_STAGES a CTA takes about 117 KB and an SM holds one, so 256 CTAs run in two waves (tp 8,
# 128k: 48.95 us, records/2026-12-02-h200-9b893c6-attn2-table-ahead-and-pairs.json). At 16 stages
# (85 KB; 93 KB with `SplitIssue.defer_values`' two more) two fit an SM. Measured on the H200, tp 8
# at 256 splits, two rounds (records/2026-12-02-h200-985db7b-sweep-attn2-pairs-ring.json, 0 bits
# differing): 128k 33.35-33.37 us at 16 stages, 33.33-33.38 at 20, 39.55-39.57 at 12; deferred
# 32.01-32.05 at 16 (+2), 31.31 at 20 (+2); one split a CTA (the deployment) 28.82-29.44.
PAIRED_DEEP_RING_STAGES = 16


def ring_stages(window: int, num_kv_heads: int, num_splits: int, per_cta: int | None = None,
                deferred: bool = False) -> int:
    """A deployment's split-kernel ring depth: for a split plan without a window (num_splits > 1,
    window 0) whose split CTAs a request (num_kv_heads x num_splits / per_cta, `splits_per_cta` by
    default) number at most DEEP_RING_MAX_CTAS, DEEP_RING_STAGES, or DEFERRED_DEEP_RING_STAGES when
    the kernel defers its P V waits (`deferred`: `SplitIssue.defer_values`, which adds its own
    stages on top), or PAIRED_DEEP_RING_STAGES when a CTA runs two splits (per_cta 2: the held
    split's shared memory with a ring of DEEP_RING_STAGES would leave one CTA an SM); else
    PIPELINE_STAGES. A performance choice only: the ring moves no
    arithmetic, the bits are the same at any depth."""
    _check_positive(num_kv_heads=num_kv_heads, num_splits=num_splits)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: none), got {window!r}")
    per_cta = splits_per_cta(num_kv_heads, num_splits) if per_cta is None else per_cta
    check_splits_per_cta(per_cta, num_splits)
    ctas = num_kv_heads * num_splits // per_cta
    if num_splits > 1 and window == 0 and ctas <= DEEP_RING_MAX_CTAS:
        if per_cta > 1:
            return PAIRED_DEEP_RING_STAGES
        return DEFERRED_DEEP_RING_STAGES if deferred else DEEP_RING_STAGES
    return PIPELINE_STAGES


def workspace_bytes(num_reqs: int, num_kv_heads: int, num_splits: int, per_cta: int | None = None) -> int:
    """Bytes of the split kernel's workspace: one partial per (request, KV head, split CTA), a CTA
    running `per_cta` splits (default `splits_per_cta(num_kv_heads, num_splits)`); 0 with one split
    (nothing to merge). Nothing in it needs zeroing: a partial is read only by the combine of the
    launch that wrote it."""
    _check_positive(num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_splits=num_splits)
    if not is_power_of_two(num_splits):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if num_splits == 1:
        return 0
    if per_cta is None:
        per_cta = splits_per_cta(num_kv_heads, num_splits)
    check_splits_per_cta(per_cta, num_splits)
    return num_reqs * num_kv_heads * (num_splits // per_cta) * PARTIAL_BYTES


def split_table_entries(max_model_len: int, window: int, num_splits: int) -> int:
    """Page-table entries a split CTA prefetches (its pages start + i S, i below this): the most
    pages one split visits, ceil(n / S) for n the most pages a step's visible keys span (every
    page below max_model_len; with a window, W + 7 keys straddling at most one page more)."""
    pages = max_pages(max_model_len)
    if window:
        pages = min(pages, max_pages(window + QUERY_LEN - 1) + 1)
    return -(-pages // num_splits)


def split_pages(split: int, num_splits: int, first_page: int, end_page: int) -> range:
    """The pages split `split` visits, ascending: those of [first_page, end_page) congruent to
    `split` modulo num_splits."""
    start = first_page + (split - first_page) % num_splits
    return range(start, max(start, end_page), num_splits)


def split_steps(split: int, num_splits: int, first_page: int, end_page: int, pages_per_step: int) -> list[tuple]:
    """The steps of split `split`'s online softmax over its pages (`split_pages`), in order, each a
    tuple of pages. With 1 a page a step; with 2 the split's pages in pairs by their place in the
    split's whole list, page p its (p // num_splits)-th: pairs (2j, 2j + 1) of that list, so a
    step's pages do not depend on L or the window (a window that starts at an odd place starts
    with a one-page step; an odd end ends with one). Without a window (first_page 0) these are
    pairs (0, 1), (2, 3), ... of the pages a split visits."""
    check_pages_per_step(pages_per_step)
    steps: list[tuple] = []
    for page in split_pages(split, num_splits, first_page, end_page):
        pair = (page // num_splits) // pages_per_step
        if steps and (steps[-1][0] // num_splits) // pages_per_step == pair:
            steps[-1] = steps[-1] + (page,)
        else:
            steps.append((page,))
    return steps


def visible_keys(seq_len: int, window: int) -> tuple[int, int]:
    """[first, end) of the keys any of a request's 8 rows sees: row i sees keys
    max(0, L - 8 + i - W + 1) .. L - 8 + i (with a window W), so the union is
    [max(0, L - 7 - W), L)."""
    first = max(0, seq_len - QUERY_LEN + 1 - window) if window else 0
    return first, seq_len


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Attn2Layer:
    """A stand-in for vLLM's MuseSpark1xAttention with the attributes `unsupported_attn2` reads
    (this rank's heads); the defaults are a Muse Spark layer at tp 8."""

    use_o_norm: bool = True
    use_o_gate: bool = True
    head_dim: int = HEAD_DIM
    num_heads: int = 16
    num_kv_heads: int = 2
    scaling: float = config.ATTN_SCALE
    rms_norm_eps: float = config.RMS_NORM_EPS
    sliding_window: int | None = None
