"""attn2 in CuTe DSL: the verify step's paged attention (8 query rows, head_dim 64, 8 query heads
per KV head) fused with the o-norm and sigmoid gate, for sm_90a and sm_100a.

Public API (behind `musebench.cute_ops`): `prepare`, `launch`, `compile_attn2`. The algorithm is
`musebench.cpu.attn2`'s, step for step (its docstring lists what is the same and what is not);
the geometry and the split plan are `musebench.attn2_layout`'s.

Two kernels, one class each. The split kernel: one CTA of 128 threads (one warpgroup) per (KV
head, split, request), grid index y running partial bitrev(y) in split plans without a window and
partial y otherwise (`Attn2Build.spread_splits`, the rule `attn2_layout.spread_splits`: the GPU hands
consecutive CTAs to the same few SMs, and at small L the splits with pages are the lowest, so in
grid order they shared SMs; spread ran tp 8 L 128 in 5.4 us against 6.7, but the window's plan
slower). Warp w computes rows of heads 2w, 2w + 1 (rows g and g + 8 of its 16, g = lane // 4 the
token); the 64 rows of a KV head are one M = 64 tile. Two tensor-core paths give the same bits
(`Attn2Build.tensor_ops`, `TENSOR_OPS`): on sm_90a `wgmma` with A (Q, P) from registers and B (K,
V) from shared memory by descriptor (`kernels.gmma`); elsewhere (sm_100a: no wgmma)
`mma.sync.m16n8k16` with B fragments through `ldmatrix`. Each k16 step of wgmma equals
mma.sync's on the H200 (`kernels.gmma_probe`), and both paths run the same chains in the same
order (tests/kernels/test_attn2_gpu.py compares them bit for bit):

1. `griddepcontrol.wait` (PDL), then the Q fragments straight from global memory (16 words).
2. The split's pages, ascending, through a PIPELINE_STAGES-deep cp.async ring in shared memory
   (one 4 KB page a stage; wgmma: K and V as two 2 KB regions of 16 rows, 16-byte chunks
   XOR-swizzled by row, the 128-byte swizzle of `gmma.page_offset`, the ring 1024-byte aligned;
   mma.sync: K | V per slot, chunks swizzled by slot, so the ldmatrix reads are bank-conflict
   free). Slots at and past L are zero-filled by cp.async's src-size 0 (never read: other
   requests' data or poison may sit there); pages past L are never touched. One barrier a page.
   With two splits a CTA the ring runs on from the first split's pages into the second's.
3. Per page: S = Q K^T (four k16 steps from zero), the causal and window mask (the same for both
   rows of a thread), the online softmax on unscaled scores (row maxima of S, weights
   2^((s - m) fp32(scale log2 e)) with the difference rounded before the product, by
   `ex2.approx.ftz`; m_use = 0 while a row has seen nothing, so a masked page is an exact no-op),
   P = p_hi + p_lo as two BF16 terms; O and l times alpha (FP32), then the tensor cores add
   p_lo's step and p_hi's step into them (`cpu.attn2.accumulate_page`): B is V with an n-tile
   of ones beside it (N = 72: wgmma reads the ones from a CTA-wide block that the descriptor
   reaches as V's second 64-column block; mma.sync takes a constant B fragment), so that
   n-tile's accumulator is l and a page costs no FP32 adds for O or the row sums. n-tile t of
   P V is dims 8t .. 8t + 7, so a thread holds dims 8t + 2c, 8t + 2c + 1 of its rows g and
   g + 8 (t = 0 .. 7; `attn2_layout.lane_dims`).
   With `Attn2Build.pages_per_step` 2 (the deployments' for split plans without a window,
   `attn2_layout.pages_per_step`, at every tp; one or two splits a CTA) a step takes two of the
   split's pages (`attn2_layout.split_steps`: pairs by place in the split's whole list, so that no
   step depends on L or the window; a lone first or last page runs the one-page loop): both in
   the ring (it holds one page less ahead), one wait and one barrier, S per page, one max over
   the 32 keys, one alpha and rescale, then P V page by page (p_lo, p_hi of the first, then of the
   second). With two splits a CTA each split steps through its own pages so (`step_chain`), as
   a CTA running it alone would. Other bits than one page a step
   (`cpu.attn2.attn2_model(pages_per_step=2)`'s), the same determinism. SASS a page (sm_90a,
   tp 8 128k, every row sees both, no rescale) 103 against 131 (`scripts/attn2-sass.py
   --pages-per-step 2`).
   `SplitIssue` (compile-time, each keeping every bit; all on in the deployments but
   `defer_values`, which `deployment_issue` turns on where a CTA runs one split of wgmma two-page
   steps: tp 8 and 16): pages every row sees
   whole take an unmasked copy of the scores, a warp whose alphas are all 1.0 skips the rescale,
   and (mma.sync) the fragment addresses are per-thread constants plus the stage's offset.
4. With one split: the epilogue. Otherwise a CTA with pages writes its partial (O, m, l) to its
   workspace slot (`attn2_layout`) and ends; a CTA without pages writes nothing and (every
   deployment, `Attn2Build.empty_ctas_exit`) ends right after L's load, before its Q and table
   loads, which would only compete with the CTAs that have pages. With two splits
   a CTA (`attn2_layout.splits_per_cta`: tp 4 and 2 at 256 splits; `Attn2Build.splits_per_cta`), splits 2j and 2j + 1,
   the first split's state waits in shared memory (`hold_pending`) while the second runs from a
   fresh (m, O, l), and the CTA merges them (`merge_pending`: `merge_into`, left child first,
   the combine's merge of those two leaves), so its partial is the tree's level-1 node j, bit for
   bit what the combine would make of the two leaves. The split count fixes the bits; how many
   splits a CTA runs does not.

Experiments (`scripts/sweep-attn2.py`, `Attn2Build`; none is a deployment's): the split count,
the splits a CTA runs (forced), the tensor-core path, `SplitIssue` settings other than the rule's,
the pages a softmax step takes (forced against the rule) and the ring's depth
(`Attn2Build.ring_stages`: 24 stages ran tp 16 at 128k in 19.8 us against 25.8-26.0 at 8, the same
bits; tp 8 slower deeper: records/2026-12-02-h200-6073cb6-sweep-attn2-ring.json). Measured and
removed (records/, 2026-12-01 af718e6): an mbarrier ring with no CTA barrier a page (slower at 128k by 1.5-2.7 us),
the next page's Q K^T issued before this page's softmax on it (it changed bits: removed with its
bug), a combine trimmed to the live subtree (no faster), and several KV heads a CTA (no faster:
the heads' chains ran one after the other, each restarting the ring).
Measured and removed on 2026-12-02 (session 11, branch attn2-s11-experiments; the deployment's
bits every time): the next step's Q K^T issued before this step's softmax, now without the bit
change (that branch's SplitIssue.scores_ahead: 121 against 100.5 SASS a page for the 16 moves that
carry the scores; tp 8 / 16 at 128k 30.43 / 18.86 us against 28.55 / 17.73,
records/2026-12-02-h200-68f8fa8-attn2-scores-ahead.json), and a combine that merges each partial
as it lands, behind row flags the split CTAs set (that branch's progressive_combine, the combine
launched after the split kernel's prologue or after its chain: 32.90 / 30.83 us against 28.15 /
29.37 at tp 8 and 128k; the flags' release costs the last split CTA about 1 us, as the grid's flush
did, records/2026-12-02-h200-3f28415-attn2-progressive-combine.json).

Where tp 8's 128k time goes (H200, records/2026-12-02-h200-*: 4426823 trace rows, 93d25a5
ncu loads-only, 081ea38 stalls and read floor, fb41107 weight terms). The graph period is 28.1 us
against a plain read of the same 67 MB in 17.1 us. The split CTAs' chains start 4.1-5.0 us after
the launch's first entry; SMs with four CTAs stream 6.7 pages a microsecond and their last CTA
ends at 23.4 us (median; 25.6 the last), SMs with three at 5.8 and 20.8 us; the combine then
takes about 4 us. The page stream alone (`loads_only`) is only 1.9 us shorter than the whole
kernel (Nsight Compute, one launch: 22.9 against 24.8 us), pages in logical order save 1.1 us
more, half the P V MMAs (`weight_terms` 1) 0.3 us. Warp stalls are spread: fixed-latency waits
23 %, issue contention 32 %, the CTA barrier 9 %, scoreboards 11 %; 144 warp instructions a warp a
page; 14 of 16 warps an SM resident (110 registers, 44 KB of ring a CTA). Neither the tensor
cores nor HBM bound it alone. Traces with and without the arithmetic (`loads_only`), from HBM
and partly from L2, with half the P V work (`weight_terms` 1) beside them
(records/2026-12-02-h200-81d4d3c-attn2-bound.json). With the arithmetic an SM (four CTAs) does
6.6 pages a microsecond with its pages from HBM (tp 8, 128k: 6.63, about 3.5 TB/s in all) and
partly from L2 (tp 8 at 64k, 33.5 MB, L2 hit rate 45 %: 6.56), and with two CTAs from L2 (tp 16
at 128k: 6.69). The stream alone, with five CTAs an SM (fewer registers), does 7.7-9.0 from HBM
(3.5-3.7 TB/s over the SMs that hold five), its chains no shorter than the kernel's; from L2 it
does 10.6 (tp 8 64k) and 17.9 (tp 16). So at tp 8 128k the page stream from HBM is what limits
most: half the P V work (about a quarter of a step's instructions) saves 0.27 us there, and a
deeper ring or L2 prefetch (measured before) did not help. Where pages come from L2 the arithmetic
limits more: the same half saves 0.95 us at tp 8 64k and 1.21 at tp 16 128k (5-7 %). Nsight
Compute (one launch): the schedulers issue in 52-54 % of cycles; no pipe is busier than 36 %.

The combine kernel (only with splits): one CTA per (row, KV head, request), COMBINE_QUADS x
`combine_groups` threads. Thread (group j, quad c) reads the row's 16 dims of O (`lane_dims(c)`,
from the partial's vectors, `attn2_layout.partial_vector_dims`), m and l that lane c held in each
partial of its group (skipping partials without pages: (0, -inf, 0), what a merge of empty
leaves makes), merges them as the subtree they are (left child first: w = 2^((m - top) scale
log2 e), O = O_L w_L + O_R w_R as two products and one sum), then the groups' results meet level
by level: within each warp (8 groups) by shuffles, node 2j taking node 2j + 1 from 4, 8, 16 lanes
up, then warp 0 merges the warps' nodes in warp order from shared memory (one barrier), and runs
the epilogue on the root. The same tree, so the same bits, as the level-by-level merge through
shared memory it replaced (six levels of three barriers at 64 groups), and 0.4-2.1 us faster at
every L on the H200 (bench attn, tp 8 8k 11.5 against 13.4 us; 32 groups within +-0.4 us of 64:
records/2026-12-02-h200-3bb425a-ab-combine-shuffle.json); with the shared-memory tree, twice the
groups (512 threads) was slower at 22 of 24 points (records/2026-12-02-h200-2f72f10-ab-combine-
groups.json). Only the tree's levels that can meet pages run (`upper_tree`; CTA-uniform, from L
alone, when the splits with pages start at split 0): above them every merge on the root's path is
merge(node, empty), and one merge with an empty node gives their bits (merge with an empty node is
idempotent: tests/cpu/test_attn2_model.py). At 256 splits (64 groups of 4 leaves, 8 groups a
warp) L <= 64 takes one merge in place of the shuffles, shared memory and barrier, and L <= 512
skips the shared-memory stage (`Attn2Build.full_tree` keeps the whole tree: the GPU test holds
both to the same bits). Only quad 0 of warp 0 holds the root: the other quads run the epilogue on ones,
never stored (a node of empty leaves, 0 / 0, would take div.rn's slow path and hold the warp: 2.1
us at 4 splits and L 8, records/2026-12-02-h200-75f5410-*).

Epilogue: o = O / l (div.rn) rounded to BF16, sum of squares in lane order (each of 4 lanes its 16
dims 8t + 2c + k, t ascending, k = 0 then 1, from +0.0; then the butterfly over xor 1, 2),
rstd = 1 / sqrt(ss / 64 + eps) (IEEE), sigmoid(g) = 1 / (1 + 2^(-g log2 e)), out = bf16(o rstd
sig), one 4-byte store (gate: one 4-byte load) per n-tile. A lane's 16 quotients O / l and its 16
sigmoids go through `kernels.division.quotients_rn`: div.rn.f32's bits, on its fast path without a
branch per quotient where every operand lies in 2^-60 .. 2^61 (else div.rn.f32 each, one branch
for the list). div.rn.f32 alone branched around its slow path 33 times a row, one after the other:
the combine's epilogue took 1.5 us; now 0.7 (trace, tp 16 128k), every bench point 0.4-1.3 us
faster with the same bits (records/2026-12-02-h200-081ea38-ab-attn2-quotients.json).

Determinism. The layout fixes which lane holds which dim and so the sum of squares' order; it is
a compile-time constant of the code, the same for every KV head, request, L, tp and launch (eager
or a graph replay): the layout enters no decision that depends on them. So the properties the
tests check (a KV head's bits whatever the tp, a row's bits whatever L when it sees the same
keys, equal bits across calls and replays) hold by construction, and so do the split kernel's
switches (`SplitIssue`, `tensor_ops`, `splits_per_cta`): each runs the same chains in the same order
and merges them in the same tree.

Memory ordering: PDL. Every global read of either kernel follows its `griddepcontrol.wait` (Q,
the gate and the cache are the QKV front's outputs; the partials are the split kernel's, which the
combine's wait sees finished and flushed); each releases its dependents after its main work (a
split CTA without pages by ending after L's load, which PDL counts as a release).

Trace (compile-time `Attn2Build.trace`, an experiment: `launch(..., trace=True)`,
`scripts/trace-attn2.py`; no deployment builds it, and the deployments' PTX is the same as without
the knob): thread 0 of every split CTA and of every combine CTA writes TRACE_WORDS int64, after its
last store, into the workspace past the partials (`traced_workspace_bytes`: the launch refuses a
smaller workspace with ValueError before anything launches, one split included; `trace_rows` views
them): its SM, %globaltimer at entry and at the end (ns, one clock for every SM), and %clock64 (the
SM's cycles) at entry, after griddepcontrol.wait, then (split, SPLIT_TRACE_FIELDS) after the
prologue (Q fragments, table prefetch, the ring's first copies issued), after the page chain(s)
and after the partial write (or the one-split epilogue); (combine, COMBINE_TRACE_FIELDS) after the
group's partial loads and subtree, after the tree above the groups, and at the end. Every thread
reads the clocks (no branch in the page loop); only thread 0 writes. The bits of `out` and of the
partials are the untraced build's: the trace adds reads of special registers and its own stores.
Since 2026-12-02 (session 11) a split CTA without pages ends after L's load (`empty_ctas_exit`): its
prologue, chain and write phases end there, at zero length, so medians over every CTA are not
comparable with earlier traces at small L; those over the CTAs with pages are.

Cost (scripts/attn2-sass.py, sm_90a, a page every row sees whole, no rescale): 131 SASS
instructions a warp, from 346 with mma.sync, word loads and FP32 accumulation (b8721c8); no
spills, no wgmma serialization.
Measured on the H200 (`musebench bench attn`, records/): see the README's performance section.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from musebench import attn2_layout as lay
from musebench import config
from musebench.kernels import compilation, division, gmma, ptx
from musebench.kernels.compilation import compiler, cute_flat, fake_flat

__all__ = ["Attn2Build", "CompiledAttn2", "SplitIssue", "compile_attn2", "launch", "prepare"]

LOG2_E = 1.4426950408889634
SCALE_LOG2 = config.ATTN_SCALE * LOG2_E  # rounded to binary32 once, when the kernel is built
NEG_INF = float("-inf")
BF16_BYTES = 2
WORD_BYTES = 4
VECTOR_BYTES = 16
SLOT_BYTES = lay.SLOT_WIDTH * BF16_BYTES  # 256
CHUNKS_PER_SLOT = SLOT_BYTES // VECTOR_BYTES  # 16
SWIZZLE_MASK = 7  # chunk ^ (slot & 7): K stays in chunks 0-7, V in 8-15
K_TILES = lay.HEAD_DIM // 16  # 4 k-steps of Q K^T
V_TILES = lay.HEAD_DIM // lay.TILE_DIMS  # 8 n-tiles of P V: dims 8t .. 8t + 7
ACCUMULATOR_COLUMNS = (V_TILES + 1) * lay.TILE_DIMS  # 72: V's 64 dims, then the ones' n-tile (l)
ACCUMULATORS = 4 * (V_TILES + 1)  # 36 a thread: o[4 t + j]; t = V_TILES holds l (j 0: row g, 2: g + 8)
V_TILE_PAIRS = V_TILES // 2  # one ldmatrix.x4.trans each
V_CHUNK0 = lay.HEAD_DIM * BF16_BYTES // VECTOR_BYTES  # 8: V's first 16-byte chunk in a slot
ALIGN = 16
# The combine's launch bound (.minnctapersm): 1, so that ptxas may take the registers it needs.
# Without a bound it settled on 64 for the combine of 128 partials (the 4096-token plan: 64 groups
# of 2) and spilled 4 bytes; with it, 69 and no spill. Register allocation only: the same bits.
COMBINE_CTAS_PER_SM = 1
# Attn2Build.ring_stages (experiments): ring depths a build may take (4 KB a stage; above 12 the
# shared memory of four CTAs no longer fits an SM, so fewer run at once)
RING_STAGES_CHOICES = (4, 6, 8, 10, 12, 16, 20, 24)  # lay.DEEP_RING_STAGES among them
# SplitIssue.defer_values: ring stages beyond PIPELINE_STAGES, so that a step's copies never go
# into the stages of the step before it (its P V may still be pending)
DEFER_EXTRA_STAGES = 2
# a thread's [16 O, m, l] in shared memory, padded to whole 16-byte vectors (80 bytes)
COMBINE_SLOT_BYTES = -(-lay.COMBINE_ROW_FLOATS * 4 // VECTOR_BYTES) * VECTOR_BYTES
# The traced build (`Attn2Build.trace`, an experiment): the int64 words thread 0 of a CTA writes,
# after its last store, into the trace rows past the partials (`trace_rows`). %globaltimer (ns, one
# clock for every SM) at entry and end; %clock64 (the SM's cycles) at the phases' ends.
SPLIT_TRACE_FIELDS = ("smid", "globaltimer_entry", "globaltimer_end", "clock_entry", "clock_waited", "clock_prologue",
                      "clock_chained", "clock_written")
COMBINE_TRACE_FIELDS = ("smid", "globaltimer_entry", "globaltimer_end", "clock_entry", "clock_waited", "clock_loaded",
                        "clock_merged", "clock_end")
TRACE_WORDS = len(SPLIT_TRACE_FIELDS)  # a CTA's row of either kernel
TRACE_ROW_BYTES = TRACE_WORDS * 8
assert len(COMBINE_TRACE_FIELDS) == TRACE_WORDS


WEIGHT_TERMS_CHOICES = (1, 2)  # `Attn2Build.weight_terms`
# `SplitIssue.prefetch_pages`: how far beyond the ring's copies a step asks L2 for pages (8 pages of
# one KV head a CTA: 32 KB; 512 CTAs at tp 8 hold 16 MB of the 50 MB L2 ahead)
L2_PREFETCH_PAGES = 8


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class SplitIssue:
    """The split kernel's instruction savings, each a compile-time switch (each leaves every output bit as it is, so `scripts/sweep-attn2.py --issue` times them
    against `SplitIssue.none()` on the same split plan and counts differing bits, which must be 0).
    The first four are on in every deployment; `defer_values` where `deployment_issue` says
    (sm_90a's wgmma two-page steps, one split a CTA: tp 8 and 16). `SplitIssue()` itself keeps
    `defer_values` off: it is the "all" setting of the scripts, not a deployment.

    - `mask_edges_only`: a page whose 16 keys every row of the CTA sees (key <= L - 8, the smallest
      own key, and with a window key >= L - W, the largest low key: a CTA-uniform test) runs a copy
      of the page step without the causal / window compares and selects; a page at an edge runs
      the masked copy. A visible score is selected unchanged, so the copies agree bit for bit.
    - `skip_unit_rescale`: the warp skips O *= alpha and l *= alpha (34 multiplies) when every
      alpha of the warp is exactly 1.0 (`vote.sync.all`): x * 1.0 is x, bit for bit, for every
      non-NaN x (-0.0, subnormals and inf included: mul.rn.f32 keeps subnormals); a NaN O turns
      into the canonical NaN through the add that follows either way.
    - `lean_addressing`: the per-thread parts of the shared addresses of the K and V fragments
      (the XOR swizzle) are computed once, before the page loop, so a page adds only its stage's
      offset (ptxas then reads with [R + UR] addressing); the cp.async source of a zero-filled
      chunk stays its own address in the page (src-size 0: not read) instead of a 64-bit select.
    - `ldmatrix_keys`: Q K^T's B fragments through `ldmatrix.x4` (`k_fragment_row`: two k-steps of
      eight keys each, four per copy of the scores) instead of 16 word loads; the same words.
      Without `lean_addressing` it costs the windowed sm_90a kernel (2 KV heads) a spill (28
      bytes: the per-page addresses), so `none()` is without it.
    - `defer_values` (wgmma two-page steps only: sm_90a, `pages_per_step` 2; ValueError
      elsewhere): a step's P V is committed without a wait; the next step's Q K^T wait (wait_group
      0) completes it too, and the accumulators pass through that wait, so the P V runs under the
      next step's barrier, copies and Q K^T issue instead of stalling its own step. A copy may
      not overwrite a stage a pending P V of any warp still reads: the ring keeps
      DEFER_EXTRA_STAGES more stages (the lookahead unchanged), so the copies after step i's
      barrier go into step i - 2's stages, whose P V every warp waited for (in step i - 1) before
      reaching that barrier. The same MMAs on the same values in the same order. Measured on the
      H200 (records/2026-12-02-h200-eb7af05-sweep-attn2-defer.json, 0 bits differ): tp 8 / 16 at
      128k 29.2-29.3 / 25.4-25.6 us against 29.9 / 26.5, 32k 0.1-0.2 us faster, 8k the same; tp 4
      (two splits a CTA: the deeper ring and the held split's 18 KB cost a CTA an SM) 61.5 against
      53.1 at 128k. So the deployments defer where a CTA runs one split (`deployment_issue`), with
      the deep ring at `attn2_layout.DEFERRED_DEEP_RING_STAGES`.
    - `prefetch_pages` (an experiment, in no deployment and not in "all"): each ring step also
      asks L2 for the CTA's pages L2_PREFETCH_PAGES beyond its copies (`cp.async.bulk.prefetch.L2`,
      one 4 KB request a page from one thread; the prologue for the first ones), so that a page's
      cp.async later finds it in L2: the page stream gets L2_PREFETCH_PAGES more pages in flight a
      CTA without shared memory, registers or occupancy. A hint: no value changes. Why: at tp 8,
      128k the page stream from HBM limits the kernel with the arithmetic (this module's
      docstring). Measured on the H200, not taken (the deployment's bits: 12 GPU tests;
      records/2026-12-02-h200-ede3d4c-attn2-prefetch-trace-short.json): tp 8 at 128k 32.63 us
      against 28.03, tp 16 18.72 against 17.94, 32k within 0.1 us.

    `named("all" | "none" | "mask+rescale+lean+keys" | "mask+lean" ...)`: a setting by name
    (the scripts' flags).
    """

    mask_edges_only: bool = True
    skip_unit_rescale: bool = True
    lean_addressing: bool = True
    ldmatrix_keys: bool = True
    defer_values: bool = False
    prefetch_pages: bool = False

    @staticmethod
    def none() -> SplitIssue:
        """Every switch off: the split kernel as it was before them (the A/B baseline)."""
        return SplitIssue(False, False, False, False, False, False)

    SHORT_NAMES = {"mask": "mask_edges_only", "rescale": "skip_unit_rescale", "lean": "lean_addressing",
                   "keys": "ldmatrix_keys", "defer": "defer_values", "prefetch": "prefetch_pages"}

    @staticmethod
    def named(name: str) -> SplitIssue:
        """"all" (`SplitIssue()`: every switch but `defer_values` and `prefetch_pages`), "none", or
        short names joined by "+" (those on, the rest off): "mask", "rescale", "lean", "keys",
        "defer", "prefetch".
        ValueError for anything else (an unknown or
        repeated name, "all" joined with anything)."""
        if name == "all":
            return SplitIssue()
        if name == "none":
            return SplitIssue.none()
        parts = name.split("+")
        _require(all(p in SplitIssue.SHORT_NAMES for p in parts) and len(set(parts)) == len(parts),
                 f"unknown SplitIssue {name!r}: 'all', 'none' or {'+'.join(SplitIssue.SHORT_NAMES)} (any of them "
                 "joined by '+', each once)")
        return SplitIssue(**{field: short in parts for short, field in SplitIssue.SHORT_NAMES.items()})

    def knobs(self) -> dict[str, bool]:
        return {name: bool(getattr(self, name)) for name in SplitIssue.SHORT_NAMES.values()}


def named_issue(name: str) -> SplitIssue | None:
    """A setting of the scripts' --issue: "auto" is the deployment's (None: `deployment_issue`
    per build), any other name `SplitIssue.named`'s (ValueError for an unknown one)."""
    return None if name == "auto" else SplitIssue.named(name)


def deployment_issue(wgmma: bool, pages_per_step: int, splits_per_cta: int) -> SplitIssue:
    """The split kernel's `SplitIssue` in a deployment (`Attn2Build.issue` None): every saving on,
    and `defer_values` where the kernel runs wgmma two-page steps (`pages_per_step` 2: split plans
    without a window) with one split a CTA (tp 8 and 16 at 256 splits). Not with two splits a CTA
    (tp 4 and 2: the deeper ring and the held split cost a CTA an SM, 61.5 against 53.1 us at
    128k), nor with mma.sync (sm_100a; the deferred wait is wgmma's). The bits are the same either
    way; only the speed differs (`SplitIssue`'s measurements)."""
    return SplitIssue(defer_values=bool(wgmma) and pages_per_step == 2 and splits_per_cta == 1)


@dataclass(frozen=True)
class Attn2Build:
    """Compile-time knobs besides the deployment: PDL, the target (default: CUTE_DSL_ARCH or the
    current GPU), a folder for the PTX (tests) and, for experiments (`scripts/sweep-attn2.py`),
    a split count other than `attn2_layout.splits`' (a power of two; the bits then follow that
    plan, not the deployment's), the splits a CTA runs other than `attn2_layout.splits_per_cta`'s
    (1 or 2: the same bits either way), the split kernel's instruction savings (`SplitIssue`:
    the same bits with any setting) and the pages a softmax step takes (`pages_per_step`: None,
    the deployment's rule for the build's plan, `attn2_layout.pages_per_step`, resolved into the
    compile key; 1 or 2 forced, with one or two splits a CTA; 2 gives other bits than 1, those of
    `cpu.attn2.attn2_model` with pages_per_step 2, with the same determinism). `issue` None: the
    deployment's (`deployment_issue`), resolved into the compile key."""

    enable_pdl: bool = True
    arch: str | None = None
    ptx_dir: str | None = None
    num_splits: int | None = None  # experiments only: another split plan than the deployment's (other bits)
    issue: SplitIssue | None = None  # None: the deployment's, `deployment_issue`
    tensor_ops: str | None = None  # "wgmma" (sm_90a only) or "sync"; None: the target's (TENSOR_OPS)
    splits_per_cta: int | None = None  # experiments only: 1 or 2 (None: the layout's); the same bits
    # 1 or 2 (`attn2_layout.split_steps`); None: the plan's (`attn2_layout.pages_per_step`)
    pages_per_step: int | None = None
    # experiments only: the split kernel's ring stages (RING_STAGES_CHOICES; None: the deployment's,
    # `attn2_layout.ring_stages`); a deeper ring keeps more pages in flight a CTA (the same bits: the
    # ring moves no arithmetic)
    ring_stages: int | None = None
    # experiments only: every CTA's clocks into trace rows past the partials (`trace_rows`; the
    # launch then needs `traced_workspace_bytes`); the same bits of out and of the partials
    trace: bool = False
    # a timing probe only (`scripts/profile-attn2.py --loads-only`): the split kernel keeps its ring,
    # copies, waits and barriers and drops every MMA and the softmax, so its time is the ceiling the
    # page stream alone sets; its out and partials are NOT attention (they hold what an empty split
    # leaves). Never a deployment; no test compares its bits.
    loads_only: bool = False
    # experiments only: P's BF16 terms in P V: 2 (every deployment: p_hi + p_lo, P V near FP32) or 1
    # (p_hi = RN(p) alone: half the P V MMAs, P rounded to BF16 as FlashAttention's is; other bits,
    # no CPU model; wgmma only). `scripts/weight-terms-attn2.py` times both and measures their error
    # against the FP64 reference beside the stock's. Measured on the H200, not taken (records/
    # 2026-12-02-h200-fb41107-attn2-short-plan-and-weight-terms.json): tp 8 128k 27.77 against 28.10
    # us, tp 16 128k 16.54 against 17.78, 8k within 0.2 us; the max error from 3.16 to 331.8 BF16
    # ULPs at tp 8 128k (still under the stock's 752.2), the mean 0.25 to 0.31. Half the P V
    # tensor work buys 1 % at tp 8: the tensor cores do not bound the split kernel there.
    weight_terms: int = 2
    # experiments only (the A/B baseline of the combine's shortcut): the combine runs every level of
    # its upper tree, where every deployment runs only those that can meet pages and one merge with
    # an empty node for the rest (`_Attn2CombineKernel.upper_tree`); the same bits either way (GPU test)
    full_tree: bool = False
    # experiments only: with splits, each kernel releases its dependents (griddepcontrol.
    # launch_dependents) right after its own griddepcontrol.wait instead of after its main work: the
    # combine's CTAs then launch while the split CTAs stream (and wait for the split grid's end at
    # their own wait), and the next launch's split CTAs while the combine merges. Where a dependent
    # reads nothing before its wait but what the grid before this one finished, the same bits.
    # Measured on the H200, not taken (records/2026-12-02-h200-79b2721-ab-combine-shortcut-early-
    # release.json, two rounds each): tp 8 at 128k 30.01 / 30.15 us against 28.42 / 28.81 (the early
    # combine CTAs share the SMs with the split CTAs' stream), L 8 5.21 / 5.12 against 5.31 / 5.60,
    # tp 16 within noise.
    early_release: bool = False
    # split plans: a split CTA whose splits have no page (`page_range`: L and the window say so,
    # CTA-uniform) ends right after its PDL wait and L's load, before its Q fragments, its table
    # entries and its barrier (None: the deployment's rule, on with splits; False: every CTA runs
    # the whole prologue and writes nothing, as before: the A/B baseline). It writes nothing either
    # way, so the bits are the same. Refused (True) on a one-split plan: its CTA always has pages.
    empty_ctas_exit: bool | None = None
    # split plans: the split CTA at grid index y runs partial bitrev(y) (its log2(partials) bits
    # reversed), so that the splits with pages at small L (the lowest partials) are far apart in the
    # order the GPU hands CTAs to SMs, which packs consecutive CTAs onto the same few SMs (trace: the
    # first 16 CTAs of a tp 8 launch on 4 SMs). A CTA's split, pages and partial slot are the same
    # whichever CTA runs them: the same bits. None: the deployment's rule (`attn2_layout.spread_splits`,
    # with the measurements behind it: on for split plans without a window); False: grid order, the
    # A/B baseline; True: spread in any split plan. Refused (True) on a one-split plan.
    spread_splits: bool | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.trace, bool), f"trace must be a bool, got {self.trace!r}")
        _require(self.spread_splits is None or isinstance(self.spread_splits, bool),
                 f"spread_splits must be a bool or None (the deployment's rule), got {self.spread_splits!r}")
        _require(self.empty_ctas_exit is None or isinstance(self.empty_ctas_exit, bool),
                 f"empty_ctas_exit must be a bool or None (the deployment's rule), got {self.empty_ctas_exit!r}")
        _require(isinstance(self.full_tree, bool), f"full_tree must be a bool, got {self.full_tree!r}")
        _require(isinstance(self.early_release, bool), f"early_release must be a bool, got {self.early_release!r}")
        _require(not self.early_release or self.enable_pdl,
                 "early_release moves griddepcontrol.launch_dependents: it needs enable_pdl (without PDL there is "
                 "nothing to release)")
        _require(type(self.weight_terms) is int and self.weight_terms in WEIGHT_TERMS_CHOICES,
                 f"weight_terms must be one of {WEIGHT_TERMS_CHOICES}, got {self.weight_terms!r}")
        _require(isinstance(self.loads_only, bool), f"loads_only must be a bool, got {self.loads_only!r}")
        _require(self.issue is None or isinstance(self.issue, SplitIssue),
                 f"issue must be a SplitIssue or None (the deployment's), got {self.issue!r}")
        if self.splits_per_cta is not None:
            lay.check_splits_per_cta(self.splits_per_cta)
        if self.pages_per_step is not None:
            lay.check_pages_per_step(self.pages_per_step)
        _require(self.ring_stages is None or (isinstance(self.ring_stages, int) and not isinstance(self.ring_stages, bool)
                                              and self.ring_stages in RING_STAGES_CHOICES),
                 f"ring_stages must be one of {RING_STAGES_CHOICES} or None, got {self.ring_stages!r}")
        _require(self.tensor_ops in (None, *TENSOR_OPS_CHOICES),
                 f"tensor_ops must be one of {TENSOR_OPS_CHOICES} or None, got {self.tensor_ops!r}")


