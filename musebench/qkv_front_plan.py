"""The QKV front's work plans as host arithmetic: how the cluster plan and the balanced plan cut
one projection into CTAs, how evenly those CTAs spread over an H200's 132 SMs, and the balanced
plan's workspace layout (one source for `kernels.qkv_front_balanced`, `cute_ops` and the tests;
torch-free, imports nothing but `config`).

Plans (`PLANS`): "cluster" (`kernels.qkv_front`: a cluster of 8 CTAs of 4 warps per head, each CTA
one k-slice of 1024 of the head's 64 columns, reduced through DSMEM) and "balanced"
(`kernels.qkv_front_balanced`: a CTA of `warps` warps per (head, k-slice, 8 x warps columns), a
warp per n-tile of 8 columns, reduced through global memory). Both compute every output element
as the same 8 MMA chains (one per k-slice, in k order) added in slice order 0 + 1 + .. + 7, so
their bits are equal.

Balance (`balance`): with equal CTAs scheduled as they free up, the busiest SM runs
ceil(CTAs / 132) of them against a mean of CTAs / 132:

| N    | cluster CTAs, per SM, busiest / mean | balanced, 1 warp per CTA      | balanced, 2 warps per CTA   |
| ---- | ------------------------------------ | ----------------------------- | --------------------------- |
| 1152 | 144, 1.09, 2 / 1.09 = 1.83           | 1152, 8.73, 9 / 8.73 = 1.031  | 576, 4.36, 5 / 4.36 = 1.146 |
| 2304 | 288, 2.18, 3 / 2.18 = 1.375          | 2304, 17.45, 18 / 17.45 = 1.031 | 1152, 8.73, 9 / 8.73 = 1.031 |
| 4608 | 576, 4.36, 5 / 4.36 = 1.146          | 4608, 34.9, 35 / 34.9 = 1.003 | 2304, 17.45, 18 / 17.45 = 1.031 |

(a CTA's work is its weight bytes: 128 KB in the cluster plan, 16 KB x warps in the balanced one;
the balanced CTA also reads x's slice, T x 2 KB, shared by its warps). `DEFAULT_WARPS` picks 1
warp at N = 1152 and 2304 and 2 at 4608 (where 1-warp CTAs would exceed the 32 resident CTAs of
an SM and get a 2-stage ring; 2-warp CTAs halve x's reads).

Ring (`balanced_stages`): stages of 64 k (8 x warps weight rows + 16 x rows, 128 bytes each),
as deep as shared memory allows when ceil(CTAs / 132) CTAs (at most `MAX_CTAS_PER_SM`) share an
SM, at most 8: 8 / 3 / 2 stages for 1-warp CTAs at N = 1152 / 2304 / 4608 (7, 2, 1 weight stages
of 1 KB in flight per CTA: 63, 36, 32 KB per SM), 8 / 6 / 2 for 2-warp CTAs.

Workspace (`workspace_bytes`, `WorkspaceLayout`; bytes, allocated zeroed by the host before any
capture, reused by every launch of that N that cannot overlap it):
- partials: FP32 [heads, 8 n-tiles, 8 slices, 32 lanes, 4] (32 KB a head): a warp's MMA
  accumulators of its (head, slice, n-tile), lane-major as the fragment holds them;
- projection: BF16 [heads, 16 rows, 64 columns] (2 KB a head): the head's rounded sum, the
  epilogue's input;
- group counters: u32 [heads, 8] (arrivals of a (head, column group)'s 8 slices);
- head counters: u32 [heads] (arrivals of a head's column groups).
Every counter is back at 0 when a launch ends (its last arriver re-arms it), so graph replays
need no memset. N = 1152: 627,344 bytes; 2304: 1,254,672; 4608: 2,509,344.
"""

from __future__ import annotations

from typing import NamedTuple

from musebench import config

PLANS = ("cluster", "balanced")
DEFAULT_PLAN = "cluster"  # the deployed launch until a GPU A/B says otherwise

