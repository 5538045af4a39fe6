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

Merge. With `num_splits` > 1 (a power of two) the splits' partials (O in FP32, the running max in
the log2 domain and the sum) meet in a fixed binary tree: node (level k, j) merges its children
(k - 1, 2j) and (k - 1, 2j + 1), in that order, whichever CTA does it. Each CTA writes its partial
to its slot, then climbs: one atomic per node, the first of the two children to arrive leaves,
the second re-arms the counter (graph replays find it zero), reads its sibling and merges; the
CTA that merges the root writes the output. Nothing waits on anything: no spin to bound.
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
# SPLIT_TARGET_CLUSTERS: CTAs a request's launch aims for over the rank's KV heads: about one
# wave of the 132 SMs of an H200 (148 on a GB200), rounded down to a power of two so the merge
# tree is complete. One CTA per SM with an 8-page pipeline keeps 32 KB of reads in flight per SM,
# about the 4.2 TB/s x ~1 us of latency the GPU needs; more CTAs would only deepen the merge.
SPLIT_TARGET_CLUSTERS = 128
# MAX_SPLITS: the merge tree's depth is log2 of it (6 levels of one 18 KB read each on the
# critical path); beyond 64 the extra parallelism of one KV head (tp 16) no longer pays for it.
MAX_SPLITS = 64
# MIN_PAGES_PER_SPLIT: below two pages a split's pipeline never fills and the merge dominates.
MIN_PAGES_PER_SPLIT = 2
# SHORT_MAX_LEN: up to 2048 tokens (128 pages) one CTA per KV head reads the whole context; a
# deployment whose max_model_len fits it never pays for a merge.
SHORT_MAX_LEN = 2048
# The window a row sees spans at most window + QUERY_LEN - 1 keys across the 8 rows.

PIPELINE_STAGES = 8  # pages in flight per CTA (cp.async, 4 KB each): see SPLIT_TARGET_CLUSTERS
PAGE_BYTES = PAGE_TOKENS * SLOT_WIDTH * 2  # 4096: one page of one KV head, K | V per slot

# Workspace: counters, then one partial per (request, KV head, split) slot. A partial is in the
# kernel's register order: PARTIAL_O_VECTORS float4 vectors of O per thread, vector-major
# ([vector][thread][4]: a warp's load is 512 contiguous bytes), then one float4 per thread
# (max of row g, max of row g + 8, sum of row g, sum of row g + 8).
PARTIAL_O_VECTORS = 8  # 32 FP32 of O per thread: 2 rows x 16 dims
PARTIAL_FLOATS = CTA_THREADS * 4 * (PARTIAL_O_VECTORS + 1)
PARTIAL_BYTES = 4 * PARTIAL_FLOATS  # 18432
COUNTER_ALIGN = 16


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def max_pages(max_model_len: int) -> int:
    """Page-table entries per request for max_model_len tokens (the page table's width)."""
    return -(-max_model_len // PAGE_TOKENS)


def splits(max_model_len: int, window: int, num_kv_heads: int) -> int:
    """The splits of a launch (a power of two): 1 up to SHORT_MAX_LEN, else MAX_SPLITS, at least
    MIN_PAGES_PER_SPLIT pages each (of the pages a row can see: the window's with one).

    Not divided by num_kv_heads (the seeds' SPLIT_TARGET_CLUSTERS // (ROW_GROUPS * heads)): the
    split count decides a row's summation order, and a KV head's bits must be the same whichever
    tp computes it (tp 2: 8 heads x 64 splits = 512 CTAs, four waves of short CTAs; tp 8 and 16:
    128 and 64 CTAs, about SPLIT_TARGET_CLUSTERS). num_kv_heads is validated only."""
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


def counter_words(num_reqs: int, num_kv_heads: int, num_splits: int) -> int:
    """int32 counters: one per merge-tree node slot (num_splits per request and KV head, heap
    numbered 1 .. num_splits - 1, word 0 unused), padded to COUNTER_ALIGN bytes."""
    words = num_reqs * num_kv_heads * num_splits
    return -(-words * 4 // COUNTER_ALIGN) * COUNTER_ALIGN // 4


def workspace_bytes(num_reqs: int, num_kv_heads: int, num_splits: int) -> int:
    """Bytes of the split kernel's workspace (0 with one split: nothing to merge)."""
    _check_positive(num_reqs=num_reqs, num_kv_heads=num_kv_heads, num_splits=num_splits)
    if not is_power_of_two(num_splits):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if num_splits == 1:
        return 0
    return 4 * counter_words(num_reqs, num_kv_heads, num_splits) + num_reqs * num_kv_heads * num_splits * PARTIAL_BYTES


def split_pages(split: int, num_splits: int, first_page: int, end_page: int) -> range:
    """The pages split `split` visits, ascending: those of [first_page, end_page) congruent to
    `split` modulo num_splits."""
    start = first_page + (split - first_page) % num_splits
    return range(start, max(start, end_page), num_splits)


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
