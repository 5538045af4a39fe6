"""The attn2 family (`attn`): the verify step's paged attention with the o-norm and sigmoid gate,
on virtual ranks of one GPU (each rank its KV heads of one request, no mailboxes).

A case is one request of length L (`tokens`) in a deployment of `max_model_len` and `window`
(0: none) at `tp` (2, 4, 8, 16: 8 .. 1 of Muse Spark's 16 KV heads a rank). Inputs
(`cases.attn2_inputs`): all 16 KV heads drawn once, every rank slicing its own (`for_rank`), the
page table shuffled and every slot the step must not read poisoned. Output per rank: `out`, the
whole buffer bf16 [GUARD_ROWS + 8 + GUARD_ROWS, 512 K] (the driver poisons it before each call);
the implementation's `cute_ops.launch_attn2` gets the 8 rows between the guards (`out_rows`), so
a store past its rows (a wrong request index or row stride) lands in a guard row and fails the
bitwise check like a wrong value.

Checks:
- determinism, raw bits: every rank's calls repeat their bits (the driver's repeated calls), and
  every rank's bits equal its KV heads' columns of one launch over all 16 KV heads (`expected`):
  a KV head's output is the same whichever rank, and however many heads a launch holds, computes
  it; the guard rows keep the poison;
- accuracy (`accuracy_verdict`): the whole step's max and mean error in BF16 ULPs against the FP64
  reference (`stock.attn2.attn2_reference`), each at most the stock's (torch SDPA's flash backend
  then the Triton gate's arithmetic, `stock.attn2.stock_attn2`) on the same inputs, and no NaN or
  inf where the reference is finite; both errors go into the row's stock path side by side. A
  case with `enforce_accuracy` False (the bench's) reports them without failing on them, and says
  so in the row;
- refusals: a tp that does not split 16 KV heads, L outside [8, max_model_len], a window outside
  [0, max_model_len) and unknown inputs are refused before anything launches (`check_case`); the
  launch refuses shapes, dtypes and alignment (`cute_ops.launch_attn2`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from musebench import attn2_layout as lay
from musebench import config
from musebench.harness.case import Expected, MailboxSpec, RunOptions
from musebench.stock.read_floor import READ_FLOOR  # the baseline: a read of bytes_moved(case), one buffer

name = "attn2"
faults = ("flip", "silent")
PARTS: tuple[str, ...] = ()
VIRTUAL_STOCK = PROCESS_STOCK = "torch SDPA flash"
OUT = "out"
TPS = (2, 4, 8, 16)  # 8, 4, 2, 1 KV heads a rank
GUARD_ROWS = 8  # poisoned rows of `out` before and after the launch's: one request's worth each side
ROOFLINE_BYTES_PER_S = 4.2e12  # the HBM read bandwidth this H200 shows (issue 15)
# The implementation's cute_ops entry points a runner calls (`runner_for`): the launch, its
# compile, and the split plan and workspace size it sizes the launch with. A job asks for all of
# them before anything launches (`harness.jobs.make_attn2_job`).
ENTRY_POINTS = ("launch_attn2", "prepare_attn2", "attn2_splits", "attn2_workspace_bytes")


def kv_heads_for(tp: int) -> int:
    """KV heads per rank at `tp`; ValueError with the reason otherwise."""
    if tp == 32:
        raise ValueError("tp 32: Muse Spark's 16 KV heads cannot be split 32 ways (attn2 runs at tp 2, 4, 8, 16)")
    if tp not in TPS:
        raise ValueError(f"attn2 runs at tp 2, 4, 8 or 16 (8, 4, 2, 1 of the 16 KV heads a rank), got tp {tp}")
    return config.NUM_KV_HEADS // tp


@dataclass(frozen=True)
class Attn2Case:
    tp: int
    tokens: int  # L: the request's length, the 8 query rows at L - 8 .. L - 1
    max_model_len: int = 4096
    window: int = 0
    inputs: str = "random"
    seed: int = 0
    enforce_accuracy: bool = True
    family: str = "attn2"

    def label(self) -> str:
        window = f" W={self.window}" if self.window else ""
        return f"attn2 tp={self.tp} L={self.tokens} max_model_len={self.max_model_len}{window} {self.inputs} seed={self.seed}"


Case = Attn2Case


def check_case(case: Attn2Case) -> None:
    """ValueError naming the first value outside attn2's contract (nothing launched)."""
    from musebench.cases.attn2_inputs import INPUT_FAMILIES

    kv_heads_for(case.tp)
    if case.inputs not in INPUT_FAMILIES:
        raise ValueError(f"attn2 inputs must be among {', '.join(INPUT_FAMILIES)}, got {case.inputs!r}")
    if isinstance(case.max_model_len, bool) or not isinstance(case.max_model_len, int) or case.max_model_len < lay.QUERY_LEN:
        raise ValueError(f"max_model_len must be an int >= {lay.QUERY_LEN}, got {case.max_model_len!r}")
    if not lay.QUERY_LEN <= case.tokens <= case.max_model_len:
        raise ValueError(f"L = {case.tokens} outside [{lay.QUERY_LEN}, max_model_len = {case.max_model_len}]")
    if isinstance(case.window, bool) or not isinstance(case.window, int) or not 0 <= case.window < case.max_model_len:
        raise ValueError(f"window {case.window!r} outside [0, max_model_len = {case.max_model_len}) (0: none)")


