"""attn2's input families: one request's verify step over all 16 KV heads of Muse Spark, drawn
once per (family, L, max_model_len, window, seed) so that every rank and every tp slices the same
numbers (`for_rank`): a KV head's output must be the same bits whichever rank computes it.

Every family shuffles the page table (pages in random physical order) and poisons what the
kernel must not read: every page of the pool outside the request's first ceil(L / 16) table
entries, the slots at and beyond L in its last page, the table entries past its pages (they
point at poisoned pages) and, with a window, every page wholly before the first key any row sees
(a sliding-window server may have freed and reused it: its table entry still points at it, and it
holds poison; the keys before the window that share a page with visible ones stay real values, as
they are in a live cache). Poison alternates NaN and a huge finite BF16 (+-3e38), so a read of it
shows as a NaN or a wrong value.

- random: q, gate, K, V ~ N(0, 1) (q and K after the QK-norm are unit-RMS rows).
- large: q and K aligned and scaled so scale * q.k is about 2800: exp without max subtraction
  overflows FP32 (and FP64 past 710), and one key dominates.
- equal: every key equal (a uniform softmax: o is the mean of V, summation order shows).
- tiny: -0.0 and BF16 subnormals in q, K, V and gate, beside ordinary values.
"""

from __future__ import annotations

import hashlib

import torch

from musebench import attn2_layout as lay
from musebench import config
from musebench.stock.attn2 import Attn2Problem

INPUT_FAMILIES = ("random", "large", "equal", "tiny")
POISON_HUGE = 3.0e38
SPARE_PAGES = 5  # pool pages beyond the request's: poisoned, reachable only through bad reads


def _generator(*key: object) -> torch.Generator:
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _poison(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    nan_or_huge = torch.randint(0, 2, shape, generator=g).bool()
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return torch.where(nan_or_huge, torch.full(shape, float("nan")), sign * POISON_HUGE).to(torch.bfloat16)


def make_problem(family: str, seq_len: int, max_model_len: int, window: int = 0, seed: int = 0,
                 num_kv_heads: int = config.NUM_KV_HEADS) -> Attn2Problem:
    """One request of all `num_kv_heads` KV heads (default 16), deterministic in its arguments."""
    if family not in INPUT_FAMILIES:
        raise ValueError(f"attn2 inputs must be one of {', '.join(INPUT_FAMILIES)}, got {family!r}")
    if not lay.QUERY_LEN <= seq_len <= max_model_len:
        raise ValueError(f"L = {seq_len} outside [8, max_model_len = {max_model_len}]")
    g = _generator("attn2", family, seq_len, max_model_len, window, seed, num_kv_heads)
    heads = num_kv_heads * lay.HEADS_PER_KV_HEAD
    table_width = lay.max_pages(max_model_len)
    used = lay.max_pages(seq_len)
    pool = used + SPARE_PAGES
    q = torch.randn(lay.QUERY_LEN, heads, lay.HEAD_DIM, generator=g)
    gate = torch.randn(lay.QUERY_LEN, heads, lay.HEAD_DIM, generator=g) * 2
    kv = torch.randn(used * lay.PAGE_TOKENS, num_kv_heads, lay.SLOT_WIDTH, generator=g)
    if family == "large":
        direction = torch.nn.functional.normalize(torch.randn(num_kv_heads, lay.HEAD_DIM, generator=g), dim=-1)
        q = direction.repeat_interleave(lay.HEADS_PER_KV_HEAD, 0)[None] * 64.0 + q * 0.5
        kv[:, :, : lay.HEAD_DIM] = direction[None] * 64.0 * torch.rand(kv.shape[0], num_kv_heads, 1, generator=g)
    elif family == "equal":
        kv[:, :, : lay.HEAD_DIM] = kv[:1, :, : lay.HEAD_DIM]
    elif family == "tiny":
        for t in (q, gate, kv):
            pick = torch.rand(t.shape, generator=g)
            t[pick < 0.2] = -0.0
            subnormal = torch.ldexp(torch.randint(1, 128, t.shape, generator=g).float(), torch.tensor(-133))
            t[(pick >= 0.2) & (pick < 0.4)] = subnormal[(pick >= 0.2) & (pick < 0.4)] * torch.sign(
                torch.randn(t.shape, generator=g))[(pick >= 0.2) & (pick < 0.4)]
    kv = kv.to(torch.bfloat16)
    cache = _poison((pool, num_kv_heads, lay.PAGE_TOKENS, lay.SLOT_WIDTH), g)
    physical = torch.randperm(pool, generator=g)
    pages = kv.view(used, lay.PAGE_TOKENS, num_kv_heads, lay.SLOT_WIDTH).permute(0, 2, 1, 3)
    tail = seq_len - (used - 1) * lay.PAGE_TOKENS  # keys in the last page
    first_page = lay.visible_keys(seq_len, window)[0] // lay.PAGE_TOKENS  # pages before it: poison
    for logical in range(first_page, used):
        keep = lay.PAGE_TOKENS if logical < used - 1 else tail
        cache[physical[logical], :, :keep] = pages[logical, :, :keep]
    table = torch.empty(1, table_width, dtype=torch.int32)
    table[0, :used] = physical[:used].int()
    spare = physical[used:]
    table[0, used:] = spare[torch.randint(0, SPARE_PAGES, (table_width - used,), generator=g)].int()
    return Attn2Problem(
        q=q.to(torch.bfloat16).reshape(lay.QUERY_LEN, -1).contiguous(),
        gate=gate.to(torch.bfloat16).reshape(lay.QUERY_LEN, -1).contiguous(),
        kv_cache=cache.contiguous(), page_table=table, seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        max_model_len=max_model_len, window=window,
    )


def kv_heads_of(rank: int, tp: int, total: int = config.NUM_KV_HEADS) -> range:
    """The KV heads rank holds at tp (tp divides the 16 KV heads)."""
    if total % tp:
        raise ValueError(f"tp {tp} does not divide {total} KV heads")
    per = total // tp
    return range(rank * per, (rank + 1) * per)


def for_heads(problem: Attn2Problem, heads: range) -> Attn2Problem:
    """The same request restricted to KV heads `heads` (contiguous copies, as a rank holds them)."""
    width = lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM
    cols = slice(heads.start * width, heads.stop * width)
    return Attn2Problem(problem.q[:, cols].contiguous(), problem.gate[:, cols].contiguous(),
                        problem.kv_cache[:, heads.start:heads.stop].contiguous(), problem.page_table,
                        problem.seq_lens, problem.max_model_len, problem.window)


def for_rank(problem: Attn2Problem, rank: int, tp: int) -> Attn2Problem:
    """Rank `rank`'s share of a 16-KV-head problem at tp."""
    return for_heads(problem, kv_heads_of(rank, tp, problem.num_kv_heads))
