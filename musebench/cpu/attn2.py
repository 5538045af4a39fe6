"""The CPU model of attn2's kernel (`musebench.kernels.attn2`): its exact algorithm in torch, so a
GPU run only has to confirm that the device code does what this does.

Same as the kernel: the split plan (`attn2_layout.split_pages`: page p in split p % S, ascending),
the pages a CTA visits (those holding keys of [first visible key, L)), the mask (causal, window,
keys at and past L), the online softmax in FP32 on unscaled scores (row maxima of s = fp32(q.k);
p = 2^(fp32(s - m_use) * fp32(scale log2 e)), the difference rounded before the product, exact
for keys near the max; m_use = m_new, or 0 while a row has seen no key, so a masked page is an
exact no-op; the merge's weights likewise),
P split into two BF16 terms (p_hi = bf16(p), p_lo = bf16(p - p_hi): two P V mmas, so P keeps
about 16 bits where one BF16 P would keep 8), O and l rescaled by alpha (FP32 products; skipped,
the same bits, where every alpha of a warp is 1.0) and then accumulated by the tensor cores
(`accumulate_page`: p_lo's step, then p_hi's, over V with an n-tile of ones beside it whose
accumulator is l, so the row sums cost no FP32 adds), the fixed merge tree
(left child first, O = O_L w_L + O_R w_R as two products and one sum), o = O / l rounded to BF16,
the norm's sum of squares in the kernel's lane order (lane c of a quad holds dims 8t + 2c,
8t + 2c + 1 of n-tile t, the mma's natural C layout, `attn2_layout.lane_dims`; it sums its 16
squares t ascending from +0.0, then the quad (0 + 1) + (2 + 3)), rstd = 1 / sqrt(ss / 64 + eps),
then x rstd sigmoid(g). With `pages_per_step` 2 (`Attn2Build.pages_per_step`; the deployments'
rule, `attn2_layout.pages_per_step`, takes it for split plans without a window) a step of the
online softmax takes two of a split's pages (`attn2_layout.split_steps`, `softmax_step`): one max,
one alpha, one rescale for their 32 keys, then their P V steps page by page. Only the sum of
squares depends on which lane holds which dim: every other step is element-wise or sums over keys, whose order the layout does not touch.

The tensor cores, emulated (`tc_mma`): one m16n8k16 step is D = RZ(C + sum of the 16 products),
the products exact and summed without rounding, the result truncated to FP32 (round toward zero:
the tensor cores of Volta through Hopper align and truncate rather than round, Fasi et al., "Numerical
behavior of NVIDIA tensor cores", PeerJ CS 2021). Q K^T is the chain of its four k-steps from
zero, as the kernel issues them. Modelling this matters: with round to nearest instead, the model
missed the H200 by up to 653 BF16 ULPs at L = 2048 (then one split, a chain of 128 pages; scores
near 4000 lose up to an FP32 ULP, 2^-12, per truncation; a long chain of P V mmas into one
accumulator drifts toward zero), while
this emulation (of the kernel as it then was) reproduced the worst elements of its three failing
`large` cases to the ULP (197, 653 and 68 ULPs).

Not the same, by design: the exact sum inside a tensor core step (the hardware keeps a few guard
bits, not all) and the GPU's ex2.approx (relative error about 2^-22); so the GPU agrees with this
model to within a few ULPs, not bitwise. The model's own bits are exact, ordered arithmetic, so
it also proves the determinism argument: a row that sees the same keys gets the same bits at every
L (tests/cpu/test_attn2_model.py).
"""

from __future__ import annotations


from dataclasses import dataclass

import torch

from musebench import attn2_layout as lay
from musebench import config
from musebench.stock.attn2 import Attn2Problem, bf16_ulp

LOG2_E = 1.4426950408889634
NEG_INF = float("-inf")


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def tc_mma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """One tensor-core step as the model takes it: FP32 [M, N] = RZ(c + a @ b) for a [M, 16] and
    b [16, N] holding BF16 values (as FP32) and c FP32 [M, N]. The products are exact in FP64 and
    summed in a fixed order (k ascending, after c), exact for all but extreme exponent spreads;
    the sum is truncated to FP32 toward zero."""
    if a.shape[1] != 16 or b.shape[0] != 16:
        raise ValueError(f"an mma step takes k = 16, got {tuple(a.shape)} @ {tuple(b.shape)}")
    a64, b64 = a.double(), b.double()
    acc = c.double()
    for k in range(16):
        acc = acc + a64[:, k : k + 1] * b64[k : k + 1, :]
    return round_toward_zero_f32(acc)


def round_toward_zero_f32(x: torch.Tensor) -> torch.Tensor:
    """FP64 -> FP32, rounded toward zero (NaN and inf pass through)."""
    nearest = x.float()
    overshoot = torch.isfinite(x) & (nearest.double().abs() > x.abs())
    return torch.where(overshoot, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)