def make_inputs(case: Attn2Case) -> Any:
    """The request over all 16 KV heads (`attn2_inputs.make_problem`), deterministic in the case."""
    from musebench.cases.attn2_inputs import make_problem

    check_case(case)
    return make_problem(case.inputs, case.tokens, case.max_model_len, window=case.window, seed=case.seed)


def mailboxes(case: Attn2Case, capacity: int) -> dict[str, MailboxSpec]:
    return {}


def _cute_ops(impl: Any) -> Any:
    """The implementation's cute_ops module providing every one of ENTRY_POINTS (musebench:
    `musebench.cute_ops`; ImplError, a ValueError naming them, where one is missing)."""
    from musebench.harness.impl import cute_ops_with

    return cute_ops_with(impl, *ENTRY_POINTS)


@dataclass
class Attn2Runner:
    """One rank's attn2 launch on its device copy of its KV heads (its workspace of partials allocated zeroed, though the kernels need no zeroing)."""

    ops: Any
    problem: Any  # Attn2Problem on the device, this rank's heads
    workspace: torch.Tensor | None
    outputs: dict[str, torch.Tensor]

    def call(self) -> None:
        p = self.problem
        self.ops.launch_attn2(p.q, p.gate, p.kv_cache, p.page_table, p.seq_lens, out_rows(self.outputs[OUT]),
                              self.workspace, max_model_len=p.max_model_len, window=p.window)

    def check_fault(self) -> None:
        return None

    def parts(self) -> dict:
        return {}

    def launch_demands(self) -> list:
        return []


def runner_for(ops: Any, problem: Any, device: torch.device) -> Attn2Runner:
    """A runner for `problem` (any heads) on `device`: prepared (compiled) before any capture."""
    p = problem.to(device)
    heads = p.num_kv_heads
    splits = ops.attn2_splits(p.max_model_len, p.window, heads)
    need = ops.attn2_workspace_bytes(p.num_reqs, heads, splits)
    workspace = torch.zeros(need, dtype=torch.uint8, device=device) if need else None
    ops.prepare_attn2(heads, p.max_model_len, p.window)
    buffer = torch.empty(GUARD_ROWS + p.q.shape[0] + GUARD_ROWS, p.q.shape[1], dtype=p.q.dtype, device=device)
    return Attn2Runner(ops, p, workspace, {OUT: buffer})


def out_rows(buffer: torch.Tensor) -> torch.Tensor:
    """The rows of an `out` buffer [GUARD_ROWS + R + GUARD_ROWS, width] a launch writes: a
    contiguous view between the guards (16-byte aligned: a row is a multiple of 1 KB)."""
    return buffer[GUARD_ROWS: buffer.shape[0] - GUARD_ROWS]


def with_guards(rows: torch.Tensor) -> torch.Tensor:
    """The whole `out` buffer a launch that wrote `rows` [R, width] leaves: `rows` between
    GUARD_ROWS poisoned rows each side (`harness.checks.poison`'s pattern)."""
    from musebench.harness import checks

    guard = checks.poison(torch.empty(GUARD_ROWS, rows.shape[1], dtype=rows.dtype, device=rows.device))
    return torch.cat([guard, rows, guard])


def bind(case: Attn2Case, impl: Any, rank: int, boxes: dict[str, Any], inputs: Any, options: RunOptions) -> Attn2Runner:
    """This rank's runner (its KV heads); one eager call, so nothing compiles inside a capture."""
    from musebench.cases.attn2_inputs import for_rank

    check_case(case)
    device = torch.device("cuda", torch.cuda.current_device())
    runner = runner_for(_cute_ops(impl), for_rank(inputs, rank, case.tp), device)
    runner.call()
    return runner


def accuracy_verdict(got: torch.Tensor, stock: torch.Tensor, exact: torch.Tensor) -> tuple[str, bool]:
    """(line, ok): attn2's and the stock's max and mean error in BF16 ULPs of the FP64 reference
    `exact`, side by side; ok when attn2 has no NaN or inf where the reference is finite and its
    error is `UlpError.within` the stock's: each of max and mean at most the stock's, or attn2
    correctly rounded everywhere (element-wise dominance is not asked)."""
    from musebench.stock.attn2 import ulp_error

    mine, theirs = ulp_error(got, exact), ulp_error(stock, exact)
    ok = mine.nonfinite == 0 and mine.within(theirs)
    line = (f"vs FP64: attn2 max {mine.max:.6g} mean {mine.mean:.6f} ULP, stock max {theirs.max:.6g} "
            f"mean {theirs.mean:.6f} ULP" + (f", attn2 non-finite {mine.nonfinite}" if mine.nonfinite else ""))
    return line, ok


