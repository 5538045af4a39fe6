"""attn2's references: the FP64 reference of the whole verify step, the stock path a GPU runs
(torch SDPA, then the Triton `rms_norm_gated` arithmetic), and the error metric.

The step (issue 15): one request's 8 query rows at positions L - 8 .. L - 1, per query head h of
KV head h // 8: row t sees keys k with max(0, L - 8 + t - W + 1) <= k <= L - 8 + t (W the window,
W keys including the row's own; FlashInfer's window_left = W - 1; no window: from key 0);
o = softmax(scale * q K^T) V; out = bf16(rms_norm(bf16(o)) * sigmoid(gate)), the RMS norm
weightless over head_dim with eps. Both stocks round o to BF16 before the o-norm, so the reference
does too.

- `attn2_reference`: scores, softmax and o in FP64 from the BF16 cache, o rounded to BF16, the
  norm and the gate in FP64, then BF16. Also returns the FP64 value before the last rounding:
  errors are measured against it (`ulp_error`).
- `sdpa_attention` + `rms_norm_gated_emulation`: the stock that runs on an H200 (vLLM 0.33.0 picks
  FlashAttention 3 there; torch's SDPA flash backend stands in, on K/V gathered contiguous, one
  call per query row so each row gets exactly its keys without a mask the flash backend cannot
  take), then `vllm/third_party/flash_linear_attention/ops/fused_norm_gate.py`'s arithmetic in
  FP32: var = sum(x * x) / D, rstd = 1 / sqrt(var + eps), y = x * rstd, y = y * sigmoid(g),
  stored as BF16 (the summation order of its tl.sum is the compiler's; torch's stands in).
- `ulp_error`: |got - ref| in units of the BF16 spacing at the reference (2^(e - 7) for
  2^e <= |ref| < 2^(e + 1), the subnormal spacing 2^-133 below 2^-126): a correctly rounded
  result is within 0.5.

Imports torch only (no kernels, no harness): the reference never depends on what it checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from musebench import attn2_layout as lay
from musebench import config

BF16_MANTISSA_BITS = 7
BF16_MIN_NORMAL_EXP = -126
BF16_SUBNORMAL_ULP = 2.0**-133


@dataclass(frozen=True)
class Attn2Problem:
    """One launch's inputs (CPU or GPU tensors): q, gate bf16 [8 R, 512 K]; kv_cache bf16
    [pages, K, 16, 128]; page_table int32 [R, max_pages]; seq_lens int32 [R]; the deployment's
    max_model_len and window (0: none)."""

    q: torch.Tensor
    gate: torch.Tensor
    kv_cache: torch.Tensor
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    max_model_len: int
    window: int = 0

    @property
    def num_kv_heads(self) -> int:
        return int(self.kv_cache.shape[1])

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def to(self, device: torch.device | str) -> Attn2Problem:
        return Attn2Problem(self.q.to(device), self.gate.to(device), self.kv_cache.to(device),
                            self.page_table.to(device), self.seq_lens.to(device), self.max_model_len, self.window)


def gather_kv(kv_cache: torch.Tensor, page_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request, [K heads, L, 64] each, gathered contiguous through its page-table
    row (only the pages holding keys 0 .. L - 1 are read)."""
    pages = page_row[: lay.max_pages(seq_len)].long().to(kv_cache.device)
    slots = kv_cache.index_select(0, pages)  # [n, K, 16, 128]
    slots = slots.permute(1, 0, 2, 3).reshape(kv_cache.shape[1], -1, lay.SLOT_WIDTH)[:, :seq_len]
    return slots[..., : lay.HEAD_DIM].contiguous(), slots[..., lay.HEAD_DIM :].contiguous()


def key_range(seq_len: int, row: int, window: int) -> tuple[int, int]:
    """[first, end) of the keys row `row` (0..7) of a request of length L sees."""
    end = seq_len - lay.QUERY_LEN + row + 1
    first = max(0, end - window) if window else 0
    return first, end


def _check(problem: Attn2Problem) -> None:
    q = problem.q
    rows, width = q.shape
    heads = problem.num_kv_heads
    if width != heads * lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM or rows != problem.num_reqs * lay.QUERY_LEN:
        raise ValueError(f"q {tuple(q.shape)} does not fit {problem.num_reqs} requests of {heads} KV heads")
    for r in range(problem.num_reqs):
        seq_len = int(problem.seq_lens[r])
        if not lay.QUERY_LEN <= seq_len <= problem.max_model_len:
            raise ValueError(f"request {r}: L = {seq_len} outside [8, {problem.max_model_len}]")