def page_scores(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Q K^T of one page as the kernel's mma chain: q FP32 [64, 64], keys FP32 [16, 64] ->
    FP32 [64, 16], the four k-steps (dims 16 kk .. 16 kk + 15) in order from zero."""
    keys_t = keys.T.contiguous()
    acc = torch.zeros(q.shape[0], keys.shape[0], dtype=torch.float32)
    for kk in range(lay.HEAD_DIM // 16):
        acc = tc_mma(q[:, 16 * kk : 16 * kk + 16], keys_t[16 * kk : 16 * kk + 16], acc)
    return acc


def page_values(p_hi: torch.Tensor, p_lo: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """P V of one page in a fresh accumulator: p_lo's step from zero, then p_hi's on top (the
    tensor cores' steps alone: the wgmma probe's reference; the kernel accumulates into O,
    `accumulate_page`)."""
    zero = torch.zeros(p_hi.shape[0], values.shape[1], dtype=torch.float32)
    return tc_mma(p_hi, values, tc_mma(p_lo, values, zero))


def weight(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as the split kernel's ex2.approx.ftz takes it: a result below 2^-126 (FP32's
    smallest normal) is +0.0. What that drops is invisible: a row's weights include its max's, 1.0,
    so l >= 1 and a weight below 2^-126 moves O / l by less than 2^-100 of a value's scale (unless
    a V element is within 2^26 of FP32's largest: not a cache a model writes)."""
    value = torch.exp2(exponent)
    return torch.where(value < 2.0**-126, torch.zeros((), dtype=value.dtype), value)


ONES_COLUMNS = 8  # the n-tile of ones beside V: its accumulator is the row sum l


def accumulate_page(o: torch.Tensor, lsum: torch.Tensor, p_hi: torch.Tensor, p_lo: torch.Tensor,
                    values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, l) after one page, both already rescaled by alpha: the tensor cores accumulate into
    them, p_lo's step then p_hi's, over V with an n-tile of ones beside it ([16, 64 + 8]: the ones'
    columns sum each row's P, so l rides in the same chain as O; its 8 columns are equal, and l is
    the first). Each step truncates at the accumulator's scale, toward zero: a split's chain of n
    pages (a deployment's n: at most 4 with one split, `attn2_layout.SHORT_MAX_LEN`; 32 at 128k with
    256 splits; 128 for an experiment forcing one split at 2048) leaves O and l within 2n FP32 ULPs
    of the rounded sums (2^-16 relative at n = 128, a 256th of a BF16 ULP)."""
    ones = torch.ones(values.shape[0], ONES_COLUMNS, dtype=torch.float32)
    acc = torch.cat([o, lsum[:, None].expand(-1, ONES_COLUMNS)], dim=1)
    acc = tc_mma(p_hi, torch.cat([values, ones], dim=1), tc_mma(p_lo, torch.cat([values, ones], dim=1), acc))
    return acc[:, : values.shape[1]], acc[:, values.shape[1]]


def _lane_sum_squares64(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares of [rows, 64] FP32 in the kernel's order: lane c holds dims 8t + 2c + k
    (`attn2_layout.lane_dims(c)`: the mma's natural C layout), summed in that order (t ascending,
    k = 0 then 1) from +0.0, then the quad (0 + 1) + (2 + 3)."""
    lanes = []
    for c in range(4):
        acc = torch.zeros(x.shape[0], dtype=torch.float32)
        for d in lay.lane_dims(c):
            v = x[:, d]
            acc = acc + v * v
        lanes.append(acc)
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3])