HIDDEN = config.HIDDEN_SIZE  # 8192
HEAD_DIM = config.HEAD_DIM  # 64
COLUMNS_PER_KV_HEAD = 2 * (config.NUM_QUERY_HEADS // config.NUM_KV_HEADS + 1) * HEAD_DIM  # 1152
KV_HEADS = (1, 2, 4)
SPLIT = 8  # k-slices of 1024 per head, added in slice order
N_TILES = HEAD_DIM // 8  # n-tiles of 8 columns per head
MAX_TOKENS = 16
LANES = 32
H200_SMS = 132
SM_SHARED_BYTES = 228 * 1024  # per SM, 1 KB of it reserved per CTA
CTA_RESERVED_BYTES = 1024
MAX_CTAS_PER_SM = 32  # sm_90 / sm_100: resident CTAs per SM
MAX_THREADS_PER_SM = 2048
MAX_STAGES = 8
LINE_BYTES = 128  # one row of a 64-k stage in BF16
SMEM_SLACK = 128  # alignment slack and the two arrival flags of a CTA
CLUSTER_WARPS = 4

UNIT_WARPS = (1, 2, 4)  # warps (n-tiles) per balanced CTA
DEFAULT_WARPS = {1: 1, 2: 1, 4: 2}

PARTIAL_BYTES = LANES * 4 * 4  # one warp's four FP32 accumulators per lane: 512
HEAD_PARTIAL_BYTES = N_TILES * SPLIT * PARTIAL_BYTES  # 32768
HEAD_PROJECTION_BYTES = MAX_TOKENS * HEAD_DIM * 2  # 2048
COUNTER_BYTES = 4
WORKSPACE_ALIGN = 16


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_kv(num_kv_heads: object) -> int:
    _require(isinstance(num_kv_heads, int) and not isinstance(num_kv_heads, bool) and num_kv_heads in KV_HEADS,
             f"num_kv_heads must be one of {KV_HEADS}, got {num_kv_heads!r}")
    return num_kv_heads  # type: ignore[return-value]


def _check_warps(warps: object) -> int:
    _require(isinstance(warps, int) and not isinstance(warps, bool) and warps in UNIT_WARPS,
             f"warps must be one of {UNIT_WARPS}, got {warps!r}")
    return warps  # type: ignore[return-value]


def heads(num_kv_heads: int) -> int:
    """Heads of 64 columns in N = 1152 num_kv_heads: 18 per KV head (q, k, v and gate)."""
    return COLUMNS_PER_KV_HEAD * _check_kv(num_kv_heads) // HEAD_DIM


def cluster_ctas(num_kv_heads: int) -> int:
    """CTAs of the cluster plan: 8 per head (144, 288, 576)."""
    return SPLIT * heads(num_kv_heads)


def groups(warps: int) -> int:
    """Column groups (CTAs per (head, slice)) of a balanced CTA of `warps` warps: 8 / warps."""
    return N_TILES // _check_warps(warps)


def balanced_ctas(num_kv_heads: int, warps: int) -> int:
    """CTAs of the balanced plan: heads x 8 slices x 8 / warps column groups."""
    return heads(num_kv_heads) * SPLIT * groups(warps)


def balanced_stage_bytes(warps: int) -> int:
    """One ring stage of a balanced CTA: 8 x warps weight rows and 16 x rows of 128 bytes."""
    return (8 * _check_warps(warps) + MAX_TOKENS) * LINE_BYTES


def resident_ctas_per_sm(num_kv_heads: int, warps: int) -> int:
    """CTAs of the balanced plan an SM must hold for every CTA to run in one wave, capped by what
    an SM can hold at all (32 CTAs, 2048 threads)."""
    wanted = -(-balanced_ctas(num_kv_heads, warps) // H200_SMS)
    return min(wanted, MAX_CTAS_PER_SM, MAX_THREADS_PER_SM // (LANES * warps))


def balanced_stages(num_kv_heads: int, warps: int) -> int:
    """Ring stages of a balanced CTA: as many as fit when `resident_ctas_per_sm` CTAs share an
    SM's shared memory, at most 8; ValueError where fewer than 2 fit (no stage could be in flight
    while one is consumed)."""
    per_sm = resident_ctas_per_sm(num_kv_heads, warps)
    room = SM_SHARED_BYTES // per_sm - CTA_RESERVED_BYTES - SMEM_SLACK
    stages = min(MAX_STAGES, room // balanced_stage_bytes(warps))
    _require(stages >= 2, f"{warps}-warp CTAs at {num_kv_heads} KV heads leave room for {stages} ring stages")
    return stages


def balanced_smem_bytes(num_kv_heads: int, warps: int) -> int:
    """Dynamic shared memory of a balanced CTA: its ring (which holds nothing else) and the slack."""
    return balanced_stages(num_kv_heads, warps) * balanced_stage_bytes(warps) + SMEM_SLACK


class Balance(NamedTuple):
    ctas: int
    mean_per_sm: float  # CTAs / SMs
    busiest: int  # ceil(CTAs / SMs)
    ratio: float  # busiest / mean: how much longer the busiest SM works than the average one


def balance(ctas: int, sms: int = H200_SMS) -> Balance:
    """How evenly `ctas` equal CTAs spread over `sms` SMs (scheduled as SMs free up)."""
    _require(ctas >= 1 and sms >= 1, f"ctas and sms must be positive, got {ctas}, {sms}")
    mean = ctas / sms
    busiest = -(-ctas // sms)
    return Balance(ctas, mean, busiest, busiest / mean)


def plan_balance(plan: str, num_kv_heads: int, warps: int | None = None) -> Balance:
    """`balance` of a plan's CTAs at `num_kv_heads` on an H200 (balanced: `warps`, default
    `DEFAULT_WARPS`)."""
    _require(plan in PLANS, f"plan must be one of {PLANS}, got {plan!r}")
    if plan == "cluster":
        return balance(cluster_ctas(num_kv_heads))
    return balance(balanced_ctas(num_kv_heads, DEFAULT_WARPS[_check_kv(num_kv_heads)] if warps is None else warps))


class WorkspaceLayout(NamedTuple):
    """Byte offsets of the balanced plan's workspace regions (module docstring)."""

    partials: int
    projection: int
    group_counters: int
    head_counters: int
    total: int


def workspace_layout(num_kv_heads: int) -> WorkspaceLayout:
    h = heads(num_kv_heads)
    projection = h * HEAD_PARTIAL_BYTES
    group_counters = projection + h * HEAD_PROJECTION_BYTES
    head_counters = group_counters + h * N_TILES * COUNTER_BYTES
    end = head_counters + h * COUNTER_BYTES
    total = -(-end // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    return WorkspaceLayout(0, projection, group_counters, head_counters, total)


def workspace_bytes(num_kv_heads: int) -> int:
    """Bytes of the balanced plan's workspace at `num_kv_heads` (the same for every warps)."""
    return workspace_layout(num_kv_heads).total