def norm_gate_fp64(o: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """FP64 rms_norm(o) * sigmoid(gate) over the last dim (64), o and gate as given (any dtype)."""
    x = o.double()
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return x * rstd * torch.sigmoid(gate.double())


def attn2_reference(problem: Attn2Problem, scale: float = config.ATTN_SCALE,
                    eps: float = config.RMS_NORM_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16 [8 R, 512 K], the FP64 value out rounds [8 R, 512 K]) on the CPU: scores and
    softmax in FP64 from the BF16 cache, o rounded to BF16, norm and gate in FP64."""
    _check(problem)
    p = problem.to("cpu")
    heads = p.num_kv_heads
    group = lay.HEADS_PER_KV_HEAD
    exact = torch.zeros(p.q.shape, dtype=torch.float64)
    for r in range(p.num_reqs):
        seq_len = int(p.seq_lens[r])
        keys, values = gather_kv(p.kv_cache, p.page_table[r], seq_len)
        keys, values = keys.double(), values.double()
        rows = slice(r * lay.QUERY_LEN, (r + 1) * lay.QUERY_LEN)
        q = p.q[rows].double().view(lay.QUERY_LEN, heads * group, lay.HEAD_DIM)
        gate = p.gate[rows].double().view(lay.QUERY_LEN, heads * group, lay.HEAD_DIM)
        o = torch.empty(lay.QUERY_LEN, heads * group, lay.HEAD_DIM, dtype=torch.float64)
        for t in range(lay.QUERY_LEN):
            first, end = key_range(seq_len, t, p.window)
            for kv in range(heads):
                hs = slice(kv * group, (kv + 1) * group)
                s = (q[t, hs] @ keys[kv, first:end].T) * scale  # [8, n]
                w = torch.softmax(s, dim=-1)
                o[t, hs] = w @ values[kv, first:end]
        o = o.to(torch.bfloat16)
        exact[rows] = norm_gate_fp64(o, gate, eps).reshape(lay.QUERY_LEN, -1)
    return exact.to(torch.bfloat16), exact


def sdpa_attention(problem: Attn2Problem, scale: float = config.ATTN_SCALE) -> torch.Tensor:
    """The stock's attention output o, bf16 [8 R, 512 K] on the problem's device: torch SDPA (the
    flash backend on CUDA; torch's default CPU kernel elsewhere) on K/V gathered contiguous, one
    call per query row over exactly its keys (no mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    _check(problem)
    heads = problem.num_kv_heads
    group = lay.HEADS_PER_KV_HEAD
    out = torch.empty_like(problem.q)
    backends = [SDPBackend.FLASH_ATTENTION] if problem.q.is_cuda else [SDPBackend.MATH]
    for r in range(problem.num_reqs):
        seq_len = int(problem.seq_lens[r])
        keys, values = gather_kv(problem.kv_cache, problem.page_table[r].cpu(), seq_len)
        keys = keys.repeat_interleave(group, dim=0)  # [H, L, 64]: one K per query head
        values = values.repeat_interleave(group, dim=0)
        for t in range(lay.QUERY_LEN):
            row = r * lay.QUERY_LEN + t
            first, end = key_range(seq_len, t, problem.window)
            q = problem.q[row].view(1, heads * group, 1, lay.HEAD_DIM)
            with sdpa_kernel(backends):
                o = scaled_dot_product_attention(q, keys[None, :, first:end], values[None, :, first:end],
                                                 scale=scale)
            out[row] = o.reshape(-1)
    return out


def rms_norm_gated_emulation(o: torch.Tensor, gate: torch.Tensor, eps: float = config.RMS_NORM_EPS) -> torch.Tensor:
    """The Triton rms_norm_gated ("sigmoid", no weight, no bias) arithmetic in FP32 on o and gate
    bf16 [rows, heads * 64]: per head var = sum(x * x) / 64, rstd = 1 / sqrt(var + eps),
    y = x * rstd * sigmoid(g) with sigmoid(g) = 1 / (1 + exp(-g)); bf16 out."""
    x = o.float().view(o.shape[0], -1, lay.HEAD_DIM)
    g = gate.float().view_as(x)
    var = (x * x).sum(-1, keepdim=True) / lay.HEAD_DIM
    rstd = 1.0 / torch.sqrt(var + eps)
    y = x * rstd
    y = y * (1.0 / (1.0 + torch.exp(-g)))
    return y.to(torch.bfloat16).view_as(o)


def stock_attn2(problem: Attn2Problem) -> torch.Tensor:
    """The stock step on the problem's device: `sdpa_attention` then `rms_norm_gated_emulation`."""
    return rms_norm_gated_emulation(sdpa_attention(problem), problem.gate)


def bf16_ulp(reference: torch.Tensor) -> torch.Tensor:
    """The BF16 spacing at each FP64 reference value (2^-133 at and below the subnormal range)."""
    magnitude = reference.double().abs()
    exponent = torch.floor(torch.log2(magnitude.clamp_min(2.0**BF16_MIN_NORMAL_EXP)))
    return torch.exp2(exponent - BF16_MANTISSA_BITS).clamp_min(BF16_SUBNORMAL_ULP)


CORRECTLY_ROUNDED_ULP = 0.5  # half a BF16 ULP of the reference: the reference rounded to nearest
# How far past half a ULP an output still counts as correctly rounded: the noise of the FP32
# epilogue every implementation runs (the stock's Triton gate too). o is exact BF16 when the norm
# starts; rstd (a sum of squares, a product, a sum, sqrt.rn, a division) and sigmoid (ex2.approx,
# relative error about 2^-22, a sum, a division) and the two products carry about 2^-20 of
# relative error together, which is at most 2^-12 of a BF16 ULP of the output (a ULP is at least
# 2^-8 of the value). A value within that of a rounding midpoint can land on either side in any
# FP32 epilogue: the H200 showed attn2 at 0.500021 against the stock's 0.499979 on one element of
# `attn --tp 16` (L 17, W 2048, large), both means 0.2501. The FP64 reference's own error (below
# 2^-40 ULP) is inside it.
ROUNDING_SLACK_ULP = 2.0**-12


@dataclass(frozen=True)
class UlpError:
    """max and mean |got - ref| in BF16 ULPs of the reference; `nonfinite`: elements that are NaN
    or inf where the reference is finite (counted apart, never averaged)."""

    max: float
    mean: float
    nonfinite: int

    def within(self, other: UlpError) -> bool:
        """Whether this error is at most `other`'s on both counts and has no non-finite element
        that `other` lacks; or has no non-finite element and is within CORRECTLY_ROUNDED_ULP
        everywhere (up to ROUNDING_SLACK_ULP, the noise of an FP32 epilogue): every element is
        then the reference rounded to BF16 (a tie, or a near tie, either way), and no
        BF16 output is more accurate, whatever the other's mean says (the two means can differ in
        the fourth digit by which side of a tie, or of a binade edge, an element fell)."""
        if self.nonfinite > other.nonfinite:
            return False
        if self.nonfinite == 0 and self.max <= CORRECTLY_ROUNDED_ULP + ROUNDING_SLACK_ULP:
            return True
        return self.max <= other.max and self.mean <= other.mean


def ulp_error(got: torch.Tensor, exact: torch.Tensor) -> UlpError:
    """`got` (any float dtype) against the FP64 reference `exact` of the same shape."""
    if got.shape != exact.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(exact.shape)}")
    got64, exact64 = got.detach().cpu().double(), exact.detach().cpu().double()
    finite = torch.isfinite(exact64)
    bad = finite & ~torch.isfinite(got64)
    ok = finite & ~bad
    err = ((got64 - exact64).abs() / bf16_ulp(exact64))[ok]
    if err.numel() == 0:
        return UlpError(0.0, 0.0, int(bad.sum()))
    return UlpError(float(err.max()), float(err.mean()), int(bad.sum()))


def hbm_bytes(seq_len: int, num_kv_heads: int, window: int = 0) -> int:
    """K + V bytes a request of length L reads per rank (the roofline's numerator): the pages of
    its visible keys, whole."""
    first, end = lay.visible_keys(seq_len, window)
    pages = lay.max_pages(end) - first // lay.PAGE_TOKENS
    return pages * lay.PAGE_BYTES * num_kv_heads


__all__ = ["Attn2Problem", "UlpError", "attn2_reference", "bf16_ulp", "gather_kv", "hbm_bytes", "key_range",
           "norm_gate_fp64", "rms_norm_gated_emulation", "sdpa_attention", "stock_attn2", "ulp_error"]