def split_partial(q: torch.Tensor, cache: torch.Tensor, table_row: torch.Tensor, kv_head: int, seq_len: int,
                  window: int, split: int, num_splits: int, scale_log2: torch.Tensor,
                  pages_per_step: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One split's partial: (O FP32 [64, 64], m [64], l [64]) for the 64 rows [token t, head j] of
    one KV head (row = 8 t + j), over the pages of split `split`, `pages_per_step` pages a step of
    the online softmax (`attn2_layout.split_steps`, `softmax_step`; None: the plan's rule,
    `attn2_layout.pages_per_step`, which reads only the plan's split count and window: 2 for
    num_splits > 1 without a window, else 1)."""
    if pages_per_step is None:
        pages_per_step = lay.pages_per_step(window, num_splits)
    rows = lay.ROWS_PER_KV_HEAD
    first, end = lay.visible_keys(seq_len, window)
    o = torch.zeros(rows, lay.HEAD_DIM, dtype=torch.float32)
    m = torch.full((rows,), NEG_INF, dtype=torch.float32)
    lsum = torch.zeros(rows, dtype=torch.float32)
    qf = q.float()
    for step in lay.split_steps(split, num_splits, first // lay.PAGE_TOKENS, lay.max_pages(end), pages_per_step):
        slots = [cache[int(table_row[page]), kv_head].float() for page in step]  # [16, 128] each
        o, m, lsum = softmax_step(qf, step, slots, seq_len, window, scale_log2, o, m, lsum)
    return o, m, lsum


def softmax_step(qf: torch.Tensor, pages: tuple, slots: list[torch.Tensor], seq_len: int, window: int,
                 scale_log2: torch.Tensor, o: torch.Tensor, m: torch.Tensor, lsum: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the online softmax over `pages` (one or two logical pages, ascending; `slots`
    their FP32 [16, 128] K | V of the KV head) for the 64 rows of qf FP32 [64, 64]: S per page (its
    own k-step chain from zero), the mask per page, one row max over the step's keys and m, one
    alpha, P of every key as p_hi + p_lo, (O, l) rescaled once, then per page in order p_lo's and
    p_hi's P V steps (`accumulate_page`). Returns the new (O, m, l). A page no row sees adds
    nothing (P 0, and the max does not move): a step with it is the step without it, bit for bit."""
    token = torch.arange(lay.ROWS_PER_KV_HEAD) // lay.HEADS_PER_KV_HEAD
    last_key = seq_len - lay.QUERY_LEN + token  # row's own position
    first_key = (last_key - window + 1).clamp_min(0) if window else torch.zeros_like(last_key)
    scores = []
    loaded = []
    for page, page_slots in zip(pages, slots):
        keys_idx = page * lay.PAGE_TOKENS + torch.arange(lay.PAGE_TOKENS)
        in_l = keys_idx < seq_len
        page_slots = torch.where(in_l[:, None], page_slots, torch.zeros(()))  # slots past L: never loaded, zeros
        s = page_scores(qf, page_slots[:, : lay.HEAD_DIM])
        visible = (keys_idx[None, :] <= last_key[:, None]) & (keys_idx[None, :] >= first_key[:, None])
        scores.append(torch.where(visible, s, torch.full((), NEG_INF)))
        loaded.append(page_slots)
    s = torch.cat(scores, dim=1)
    m_new = torch.maximum(m, s.max(dim=1).values)
    m_use = torch.where(m_new == NEG_INF, torch.zeros(()), m_new)
    alpha = weight((m - m_use) * scale_log2)
    p = weight((s - m_use[:, None]) * scale_log2)
    p_hi = p.to(torch.bfloat16).float()
    p_lo = (p - p_hi).to(torch.bfloat16).float()
    o, lsum = o * alpha[:, None], lsum * alpha
    for k, page_slots in enumerate(loaded):
        keys = slice(k * lay.PAGE_TOKENS, (k + 1) * lay.PAGE_TOKENS)
        o, lsum = accumulate_page(o, lsum, p_hi[:, keys], p_lo[:, keys], page_slots[:, lay.HEAD_DIM :])
    return o, m_new, lsum


def merge(left: tuple, right: tuple, scale_log2: torch.Tensor) -> tuple:
    """One merge-tree node: (O, m, l) of the left child, then the right's; m are raw row maxima,
    w = 2^((m - top) scale log2 e) with the difference and the product rounded in FP32."""
    o_l, m_l, l_l = left
    o_r, m_r, l_r = right
    top = torch.maximum(m_l, m_r)
    use = torch.where(top == NEG_INF, torch.zeros(()), top)
    w_l, w_r = torch.exp2((m_l - use) * scale_log2), torch.exp2((m_r - use) * scale_log2)
    return o_l * w_l[:, None] + o_r * w_r[:, None], top, l_l * w_l + l_r * w_r


def merge_tree(partials: list[tuple], scale_log2: torch.Tensor) -> tuple:
    """The fixed tree over num_splits (a power of two) partials: level by level, pairs (2j, 2j+1)."""
    level = list(partials)
    while len(level) > 1:
        level = [merge(level[2 * j], level[2 * j + 1], scale_log2) for j in range(len(level) // 2)]
    return level[0]


def epilogue(o: torch.Tensor, lsum: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """out bf16 [64, 64] from the merged (O, l) and the gate rows bf16 [64, 64]."""
    x = (o / lsum[:, None]).to(torch.bfloat16).float()
    ss = _lane_sum_squares64(x)
    rstd = 1.0 / torch.sqrt(ss * (1.0 / lay.HEAD_DIM) + _f32(eps))
    sig = 1.0 / (1.0 + torch.exp(-gate.float()))
    return ((x * rstd[:, None]) * sig).to(torch.bfloat16)


def attn2_model(problem: Attn2Problem, num_splits: int | None = None, scale: float = config.ATTN_SCALE,
                eps: float = config.RMS_NORM_EPS, pages_per_step: int | None = None) -> torch.Tensor:
    """The kernel's output, bf16 [8 R, 512 K], computed on the CPU as the kernel computes it;
    `num_splits` defaults to the deployment's (`attn2_layout.splits`), `pages_per_step` is
    `Attn2Build.pages_per_step`'s (1 or 2; ValueError otherwise; None: the plan's rule,
    `attn2_layout.pages_per_step`, as the kernel's default)."""
    p = problem.to("cpu")
    heads = p.num_kv_heads
    splits = num_splits or lay.splits(p.max_model_len, p.window, heads)
    if pages_per_step is None:
        pages_per_step = lay.pages_per_step(p.window, splits)
    lay.check_pages_per_step(pages_per_step)
    scale_log2 = _f32(scale * LOG2_E)
    out = torch.empty_like(p.q)
    width = lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM
    for r in range(p.num_reqs):
        seq_len = min(max(int(p.seq_lens[r]), lay.QUERY_LEN), p.max_model_len)
        rows = slice(r * lay.QUERY_LEN, (r + 1) * lay.QUERY_LEN)
        for h in range(heads):
            cols = slice(h * width, (h + 1) * width)
            q = p.q[rows, cols].reshape(lay.ROWS_PER_KV_HEAD, lay.HEAD_DIM)  # row 8 t + j
            gate = p.gate[rows, cols].reshape(lay.ROWS_PER_KV_HEAD, lay.HEAD_DIM)
            partials = [split_partial(q, p.kv_cache, p.page_table[r], h, seq_len, p.window, s, splits, scale_log2,
                                      pages_per_step)
                        for s in range(splits)]
            o, _, lsum = merge_tree(partials, scale_log2)
            out[rows, cols] = epilogue(o, lsum, gate, eps).reshape(lay.QUERY_LEN, width)
    return out




# How close the GPU must come to the model. An element-wise ULP bound cannot be the test: an
# output element that is the small difference of large terms (o near 0 in its row, the RMS norm
# then keeps it small) moves by hundreds of its own ULPs when a score's last FP32 bit moves, and the
# tensor cores' exact guard bits are not documented. So the bound is at the row's scale: every
# element within AGREE_ROW_ULPS BF16 ULPs of its 64-wide head row's largest |model| element (a
# wrong key, page, mask or scale moves whole rows by much more), and the mean element-wise error
# small (AGREE_MEAN_ULPS: a systematic drift shows in the mean long before in the max).
AGREE_ROW_ULPS = 2.0
AGREE_MEAN_ULPS = 0.25


@dataclass(frozen=True)
class Agreement:
    """`got` against the model: `row_max` (max |got - model| in BF16 ULPs of the element's head
    row's largest |model|), `elem_max` and `elem_mean` (in ULPs of the element itself), `over`
    (elements past 2 of their own ULPs) and the worst element (`worst`: (row, column, got,
    model)), for a failure message that names where to look."""

    row_max: float
    elem_max: float
    elem_mean: float
    over: int
    nonfinite: int
    worst: tuple[int, int, float, float]

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.row_max <= AGREE_ROW_ULPS and self.elem_mean <= AGREE_MEAN_ULPS

    def describe(self) -> str:
        row, col, got, want = self.worst
        head, dim = divmod(col, lay.HEAD_DIM)
        return (f"row-scaled max {self.row_max:.3g} ULP (bound {AGREE_ROW_ULPS}), element max {self.elem_max:.3g} "
                f"mean {self.elem_mean:.4f} (bound {AGREE_MEAN_ULPS}), {self.over} elements > 2 ULP, "
                f"{self.nonfinite} non-finite; worst at query row {row} (token {row % lay.QUERY_LEN}), head {head} "
                f"(KV head {head // lay.HEADS_PER_KV_HEAD}), dim {dim}: got {got!r}, model {want!r}")


def agreement(got: torch.Tensor, model: torch.Tensor) -> Agreement:
    """Compare a kernel output with `attn2_model`'s, both bf16 [8 R, 512 K] (any device)."""
    if got.shape != model.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(model.shape)}")
    g, m = got.detach().cpu().double(), model.detach().cpu().double()
    rows, width = m.shape
    bad = torch.isfinite(m) & ~torch.isfinite(g)
    diff = torch.where(bad, torch.zeros(()), (g - m).abs())
    row_scale = m.abs().view(rows, -1, lay.HEAD_DIM).amax(-1, keepdim=True).expand(-1, -1, lay.HEAD_DIM)
    row_err = diff / bf16_ulp(row_scale.reshape(rows, width))
    elem_err = diff / bf16_ulp(m)
    flat = int(row_err.argmax())
    r, c = divmod(flat, width)
    return Agreement(float(row_err.max()), float(elem_err.max()), float(elem_err.mean()), int((elem_err > 2).sum()),
                     int(bad.sum()), (r, c, float(g[r, c]), float(m[r, c])))