def columns_of(out: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s columns (its KV heads' query heads) of an all-16-KV-head output [8, 8192]."""
    from musebench.cases.attn2_inputs import kv_heads_of

    heads = kv_heads_of(rank, tp)
    width = lay.HEADS_PER_KV_HEAD * lay.HEAD_DIM
    return out[:, heads.start * width: heads.stop * width].contiguous()


def expected_from_whole(case: Attn2Case, whole: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Every rank's expected bits: its columns of one launch over all 16 KV heads [8, 8192],
    between poisoned guard rows (`with_guards`)."""
    return [{OUT: with_guards(columns_of(whole, rank, case.tp))} for rank in range(case.tp)]


def expected(case: Attn2Case, inputs: Any, options: RunOptions, approximations: Any) -> Expected:
    """Per rank: its columns of an independent launch over all 16 KV heads. ValueError (the case's
    error) where that output is less accurate than the stock's (unless the case only reports it)."""
    from musebench.stock.attn2 import attn2_reference, stock_attn2

    device = torch.device("cuda", torch.cuda.current_device())
    whole_runner = runner_for(_cute_ops(options.impl), inputs, device)
    whole_runner.outputs[OUT].fill_(float("nan"))
    whole_runner.call()
    torch.cuda.synchronize()
    whole = out_rows(whole_runner.outputs[OUT]).cpu()
    _, exact = attn2_reference(whole_runner.problem)
    line, ok = accuracy_verdict(whole, stock_attn2(whole_runner.problem).cpu(), exact)
    if not ok and case.enforce_accuracy:
        raise ValueError(f"attn2 is less accurate than the stock: {line}")
    note = "" if case.enforce_accuracy else " (reported, not enforced: bench)"
    return Expected(expected_from_whole(case, whole), f"a 16-KV-head launch (rank identity); {line}{note}")


def bytes_moved(case: Attn2Case) -> int:
    """K + V bytes one rank reads per call: the pages of its visible keys (the roofline's numerator)."""
    from musebench.stock.attn2 import hbm_bytes

    return hbm_bytes(case.tokens, kv_heads_for(case.tp), case.window)


def roofline_us(case: Attn2Case) -> float:
    """bytes_moved / 4.2 TB/s, in µs."""
    return bytes_moved(case) / ROOFLINE_BYTES_PER_S * 1e6


def row_fields(case: Attn2Case, options: RunOptions) -> dict[str, Any]:
    window = f"W={case.window}" if case.window else "no window"
    return dict(kernel=name, mode=f"max_model_len={case.max_model_len}", tp=case.tp, tokens=case.tokens,
                weight_dtype="bf16", norm=f"o-norm gate, {window}", inputs=case.inputs, seed=case.seed, stock="reference")


def variants(case: Attn2Case, options: RunOptions) -> dict[str, RunOptions]:
    return {}


def sdpa_call(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> Any:
    """torch SDPA's flash backend on contiguous K/V: q [1, K, 64, 64] (a KV head's 8 query heads x
    8 tokens as 64 rows), keys/values [1, K, n, 64], no mask (the flash backend's is_causal aligns
    top-left; the 8-row causal mask would not change what it reads). The call launches the
    attention alone: its output (from the allocator, a graph's pool under capture) is dropped, so
    the timed stock carries no copy the stock does not make."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def call() -> None:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            scaled_dot_product_attention(q, keys, values, scale=config.ATTN_SCALE)

    return call


def baselines(case: Attn2Case, inputs: Any, rank: int, runner: Attn2Runner, comms: Any) -> dict:
    """torch SDPA (flash) on this rank's K/V gathered contiguous: the keys the 8 rows see (with a
    window: its last W + 7), all 64 query rows of a KV head in one call; its output is not checked
    (another summation order, no gate). And `read floor` (`stock.read_floor.FloorRead`): a plain
    streaming read of `bytes_moved(case)` bytes, one buffer allocated here (once a case) and read
    by every call, as the kernel reads the same KV cache every call: where the bytes fit the 50 MiB
    L2 (tp 16 at 128k: 33.6 MB) both may read from L2 across the graph's replays. Its cell's ratio
    is the kernel over it, measured in the same run. Its sum is checked once here, before any
    timing (RuntimeError, the case's error, where the reader skipped a byte)."""
    from musebench.cases.tail import Baseline
    from musebench.stock import read_floor
    from musebench.stock.attn2 import gather_kv

    p = runner.problem
    keys, values = gather_kv(p.kv_cache, p.page_table[0].cpu(), case.tokens)
    first, _ = lay.visible_keys(case.tokens, case.window)
    keys, values = keys[None, :, first:].contiguous(), values[None, :, first:].contiguous()
    heads = p.num_kv_heads
    q = p.q.view(lay.QUERY_LEN, heads, lay.HEADS_PER_KV_HEAD, lay.HEAD_DIM).permute(1, 2, 0, 3)
    q = q.reshape(1, heads, lay.ROWS_PER_KV_HEAD, lay.HEAD_DIM).contiguous()
    floor = read_floor.checked_floor(bytes_moved(case), p.kv_cache.device, f"{READ_FLOOR} of {case.label()}")
    return {VIRTUAL_STOCK: Baseline(sdpa_call(q, keys, values)), READ_FLOOR: Baseline(floor)}