# The split kernel's tensor-core path per target (`Attn2Build.tensor_ops` overrides it): on sm_90a
# a CTA of 128 threads is one warpgroup and a KV head's 64 rows are wgmma's M, so Q K^T and P V
# are warpgroup MMAs reading K and V from shared memory by descriptor (`kernels.gmma`: no fragment
# loads); elsewhere (sm_100a has no wgmma) mma.sync with ldmatrix fragments. Both give the same
# bits: each k16 step of wgmma equals mma.sync's on the H200 for every input family of
# tests/kernels/test_gmma_probe_gpu.py, and the chains and their order are the same.
TENSOR_OPS_CHOICES = ("wgmma", "sync")
TENSOR_OPS = {"sm_90a": "wgmma"}  # any other target: "sync"


def tensor_ops_for(target: str, requested: str | None) -> str:
    """The split kernel's tensor-core path on `target`: `requested`, or the target's default;
    ValueError for wgmma off sm_90a (the instruction exists only there)."""
    chosen = requested or TENSOR_OPS.get(target, "sync")
    _require(chosen == "sync" or target == "sm_90a",
             f"tensor_ops 'wgmma' needs sm_90a (wgmma is Hopper's), the target is {target}")
    return chosen


class _Attn2Kernel:
    """One attn2 variant: `num_kv_heads` KV heads per launch, `num_splits` splits run
    `splits_per_cta` to a CTA, `max_pages` page-table entries per request, `window` (0: none), and
    `SplitIssue`'s switches (same bits)."""

    def __init__(self, *, num_kv_heads: int, num_splits: int, max_pages: int, max_model_len: int, window: int,
                 eps: float, enable_pdl: bool, ctas_per_sm: int = lay.SPLIT_CTAS_PER_SM, mask_edges_only: bool = True,
                 skip_unit_rescale: bool = True, lean_addressing: bool = True, ldmatrix_keys: bool = True,
                 wgmma: bool = False, splits_per_cta: int = 1, pages_per_step: int = 1,
                 defer_values: bool = False, ring_stages: int = lay.PIPELINE_STAGES, trace: bool = False,
                 loads_only: bool = False, weight_terms: int = 2, prefetch_pages: bool = False,
                 early_release: bool = False, empty_ctas_exit: bool = False, spread_splits: bool = False) -> None:
        _require(num_kv_heads >= 1 and lay.is_power_of_two(num_splits), "bad attn2 configuration")
        # `Attn2Build.spread_splits`: grid index y runs partial bitrev(y) (split plans only)
        _require(isinstance(spread_splits, bool) and (not spread_splits or num_splits > 1),
                 f"spread_splits {spread_splits!r}: a bool, True only with splits (Attn2Build.spread_splits)")
        self.spread_splits = spread_splits
        # `Attn2Build.empty_ctas_exit`: a CTA without pages ends after L's load (split plans only)
        _require(isinstance(empty_ctas_exit, bool) and (not empty_ctas_exit or num_splits > 1),
                 f"empty_ctas_exit {empty_ctas_exit!r}: a bool, True only with splits (Attn2Build.empty_ctas_exit)")
        self.empty_ctas_exit = empty_ctas_exit
        _require(weight_terms in WEIGHT_TERMS_CHOICES and (weight_terms == 2 or wgmma),
                 f"weight_terms {weight_terms!r}: 2, or 1 with tensor_ops 'wgmma' (Attn2Build.weight_terms)")
        self.weight_terms = weight_terms
        self.prefetch_pages = prefetch_pages  # `SplitIssue.prefetch_pages`
        _require(isinstance(trace, bool), f"trace must be a bool, got {trace!r}")
        self.trace = trace
        self.loads_only = loads_only  # `Attn2Build.loads_only`: the page stream without the arithmetic
        lay.check_splits_per_cta(splits_per_cta, num_splits)
        lay.check_pages_per_step(pages_per_step)
        self.pages_per_step = pages_per_step
        # pages the ring holds ahead of the step's first page: STAGES - 1 with one page a step, one
        # stage less with two (a step's two pages occupy two stages while the rest load)
        self.lookahead = ring_stages - pages_per_step
        _require(not defer_values or (wgmma and pages_per_step == 2),
                 "SplitIssue.defer_values defers the two-page step's wgmma P V: it needs tensor_ops 'wgmma' and "
                 f"pages_per_step 2 (got {'wgmma' if wgmma else 'sync'}, pages_per_step {pages_per_step})")
        self.defer_values = defer_values
        # ring stages: with defer_values two more, so a step's copies skip the previous step's stages
        self.stages = ring_stages + (DEFER_EXTRA_STAGES if defer_values else 0)
        self.wgmma = wgmma
        self.mask_edges_only = mask_edges_only
        self.skip_unit_rescale = skip_unit_rescale
        self.lean_addressing = lean_addressing
        self.ldmatrix_keys = ldmatrix_keys
        self.num_kv_heads = num_kv_heads
        self.num_splits = num_splits
        self.splits_per_cta = splits_per_cta
        self.partials = num_splits // splits_per_cta  # workspace slots per (request, KV head)
        self.max_pages = max_pages
        self.max_model_len = max_model_len
        self.window = window
        self.eps = eps
        self.enable_pdl = enable_pdl
        # `Attn2Build.early_release`: dependents released right after this grid's own wait (split plans)
        _require(isinstance(early_release, bool) and (not early_release or (enable_pdl and num_splits > 1)),
                 f"early_release {early_release!r}: a bool, True only with PDL and splits (Attn2Build.early_release)")
        self.early_release = early_release
        self.table_entries = lay.split_table_entries(max_model_len, window, num_splits)  # per split
        self.ctas_per_sm = ctas_per_sm

    def ring_alignment(self) -> int:
        """The ring's byte alignment: wgmma's 128-byte swizzle is a function of the absolute shared
        address, so each stage (4 KB) starts on a 1024-byte swizzle atom (`kernels.gmma`)."""
        return gmma.ATOM_BYTES if self.wgmma else 128

    def smem_bytes(self) -> int:
        table = -(-self.splits_per_cta * self.table_entries * WORD_BYTES // VECTOR_BYTES) * VECTOR_BYTES
        ones = gmma.ONES_BYTES if self.wgmma else 0
        pending = lay.PENDING_BYTES if self.splits_per_cta > 1 else 0
        return self.ring_alignment() + self.stages * lay.PAGE_BYTES + ones + table + pending

    @cute.jit
    def __call__(self, q: cute.Tensor, gate: cute.Tensor, kv_cache: cute.Tensor, page_table: cute.Tensor,
                 seq_lens: cute.Tensor, out: cute.Tensor, workspace: cute.Tensor, q_row_words: Int32,
                 gate_row_words: Int32, num_reqs: Int32, stream: cuda.CUstream) -> None:
        self.kernel(q, gate, kv_cache, page_table, seq_lens, out, workspace, q_row_words, gate_row_words).launch(
            grid=[self.num_kv_heads, self.partials, num_reqs],
            block=[lay.CTA_THREADS, 1, 1],
            smem=self.smem_bytes(),
            stream=stream,
            use_pdl=self.enable_pdl,
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100,
        )

    @cute.jit
    def physical_page(self, table_smem: Int32, index: Int32, cache_pages: Int32):
        """(the split's page `index`'s table entry from shared memory, whether it names a page of the
        cache): both bounds, signed. A Uint32 cast of an Int32 keeps the compare signed (setp.s32),
        so -1 (or -2^31) would pass as inside and address memory before the cache."""
        physical = Int32(ptx.ld_shared_u32(table_smem + index * WORD_BYTES))
        return physical, (physical >= Int32(0)) & (physical < cache_pages)

    @cute.jit
    def page_address(self, cache_base: Int64, physical: Int32, kv_head: Int32) -> Int64:
        """The address of this KV head's 4 KB of cache page `physical` ([pages, kv, 16, 128])."""
        return cache_base + (Int64(physical) * self.num_kv_heads + Int64(kv_head)) * lay.PAGE_BYTES

    @cute.jit
    def page_prefetch(self, cache_base: Int64, table_smem: Int32, index: Int32, kv_head: Int32,
                      cache_pages: Int32) -> None:
        """`SplitIssue.prefetch_pages`: ask L2 for the split's page `index` (this KV head's 4 KB of
        it), by the calling thread alone; a table entry outside the cache asks for nothing."""
        physical, in_cache = self.physical_page(table_smem, index, cache_pages)
        if in_cache:
            ptx.cp_async_bulk_prefetch_l2_global(self.page_address(cache_base, physical, kv_head), lay.PAGE_BYTES)

    @cute.jit
    def page_load(self, smem_stage: Int32, cache_base: Int64, table_smem: Int32, index: Int32, page: Int32,
                  kv_head: Int32, seq_len: Int32, cache_pages: Int32, tidx: Int32) -> None:
        """cp.async of the split's page `index` (logical page `page`) into a ring stage: its
        physical page from the prefetched table (`physical_page`); slots at and past L, and a
        physical page outside the cache (a bad table entry: never read out of bounds), zero-filled."""
        physical, in_cache = self.physical_page(table_smem, index, cache_pages)
        page_base = self.page_address(cache_base, cutlass.select_(in_cache, physical, Int32(0)), kv_head)
        for half in cutlass.range_constexpr(2):
            chunk = tidx + half * lay.CTA_THREADS
            slot = chunk // CHUNKS_PER_SLOT
            column = chunk % CHUNKS_PER_SLOT
            live = (page * lay.PAGE_TOKENS + slot < seq_len) & in_cache
            source = page_base + Int64(chunk) * VECTOR_BYTES
            if cutlass.const_expr(self.wgmma):
                dest = smem_stage + gmma.page_offset(slot, column)  # K and V regions, 128-byte swizzle
            else:
                dest = smem_stage + slot * SLOT_BYTES + (column ^ (slot & SWIZZLE_MASK)) * VECTOR_BYTES
            if cutlass.const_expr(not self.lean_addressing):
                source = cutlass.select_(live, source, page_base)
            # zero fill: the source not read (either way an address inside the page at page_base)
            ptx.cp_async_cg_shared_global_16(dest, source, cutlass.select_(live, Int32(VECTOR_BYTES), Int32(0)))

    @cute.jit
    def slot_word(self, stage: Int32, slot, word) -> Uint32:
        chunk = word // 4
        return ptx.ld_shared_u32(stage + slot * SLOT_BYTES + ((chunk ^ (slot & SWIZZLE_MASK)) * VECTOR_BYTES)
                                 + (word % 4) * WORD_BYTES)

    @cute.jit
    def fragment_word(self, stage: Int32, stage_offset: Int32, lean, slot, word, index: tuple,
                      extra: cutlass.Constexpr) -> Uint32:
        """One word of a K fragment (without `ldmatrix_keys`) in the stage at `stage` (= ring base
        + `stage_offset`): through the swizzle (`slot_word`), or with lean_addressing from this
        thread's precomputed
        stage-0 address `lean[index]` plus `stage_offset` and `extra` (a constant: 8 slots further
        is + 2048, the same swizzle). Both read the same byte."""
        if cutlass.const_expr(lean is None):
            return self.slot_word(stage, slot, word)
        return ptx.ld_shared_u32(lean[index[0]][index[1]] + stage_offset + extra)

    @cute.jit
    def page_step(self, stage: Int32, stage_offset: Int32, k_words, v_words, descriptors, a: list, g: Int32,
                  c: Int32, page_key: Int32, own_key: Int32, low_key: Int32, inside, m: list, o: list):
        """One page of the online softmax (its stage at `stage`); returns the new (m, o), o the
        accumulators of O and, in n-tile 8, of l (`page_values`).

        Two halves, each a real branch (large enough that ptxas keeps the jump rather than
        predicating both sides): the scores and P, masked or not (`inside`: every key visible to
        every row, a CTA-uniform test; `mask_edges_only`), then P V into O with or without the
        rescale (`skip_unit_rescale`: the warp's vote that every alpha is 1.0)."""
        m, ah, al, alpha = self.step_softmax([stage], [stage_offset], k_words, descriptors, a, g, c, [page_key],
                                             own_key, low_key, inside, m)
        return m, self.page_accumulate(stage, stage_offset, v_words, descriptors, g, c, ah, al, alpha, o)

    @cute.jit
    def step_softmax(self, stages: list, offsets: list, k_words, descriptors, a: list, g: Int32, c: Int32,
                     keys: list, own_key: Int32, low_key: Int32, inside, m: list, saccs=None):
        """The first half of a step (`page_step`: one page, `pair_at`: two): (m, P hi, P lo,
        alpha) of its pages (stages `stages`, first keys `keys`) through the masked or the
        unmasked copy of `step_scores` (`mask_edges_only`; `inside`: every key of the step visible
        to every row, a CTA-uniform test). `saccs`: the step's scores already computed and waited
        for (`defer_values`), else each copy computes them."""
        if cutlass.const_expr(self.mask_edges_only):
            # the branch's results, defined before it (the DSL's rule; both sides overwrite them)
            ah = [Uint32(0) for _ in range(4 * len(stages))]
            al = [Uint32(0) for _ in range(4 * len(stages))]
            alpha = [Float32(0.0), Float32(0.0)]
            if inside:
                m, ah, al, alpha = self.step_scores(stages, offsets, k_words, descriptors, a, g, c, keys, own_key,
                                                    low_key, m, False, saccs)
            else:
                m, ah, al, alpha = self.step_scores(stages, offsets, k_words, descriptors, a, g, c, keys, own_key,
                                                    low_key, m, True, saccs)
        else:
            m, ah, al, alpha = self.step_scores(stages, offsets, k_words, descriptors, a, g, c, keys, own_key, low_key,
                                                m, True, saccs)
        return m, ah, al, alpha

    @cute.jit
    def page_accumulate(self, stage: Int32, stage_offset: Int32, v_words, descriptors, g: Int32, c: Int32, ah: list,
                        al: list, alpha: list, o: list):
        """The second half of `page_step`: O and l times alpha (or not, `skip_unit_rescale`), then
        the page's P V into them (`page_values`)."""
        o = self.step_rescale(alpha, o)
        return self.page_values(stage, stage_offset, v_words, descriptors, g, c, ah, al, o)

    @cute.jit
    def step_rescale(self, alpha: list, o: list) -> list:
        """O and l times alpha, once a step (or not, `skip_unit_rescale`)."""
        if cutlass.const_expr(self.skip_unit_rescale):
            # Every alpha of the warp exactly 1.0 (no row's max moved): x * 1.0 == x bit for bit for
            # every non-NaN x (-0.0 included: -0.0 * 1.0 is -0.0; subnormals: mul.rn.f32 keeps them;
            # inf); a NaN accumulator stays NaN through the tensor cores' step either way: skipping
            # the 36 multiplies leaves every bit as it is.
            unit = ptx.vote_sync_all_pred((alpha[0] == Float32(1.0)) & (alpha[1] == Float32(1.0)))
            o = self.rescale(o, alpha, unit)
        else:
            o = [ptx.mul_rn_f32(o[k], alpha[(k % 4) // 2]) for k in range(ACCUMULATORS)]
        return o

    @cute.jit
    def step_scores(self, stages: list, offsets: list, k_words, descriptors, a: list, g: Int32, c: Int32, keys: list,
                    own_key: Int32, low_key: Int32, m: list, masked: cutlass.Constexpr, saccs=None):
        """S = Q K^T of the step's pages (one or two; wgmma with two: both chains issued, then one
        wait), masked when `masked` (otherwise the caller found every key visible to every row:
        each select would pick its score unchanged), and the step's weights (`step_weights`):
        (m, P hi, P lo (4 words a page, pages in order), alpha per row). `saccs`: the pages' scores
        computed by the caller (`defer_values`)."""
        if cutlass.const_expr(saccs is None):
            saccs = [None for _ in stages]
            if cutlass.const_expr(self.wgmma and len(stages) == 2):
                saccs, _ = self.pair_scores_chains(offsets, descriptors, a)
        scores = [self.score_page(stages[k], offsets[k], k_words, descriptors, a, g, c, keys[k], own_key, low_key,
                                  masked, saccs[k]) for k in range(len(stages))]
        return self.step_weights(scores, m)

    @cute.jit
    def score_page(self, stage: Int32, stage_offset: Int32, k_words, descriptors, a: list, g: Int32, c: Int32,
                   page_key: Int32, own_key: Int32, low_key: Int32, masked: cutlass.Constexpr, sacc=None) -> list:
        """A page's 8 scores of this thread, s[4 nt + j] (keys page_key + 8 nt + 2c + (j % 2), rows g
        for j < 2, g + 8), unscaled, -inf where masked (`masked`): wgmma's chain (`sacc`, or the
        page's own `page_scores_chain`) or mma.sync's two n-tiles of four k16 steps from zero."""
        s = []
        if cutlass.const_expr(self.wgmma):
            # four k16 steps from zero (scale-d 0), K-major K from the stage's K region: step kk
            # starts 32 kk bytes in (`kernels.gmma`); d[4 nt + j] is mma.sync's s[4 nt + j]
            if cutlass.const_expr(sacc is None):
                sacc = self.page_scores_chain(stage_offset, descriptors, a)
            for j in cutlass.range_constexpr(8):
                if cutlass.const_expr(masked):
                    key = page_key + (j // 4) * 8 + 2 * c + (j % 2)
                    visible = (key <= own_key) & (key >= low_key)
                    s.append(cutlass.select_(visible, sacc[j], Float32(NEG_INF)))
                else:
                    s.append(sacc[j])
        for nt in cutlass.range_constexpr(0 if self.wgmma else 2):
            # kb[2h], kb[2h + 1]: b0, b1 of k-step 2 quad + h for keys 8 nt .. 8 nt + 7 (`k_fragment_row`)
            sacc = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
            for kk in cutlass.range_constexpr(K_TILES):
                h = kk % 2
                if cutlass.const_expr(not self.ldmatrix_keys):
                    kb = [self.fragment_word(stage, stage_offset, k_words, nt * 8 + g, kk * 8 + 4 * half + c, (kk, half),
                                             nt * 8 * SLOT_BYTES) for half in range(2)]
                    h = 0
                elif cutlass.const_expr(h == 0):
                    quad = kk // 2
                    if cutlass.const_expr(k_words is None):
                        kb = ptx.ldmatrix_sync_aligned_m8n8_x4_shared_b16(stage + k_fragment_row(4 * g + c, nt, quad))
                    else:
                        kb = ptx.ldmatrix_sync_aligned_m8n8_x4_shared_b16(k_words[quad] + stage_offset
                                                                          + nt * 8 * SLOT_BYTES)
                sacc = list(ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                    a[kk][0], a[kk][1], a[kk][2], a[kk][3], kb[2 * h], kb[2 * h + 1], sacc[0], sacc[1], sacc[2],
                    sacc[3]))
            for j in cutlass.range_constexpr(4):
                scaled = sacc[j]  # unscaled: the exponent scales the difference from the max
                if cutlass.const_expr(masked):
                    key = page_key + nt * 8 + 2 * c + (j % 2)
                    visible = (key <= own_key) & (key >= low_key)
                    s.append(cutlass.select_(visible, scaled, Float32(NEG_INF)))
                else:
                    s.append(scaled)
        return s

    @cute.jit
    def step_weights(self, scores: list, m: list):
        """The online softmax of one step over its pages' scores (`scores`: one `score_page` list a
        page, one or two): each row's max over the step's keys (a page's four of the thread, then
        the pages', then the quad's by two shuffles) and m, one alpha, and P of every key as two
        BF16 terms. Returns (m, P hi A fragments, P lo A fragments, alpha per row), the fragments
        4 words a page, pages in order."""
        scale_log2 = Float32(SCALE_LOG2)
        m = list(m)
        alpha = []
        p_hi = []
        p_lo = []
        for half in cutlass.range_constexpr(2):  # row g (elements 0, 1), row g + 8 (2, 3)
            es = [[s[2 * half], s[2 * half + 1], s[4 + 2 * half], s[4 + 2 * half + 1]] for s in scores]
            top = None
            for e in es:
                page_top = ptx.max_f32(ptx.max_f32(e[0], e[1]), ptx.max_f32(e[2], e[3]))
                top = page_top if top is None else ptx.max_f32(top, page_top)
            top = ptx.max_f32(top, cute.arch.shuffle_sync_bfly(top, offset=1))
            top = ptx.max_f32(top, cute.arch.shuffle_sync_bfly(top, offset=2))
            m_new = ptx.max_f32(m[half], top)
            m_use = cutlass.select_(m_new == Float32(NEG_INF), Float32(0.0), m_new)
            # ftz: one MUFU each; a weight below 2^-126 is 0 (`cpu.attn2.weight`: nothing an FP32 O / l
            # with l >= 1 could show)
            alpha.append(ptx.ex2_approx_ftz_f32(scaled_difference(m[half], m_use, scale_log2)))
            m[half] = m_new
            hi = []
            lo = []
            for e in es:
                for k in cutlass.range_constexpr(2):  # keys (2c, 2c + 1), then (8 + 2c, 9 + 2c)
                    px0 = ptx.ex2_approx_ftz_f32(scaled_difference(e[2 * k], m_use, scale_log2))
                    px1 = ptx.ex2_approx_ftz_f32(scaled_difference(e[2 * k + 1], m_use, scale_log2))
                    pword = ptx.cvt_rn_bf16x2_f32(px1, px0)
                    h0 = ptx.bitcast_u32_to_f32(pword << 16)
                    h1 = ptx.bitcast_u32_to_f32(pword & Uint32(0xFFFF0000))
                    hi.append(pword)
                    if cutlass.const_expr(self.weight_terms == 2):
                        lo.append(ptx.cvt_rn_bf16x2_f32(ptx.sub_rn_f32(px1, h1), ptx.sub_rn_f32(px0, h0)))
                    else:  # `Attn2Build.weight_terms` 1: P V takes p_hi alone (these words are never read)
                        lo.append(Uint32(0))
            p_hi.append(hi)
            p_lo.append(lo)
        # A fragments of P, per page: a0 row g keys 2c.., a1 row g + 8 keys 2c.., a2 row g keys 8 + 2c..,
        # a3 row g + 8.
        ah = []
        al = []
        for k in cutlass.range_constexpr(len(scores)):
            ah += [p_hi[0][2 * k], p_hi[1][2 * k], p_hi[0][2 * k + 1], p_hi[1][2 * k + 1]]
            al += [p_lo[0][2 * k], p_lo[1][2 * k], p_lo[0][2 * k + 1], p_lo[1][2 * k + 1]]
        return m, ah, al, alpha

    @cute.jit
    def page_scores_chain(self, stage_offset: Int32, descriptors, a: list) -> list:
        """wgmma: the page's S = Q K^T, four k16 steps from zero (scale-d 0), K-major K from the
        stage's K region: step kk starts 32 kk bytes in (`kernels.gmma`); d[4 nt + j] is
        mma.sync's s[4 nt + j]."""
        step = Int64(stage_offset >> 4)  # the stage's start, in the address field's 16-byte units
        return wgmma_chain(lay.PAGE_TOKENS, a, [gmma.advance_keys_descriptor(descriptors[0], step, kk)
                                                for kk in range(K_TILES)], 0)

    @cute.jit
    def rescale(self, o: list, alpha: list, unit):
        """The accumulators (O and l) times alpha, or as they are where `unit` (every alpha of the
        warp is 1.0: the same bits). The multiplies are pinned in the branch (`pinned`): LLVM would
        otherwise hoist them above it and select, and ptxas then issues all 36 predicated."""
        if not unit:
            o = [ptx.mul_rn_f32(o[k], alpha[(k % 4) // 2], pinned=True) for k in range(ACCUMULATORS)]
        return o

    @cute.jit
    def page_values(self, stage: Int32, stage_offset: Int32, v_words, descriptors, g: Int32, c: Int32,
                    ah: list, al: list, o: list) -> list:
        """The tensor cores add this page's P V into the accumulators (O, then n-tile 8: l, over an
        n-tile of ones beside V), p_lo's step then p_hi's (`cpu.attn2.accumulate_page`); `o` is
        already rescaled. Returns the ACCUMULATORS new values."""
        if cutlass.const_expr(self.wgmma):
            # N = 72: V's 64 dims (N-major, transpose-b) and 8 columns of the ones block, which the
            # descriptor reaches as V's second 64-column block (LBO: `gmma.MN_MAJOR_VALUES_WITH_ONES`)
            descriptor = gmma.advance_values_descriptor(descriptors[1], Int64(stage_offset >> 4))
            if cutlass.const_expr(self.weight_terms == 1):
                return wgmma_chain(ACCUMULATOR_COLUMNS, [ah], [descriptor], 1, o)
            return wgmma_chain(ACCUMULATOR_COLUMNS, [al, ah], [descriptor, descriptor], 1, o)
        o = list(o)
        ones = Uint32(gmma.BF16_ONES_WORD)
        for pair in cutlass.range_constexpr(V_TILE_PAIRS + 1):
            # (b0, b1) of n-tile 2 pair, then of 2 pair + 1 (`v_fragment_row`); the ones' n-tile last
            if cutlass.const_expr(pair == V_TILE_PAIRS):
                vb = [ones, ones]
            elif cutlass.const_expr(v_words is None):
                vb = ptx.ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(stage + v_fragment_row(4 * g + c, pair))
            else:
                vb = ptx.ldmatrix_sync_aligned_m8n8_x4_trans_shared_b16(v_words[pair] + stage_offset)
            for h in cutlass.range_constexpr(1 if pair == V_TILE_PAIRS else 2):
                t = 2 * pair + h
                acc = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                    al[0], al[1], al[2], al[3], vb[2 * h], vb[2 * h + 1], o[4 * t], o[4 * t + 1], o[4 * t + 2],
                    o[4 * t + 3])
                acc = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                    ah[0], ah[1], ah[2], ah[3], vb[2 * h], vb[2 * h + 1], *acc)
                for j in cutlass.range_constexpr(4):
                    o[4 * t + j] = acc[j]
        return o

    @cute.jit
    def page_at(self, i: Int32, ring_base: Int32, start: Int32, seq_len: Int32, k_words, v_words, descriptors,
                a: list, g: Int32, c: Int32, own_key: Int32, low_key: Int32, m: list, o: list):
        """The split's page i (its stage i % STAGES of the ring, its keys from (start + i S) 16)
        through `page_step`, masked or not (`page_inside`); returns (m, o)."""
        stage_offset = (i % self.stages) * lay.PAGE_BYTES
        page_key = (start + i * self.num_splits) * lay.PAGE_TOKENS
        inside = None
        if cutlass.const_expr(self.mask_edges_only):
            inside = self.page_inside(page_key, seq_len)
        return self.page_step(ring_base + stage_offset, stage_offset, k_words, v_words, descriptors, a, g, c,
                              page_key, own_key, low_key, inside, m, o)

    @cute.jit
    def pair_at(self, i: Int32, ring_base: Int32, start: Int32, seq_len: Int32, k_words, v_words, descriptors,
                a: list, g: Int32, c: Int32, own_key: Int32, low_key: Int32, m: list, o: list):
        """One step of two pages (`pages_per_step` 2): the split's pages i and i + 1 (stages
        i % STAGES and (i + 1) % STAGES, keys from (start + i S) 16 and S 16 further), S of each
        page its own chain from zero, the mask per page (the unmasked copy when every row sees
        both pages whole), one max over the 32 keys and m, one alpha, O and l rescaled once, then
        P V: page i's p_lo step, its p_hi step, page i + 1's p_lo, its p_hi. Returns (m, o)."""
        offsets = [(i % self.stages) * lay.PAGE_BYTES, ((i + 1) % self.stages) * lay.PAGE_BYTES]
        keys = [(start + i * self.num_splits) * lay.PAGE_TOKENS]
        keys.append(keys[0] + self.num_splits * lay.PAGE_TOKENS)
        stages = [ring_base + offset for offset in offsets]
        inside = None
        if cutlass.const_expr(self.mask_edges_only):
            inside = self.page_inside(keys[0], seq_len) & self.page_inside(keys[1], seq_len)
        saccs = None
        if cutlass.const_expr(self.defer_values):
            # Q K^T of both pages and its one wait, which also completes the previous step's P V:
            # o comes out of it (before the mask branch, so both copies take the same scores)
            saccs, o = self.pair_scores_chains(offsets, descriptors, a, o)
        m, ah, al, alpha = self.step_softmax(stages, offsets, k_words, descriptors, a, g, c, keys, own_key, low_key,
                                             inside, m, saccs)
        o = self.step_rescale(alpha, o)
        if cutlass.const_expr(self.wgmma):
            values = [gmma.advance_values_descriptor(descriptors[1], Int64(offset >> 4)) for offset in offsets]
            # defer_values: committed, not waited for (the next step's Q K^T wait, or pair_chain's end)
            if cutlass.const_expr(self.weight_terms == 2):
                o = wgmma_chain(ACCUMULATOR_COLUMNS, [al[0:4], ah[0:4], al[4:8], ah[4:8]],
                                [values[0], values[0], values[1], values[1]], 1, o, wait=not self.defer_values)
            else:
                o = wgmma_chain(ACCUMULATOR_COLUMNS, [ah[0:4], ah[4:8]], [values[0], values[1]], 1, o,
                                wait=not self.defer_values)
        else:
            for k in cutlass.range_constexpr(2):
                o = self.page_values(stages[k], offsets[k], v_words, descriptors, g, c, ah[4 * k:4 * k + 4],
                                     al[4 * k:4 * k + 4], o)
        return m, o

    @cute.jit
    def pair_scores_chains(self, offsets: list, descriptors, a: list, pending: list = ()):
        """wgmma: S = Q K^T of two pages, each four k16 steps from zero (as `page_scores_chain`),
        behind one fence, committed as one group and waited for once. Returns ([page i's 8
        accumulators, page i + 1's], `pending` after the wait): `pending` (defer_values: the
        accumulators of the previous step's P V, committed earlier, not waited for; empty
        otherwise) pass through the same wait (wait_group 0 completes every earlier group)."""
        fenced = ptx.wgmma_fence_sync_aligned([w for fragment in a for w in fragment])
        accumulators = []
        for offset in offsets:
            step = Int64(offset >> 4)
            acc = None
            for kk in cutlass.range_constexpr(K_TILES):
                descriptor = gmma.advance_keys_descriptor(descriptors[0], step, kk)
                fragment = fenced[4 * kk:4 * kk + 4]
                if cutlass.const_expr(acc is None):
                    acc = ptx.wgmma_mma_async_sync_aligned_m64n16k16_f32_bf16_bf16(fragment, descriptor, None, 0, 0)
                else:
                    acc = ptx.wgmma_mma_async_sync_aligned_m64n16k16_f32_bf16_bf16(fragment, descriptor, acc, 1, 0)
            accumulators += list(acc)
        ptx.wgmma_commit_group_sync_aligned()
        done = ptx.wgmma_wait_group_sync_aligned(0, accumulators + list(pending))
        half = len(accumulators) // 2
        return [done[:half], done[half:2 * half]], done[2 * half:]

    @cute.jit
    def pair_chain(self, begin: Int32, steps: Int32, chain_start: Int32, ring_base: Int32, cache_base: Int64,
                   table_smem: Int32, total: Int32, k_words, v_words, descriptors, a: list, g: Int32, c: Int32,
                   kv_head: Int32, seq_len: Int32, cache_pages: Int32, tidx: Int32, own_key: Int32, low_key: Int32,
                   m: list, o: list, streams=None):
        """`steps` steps of two pages from the CTA's page `begin` (pages begin + 2j, begin + 2j + 1;
        the split's logical page of CTA page i is chain_start + i S), from (m, o); returns (m, o).

        One barrier a step. Before a step at page i, 6 + i copy groups are committed (one per page,
        `lookahead` 6: `ring_prologue` and `split_chain` keep the count); waiting until at most 4
        are pending completes pages i and i + 1. The barrier makes every thread's copies of both
        visible and, as every warp reaches it only after its previous step, frees the stages of
        pages i - 2 and i - 1: pages i + 6 and i + 7 go there after it, a commit group each. The
        count runs on across the splits of a CTA. `streams`: as `split_chain`'s (None: the copies
        are this chain's split's pages, table entry = CTA page)."""
        for j in cutlass.range(0, steps, unroll=1):
            i = begin + 2 * j
            self.ring_advance(i, 2, None, chain_start, ring_base, cache_base, table_smem, total, kv_head, seq_len,
                              cache_pages, tidx, streams)
            if cutlass.const_expr(not self.loads_only):
                m, o = self.pair_at(i, ring_base, chain_start, seq_len, k_words, v_words, descriptors, a, g, c,
                                    own_key, low_key, m, o)
        if cutlass.const_expr(self.defer_values):
            o = ptx.wgmma_wait_group_sync_aligned(0, o)  # the last step's P V (a no-op after none)
        return m, o

    @cute.jit
    def page_inside(self, page_key: Int32, seq_len: Int32):
        """`mask_edges_only`'s CTA-uniform test: every key of the page (keys page_key ..
        page_key + 15) visible to every row of the CTA: token 0's causal limit (the smallest own
        key) and token 7's window start (the largest low key)."""
        inside = page_key + (lay.PAGE_TOKENS - 1) <= seq_len - lay.QUERY_LEN
        if cutlass.const_expr(self.window > 0):
            inside = inside & (page_key >= seq_len - self.window)
        return inside

    @cute.jit
    def load_q_fragments(self, q: cute.Tensor, kv_head: Int32, warp: Int32, req: Int32, g: Int32, c: Int32,
                         q_row_words: Int32) -> list:
        """KV head `kv_head`'s Q A fragments of this thread (16 words): row g of the tile is (token
        g, head 2 warp), row g + 8 (token g, head 2 warp + 1)."""
        head0 = kv_head * lay.HEADS_PER_KV_HEAD + 2 * warp
        row = req * lay.QUERY_LEN + g
        q_base = Int64(q.iterator.toint()) + Int64(row) * Int64(q_row_words) * WORD_BYTES
        a = []
        for kk in cutlass.range_constexpr(K_TILES):
            w_lo = kk * 8 + c
            w_hi = kk * 8 + 4 + c
            r0 = q_base + Int64(head0 * (lay.HEAD_DIM // 2) + w_lo) * WORD_BYTES
            r1 = q_base + Int64((head0 + 1) * (lay.HEAD_DIM // 2) + w_lo) * WORD_BYTES
            r2 = q_base + Int64(head0 * (lay.HEAD_DIM // 2) + w_hi) * WORD_BYTES
            r3 = q_base + Int64((head0 + 1) * (lay.HEAD_DIM // 2) + w_hi) * WORD_BYTES
            a.append([ptx.ld_global_u32(r0), ptx.ld_global_u32(r1), ptx.ld_global_u32(r2), ptx.ld_global_u32(r3)])
        return a

    @cute.jit
    def prefetch_table(self, page_table: cute.Tensor, table_smem: Int32, req: Int32, start: Int32,
                       tidx: Int32) -> None:
        """A split's page-table entries (its page i is start + i S), all at once into shared memory
        from `table_smem`: no table read on the pipeline's critical path."""
        table_base = Int64(page_table.iterator.toint()) + Int64(req) * (self.max_pages * WORD_BYTES)
        for r in cutlass.range_constexpr((self.table_entries + lay.CTA_THREADS - 1) // lay.CTA_THREADS):
            index = tidx + r * lay.CTA_THREADS
            page = start + index * self.num_splits
            wanted = (index < self.table_entries) & (page < self.max_pages)
            entry = ptx.ld_global_u32(table_base + Int64(cutlass.select_(wanted, page, Int32(0))) * WORD_BYTES)
            if index < self.table_entries:
                ptx.st_shared_u32(table_smem + index * WORD_BYTES, entry)

    @cute.jit
    def stream_page(self, n: Int32, starts: list, counts: list):
        """(table index, logical page) of the CTA's n-th page: its splits' pages one split after the
        other (split j's page i is starts[j] + i S; its table entries from j x table_entries)."""
        if cutlass.const_expr(self.splits_per_cta == 1):
            return n, starts[0] + n * self.num_splits
        second = n >= counts[0]
        local = n - cutlass.select_(second, counts[0], Int32(0))
        index = local + cutlass.select_(second, Int32(self.table_entries), Int32(0))
        return index, cutlass.select_(second, starts[1], starts[0]) + local * self.num_splits

    @cute.jit
    def ring_prologue(self, ring_base: Int32, cache_base: Int64, table_smem: Int32, starts: list, counts: list,
                      total: Int32, kv_head: Int32, seq_len: Int32, cache_pages: Int32, tidx: Int32) -> None:
        """The ring's first copies (every stage free): the CTA's pages 0 .. lookahead - 1 (STAGES - 2
        with one page a step, STAGES - 3 with two), a commit group each."""
        for st in cutlass.range_constexpr(self.lookahead):
            if st < total:
                index, page = self.stream_page(Int32(st), starts, counts)
                self.page_load(ring_base + st * lay.PAGE_BYTES, cache_base, table_smem, index, page, kv_head, seq_len,
                               cache_pages, tidx)
            cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.prefetch_pages):
            # the pages the first steps' prefetches skip: lookahead .. lookahead + L2_PREFETCH_PAGES - 1,
            # one a thread
            far = Int32(self.lookahead) + tidx
            if (tidx < L2_PREFETCH_PAGES) & (far < total):
                index, _ = self.stream_page(far, starts, counts)
                self.page_prefetch(cache_base, table_smem, index, kv_head, cache_pages)

    @cute.jit
    def ring_advance(self, i: Int32, pages: cutlass.Constexpr, load_offset, load_start: Int32, ring_base: Int32,
                     cache_base: Int64, table_smem: Int32, total: Int32, kv_head: Int32, seq_len: Int32,
                     cache_pages: Int32, tidx: Int32, streams) -> None:
        """The ring's step before the CTA's pages i .. i + pages - 1 compute (`split_chain`: one,
        `pair_chain`: two): wait until at most lookahead - pages copy groups are pending (those
        pages' copies are complete), make every thread's copies visible to the CTA (and, wgmma, to
        the async proxy) by one barrier, then copy the CTA's pages i + lookahead .. (below
        `total`) into the stages the barrier freed, a commit group each (an empty one past
        `total`, so the count stays one group a page). A copy's table entry and logical page:
        `stream_page`'s with `streams`, else entry ahead (+ `load_offset` unless None) and page
        `load_start` + ahead S."""
        cute.arch.cp_async_wait_group(self.lookahead - pages)
        if cutlass.const_expr(self.wgmma):
            ptx.fence_proxy_async_shared_cta()  # this thread's copies, visible to wgmma's reads
        cute.arch.barrier()
        for k in cutlass.range_constexpr(pages):
            ahead = i + self.lookahead + k
            if ahead < total:
                if cutlass.const_expr(streams is None):
                    index = ahead if cutlass.const_expr(load_offset is None) else ahead + load_offset
                    page = load_start + ahead * self.num_splits
                else:
                    index, page = self.stream_page(ahead, streams[0], streams[1])
                self.page_load(ring_base + (ahead % self.stages) * lay.PAGE_BYTES, cache_base, table_smem,
                               index, page, kv_head, seq_len, cache_pages, tidx)
            cute.arch.cp_async_commit_group()
        if cutlass.const_expr(self.prefetch_pages):
            # the pages L2_PREFETCH_PAGES beyond this step's copies, thread k the step's k-th (a table
            # index past a split's range asks for a page the CTA may not read: a harmless hint)
            far = i + self.lookahead + L2_PREFETCH_PAGES + tidx
            if (tidx < pages) & (far < total):
                if cutlass.const_expr(streams is None):
                    index = far if cutlass.const_expr(load_offset is None) else far + load_offset
                else:
                    index, _ = self.stream_page(far, streams[0], streams[1])
                self.page_prefetch(cache_base, table_smem, index, kv_head, cache_pages)

    @cute.jit
    def split_chain(self, begin: Int32, end: Int32, chain_start: Int32, load_offset, load_start: Int32,
                    ring_base: Int32, cache_base: Int64, table_smem: Int32, total: Int32, k_words, v_words,
                    descriptors, a: list, g: Int32, c: Int32, kv_head: Int32, seq_len: Int32, cache_pages: Int32,
                    tidx: Int32, own_key: Int32, low_key: Int32, m: list, o: list, streams=None):
        """The CTA's pages begin .. end - 1 of one split (the CTA's page i is the split's logical page
        chain_start + i S) through the ring, from (m, o); returns (m, o). The ring runs on across
        splits: page i copies the CTA's page i + STAGES - 1 (below `total`), the table entry
        i + STAGES - 1 + load_offset (None: + 0) of logical page load_start + (i + STAGES - 1) S, so a
        range whose copies all belong to one split costs what one split a CTA costs; the caller
        cuts the ranges where the copies change split (`kernel`).

        One barrier a page. Before page i, 7 + i copy groups are committed (one per page); waiting
        until at most PIPELINE_STAGES - 2 are pending completes page i's. (With two pages a step
        the ring holds one page less ahead, `lookahead`: 6 + i committed, 5 pending at most, page
        i + 6 copied; `pair_chain` keeps the same count.) The barrier then makes
        every thread's copies of page i visible to the CTA, and, as every warp reaches it only
        after its page i - 1 (its tensor-core reads waited for), frees stage (i - 1) % STAGES:
        page i + 7's copies go there after it, 7 pages in flight while page i computes.
        `streams` (the CTA's (starts, counts), or None): each copy's table entry and logical page
        from `stream_page` instead of load_offset and load_start."""
        for i in cutlass.range(begin, end, unroll=1):
            self.ring_advance(i, 1, load_offset, load_start, ring_base, cache_base, table_smem, total, kv_head,
                              seq_len, cache_pages, tidx, streams)
            if cutlass.const_expr(not self.loads_only):
                m, o = self.page_at(i, ring_base, chain_start, seq_len, k_words, v_words, descriptors, a, g, c,
                                    own_key, low_key, m, o)
        return m, o

    @cute.jit
    def step_chain(self, begin, count: Int32, chain_start: Int32, split_start: Int32, streams, chain: tuple,
                   m: list, o: list):
        """One split's `count` pages in steps of two (`pages_per_step` 2), from the CTA's page
        `begin` (None: 0; its logical page of CTA page i is chain_start + i S), from (m, o); returns
        (m, o). The steps are `attn2_layout.split_steps`': pairs by place in the split's whole
        list (its first page `split_start` is its (split_start // S)-th), so a step's pages do not
        depend on L, the window, or the split's place in the CTA: a first page at an odd place
        runs alone (`split_chain`), then the pairs (`pair_chain`), an odd last page alone. The
        same steps in the same order as a CTA running this split alone. `streams`: None (the CTA's
        pages are this split's), or the CTA's (starts, counts) (`stream_page`: two splits a CTA)."""
        lead = cutlass.min((split_start // self.num_splits) % 2, count)
        pairs = (count - lead) // 2
        if cutlass.const_expr(begin is None):
            begin = Int32(0)
        m, o = self.split_chain(begin, begin + lead, chain_start, None, chain_start, *chain, m, o, streams=streams)
        m, o = self.pair_chain(begin + lead, pairs, chain_start, *chain, m, o, streams=streams)
        return self.split_chain(begin + lead + 2 * pairs, begin + count, chain_start, None, chain_start, *chain, m, o,
                                streams=streams)

    @cute.jit
    def hold_pending(self, pending_base: Int32, tidx: Int32, m: list, o: list) -> None:
        """The first split's state, this thread's: its 32 values of O, m and l of its two rows,
        into shared memory ([value][thread]); only this thread reads them back."""
        values = self.row_nodes(m, o)
        flat = values[0] + values[1]
        for k in cutlass.range_constexpr(lay.PENDING_VALUES):
            ptx.st_shared_u32(pending_base + (k * lay.CTA_THREADS + tidx) * WORD_BYTES, ptx.bitcast_f32_to_u32(flat[k]))

    @cute.jit
    def merge_pending(self, pending_base: Int32, tidx: Int32, m: list, o: list):
        """The CTA's level-1 node: the pending first split (left) merged with the second (right),
        row by row, by `merge_into`, the combine's merge (so the node's bits are those the combine
        makes of the two leaves); returns it as (m, o) (o's l columns: the row's merged l)."""
        right = self.row_nodes(m, o)
        width = lay.LANE_DIMS + 2
        flat = [ptx.bitcast_u32_to_f32(ptx.ld_shared_u32(pending_base + (k * lay.CTA_THREADS + tidx) * WORD_BYTES))
                for k in range(lay.PENDING_VALUES)]
        merged_m = []
        merged_o = list(o)
        for half in cutlass.range_constexpr(2):
            left = flat[half * width:(half + 1) * width]
            merge_into(left, right[half])
            for t in cutlass.range_constexpr(V_TILES):
                for k in cutlass.range_constexpr(2):
                    merged_o[4 * t + 2 * half + k] = left[2 * t + k]
            merged_m.append(left[lay.LANE_DIMS])
            for k in cutlass.range_constexpr(2):
                merged_o[4 * V_TILES + 2 * half + k] = left[lay.LANE_DIMS + 1]
        return merged_m, merged_o

    def row_nodes(self, m: list, o: list) -> list:
        """[16 values of O, m, l] of this thread's rows g and g + 8 (the merge's node form; O in
        n-tile order 8t + 2c, 8t + 2c + 1, as `attn2_layout.lane_dims(c)`)."""
        return [[o[4 * t + 2 * half + k] for t in range(V_TILES) for k in range(2)]
                + [m[half], o[4 * V_TILES + 2 * half]] for half in range(2)]

    @cute.jit
    def head_result(self, gate: cute.Tensor, out: cute.Tensor, workspace: cute.Tensor, gate_row_words: Int32,
                    kv_head: Int32, partial: Int32, req: Int32, warp: Int32, g: Int32, c: Int32, tidx: Int32,
                    pages: Int32, m: list, o: list) -> None:
        """KV head `kv_head`'s result of the CTA: with one split the epilogue (out), otherwise, if
        its splits have pages, the partial (O, m, l) into workspace slot `partial`."""
        lsum = [o[4 * V_TILES], o[4 * V_TILES + 2]]  # l of rows g and g + 8: the ones' n-tile

        # The partial's vectors (`attn2_layout.partial_vector_dims`): vec[2 p + half] = row g (half
        # 0) or g + 8, n-tiles 2p and 2p + 1, each the pair 8t + 2c, 8t + 2c + 1 (o[4 t + 2 half + k]).
        vec = []
        for pp in cutlass.range_constexpr(V_TILE_PAIRS):
            for half in cutlass.range_constexpr(2):
                vec.append([o[4 * t + 2 * half + k] for t in (2 * pp, 2 * pp + 1) for k in range(2)])
        if cutlass.const_expr(self.num_splits == 1):
            for half in cutlass.range_constexpr(2):
                row = req * lay.QUERY_LEN + g
                # the row's 16 values in the lane's order (`attn2_layout.lane_dims(c)`)
                values = [vec[2 * pp + half][j] for pp in range(V_TILE_PAIRS) for j in range(4)]
                head = kv_head * lay.HEADS_PER_KV_HEAD + 2 * warp + half
                sigmoids = gate_sigmoids(load_gate_words(gate, row, head, c, gate_row_words))
                row_epilogue(values, lsum[half], sigmoids, out, row, head,
                             c, self.num_kv_heads, self.eps, Int32(1))
        else:
            if pages > 0:  # a CTA without pages writes nothing: the combine never reads its slot
                slot = partial_slot(workspace, req, kv_head, partial, self.num_kv_heads, self.partials)
                for v in cutlass.range_constexpr(lay.PARTIAL_O_VECTORS):
                    ptx.st_global_v4_u32(slot + Int64(v * lay.CTA_THREADS + tidx) * VECTOR_BYTES,
                                         *[ptx.bitcast_f32_to_u32(x) for x in vec[v]])
                ptx.st_global_v4_u32(slot + Int64(lay.PARTIAL_O_VECTORS * lay.CTA_THREADS + tidx) * VECTOR_BYTES,
                                     ptx.bitcast_f32_to_u32(m[0]), ptx.bitcast_f32_to_u32(m[1]),
                                     ptx.bitcast_f32_to_u32(lsum[0]), ptx.bitcast_f32_to_u32(lsum[1]))

    @cute.kernel
    def kernel(self, q: cute.Tensor, gate: cute.Tensor, kv_cache: cute.Tensor, page_table: cute.Tensor,
               seq_lens: cute.Tensor, out: cute.Tensor, workspace: cute.Tensor, q_row_words: Int32,
               gate_row_words: Int32) -> None:
        clocks = {}  # the traced build's clocks (SPLIT_TRACE_FIELDS): read by every thread, written by thread 0
        if cutlass.const_expr(self.trace):
            clocks["globaltimer_entry"] = ptx.read_globaltimer_u64()
            clocks["clock_entry"] = ptx.read_clock64_u64()
        kv_head, partial, req = cute.arch.block_idx()
        if cutlass.const_expr(self.spread_splits and self.partials > 1):
            # grid index y runs partial bitrev(y) over log2(partials) bits (`Attn2Build.spread_splits`)
            shift = 32 - (self.partials.bit_length() - 1)
            partial = Int32(ptx.brev_b32(Uint32(partial)) >> Uint32(shift))
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane // 4
        c = lane % 4
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint32, cute.make_layout(self.stages * lay.PAGE_BYTES // WORD_BYTES),
                                    byte_alignment=self.ring_alignment())
        ones_base = Int32(0)
        if cutlass.const_expr(self.wgmma):  # the n-tile of ones beside V (`gmma.ONES_BYTES`)
            ones = smem.allocate_tensor(Uint32, cute.make_layout(gmma.ONES_BYTES // WORD_BYTES),
                                        byte_alignment=gmma.ATOM_BYTES)
            ones_base = Int32(ones.iterator.toint())
        table = smem.allocate_tensor(Int32, cute.make_layout(self.splits_per_cta * self.table_entries),
                                     byte_alignment=16)
        ring_base = Int32(ring.iterator.toint())
        table_smem = Int32(table.iterator.toint())
        pending_base = Int32(0)
        if cutlass.const_expr(self.splits_per_cta > 1):  # the first split's state (`hold_pending`)
            pending = smem.allocate_tensor(Uint32, cute.make_layout(lay.PENDING_BYTES // WORD_BYTES),
                                           byte_alignment=16)
            pending_base = Int32(pending.iterator.toint())

        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.early_release):
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.trace):
            clocks["clock_waited"] = ptx.read_clock64_u64()

        # The CTA's splits: partial x splits_per_cta + j, j ascending (siblings of the merge tree)
        seq_len, first_page, end_page = page_range(seq_lens, req, self.max_model_len, self.window)
        starts = []
        counts = []
        for j in cutlass.range_constexpr(self.splits_per_cta):
            split = partial * self.splits_per_cta + j
            start = first_page + ((split - first_page) & (self.num_splits - 1))
            starts.append(start)
            counts.append(cutlass.max(end_page - start + (self.num_splits - 1), Int32(0)) // self.num_splits)
        total = counts[0]
        if cutlass.const_expr(self.splits_per_cta > 1):
            total = counts[0] + counts[1]

        work = (q, gate, kv_cache, page_table, out, workspace, q_row_words, gate_row_words, kv_head, partial, req,
                tidx, warp, lane, g, c, ring_base, ones_base, table_smem, pending_base, seq_len, starts, counts, total)
        if cutlass.const_expr(not self.empty_ctas_exit):
            self.split_work(clocks, *work)
        elif cutlass.const_expr(not self.trace):
            # A CTA without pages (CTA-uniform) ends here: it would write nothing, and its Q and table
            # loads only compete with the CTAs that have pages (at L 128 of 128k, 496 of 512 CTAs)
            if total > 0:
                self.split_work(clocks, *work)
        else:
            # the traced build: one row a CTA, written in one place; a CTA without pages ends its
            # prologue, chain and write phases where it ends (the branch's results, defined before it)
            prologue = Int64(0)
            chained = Int64(0)
            written = Int64(0)
            ended = Int64(0)
            if total > 0:
                prologue, chained, written, ended = self.split_work(clocks, *work)
            else:
                prologue = ptx.read_clock64_u64()
                chained = prologue
                written = prologue
                ended = ptx.read_globaltimer_u64()
            clocks.update(clock_prologue=prologue, clock_chained=chained, clock_written=written,
                          globaltimer_end=ended)
        if cutlass.const_expr(self.trace):
            self.write_split_trace_row(clocks, workspace, kv_head, partial, req, tidx)

    @cute.jit
    def write_split_trace_row(self, clocks: dict, workspace: cute.Tensor, kv_head: Int32, partial: Int32,
                              req: Int32, tidx: Int32) -> None:
        """The traced build: thread 0 writes the CTA's row (partial `partial`'s: the logical one)."""
        if tidx == 0:
            num_reqs = cute.arch.grid_dim()[2]
            index = (req * self.num_kv_heads + kv_head) * self.partials + partial
            trace_row = (Int64(workspace.iterator.toint())
                         + trace_offset(num_reqs, self.num_kv_heads, self.num_splits, self.partials)
                         + Int64(index) * TRACE_ROW_BYTES)
            write_trace_row(trace_row, SPLIT_TRACE_FIELDS, clocks)

    @cute.jit
    def split_work(self, clocks: dict, q: cute.Tensor, gate: cute.Tensor, kv_cache: cute.Tensor,
                   page_table: cute.Tensor, out: cute.Tensor, workspace: cute.Tensor, q_row_words: Int32,
                   gate_row_words: Int32, kv_head: Int32, partial: Int32, req: Int32, tidx: Int32, warp: Int32,
                   lane: Int32, g: Int32, c: Int32, ring_base: Int32, ones_base: Int32, table_smem: Int32,
                   pending_base: Int32, seq_len: Int32, starts: list, counts: list, total: Int32):
        """A split CTA's work after L's load: its Q fragments, table entries and the ring's
        prologue, its page chain(s), its partial (or the one-split epilogue). `kernel` skips it for a
        CTA without pages where `empty_ctas_exit` says so. Traced: returns the clocks it read after
        the prologue, the chains and the write, and the end's %globaltimer (`kernel` writes the row)."""
        a = self.load_q_fragments(q, kv_head, warp, req, g, c, q_row_words)

        own_key = seq_len - lay.QUERY_LEN + g  # both rows of this thread are token g
        low_key = Int32(0)
        if cutlass.const_expr(self.window > 0):
            low_key = own_key - (self.window - 1)
        m = [Float32(NEG_INF), Float32(NEG_INF)]
        o = [Float32(0.0) for _ in range(ACCUMULATORS)]  # o[4 t + j]: n-tile t, fragment element j; t = 8: l

        cache_base = Int64(kv_cache.iterator.toint())
        cache_pages = Int32(kv_cache.shape[0] // (self.num_kv_heads * (lay.PAGE_BYTES // BF16_BYTES)))
        for j in cutlass.range_constexpr(self.splits_per_cta):
            self.prefetch_table(page_table, table_smem + j * self.table_entries * WORD_BYTES, req, starts[j], tidx)
        if cutlass.const_expr(self.wgmma):
            for r in cutlass.range_constexpr(gmma.ONES_BYTES // (VECTOR_BYTES * lay.CTA_THREADS)):
                one = Uint32(gmma.BF16_ONES_WORD)
                ptx.st_shared_v4_u32(ones_base + (r * lay.CTA_THREADS + tidx) * VECTOR_BYTES, one, one, one, one)
            ptx.fence_proxy_async_shared_cta()  # the ones, visible to wgmma's reads after the barrier
        cute.arch.barrier()
        self.ring_prologue(ring_base, cache_base, table_smem, starts, counts, total, kv_head, seq_len, cache_pages,
                           tidx)
        if cutlass.const_expr(self.trace):
            clocks["clock_prologue"] = ptx.read_clock64_u64()  # Q, the table and the ring's first copies issued

        # lean_addressing: this thread's fragment addresses in stage 0 (a page adds its stage's offset)
        k_words = None
        v_words = None
        if cutlass.const_expr(self.lean_addressing and not self.wgmma):
            if cutlass.const_expr(self.ldmatrix_keys):
                k_words = [ring_base + k_fragment_row(lane, 0, quad) for quad in range(K_TILES // 2)]
            else:
                k_words = [[ring_base + g * SLOT_BYTES + ((2 * kk + h) ^ g) * VECTOR_BYTES + c * WORD_BYTES
                            for h in range(2)] for kk in range(K_TILES)]
            v_words = [ring_base + v_fragment_row(lane, pair) for pair in range(V_TILE_PAIRS)]

        descriptors = None
        if cutlass.const_expr(self.wgmma):
            # stage 0's descriptors (`kernels.gmma`), once: K's (a page adds its stage and its k16
            # step to the address field: 14 bits of a shared address >> 4, never carried out of), and
            # V's with the ones block as its second 64-column block (LBO from V's region to it)
            v_region = ring_base + gmma.V_REGION
            descriptors = (Int64(gmma.K_MAJOR_KEYS.template_signed()) | (Int64(ring_base + gmma.K_REGION) >> 4),
                           Int64(gmma.MN_MAJOR_VALUES_WITH_ONES.template_signed()) | (Int64(v_region) >> 4)
                           | gmma.leading_offset_field(Int64(ones_base - v_region)))
        chain = (ring_base, cache_base, table_smem, total, k_words, v_words, descriptors, a, g, c, kv_head, seq_len,
                 cache_pages, tidx, own_key, low_key)
        if cutlass.const_expr(self.pages_per_step == 2):
            # Steps of two pages, split by split, each as a CTA running it alone would step
            # (`step_chain`). With two splits a CTA every copy finds its split's table entry and
            # logical page through `stream_page` (a few selects a copy, no range cuts); the first
            # split's state is held while the second runs from a fresh state, as below.
            streams = None
            if cutlass.const_expr(self.splits_per_cta > 1):
                streams = (starts, counts)
            m, o = self.step_chain(None, counts[0], starts[0], starts[0], streams, chain, m, o)
            if cutlass.const_expr(self.splits_per_cta > 1):
                self.hold_pending(pending_base, tidx, m, o)
                fresh_m = [Float32(NEG_INF), Float32(NEG_INF)]
                fresh_o = [Float32(0.0) for _ in range(ACCUMULATORS)]
                second = starts[1] - counts[0] * self.num_splits  # its logical page of CTA page i: + i S
                m, o = self.step_chain(counts[0], counts[1], second, starts[1], streams, chain, fresh_m, fresh_o)
        elif cutlass.const_expr(self.splits_per_cta == 1):
            m, o = self.split_chain(Int32(0), counts[0], starts[0], None, starts[0], *chain, m, o)
        else:
            # Three ranges, so that no page picks its copy's split: the first split's pages whose
            # copies are its own, then those whose copies are the second split's (its page j at
            # the CTA's page counts[0] + j: table entry table_entries + j), then the second split's
            # pages from a fresh state (the first's held meanwhile, `hold_pending`).
            second = starts[1] - counts[0] * self.num_splits  # the second split's logical page of CTA page i: + i S
            second_entry = Int32(self.table_entries) - counts[0]
            switch = cutlass.max(counts[0] - self.lookahead, Int32(0))
            m, o = self.split_chain(Int32(0), switch, starts[0], None, starts[0], *chain, m, o)
            m, o = self.split_chain(switch, counts[0], starts[0], second_entry, second, *chain, m, o)
            self.hold_pending(pending_base, tidx, m, o)
            fresh_m = [Float32(NEG_INF), Float32(NEG_INF)]
            fresh_o = [Float32(0.0) for _ in range(ACCUMULATORS)]
            m, o = self.split_chain(counts[0], total, second, second_entry, second, *chain, fresh_m, fresh_o)
        if cutlass.const_expr(self.trace):
            clocks["clock_chained"] = ptx.read_clock64_u64()
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(self.enable_pdl and not self.early_release):
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.splits_per_cta > 1):
            m, o = self.merge_pending(pending_base, tidx, m, o)
        self.head_result(gate, out, workspace, gate_row_words, kv_head, partial, req, warp, g, c, tidx, total, m, o)
        if cutlass.const_expr(self.trace):
            clocks["clock_written"] = ptx.read_clock64_u64()
            clocks["globaltimer_end"] = ptx.read_globaltimer_u64()
            return (clocks["clock_prologue"], clocks["clock_chained"], clocks["clock_written"],
                    clocks["globaltimer_end"])


@cute.jit
def wgmma_chain(n: cutlass.Constexpr, fragments: list, descriptors: list, transpose_b: cutlass.Constexpr,
                initial=None, wait: cutlass.Constexpr = True) -> list:
    """One accumulator chain of warpgroup MMAs (m64n16k16 or m64n72k16, A fragments[i] from
    registers, B by descriptors[i]): the first step from zero (scale-d 0) or onto `initial` (n / 2
    accumulators), the rest on top, then committed as one group and waited for (wait_group 0);
    returns the n / 2 accumulators (mma.sync's C layout per n-tile of 8). The A words
    and `initial` pass through the fence as tied operands, so whatever computes them (P, the
    rescale) is emitted before it, never between the fence and the MMA
    (`ptx.wgmma_fence_sync_aligned`). `wait` False: committed only; the returned accumulators may
    be read only through a later `wgmma_wait_group_sync_aligned` (SplitIssue.defer_values)."""
    mma = {16: ptx.wgmma_mma_async_sync_aligned_m64n16k16_f32_bf16_bf16,
           72: ptx.wgmma_mma_async_sync_aligned_m64n72k16_f32_bf16_bf16}[n]
    words = [w for fragment in fragments for w in fragment]
    fenced = ptx.wgmma_fence_sync_aligned(words + (list(initial) if initial is not None else []))
    acc = fenced[len(words):] if initial is not None else None
    for i in cutlass.range_constexpr(len(fragments)):
        step = fenced[4 * i:4 * i + 4]
        if cutlass.const_expr(acc is None):
            acc = mma(step, descriptors[i], None, 0, transpose_b)
        else:
            acc = mma(step, descriptors[i], acc, 1, transpose_b)
    ptx.wgmma_commit_group_sync_aligned()
    if cutlass.const_expr(not wait):
        return acc
    return ptx.wgmma_wait_group_sync_aligned(0, acc)


@cute.jit
def scaled_difference(score: Float32, reference: Float32, scale_log2: Float32) -> Float32:
    """The log2 exponent of a key's weight, (score - reference) scale log2 e, both roundings in
    FP32: scores and maxima stay unscaled, so the difference of a key near the row max is exact
    (Sterbenz) and equal scores weigh exactly 1; scaling first put half an FP32 ULP of the scaled
    score (2^-12 near 4000) into every exponent, up to 3349 BF16 ULPs on `large` inputs (the CPU
    model and the H200 agree: KV head 2 of `attn --tp 16` at L 2049). -inf (masked, or an empty
    split) stays -inf: its weight is 0."""
    return ptx.mul_rn_f32(ptx.sub_rn_f32(score, reference), scale_log2)


def k_fragment_row(lane, nt, quad):
    """The byte offset, in a ring stage, of the K row `lane` (0 .. 31) addresses in the
    `ldmatrix.x4` (not transposed) of keys 8 nt .. 8 nt + 7 (nt 0, 1) and k-steps 2 quad,
    2 quad + 1 (quad 0, 1); ints or DSL Int32 alike, as `v_fragment_row`.

    Matrix i = lane // 8 is dims 16 kk + 8 h .. + 7 (kk = 2 quad + i // 2, h = i % 2: the slot's
    chunk 4 quad + i, swizzled by the slot) of the 8 keys (rows: slot 8 nt + lane % 8). Result i
    gives lane 4g + c key 8 nt + g's dims 16 kk + 8h + 2c, + 1: b0 (h 0) or b1 of k-step kk, the
    Q K^T B fragment. Conflict free as V's: the 8 rows' chunks (4 quad + i) ^ (slot & 7) differ."""
    matrix = lane // 8
    slot = 8 * nt + lane % 8
    return slot * SLOT_BYTES + ((4 * quad + matrix) ^ (slot & SWIZZLE_MASK)) * VECTOR_BYTES


def v_fragment_row(lane, pair):
    """The byte offset, in a ring stage, of the V row `lane` (0 .. 31) addresses in the
    `ldmatrix.x4.trans` of n-tile pair `pair` (0 .. 3); the same arithmetic on Python ints (the
    tests) and on DSL Int32 values (the kernel).

    Matrix i = lane // 8 is keys 8 (i % 2) .. 8 (i % 2) + 7 (rows: slot 8 (i % 2) + lane % 8) of
    n-tile t = 2 pair + i // 2, dims 8t .. 8t + 7: one 16-byte chunk of the slot, V_CHUNK0 + t,
    swizzled to (V_CHUNK0 + t) ^ (slot & 7). Transposed, result i gives lane 4g + c the keys
    2c, 2c + 1 (+ 8 for odd i) of dim 8t + g: b0 of n-tile t for even i, b1 for odd i, the mma's
    B fragment, with no prmt.

    Bank conflicts: none. A matrix's 8 rows are 8 consecutive slots, slot & 7 = 0 .. 7; a slot is
    SLOT_BYTES = 256 bytes, a multiple of the 128 bytes the 32 banks span, so a row's bank group
    (16 bytes, 4 banks) is its swizzled chunk mod 8, (t ^ slot) & 7: 8 different groups, all 32
    banks once: one shared-memory wavefront per matrix, the least an ldmatrix takes."""
    matrix = lane // 8
    slot = lane % 8 + 8 * (matrix % 2)
    tile = 2 * pair + matrix // 2
    return slot * SLOT_BYTES + ((V_CHUNK0 + tile) ^ (slot & SWIZZLE_MASK)) * VECTOR_BYTES


@cute.jit
def partial_slot(workspace: cute.Tensor, req: Int32, kv_head: Int32, split: Int32, num_kv_heads: cutlass.Constexpr,
                 num_splits: cutlass.Constexpr) -> Int64:
    """The address of partial (req, kv_head, split) in the workspace."""
    index = (req * num_kv_heads + kv_head) * num_splits + split
    return Int64(workspace.iterator.toint()) + Int64(index) * lay.PARTIAL_BYTES


@cute.jit
def page_range(seq_lens: cute.Tensor, req: Int32, max_model_len: cutlass.Constexpr, window: cutlass.Constexpr):
    """(L clamped to [8, max_model_len], first page, end page) of request req: the pages holding
    keys any of its rows sees."""
    seq_len = Int32(ptx.ld_global_u32(Int64(seq_lens.iterator.toint()) + Int64(req) * WORD_BYTES))
    seq_len = cutlass.max(cutlass.min(seq_len, Int32(max_model_len)), Int32(lay.QUERY_LEN))
    first_key = Int32(0)
    if cutlass.const_expr(window > 0):
        first_key = cutlass.max(seq_len - (lay.QUERY_LEN - 1 + window), Int32(0))
    return seq_len, first_key // lay.PAGE_TOKENS, (seq_len + lay.PAGE_TOKENS - 1) // lay.PAGE_TOKENS


@cute.jit
def merge_into(left: list, right: list) -> None:
    """One merge-tree node in place of `left`: [O..., m, l] lists (O first), left child first:
    top = max(m_L, m_R), w = 2^((m - top) scale log2 e) (top 0 while both are empty), O = O_L w_L + O_R w_R, l
    likewise (two products, one sum), m = top."""
    n = len(left) - 2
    m_l, m_r = left[n], right[n]
    top = ptx.max_f32(m_l, m_r)
    use = cutlass.select_(top == Float32(NEG_INF), Float32(0.0), top)
    w_l = ptx.ex2_approx_f32(scaled_difference(m_l, use, Float32(SCALE_LOG2)))
    w_r = ptx.ex2_approx_f32(scaled_difference(m_r, use, Float32(SCALE_LOG2)))
    for k in cutlass.range_constexpr(n):
        left[k] = ptx.add_rn_f32(ptx.mul_rn_f32(left[k], w_l), ptx.mul_rn_f32(right[k], w_r))
    left[n] = top
    left[n + 1] = ptx.add_rn_f32(ptx.mul_rn_f32(left[n + 1], w_l), ptx.mul_rn_f32(right[n + 1], w_r))


@cute.jit
def merged(left: list, right: list) -> list:
    """`merge_into` on a copy of `left`: the node, as a new list (for values that leave a dynamic
    branch by assignment)."""
    node = list(left)
    merge_into(node, right)
    return node


def empty_node(dims: int) -> list:
    """The node of a leaf without pages, as the combine's `load_leaf` makes it: O +0.0, m -inf, l +0.0."""
    return [Float32(0.0) for _ in range(dims)] + [Float32(NEG_INF), Float32(0.0)]


@cute.jit
def live_groups(first_page: Int32, end_page: Int32, num_splits: cutlass.Constexpr, group_splits: cutlass.Constexpr,
                groups: cutlass.Constexpr) -> Int32:
    """How many of the combine's first groups hold every split with pages (group_splits splits a
    group): split s has pages iff (s - first_page) mod S < n, n = end_page - first_page
    (`page_range`, `load_leaf`), i.e. the splits lo .. lo + n - 1 mod S, lo = first_page mod S.
    With lo 0 those are the first min(n, S) splits: ceil(min(n, S) / group_splits) groups; a range
    that starts past split 0 (a window) counts as every group. Its host mirror,
    `attn2_layout.live_groups`, with a model of `upper_tree`, is held to the whole merge tree bit for
    bit over every page range of each plan by tests/cpu/test_attn2_model.py."""
    lo = first_page & (num_splits - 1)
    live_splits = cutlass.min(end_page - first_page, Int32(num_splits))
    prefix = (live_splits + (group_splits - 1)) // group_splits
    return cutlass.select_(lo == 0, prefix, Int32(groups))


def trace_offset(num_reqs: Int32, num_kv_heads: int, num_splits: int, partials: int) -> Int64:
    """Device side (inlined into a traced kernel): the first trace row's byte offset in the
    workspace, past the partials (none with one split), as `trace_rows` reads it."""
    if num_splits == 1:
        return Int64(0)
    return Int64(num_reqs * (num_kv_heads * partials)) * lay.PARTIAL_BYTES


def write_trace_row(row: Int64, fields: tuple[str, ...], clocks: dict) -> None:
    """Device side (inlined into a traced kernel; its caller's thread 0 only): one CTA's trace row,
    `fields` in order as int64 (the SM read here, the rest from `clocks`), at address `row`."""
    words = dict(clocks, smid=Int64(ptx.read_smid_u32()))
    for i, field in enumerate(fields):
        ptx.st_global_u64(row + i * 8, words[field])


@cute.jit
def load_gate_words(gate: cute.Tensor, row: Int32, head: Int32, c: Int32, gate_row_words: Int32) -> list:
    """The gate's BF16 pairs of (row, head) that lane c holds: word t is dims 8t + 2c (low 16
    bits) and 8t + 2c + 1, t = 0 .. 7 (`attn2_layout.lane_dims`)."""
    gate_base = Int64(gate.iterator.toint()) + Int64(row) * Int64(gate_row_words) * WORD_BYTES
    return [ptx.ld_global_u32(gate_base + Int64((head * lay.HEAD_DIM + lay.TILE_DIMS * t + 2 * c) // 2) * WORD_BYTES)
            for t in range(V_TILES)]


@cute.jit
def gate_sigmoids(gate_words: list) -> list:
    """sigmoid(g) = 1 / (1 + 2^(-g log2 e)) of a lane's 16 gate values (`load_gate_words`' words,
    in `attn2_layout.lane_dims(c)`'s order), each quotient div.rn.f32's bits (`division.quotients_rn`).
    They depend on the gate alone, so the combine computes them before its PDL wait."""
    denominators = []  # 1 + 2^(-g log2 e) of dims 8t + 2c + k
    for t in cutlass.range_constexpr(V_TILES):
        gw = gate_words[t]
        gates = [ptx.bitcast_u32_to_f32(gw << 16), ptx.bitcast_u32_to_f32(gw & Uint32(0xFFFF0000))]
        for k in cutlass.range_constexpr(2):
            e = ptx.ex2_approx_f32(ptx.mul_rn_f32(gates[k], Float32(-LOG2_E)))
            denominators.append(ptx.add_rn_f32(Float32(1.0), e))
    return division.quotients_rn([1.0] * lay.LANE_DIMS, denominators)


@cute.jit
def row_epilogue(values: list, lsum: Float32, sigmoids: list, out: cute.Tensor, row: Int32, head: Int32, c: Int32,
                 num_kv_heads: cutlass.Constexpr, eps: cutlass.Constexpr, store: Int32,
                 lanes: cutlass.Constexpr = 32) -> None:
    """The o-norm and gate of one row, by the 4 lanes 4k .. 4k + 3 of a warp: lane c of the quad
    holds dims 8t + 2c + k as values[2t + k] (`attn2_layout.lane_dims(c)`) and their gates'
    sigmoids in the same order (`gate_sigmoids`). The sum of squares: the lane's 16 squares in its order (t ascending,
    k = 0 then 1) from +0.0, then the butterfly over xor 1 and 2, so every lane of the quad holds
    (lane 0 + lane 1) + (lane 2 + lane 3) bit for bit (each add is commutative). One 4-byte store
    per n-tile (dims 8t + 2c, 8t + 2c + 1; a quad's four stores fill the tile's 16 bytes). The
    warp's first `lanes` lanes (all it has) execute it (the butterfly), lanes with `store` 0 write
    nothing. Every quotient (O / l, 1 / sqrt, and the sigmoids' 1 / (1 + e)) has `div.rn.f32`'s
    bits; the lists of 16 go through `division.quotients_rn` (one branch a list, not one a quotient)."""
    mask = (1 << lanes) - 1
    out_row_words = num_kv_heads * lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM // 2
    xs = []
    ss = Float32(0.0)
    # the 16 quotients O / l: div.rn.f32's bits, one branch for the list (`kernels.division`)
    ratios = division.quotients_rn(values, [lsum] * lay.LANE_DIMS)
    for k in cutlass.range_constexpr(lay.LANE_DIMS):
        word = ptx.cvt_rn_bf16x2_f32(Float32(0.0), ratios[k])
        x = ptx.bitcast_u32_to_f32(word << 16)
        ss = ptx.add_rn_f32(ss, ptx.mul_rn_f32(x, x))
        xs.append(x)
    ss = ptx.add_rn_f32(ss, cute.arch.shuffle_sync_bfly(ss, offset=1, mask=mask))
    ss = ptx.add_rn_f32(ss, cute.arch.shuffle_sync_bfly(ss, offset=2, mask=mask))
    mean = ptx.add_rn_f32(ptx.mul_rn_f32(ss, Float32(1.0 / lay.HEAD_DIM)), Float32(eps))
    rstd = ptx.div_rn_f32(Float32(1.0), ptx.sqrt_rn_f32(mean))
    out_base = Int64(out.iterator.toint()) + Int64(row) * (out_row_words * WORD_BYTES)
    for t in cutlass.range_constexpr(V_TILES):
        dim_word = (head * lay.HEAD_DIM + lay.TILE_DIMS * t + 2 * c) // 2
        ys = [ptx.mul_rn_f32(ptx.mul_rn_f32(xs[2 * t + k], rstd), sigmoids[2 * t + k]) for k in range(2)]
        if store != 0:
            ptx.st_global_u32(out_base + Int64(dim_word) * WORD_BYTES, ptx.cvt_rn_bf16x2_f32(ys[1], ys[0]))


class _Attn2CombineKernel:
    """The merge of one split plan's partials and the epilogue: grid (64 rows, `num_kv_heads`,
    requests), COMBINE_QUADS x `combine_groups(partials)` threads; a partial is one split CTA's
    (`splits_per_cta` sibling leaves, already merged)."""

    def __init__(self, *, num_kv_heads: int, num_splits: int, max_model_len: int, window: int, eps: float,
                 enable_pdl: bool, splits_per_cta: int = 1, trace: bool = False, full_tree: bool = False,
                 early_release: bool = False) -> None:
        _require(num_kv_heads >= 1 and lay.is_power_of_two(num_splits) and num_splits > 1, "bad attn2 configuration")
        _require(isinstance(trace, bool), f"trace must be a bool, got {trace!r}")
        _require(isinstance(full_tree, bool), f"full_tree must be a bool, got {full_tree!r}")
        self.trace = trace
        self.full_tree = full_tree  # `Attn2Build.full_tree`: the upper tree even when group 0 holds every page
        lay.check_splits_per_cta(splits_per_cta, num_splits)
        self.num_kv_heads = num_kv_heads
        self.num_splits = num_splits
        self.splits_per_cta = splits_per_cta
        self.partials = num_splits // splits_per_cta
        self.groups = lay.combine_groups(self.partials)
        self.leaves = self.partials // self.groups
        self.threads = lay.COMBINE_QUADS * self.groups
        # the upper tree: log2(groups a warp) levels by shuffles, then one across the warps
        self.warps = max(1, self.threads // 32)
        self.warp_levels = int(math.log2(self.groups // self.warps))
        self.lane_mask = (1 << min(32, self.threads)) - 1
        self.max_model_len = max_model_len
        self.window = window
        self.eps = eps
        self.enable_pdl = enable_pdl
        _require(isinstance(early_release, bool) and (not early_release or enable_pdl),
                 f"early_release {early_release!r}: a bool, True only with PDL (Attn2Build.early_release)")
        self.early_release = early_release  # `Attn2Build.early_release`

    def smem_bytes(self) -> int:
        return self.warps * lay.COMBINE_QUADS * COMBINE_SLOT_BYTES

    @cute.jit
    def __call__(self, gate: cute.Tensor, seq_lens: cute.Tensor, out: cute.Tensor, workspace: cute.Tensor,
                 gate_row_words: Int32, num_reqs: Int32, stream: cuda.CUstream) -> None:
        self.kernel(gate, seq_lens, out, workspace, gate_row_words).launch(
            grid=[lay.ROWS_PER_KV_HEAD, self.num_kv_heads, num_reqs],
            block=[self.threads, 1, 1],
            smem=self.smem_bytes(),
            stream=stream,
            use_pdl=self.enable_pdl,
            min_blocks_per_mp=COMBINE_CTAS_PER_SM,
        )

    @cute.jit
    def load_leaf(self, workspace: cute.Tensor, req: Int32, kv_head: Int32, partial: Int32, first_page: Int32,
                  end_page: Int32, source: Int32, half: Int32) -> list:
        """[16 dims of O, m, l] of the row in partial `partial` ((0.., -inf, 0) if none of its splits
        has a page: the merge of empty leaves): the source lane's vectors 2p + half, p = 0 .. 3, so
        O comes in `attn2_layout.lane_dims(c)`'s order, the epilogue's."""
        leaf = empty_node(lay.LANE_DIMS)
        live = None  # any of its splits' first pages (`page_range`) below the end
        for j in cutlass.range_constexpr(self.splits_per_cta):
            split = partial * self.splits_per_cta + j
            has_pages = first_page + ((split - first_page) & (self.num_splits - 1)) < end_page
            live = has_pages if live is None else live | has_pages
        if live:
            slot = partial_slot(workspace, req, kv_head, partial, self.num_kv_heads, self.partials)
            for pp in cutlass.range_constexpr(V_TILE_PAIRS):
                words = ptx.ld_global_v4_u32(slot + Int64((2 * pp + half) * lay.CTA_THREADS + source) * VECTOR_BYTES)
                for j in cutlass.range_constexpr(4):
                    leaf[4 * pp + j] = ptx.bitcast_u32_to_f32(words[j])
            stats = slot + Int64(lay.PARTIAL_O_VECTORS * lay.CTA_THREADS + source) * VECTOR_BYTES
            leaf[lay.LANE_DIMS] = ptx.bitcast_u32_to_f32(ptx.ld_global_u32(stats + Int64(half) * WORD_BYTES))
            leaf[lay.LANE_DIMS + 1] = ptx.bitcast_u32_to_f32(ptx.ld_global_u32(stats + Int64(2 + half) * WORD_BYTES))
        return leaf

    @cute.jit
    def subtree(self, leaves: list, lo: cutlass.Constexpr, n: cutlass.Constexpr) -> list:
        if cutlass.const_expr(n == 1):
            return leaves[lo]
        left = self.subtree(leaves, lo, n // 2)
        right = self.subtree(leaves, lo + n // 2, n // 2)
        merge_into(left, right)
        return left

    @cute.jit
    def store_slot(self, base: Int32, slot: Int32, c: Int32, values: list) -> None:
        address = base + (slot * lay.COMBINE_QUADS + c) * COMBINE_SLOT_BYTES
        for k in cutlass.range_constexpr(COMBINE_SLOT_BYTES // VECTOR_BYTES):
            words = [ptx.bitcast_f32_to_u32(values[4 * k + i]) if 4 * k + i < len(values) else Uint32(0)
                     for i in range(4)]
            ptx.st_shared_v4_u32(address + k * VECTOR_BYTES, *words)

    @cute.jit
    def load_slot(self, base: Int32, slot: Int32, c: Int32) -> list:
        address = base + (slot * lay.COMBINE_QUADS + c) * COMBINE_SLOT_BYTES
        values = []
        for k in cutlass.range_constexpr(COMBINE_SLOT_BYTES // VECTOR_BYTES):
            words = ptx.ld_shared_v4_u32(address + k * VECTOR_BYTES)
            for i in cutlass.range_constexpr(4):
                if cutlass.const_expr(4 * k + i < lay.COMBINE_ROW_FLOATS):
                    values.append(ptx.bitcast_u32_to_f32(words[i]))
        return values

    @cute.jit
    def upper_tree(self, mine: list, slot_base: Int32, tidx: Int32, c: Int32, live=None) -> list:
        """The tree above the groups: first within each warp (its 32 / COMBINE_QUADS consecutive
        groups, a complete subtree) by shuffles, node (2j) taking node (2j + 1) from 4, 8, 16 lanes
        up (a lane whose node is a right child computes a merge nobody reads); then warp 0 merges the
        warps' nodes, warp order, from shared memory (a CTA barrier: every thread calls it). Returns
        the node warp 0's lanes hold (quad 0's: the root).

        `live` (None: every level): a CTA-uniform Int32 such that groups 0 .. live - 1
        hold every split with pages. A shuffle level runs only while its right subtrees can hold
        pages (2^level < live), the shared-memory stage only while the pages reach past warp
        0's groups. Above the last level that runs, every merge on the root's path is merge(node,
        empty) and every other node is empty, so one merge with an empty node gives the skipped
        levels' bits (merge with an empty node is idempotent, bit for bit:
        tests/cpu/test_attn2_model.py); the levels that run are the tree's own."""
        for level in cutlass.range_constexpr(self.warp_levels):
            if cutlass.const_expr(live is None):
                mine = self.shuffle_level(mine, level)
            else:
                if live > (1 << level):  # CTA-uniform: every lane shuffles or none
                    mine = self.shuffle_level(mine, level)
        if cutlass.const_expr(self.warps > 1):
            if cutlass.const_expr(live is None):
                mine = self.warp_nodes(mine, slot_base, tidx, c)
            else:
                if live > self.groups // self.warps:
                    mine = self.warp_nodes(mine, slot_base, tidx, c)
        if cutlass.const_expr(live is not None):
            # the top level (the shared-memory stage, or with one warp its last shuffle level) skipped
            top = self.groups // self.warps if self.warps > 1 else self.groups // 2
            if live <= top:
                mine = merged(mine, empty_node(lay.LANE_DIMS))
        return mine

    @cute.jit
    def shuffle_level(self, mine: list, level: cutlass.Constexpr) -> list:
        """One shuffle level of the upper tree: each lane merges its node with the one
        COMBINE_QUADS << level lanes up (node 2j takes node 2j + 1 of that level)."""
        delta = lay.COMBINE_QUADS << level
        right = [cute.arch.shuffle_sync_down(v, offset=delta, mask=self.lane_mask) for v in mine]
        return merged(mine, right)

    @cute.jit
    def warp_nodes(self, mine: list, slot_base: Int32, tidx: Int32, c: Int32) -> list:
        """The shared-memory stage of the upper tree: lane c of each warp stores its warp's node, one
        CTA barrier, then every lane of warp 0 merges the warps' nodes in warp order (a subtree)."""
        if tidx % 32 < lay.COMBINE_QUADS:  # lane c of each warp holds its warp's node
            self.store_slot(slot_base, tidx // 32, c, mine)
        cute.arch.barrier()
        if tidx < 32:
            nodes = [self.load_slot(slot_base, Int32(w), c) for w in range(self.warps)]
            mine = self.subtree(nodes, 0, self.warps)
        return mine

    @cute.kernel
    def kernel(self, gate: cute.Tensor, seq_lens: cute.Tensor, out: cute.Tensor, workspace: cute.Tensor,
               gate_row_words: Int32) -> None:
        clocks = {}  # the traced build's clocks (COMBINE_TRACE_FIELDS): read by every thread, written by thread 0
        if cutlass.const_expr(self.trace):
            clocks["globaltimer_entry"] = ptx.read_globaltimer_u64()
            clocks["clock_entry"] = ptx.read_clock64_u64()
        row_index, kv_head, req = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        c = tidx % lay.COMBINE_QUADS
        group = tidx // lay.COMBINE_QUADS
        # row_index = 16 w + 8 half + g: token g of head 2w + half, held by split lane 32 w + 4 g + c
        w = row_index // 16
        half = (row_index // 8) % 2
        g = row_index % 8
        source = 32 * w + 4 * g + c
        smem = cutlass.memory.SmemAllocator()
        slots = smem.allocate_tensor(Uint32, cute.make_layout(self.smem_bytes() // WORD_BYTES), byte_alignment=16)
        slot_base = Int32(slots.iterator.toint())

        # Before the wait: the gate and L. Their writers (the kernels before the split kernel) had
        # finished when the split kernel passed its own wait, and this grid starts only after every
        # split CTA has (PDL: a dependent launches once every CTA of its primary released it).
        row = req * lay.QUERY_LEN + g
        head = kv_head * lay.HEADS_PER_KV_HEAD + 2 * w + half
        sigmoids = gate_sigmoids(load_gate_words(gate, row, head, c, gate_row_words))  # gate only: before the wait
        _, first_page, end_page = page_range(seq_lens, req, self.max_model_len, self.window)
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_wait()  # the split kernel's partials, finished and flushed
        if cutlass.const_expr(self.early_release):
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.trace):
            clocks["clock_waited"] = ptx.read_clock64_u64()
        leaves = [self.load_leaf(workspace, req, kv_head, group * self.leaves + i, first_page, end_page, source, half)
                  for i in range(self.leaves)]
        mine = self.subtree(leaves, 0, self.leaves)
        if cutlass.const_expr(self.trace):
            clocks["clock_loaded"] = ptx.read_clock64_u64()  # the group's partials loaded and merged
        if cutlass.const_expr(self.enable_pdl and not self.early_release):
            cute.arch.griddepcontrol_launch_dependents()
        # The groups' results meet in the tree's upper levels (`upper_tree`), or in one merge when
        # every page is group 0's.
        if cutlass.const_expr(self.groups > 1 and not self.full_tree):
            # only the levels that can meet pages (`upper_tree`): at 256 splits (64 groups of 4
            # leaves, 8 a warp) L <= 64 takes one merge, L <= 512 no shared-memory stage
            live = live_groups(first_page, end_page, self.num_splits, self.leaves * self.splits_per_cta,
                               self.groups)
            mine = self.upper_tree(mine, slot_base, tidx, c, live)
        else:
            mine = self.upper_tree(mine, slot_base, tidx, c)
        if cutlass.const_expr(self.trace):
            clocks["clock_merged"] = ptx.read_clock64_u64()  # the tree above the groups (warp 0: its root)
        if tidx < 32:  # warp 0 (all of it, or every thread of a smaller CTA) runs the root's epilogue, quad 0 stores
            # Only quad 0 (group 0) holds the root; the butterfly stays inside each quad, so the other
            # quads' values never reach a stored bit. They run the epilogue on ones instead of their
            # node: a node of empty leaves (0 / 0) would send their whole list through div.rn.f32's
            # slow path (`division.quotients_rn`), and the warp would wait for it (2.1 us at 4 splits, L 8).
            root = group == 0
            values = [cutlass.select_(root, v, Float32(1.0)) for v in mine[:lay.LANE_DIMS]]
            lsum = cutlass.select_(root, mine[lay.LANE_DIMS + 1], Float32(1.0))
            row_epilogue(values, lsum, sigmoids, out, row, head, c, self.num_kv_heads, self.eps,
                         cutlass.select_(root, Int32(1), Int32(0)), min(32, self.threads))
        if cutlass.const_expr(self.trace):
            clocks["clock_end"] = ptx.read_clock64_u64()
            clocks["globaltimer_end"] = ptx.read_globaltimer_u64()
            if tidx == 0:  # group 0's lane 0: its row's store is its last
                num_reqs = cute.arch.grid_dim()[2]
                index = (req * self.num_kv_heads + kv_head) * lay.ROWS_PER_KV_HEAD + row_index
                trace_row = (Int64(workspace.iterator.toint())
                             + trace_offset(num_reqs, self.num_kv_heads, self.num_splits, self.partials)
                             + Int64(num_reqs * (self.num_kv_heads * self.partials)) * TRACE_ROW_BYTES
                             + Int64(index) * TRACE_ROW_BYTES)
                write_trace_row(trace_row, COMBINE_TRACE_FIELDS, clocks)


# ---------------------------------------------------------------------------------------------
# Host side.


def _variant(num_kv_heads: int, max_model_len: int, window: int, num_splits: int | None = None,
             splits_per_cta: int | None = None) -> dict[str, Any]:
    _require(not isinstance(num_kv_heads, bool) and isinstance(num_kv_heads, int) and num_kv_heads >= 1,
             f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
    _require(not isinstance(max_model_len, bool) and isinstance(max_model_len, int) and max_model_len >= lay.QUERY_LEN,
             f"max_model_len must be an int >= {lay.QUERY_LEN}, got {max_model_len!r}")
    _require(not isinstance(window, bool) and isinstance(window, int) and 0 <= window < max_model_len
             or window == 0, f"window must be 0 or an int in [1, max_model_len), got {window!r} (cute_ops.attn2_window)")
    if num_splits is None:
        num_splits = lay.splits(max_model_len, window, num_kv_heads)
    _require(not isinstance(num_splits, bool) and isinstance(num_splits, int) and lay.is_power_of_two(num_splits),
             f"num_splits must be a power of two, got {num_splits!r}")
    if splits_per_cta is None:
        splits_per_cta = lay.splits_per_cta(num_kv_heads, num_splits)
    lay.check_splits_per_cta(splits_per_cta, num_splits)
    return dict(num_kv_heads=num_kv_heads, num_splits=num_splits, splits_per_cta=splits_per_cta,
                max_pages=lay.max_pages(max_model_len), max_model_len=max_model_len, window=window,
                eps=float(config.RMS_NORM_EPS))


def _device_arch() -> str:
    """The current GPU's target name (sm_90a on an H200, sm_100a on a GB200); sm_90a without one."""
    if not torch.cuda.is_available():
        return "sm_90a"
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a"


@dataclass(frozen=True)
class CompiledAttn2:
    """A deployment's compiled kernels: the split kernel, and the combine where there are splits."""

    split: Any
    combine: Any | None


def resolved_pages_per_step(requested: int | None, window: int, num_splits: int) -> int:
    """The pages a softmax step takes in a build: `requested` (1 or 2, checked), or with None the
    rule of the build's split plan (`attn2_layout.pages_per_step`: 2 for split plans without a
    window); never anything that depends on the KV heads or tp."""
    if requested is None:
        return lay.pages_per_step(window, num_splits)
    lay.check_pages_per_step(requested)
    return requested


def resolved_spread_splits(requested: bool | None, window: int, num_splits: int) -> bool:
    """Whether a build's split CTAs run partial bitrev(y) at grid index y: `requested`, or with None
    the rule of the build's split plan (`attn2_layout.spread_splits`: split plans without a window).
    ValueError for True on a one-split plan (one CTA a KV head and request: no order)."""
    _require(num_splits > 1 or not requested,
             f"spread_splits: a one-split plan (num_splits {num_splits}) has one CTA a KV head and request")
    return lay.spread_splits(window, num_splits) if requested is None else requested


def compile_attn2(num_kv_heads: int, max_model_len: int, window: int, build: Attn2Build = Attn2Build()) -> CompiledAttn2:
    """The compiled attn2 kernels of a deployment (one compile per process: the one cache).
    Compiles from fake tensors, so no GPU is needed for an explicit target; RuntimeError during
    CUDA-graph capture; ValueError outside the contract."""
    knobs = _variant(num_kv_heads, max_model_len, window, build.num_splits, build.splits_per_cta)
    per_step = resolved_pages_per_step(build.pages_per_step, window, knobs["num_splits"])
    knobs["enable_pdl"] = bool(build.enable_pdl)
    knobs["trace"] = build.trace
    arch = build.arch or os.environ.get("CUTE_DSL_ARCH")
    target = arch or _device_arch()
    bf16 = cutlass.BFloat16
    wgmma = tensor_ops_for(target, build.tensor_ops) == "wgmma"
    issue = build.issue if build.issue is not None else deployment_issue(wgmma, per_step, knobs["splits_per_cta"])
    # the ring's depth: the build's (an experiment) or the deployment's rule (`attn2_layout.ring_stages`)
    ring = build.ring_stages or lay.ring_stages(window, num_kv_heads, knobs["num_splits"], knobs["splits_per_cta"],
                                                deferred=issue.defer_values)
    split_knobs = dict(knobs, **issue.knobs(), pages_per_step=per_step, ring_stages=ring)
    split_knobs["ctas_per_sm"] = lay.split_ctas_per_sm(target)
    split_knobs["wgmma"] = wgmma
    split_knobs["loads_only"] = build.loads_only
    if build.weight_terms != 2:  # the deployments' keys (and PTX) stay as they were
        _require(wgmma, f"weight_terms 1 needs tensor_ops 'wgmma' (sm_90a), the build's is {build.tensor_ops!r} "
                        f"on {target}")
        split_knobs["weight_terms"] = build.weight_terms

    def compile_split() -> Any:
        return compiler(arch, build.ptx_dir)(
            _Attn2Kernel(**split_knobs),
            fake_flat(bf16, 8, ALIGN),  # q (strided rows: the row stride is a runtime argument)
            fake_flat(bf16, 8, ALIGN),  # gate
            fake_flat(bf16, lay.PAGE_BYTES // BF16_BYTES, ALIGN),  # kv_cache
            fake_flat(Int32, 1, ALIGN),  # page_table
            fake_flat(Int32, 1, 4),  # seq_lens (its length is the request count)
            fake_flat(bf16, 8, ALIGN),  # out
            fake_flat(cutlass.Uint8, 16, ALIGN),  # workspace
            Int32(1), Int32(1), Int32(1),
            cuda.CUstream(0),
        )

    combine_knobs = {k: v for k, v in knobs.items() if k != "max_pages"}
    _require(knobs["num_splits"] > 1 or not (build.full_tree or build.early_release),
             "full_tree and early_release are the combine's and the split-to-combine release's: a one-split plan "
             f"(max_model_len {max_model_len} <= SHORT_MAX_LEN, or num_splits 1) has neither")
    if build.full_tree:  # the deployments' keys stay as they were
        combine_knobs["full_tree"] = True
    if build.early_release:  # the deployments' keys stay as they were
        combine_knobs["early_release"] = True
        split_knobs["early_release"] = True
    # the split kernel's split-plan switches (`Attn2Build.empty_ctas_exit`, `Attn2Build.spread_splits`):
    # None is the deployment's rule (the early end for split plans; the spread for split plans without a
    # window, `resolved_spread_splits`); True is refused on a one-split plan. A switch enters the keys only
    # when on: the keys of deployments without it stay as they were
    split_plan = knobs["num_splits"] > 1
    _require(split_plan or not build.empty_ctas_exit,
             f"empty_ctas_exit: a one-split plan (max_model_len {max_model_len} <= SHORT_MAX_LEN, or num_splits 1): "
             "its CTA always has pages")
    if split_plan if build.empty_ctas_exit is None else build.empty_ctas_exit:
        split_knobs["empty_ctas_exit"] = True
    if resolved_spread_splits(build.spread_splits, window, knobs["num_splits"]):
        split_knobs["spread_splits"] = True

    def compile_combine() -> Any:
        return compiler(arch, build.ptx_dir)(
            _Attn2CombineKernel(**combine_knobs),
            fake_flat(bf16, 8, ALIGN),  # gate
            fake_flat(Int32, 1, 4),  # seq_lens
            fake_flat(bf16, 8, ALIGN),  # out
            fake_flat(cutlass.Uint8, 16, ALIGN),  # workspace
            Int32(1), Int32(1),
            cuda.CUstream(0),
        )

    what = "attn2 (musebench.cute_ops.prepare_attn2)"
    split = compilation.compiled(compilation.kernel_key(_Attn2Kernel, arch=build.arch, ptx_dir=build.ptx_dir,
                                                        **split_knobs), compile_split, what=what)
    combine = None
    if knobs["num_splits"] > 1:
        key = compilation.kernel_key(_Attn2CombineKernel, arch=build.arch, ptx_dir=build.ptx_dir, **combine_knobs)
        combine = compilation.compiled(key, compile_combine, what=what)
    return CompiledAttn2(split, combine)


def prepare(*, num_kv_heads: int, max_model_len: int, window: int, enable_pdl: bool = True) -> None:
    """Compile a deployment's kernels before capture (`cute_ops.prepare_attn2`)."""
    compile_attn2(num_kv_heads, max_model_len, window, Attn2Build(enable_pdl=enable_pdl))


def _trace_ctas(num_reqs: int, num_kv_heads: int, num_splits: int, splits_per_cta: int | None) -> tuple[int, int]:
    """(split CTAs, combine CTAs) of a launch, a trace row each: num_reqs x num_kv_heads x
    num_splits / splits_per_cta (None: the layout's), and with splits num_reqs x num_kv_heads x 64
    (none with one split). ValueError where `attn2_layout.workspace_bytes` refuses the plan."""
    lay.workspace_bytes(num_reqs, num_kv_heads, num_splits, splits_per_cta)  # its refusals (ValueError)
    per_cta = lay.splits_per_cta(num_kv_heads, num_splits) if splits_per_cta is None else splits_per_cta
    lay.check_splits_per_cta(per_cta, num_splits)
    split_ctas = num_reqs * num_kv_heads * (num_splits // per_cta)
    return split_ctas, (num_reqs * num_kv_heads * lay.ROWS_PER_KV_HEAD if num_splits > 1 else 0)


def trace_bytes(num_reqs: int, num_kv_heads: int, num_splits: int, splits_per_cta: int | None = None) -> int:
    """Bytes of a traced launch's trace rows (`Attn2Build.trace`): TRACE_ROW_BYTES for every split
    and every combine CTA (`_trace_ctas`). They follow the partials in the workspace
    (`traced_workspace_bytes`, `trace_rows`)."""
    return sum(_trace_ctas(num_reqs, num_kv_heads, num_splits, splits_per_cta)) * TRACE_ROW_BYTES


def traced_workspace_bytes(num_reqs: int, num_kv_heads: int, num_splits: int,
                           splits_per_cta: int | None = None) -> int:
    """The workspace a traced launch needs: the partials (`attn2_layout.workspace_bytes`, 0 with one
    split), then the trace rows (`trace_bytes`)."""
    return (lay.workspace_bytes(num_reqs, num_kv_heads, num_splits, splits_per_cta)
            + trace_bytes(num_reqs, num_kv_heads, num_splits, splits_per_cta))


def trace_rows(workspace: torch.Tensor, num_reqs: int, num_kv_heads: int, num_splits: int,
               splits_per_cta: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Views of a traced launch's rows in its workspace (uint8, at least `traced_workspace_bytes`):
    (split rows int64 [split CTAs, TRACE_WORDS], SPLIT_TRACE_FIELDS, row (request x KV heads + KV
    head) x partials + partial; combine rows int64 [combine CTAs, TRACE_WORDS], COMBINE_TRACE_FIELDS,
    row (request x KV heads + KV head) x 64 + the CTA's row, or None with one split). A split CTA's
    row is written whether or not it has pages; a launch writes every row of both."""
    need = traced_workspace_bytes(num_reqs, num_kv_heads, num_splits, splits_per_cta)
    _require(isinstance(workspace, torch.Tensor) and workspace.dtype == torch.uint8 and workspace.dim() == 1
             and workspace.numel() >= need and workspace.is_contiguous() and workspace.data_ptr() % 8 == 0,
             f"workspace must be a contiguous uint8 tensor of >= {need} bytes (traced_workspace_bytes)")
    start = lay.workspace_bytes(num_reqs, num_kv_heads, num_splits, splits_per_cta)
    split_ctas, _ = _trace_ctas(num_reqs, num_kv_heads, num_splits, splits_per_cta)
    rows = workspace[start:need].view(torch.int64).view(-1, TRACE_WORDS)
    return rows[:split_ctas], (rows[split_ctas:] if num_splits > 1 else None)


def check_launch(q: torch.Tensor, gate: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None, *, max_model_len: int,
                 window: int, num_splits: int | None = None, splits_per_cta: int | None = None,
                 trace: bool = False) -> int:
    """Refuse (ValueError) arguments outside `cute_ops.launch_attn2`'s contract; the split count.
    `trace` (the traced build): the workspace must also hold the trace rows
    (`traced_workspace_bytes`, with one split as well)."""
    _require(isinstance(trace, bool), f"trace must be a bool, got {trace!r}")
    variant = _variant(int(kv_cache.shape[1]) if kv_cache.dim() == 4 else -1, max_model_len, window, num_splits,
                       splits_per_cta)
    heads = variant["num_kv_heads"]
    bf16 = torch.bfloat16
    _require(kv_cache.dtype == bf16 and kv_cache.dim() == 4 and tuple(kv_cache.shape[2:]) == (lay.PAGE_TOKENS,
             lay.SLOT_WIDTH) and kv_cache.is_contiguous(),
             f"kv_cache must be contiguous bf16 [pages, K, 16, 128], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    _require(kv_cache.data_ptr() % ALIGN == 0, "kv_cache must be 16-byte aligned (cp.async reads it in 16 bytes)")
    _require(seq_lens.dtype == torch.int32 and seq_lens.dim() == 1 and seq_lens.numel() >= 1 and seq_lens.is_contiguous(),
             "seq_lens must be a contiguous int32 [R] (R >= 1)")
    reqs = seq_lens.numel()
    width = heads * lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM
    for name, t in (("q", q), ("gate", gate), ("out", out)):
        _require(t.dtype == bf16 and t.dim() == 2 and tuple(t.shape) == (reqs * lay.QUERY_LEN, width)
                 and t.stride(1) == 1, f"{name} must be bf16 [{reqs * lay.QUERY_LEN}, {width}] with a contiguous last "
                 f"dim, got {t.dtype} {tuple(t.shape)}")
        _require(t.data_ptr() % ALIGN == 0 and (t.stride(0) * BF16_BYTES) % ALIGN == 0,
                 f"{name}'s rows must be 16-byte aligned")
    _require(out.is_contiguous(), "out must be contiguous")
    _require(page_table.dtype == torch.int32 and tuple(page_table.shape) == (reqs, variant["max_pages"])
             and page_table.is_contiguous(),
             f"page_table must be contiguous int32 [{reqs}, {variant['max_pages']}], got {page_table.dtype} "
             f"{tuple(page_table.shape)}")
    devices = {t.device for t in (q, gate, kv_cache, page_table, seq_lens, out)}
    _require(len(devices) == 1 and next(iter(devices)).type == "cuda", "every tensor must be on one CUDA device")
    splits = variant["num_splits"]
    need = lay.workspace_bytes(reqs, heads, splits, variant["splits_per_cta"])
    what = ""
    if trace:
        need = traced_workspace_bytes(reqs, heads, splits, variant["splits_per_cta"])
        what = " (traced: the partials, then the trace rows, traced_workspace_bytes)"
    if need:
        _require(workspace is not None and workspace.dtype == torch.uint8 and workspace.numel() >= need
                 and workspace.is_contiguous() and workspace.data_ptr() % ALIGN == 0 and workspace.device in devices,
                 f"workspace must be a contiguous, 16-byte aligned uint8 tensor of >= {need} bytes on the device{what}")
    return splits


def _rows_span(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view from t's first element to its last, across the row stride (a column view of the
    QKV front's rows is not contiguous; the kernel indexes rows with the stride it is given)."""
    rows, width = t.shape
    return t.as_strided(((rows - 1) * t.stride(0) + width,), (1,))


def launch(q: torch.Tensor, gate: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
           seq_lens: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None, *, max_model_len: int,
           window: int, enable_pdl: bool = True, num_splits: int | None = None,
           issue: SplitIssue | None = None, tensor_ops: str | None = None, splits_per_cta: int | None = None,
           pages_per_step: int | None = None, ring_stages: int | None = None, trace: bool = False,
           loads_only: bool = False, weight_terms: int = 2, full_tree: bool = False,
           early_release: bool = False, empty_ctas_exit: bool | None = None,
           spread_splits: bool | None = None) -> None:
    """`cute_ops.launch_attn2` (its docstring is the contract): the split kernel, then with splits
    the combine, on the current stream. `num_splits`, `issue` (None: the deployment's,
    `deployment_issue`), `tensor_ops`, `splits_per_cta`,
    `pages_per_step` (None: the rule's, `attn2_layout.pages_per_step`; 1 or 2 forced) and
    `ring_stages` (None: the rule's, `attn2_layout.ring_stages`): experiments only (`Attn2Build`; refused before any
    compile or launch outside their choices). `trace` (an experiment, `Attn2Build.trace`): the
    traced build, which also writes every CTA's clocks into the workspace past the partials (it must
    hold `traced_workspace_bytes`, one split included; read back with `trace_rows`). `loads_only`
    (a timing probe, `Attn2Build.loads_only`): the split kernel without its arithmetic; `out` is then
    not attention. `weight_terms` 1 (an experiment, `Attn2Build.weight_terms`): P V from p_hi alone.
    `full_tree` (an experiment, `Attn2Build.full_tree`): the combine's whole upper tree always.
    `early_release` (an experiment, `Attn2Build.early_release`): dependents released after each wait.
    `empty_ctas_exit` (`Attn2Build.empty_ctas_exit`; None: the deployment's rule): False keeps the
    split CTAs without pages running the whole prologue (the A/B baseline); the same bits.
    `spread_splits` (`Attn2Build.spread_splits`; None: the deployment's rule,
    `attn2_layout.spread_splits`): False runs partial y at grid index y, True partial bitrev(y) (each
    the A/B baseline of the rule's other order); the same bits."""
    build = Attn2Build(enable_pdl=enable_pdl, num_splits=num_splits, issue=issue, tensor_ops=tensor_ops,
                       splits_per_cta=splits_per_cta, pages_per_step=pages_per_step, ring_stages=ring_stages,
                       trace=trace, loads_only=loads_only, weight_terms=weight_terms, full_tree=full_tree,
                       early_release=early_release, empty_ctas_exit=empty_ctas_exit, spread_splits=spread_splits)
    splits = check_launch(q, gate, kv_cache, page_table, seq_lens, out, workspace, max_model_len=max_model_len,
                          window=window, num_splits=num_splits, splits_per_cta=splits_per_cta, trace=trace)
    compiled = compile_attn2(int(kv_cache.shape[1]), max_model_len, window, build)
    if not trace and (workspace is None or splits == 1):
        workspace = out.view(torch.uint8)  # never read with one split: any 16-byte aligned tensor serves
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    gate_rows = cute_flat(_rows_span(gate), ALIGN, 8)
    lengths = cute_flat(seq_lens, 4, 1)
    out_flat = cute_flat(out, ALIGN, 8)
    workspace_flat = cute_flat(workspace, ALIGN, 16)
    compiled.split(cute_flat(_rows_span(q), ALIGN, 8), gate_rows, cute_flat(kv_cache, ALIGN, lay.PAGE_BYTES // BF16_BYTES),
                   cute_flat(page_table, ALIGN, 1), lengths, out_flat, workspace_flat, Int32(q.stride(0) // 2),
                   Int32(gate.stride(0) // 2), Int32(seq_lens.numel()), stream)
    if compiled.combine is not None:
        compiled.combine(gate_rows, lengths, out_flat, workspace_flat, Int32(gate.stride(0) // 2),
                         Int32(seq_lens.numel()), stream)
