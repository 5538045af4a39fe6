"""TP MoE tail in CuTe DSL: finalize + post-expert RMSNorm + combine over a TP group, one launch.

What it computes (bit for bit, docs/contract-tp.md; torch reference `musebench.stock.tp`): on every
rank, `tp_rank_output(tp_tail_reference(...), path, rank)` for the path the stock's host dispatch
takes for that m (`tp_stock_path(m, tp, nsm)`). The kernel does not import the stock: the host
binds every token count m to a `TpVariant` (band split S, combine, owner grouping KO, delivery),
all compile-time; `TpVariant.from_path` reads them off a `TpStockPath`.

Geometry. `_TpTailKernel`, grid (S, ceil(m / tp), tp), clusters (S, 1, 1) when S > 1, 512 / S
threads. CTA (b, g, d) works on band b (columns b * 4096 / S ..) of token t = g * tp + d, whose
owner is rank d = t % tp; thread `tidx` owns the 8 consecutive columns from b * 4096 / S + 8 tidx,
the stock's mapping, so global warp w owns columns 256 w .. 256 w + 255 whatever S is. CTAs with
t >= m only count themselves done. The rank is a runtime argument (one compilation per group).

Phases of one CTA:

1. send: this rank's K-partials of the token's 8 routes (16 bytes per thread and route), each
   32-bit word equal to the sentinel scrubbed to 0, stored (`st.relaxed.sys.v4`) to row
   [generation, source = this rank, g * 8 + k] of the owner's route mailbox, the owner's own
   mailbox included; an index < 0 or >= rows sends +0.0 (its load reads gamma's fragment, unused).
   All 8 indices, then all 8 fragments, are loaded before the first push; the owner loads the
   route weights before it polls and the peers' token-mailbox addresses in one batch before it
   publishes (one memory latency each, not one per route or peer).
2. sum (owner CTAs, d == rank): poll the 8 * tp incoming vectors in batches of (route, source)
   in the sum's order; x = bf16(rank-order chain from +0.0 of `add.rn`); re-arm what was read.
   Then the stock's arithmetic: g = f32(gamma) + f32(gain_centre); u = x * g (weight before the
   norm) or x; per route the thread's `fma.rn` chain over its 8 columns from +0.0, the butterfly
   xor 1, 2, 4, 8, 16, then the split's combine: S = 1: one warp per route, the 16 warp sums in
   lanes 0..15 and +0.0 in lanes 16..31, the same butterfly; S > 1: the CTA's chain from +0.0 over
   its 16 / S warps, stored into every cluster peer's shared memory (`mapa` +
   `st.shared::cluster`), a cluster barrier, every CTA's chain from +0.0 over bands 0..S-1
   (`musebench.stock.tp.sum_of_squares` for that S). r = `rsqrt.approx.f32`(fma(Q, 2^-12, eps));
   y = u * r, or (x * r) * g. Combine (compile time): FMA_CHAIN acc = fma(w_k, y_k, acc) over
   k = 0..7 from +0.0; ROUNDED_PRODUCTS acc = acc + y_k * w_k (product rounded alone); OWNER_PARTIALS
   chains of KO fmas per owner group, the groups' partials added in rank order from +0.0 (the
   stock's -0.0 scrub of each partial cannot change such a sum, so it is not spelled out). The
   row band is rounded once (`cvt.rn.bf16x2.f32`), stored to the own output, and published to
   row t of every other rank's token mailbox.
3. copy (CTAs with d != rank): poll row t of the own token mailbox (this band), store it to the
   output, re-arm it.

Delivery. SCRUBBED (single-launch token-owner and its extension): the copy is the BF16 row with
every 32-bit word equal to the sentinel replaced by 0, so a (-0.0, -0.0) column pair reads
(+0.0, +0.0) on non-owners, as the stock's multicast copy does. EXACT (expert-owner, chunked):
the stock gives every rank the owner's bits, which a BF16 copy cannot carry (a (-0.0, -0.0) pair
is the sentinel itself; such pairs occur when the FP32 sum lies in [-2^-134, 0]). The owner
therefore publishes its FP32 row before rounding, the pattern 0x80008000 (-2^-134) mapped to
-0.0 (`ptx.encode_sentinel_word_f32`; both round to BF16 -0.0), and every reader rounds it with
the same `cvt.rn.bf16x2.f32`: the token mailbox is 2H int16 wide for EXACT variants.

Transports (compile time). UNICAST: the owner publishes its row with tp - 1 `st.relaxed.sys`
stores through the token peer table, its peers from rank + 1 upward. MULTICAST (the seed's, GB200
racks): one `multimem.st` per vector to the token mailboxes' multicast address, which the NVLink
switch replicates into every bound rank's token mailbox at the same offset, the owner's own
included (nothing on the owner reads that row: a rank never copies a token it owns). The pushes
into the route mailboxes stay unicast in both (each goes to one owner). The two give the same
bits: the words stored are the same registers (scrubbed BF16 pairs, `.v4.bf16x2`; or encoded
binary32 words, `.v4.f32`), a multimem store converts nothing (its type names the 16 bytes),
every reader polls and copies the same words from its own mailbox, and all arithmetic precedes
the stores and is traced from the same code (tests/kernels/test_tp_tail_compile.py compares the
two PTX files: the same arithmetic on the same operands in the same order, only the publishing
stores and the peer-address loads differ). The same word lands once per generation either way,
so the memory ordering below holds for both (a multimem store is a relaxed system-scope store to
each rank's words).

Memory ordering (the Lamport protocol, `musebench.comm.protocol`, 32-bit-word unit as in the stock
TP kernel). A word that still reads 0x80008000 has not arrived; every payload word is scrubbed
or encoded so it never equals it, and each word is written once per generation, so the data
store is the release and a torn 16-byte access is harmless. Generations: stage words
[NEXT_STAGE, ARRIVAL_COUNT] in the rank's device memory; every CTA reads NEXT_STAGE after
`griddepcontrol.wait` and counts itself in on ARRIVAL_COUNT once done (`atom.acq_rel.gpu`, after
a CTA barrier, so every thread's read precedes it); the last to arrive zeroes the count and
stores (g + 1) % 3. All ranks make
the same calls, so they agree on g. Lockstep: token 0 exists in every call (m >= 1); its owner,
rank 0, waits for every rank's pushes of call j, which each rank makes only after its call j - 1
completed (stream order; with PDL the pushes follow `griddepcontrol.wait`), and every other rank
waits for rank 0's row of call j. So any rank finishing call j implies every rank finished call
j - 1, re-arms included. A word of generation g is written again in call i + 3, by a rank that
finished call i + 2, hence after every rank finished call i + 1 and so re-armed what it read in
call i: three generations leave one call of slack, as in the EP tail, also when m (and with it
the variant and the set of owners) changes from call to call. Kernels between two calls must not
let a call's pushes start before the previous call completed.

Progress. No CTA waits for a CTA of its own rank (owners poll their own pushes after making
them); a CTA waits only for the CTA with the same (b, g, d) on another rank, and every CTA pushes
before it polls, so waits form no cycle. The units of one (b, g, d) on every rank form a wait
group independent of the others, so a group completes once its tp units are resident, and
G * (tp - 1) + 1 resident units (G = ceil(m / tp) * tp groups) always hold a whole group: that
much, not every rank's whole grid, must fit (`kernels.occupancy`; tp 8 on an H200 needs 57
clusters of 16, the occupancy API grants 58). The launch is not cooperative (PDL is kept).
Cluster size 16 is non-portable: CuTe DSL 4.8.1 sets CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
on every kernel it generates (cutlass_dsl `_generate_cuda_kernel_op`, jit_executor), so S = 16
is launched as a real 16-CTA cluster (sm_90 and sm_100 allow 16 with that attribute).

Bounded waits: every polling loop reads `%globaltimer` in the iteration of its loads; a thread
still waiting `timeout_ns` after its first poll gives up, writes and re-arms nothing more, and
the first thread of the rank to give up claims the fault record (`atom.cas` of word 0 from -1
to the waiting rank, then the missing peer, token * 16 + route (8: token row), generation). An
owner cluster shares its threads' timeouts through the same shared-memory exchange, so a band
whose sums are incomplete suppresses the whole row (non-owners then time out on it). The
generation advances anyway. After a fault the mailboxes hold stray words: reset the group
(`DeviceMailbox.reset` on every rank) before the next call.

Lazy module loading: as in the EP tail, `TpTail` launches every compiled variant once on scratch
buffers at construction, so no first launch waits behind a spinning peer.

Numbers measured (CPU host, CuTe DSL 4.8.1, 2026-11-29): compile 0.5-1 s per variant at tp <= 8,
about 4 s at tp 32; ptxas 13.0 (sm_90a -O3): no spills; 96-128 registers at S = 16, 4 and 1
(512 threads: capped at 128), 160 at S = 2, tp 8; tp 32: 126 at S = 1, 164-180 otherwise. H200, 2026-11-29, commit 302d270 (the batched send): all 270 of
tests/kernels/test_tp_tail_gpu.py passed (records/2026-11-29-h200-pytest-gpu-kernels.summary.json):
bitwise per-rank parity on random and adversarial inputs for tp 2, 3, 4, 8, m 1..8, both weight
dtypes and norm orders (nsm 132: expert-owner S=16/8, token-owner S=16 XP=8, extension), -0.0
delivery, changing m with and without PDL, the empty batch, the missing-rank fault record and
1000 graph replays. Timed by `musebench bench tail` (records/2026-11-29-h200-bench-tail-virtual.summary.json,
records/2026-11-29-2xh200-bench-tail-tp2-torchrun.summary.json: 9.4-11.5 µs per rank at tp 2 on two
H200s against 10.5-13.6 µs for an NCCL all-reduce of the K-partials then the finalize, 0.80-0.91;
at 06837f0, before the batched send, 8.8-10.8 against 10.4-13.5 on another lease: no gain shown).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int16, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor

from musebench.comm import protocol
from musebench.comm.protocol import (
    ARRIVAL_COUNT,
    DEFAULT_TIMEOUT_NS,
    FAULT_CLEAR,
    FAULT_GENERATION,
    FAULT_PEER,
    FAULT_RANK,
    FAULT_SLOTS,
    FAULT_WHERE,
    FAULT_WORD_BYTES,
    FAULT_WORDS,
    LAMPORT_GENERATIONS,
    NEXT_STAGE,
    SENTINEL_BF16X2,
    STAGE_WORD_BYTES,
    STAGE_WORDS,
    TOKEN_SLOT,
)
from musebench.kernels import compilation, ptx
from musebench.kernels.compilation import compiler, cute_flat, cute_view, fake_flat
from musebench.kernels.occupancy import LaunchDemand
from musebench.numerics import check_eps
from musebench.tp_dispatch import TpStockPath

if TYPE_CHECKING:
    from musebench.layout import UnfinalizedMoEOutput

WORD_BYTES = 4  # a 32-bit word of shared memory

H_DIM = 4096  # columns of a row (the contract's H)
TOP_K = 8  # routes per token (the contract's K)
VEC = 8  # consecutive columns per thread (one 16-byte BF16 fragment)
FRAGMENT_WORDS = 4
WARP = 32
ROW_THREADS = H_DIM // VEC  # 512 threads cover a row, whatever the split
ROW_WARPS = ROW_THREADS // WARP  # 16: global warp w owns columns 256w .. 256w + 255
BUTTERFLY = (1, 2, 4, 8, 16)  # the stock's xor-shuffle order (1 << level)
SPLITS = (1, 2, 4, 8, 16)
BF16_BYTES = 2
F32_BYTES = 4
POLL_BATCH_VECTORS = 16  # 16-byte vectors one poll covers (registers: 4 per vector)
POLL_BATCH_VECTORS_S1 = 8  # S = 1 runs 512 threads: at most 128 registers each

OWNER_PARTIALS = "owner-partials"  # expert-owner: fma chains per owner group, summed in rank order
FMA_CHAIN = "fma-chain"  # token-owner XP = 1, the extension, the chunked path
ROUNDED_PRODUCTS = "rounded-products"  # token-owner XP = P
COMBINES = (OWNER_PARTIALS, FMA_CHAIN, ROUNDED_PRODUCTS)
SCRUBBED = "scrubbed"  # single-launch delivery: other ranks get the BF16 row scrubbed per word
EXACT = "exact"  # expert-owner / chunked delivery: every rank gets the owner's bits (FP32 transport)
DELIVERIES = (SCRUBBED, EXACT)
OWNER_GROUPS = (1, 2, 4)  # routes per owner partial: KO = 8 / P for P = 8, 4, 2
UNICAST = "unicast"  # the owner publishes its row with tp - 1 stores through the token peer table
MULTICAST = "multicast"  # one multimem store per vector into the group's token mailboxes (the seed's)
TRANSPORTS = (UNICAST, MULTICAST)

WEIGHT_DTYPES = ("bf16", "fp32")
_CUTE_WEIGHT_TYPES = {"bf16": BFloat16, "fp32": Float32}
_TORCH_WEIGHT_TYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SMEM_BYTES = 2048


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---------------------------------------------------------------------------------------------
# Compile-time plan of one call size.


@dataclass(frozen=True)
class TpVariant:
    """How the kernel computes and delivers one call: the stock path's compile-time knobs.

    split: S, the band split (CTAs per token row; fixes the sum-of-squares tree).
    combine: OWNER_PARTIALS, FMA_CHAIN or ROUNDED_PRODUCTS.
    group: routes per owner partial (KO) for OWNER_PARTIALS, 0 otherwise.
    delivery: SCRUBBED (the single launch's) or EXACT (every rank gets the owner's bits).
    """

    split: int
    combine: str
    group: int = 0
    delivery: str = SCRUBBED

    def __post_init__(self) -> None:
        _require(self.split in SPLITS, f"split must be one of {SPLITS}, got {self.split}")
        _require(self.combine in COMBINES, f"combine must be one of {COMBINES}, got {self.combine!r}")
        _require(self.delivery in DELIVERIES, f"delivery must be one of {DELIVERIES}, got {self.delivery!r}")
        if self.combine == OWNER_PARTIALS:
            _require(self.group in OWNER_GROUPS, f"an owner-partials combine needs group in {OWNER_GROUPS}, got {self.group}")
        else:
            _require(self.group == 0, f"group is only meaningful for {OWNER_PARTIALS}, got {self.group}")

    @classmethod
    def from_path(cls, path: TpStockPath) -> TpVariant:
        """The knobs of the stock's dispatch for one call size (`musebench.tp_dispatch`)."""
        combine = path.combine
        group = path.experts_per_owner if combine == OWNER_PARTIALS else 0
        return cls(split=path.split, combine=combine, group=group, delivery=SCRUBBED if path.scrubbed_copies else EXACT)


def route_mailbox_shape(tp: int, capacity: int) -> tuple[int, int, int, int]:
    """[generations, source ranks, capacity * 8 route rows, H] of one rank's route mailbox (int16):
    `musebench.comm.protocol.tp_route_mailbox_shape` at H and K."""
    return protocol.tp_route_mailbox_shape(tp, capacity, H_DIM, TOP_K)


def token_mailbox_shape(capacity: int, delivery: str = EXACT) -> tuple[int, int, int, int]:
    """[generations, 1, capacity, width] of one rank's token mailbox (int16): width H for BF16
    rows (SCRUBBED only), 2H for FP32 rows (needed as soon as any variant delivers EXACT)."""
    _require(delivery in DELIVERIES, f"delivery must be one of {DELIVERIES}, got {delivery!r}")
    return protocol.tp_token_mailbox_shape(capacity, H_DIM, fp32_rows=delivery == EXACT)


def poll_batches(tp: int, split: int) -> list[list[tuple[int, int]]]:
    """The route polls of one owner thread: (route, source) in the sum's order, in batches."""
    size = POLL_BATCH_VECTORS_S1 if split == 1 else POLL_BATCH_VECTORS
    items = [(k, s) for k in range(TOP_K) for s in range(tp)]
    return [items[i : i + size] for i in range(0, len(items), size)]


# ---------------------------------------------------------------------------------------------
# Device code.


class _TpTailKernel:
    """The whole TP tail of one rank: grid (S, ceil(m / tp), tp), clusters of S CTAs."""

    def __init__(
        self,
        *,
        tp: int,
        capacity: int,
        token_width: int,
        split: int,
        combine: str,
        group: int,
        delivery: str,
        weight_before_norm: bool,
        weight_dtype: str,
        eps: float,
        gain_center: float,
        timeout_ns: int,
        enable_pdl: bool,
        transport: str = UNICAST,
    ) -> None:
        TpVariant(split=split, combine=combine, group=group, delivery=delivery)  # validates the knobs
        _require(transport in TRANSPORTS, f"transport must be one of {TRANSPORTS}, got {transport!r}")
        _require(tp >= 2, f"tp must be >= 2, got {tp}")
        _require(capacity >= 1, f"capacity must be positive, got {capacity}")
        _require(token_width in (H_DIM, 2 * H_DIM), f"token_width must be {H_DIM} or {2 * H_DIM}, got {token_width}")
        _require(delivery == SCRUBBED or token_width == 2 * H_DIM, "EXACT delivery needs a token mailbox of width 2H")
        _require(weight_dtype in WEIGHT_DTYPES, f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        check_eps(eps)
        _require(math.isfinite(gain_center), f"gain_center must be finite, got {gain_center}")
        _require(isinstance(timeout_ns, int) and 0 < timeout_ns < 2**62, f"timeout_ns must be a positive int, got {timeout_ns!r}")
        self.tp = tp
        self.capacity = capacity
        self.token_width = token_width
        self.split = split
        self.combine = combine
        self.group = group
        self.delivery = delivery
        self.weight_before_norm = bool(weight_before_norm)
        self.weight_dtype = weight_dtype
        self.eps = float(eps)
        self.gain_center = float(gain_center)
        self.timeout_ns = int(timeout_ns)
        self.enable_pdl = bool(enable_pdl)
        self.transport = transport
        self.threads = ROW_THREADS // split
        self.warps = self.threads // WARP  # 16 / S
        self.band = H_DIM // split
        self.route_rows = capacity * TOP_K
        self.batches = poll_batches(tp, split)
        self.batch_vectors = max(len(batch) for batch in self.batches)

    @cute.jit
    def __call__(
        self,
        rows: cute.Tensor,
        route_weights: cute.Tensor,
        permuted_idx: cute.Tensor,
        norm_weight: cute.Tensor,
        route_mailbox: cute.Tensor,
        route_peers: cute.Tensor,
        token_mailbox: cute.Tensor,
        token_peers: cute.Tensor,
        token_multicast: Int64,
        stage: cute.Tensor,
        fault: cute.Tensor,
        out: cute.Tensor,
        m: Int32,
        num_rows: Int32,
        row_stride: Int32,
        rank: Int32,
        stream: cuda.CUstream,
    ) -> None:
        slots = (m + self.tp - 1) // self.tp
        kernel = self.kernel(
            rows, route_weights, permuted_idx, norm_weight, route_mailbox, route_peers, token_mailbox, token_peers,
            token_multicast, stage, fault, out, m, num_rows, row_stride, rank,
        )
        if cutlass.const_expr(self.split > 1):
            kernel.launch(
                grid=(self.split, slots, self.tp),
                block=(self.threads, 1, 1),
                cluster=(self.split, 1, 1),
                smem=SMEM_BYTES,
                stream=stream,
                use_pdl=self.enable_pdl,
            )
        else:
            kernel.launch(
                grid=(1, slots, self.tp),
                block=(self.threads, 1, 1),
                smem=SMEM_BYTES,
                stream=stream,
                use_pdl=self.enable_pdl,
            )

    @cute.kernel
    def kernel(
        self,
        rows: cute.Tensor,
        route_weights: cute.Tensor,
        permuted_idx: cute.Tensor,
        norm_weight: cute.Tensor,
        route_mailbox: cute.Tensor,
        route_peers: cute.Tensor,
        token_mailbox: cute.Tensor,
        token_peers: cute.Tensor,
        token_multicast: Int64,
        stage: cute.Tensor,
        fault: cute.Tensor,
        out: cute.Tensor,
        m: Int32,
        num_rows: Int32,
        row_stride: Int32,
        rank: Int32,
    ) -> None:
        band, slot, owner = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        token = slot * self.tp + owner
        column = Int64(band * self.band + tidx * VEC)

        # Gains first: gamma is not written by the kernel this launch may overlap (PDL).
        gain_center = Float32(self.gain_center)
        gain = []
        gamma_words = ptx.ld_global_v4_u32(Int64(norm_weight.iterator.toint()) + column * BF16_BYTES)
        for j in cutlass.range_constexpr(FRAGMENT_WORDS):
            gain.append(ptx.add_rn_f32(ptx.bitcast_u32_to_f32(ptx.bf16x2_low_bits(gamma_words[j])), gain_center))
            gain.append(ptx.add_rn_f32(ptx.bitcast_u32_to_f32(ptx.bf16x2_high_bits(gamma_words[j])), gain_center))

        smem = cutlass.memory.SmemAllocator()
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout(TOP_K * self.warps), byte_alignment=16)
        warp_faults = smem.allocate_tensor(Int32, cute.make_layout(self.warps), byte_alignment=16)
        inv_rms = smem.allocate_tensor(Float32, cute.make_layout(TOP_K), byte_alignment=16)
        cta_fault = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=16)
        band_sums = smem.allocate_tensor(Float32, cute.make_layout(TOP_K * self.split), byte_alignment=16)
        band_faults = smem.allocate_tensor(Int32, cute.make_layout(self.split), byte_alignment=16)

        # Everything below reads what the preceding kernels wrote (rows, stage words, mailboxes).
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_wait()

        stage_base = Int64(stage.iterator.toint())
        generation = Int32(ptx.ld_volatile_global_u32(stage_base + NEXT_STAGE * STAGE_WORD_BYTES))

        if token < m:
            self.send(rows, permuted_idx, route_peers, Int64(norm_weight.iterator.toint()), token, slot, owner, column,
                      num_rows, row_stride, rank, generation)
            if owner == rank:
                self.reduce(
                    route_weights, route_mailbox, token_peers, token_multicast, fault, out, token, slot, band, tidx,
                    column, rank, generation, gain, warp_sums, warp_faults, inv_rms, cta_fault, band_sums, band_faults,
                )
            else:
                self.copy(token_mailbox, fault, out, token, owner, column, rank, generation)

        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_launch_dependents()

        # The last CTA of the call advances the generation: every CTA read it before its arrival.
        cute.arch.barrier()
        if tidx == 0:
            grid_x, grid_y, grid_z = cute.arch.grid_dim()
            ctas = Uint32(grid_x * grid_y * grid_z)
            arrived = ptx.atom_add_gpu_global_u32(stage_base + ARRIVAL_COUNT * STAGE_WORD_BYTES, Uint32(1), "acq_rel")
            if arrived == ctas - Uint32(1):
                ptx.st_global_u32(stage_base + ARRIVAL_COUNT * STAGE_WORD_BYTES, Uint32(0))
                ptx.st_global_u32(stage_base + NEXT_STAGE * STAGE_WORD_BYTES, Uint32((generation + 1) % LAMPORT_GENERATIONS))

    @cute.jit
    def send(
        self,
        rows: cute.Tensor,
        permuted_idx: cute.Tensor,
        route_peers: cute.Tensor,
        norm_weight_base: Int64,
        token: Int32,
        slot: Int32,
        owner: Int32,
        column: Int64,
        num_rows: Int32,
        row_stride: Int32,
        rank: Int32,
        generation: Int32,
    ) -> None:
        """Push this rank's K-partials of the token's 8 routes (this band) to the owner's mailbox."""
        rows_base = Int64(rows.iterator.toint())
        first_row = (Int64(generation) * self.tp + Int64(rank)) * self.route_rows + Int64(slot) * TOP_K
        destination = Int64(route_peers[owner]) + (first_row * H_DIM + column) * BF16_BYTES
        # Every route's index, then every route's fragment, before the first store: one memory
        # latency each, not an index -> row -> store chain per route. A route this rank has no
        # row for loads gamma's fragment instead (always there, never sent).
        fallback = norm_weight_base + column * BF16_BYTES
        route_rows = []
        for k in cutlass.range_constexpr(TOP_K):
            route_rows.append(Int32(permuted_idx[token * TOP_K + k]))
        loaded = []
        for k in cutlass.range_constexpr(TOP_K):
            row = route_rows[k]
            in_range = cutlass.select_(row < num_rows, rows_base + (Int64(row) * Int64(row_stride) + column) * BF16_BYTES,
                                       fallback)
            loaded.append(ptx.ld_global_v4_u32(cutlass.select_(row >= Int32(0), in_range, fallback)))
        payload = cute.make_rmem_tensor(cute.make_layout(FRAGMENT_WORDS), Uint32)
        for k in cutlass.range_constexpr(TOP_K):
            row = route_rows[k]
            payload.fill(Uint32(0))  # a route this rank has no row for contributes +0.0
            # Uniform over the CTA: every thread reads the same index.
            if row >= Int32(0) and row < num_rows:
                words = loaded[k]
                for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                    # A sentinel word would read as "not arrived"; as data it is (-0.0, -0.0),
                    # and +0.0 adds the same into a sum that starts from +0.0.
                    payload[j] = ptx.scrub_sentinel_word_u32(words[j])
            ptx.st_relaxed_sys_global_v4_u32(
                destination + k * (H_DIM * BF16_BYTES), payload[0], payload[1], payload[2], payload[3]
            )

    @cute.jit
    def record_fault(self, fault: cute.Tensor, rank: Int32, peer: Int32, where: Int32, generation: Int32) -> None:
        """Claim the fault record (first timeout of this rank wins) and fill it."""
        fault_base = Int64(fault.iterator.toint())
        previous = ptx.atom_cas_relaxed_gpu_global_b32(fault_base + FAULT_RANK * FAULT_WORD_BYTES, Int32(FAULT_CLEAR), rank)
        if previous == Int32(FAULT_CLEAR):
            ptx.st_global_u32(fault_base + FAULT_PEER * FAULT_WORD_BYTES, peer)
            ptx.st_global_u32(fault_base + FAULT_WHERE * FAULT_WORD_BYTES, where)
            ptx.st_global_u32(fault_base + FAULT_GENERATION * FAULT_WORD_BYTES, generation)

    @cute.jit
    def reduce(
        self,
        route_weights: cute.Tensor,
        route_mailbox: cute.Tensor,
        token_peers: cute.Tensor,
        token_multicast: Int64,
        fault: cute.Tensor,
        out: cute.Tensor,
        token: Int32,
        slot: Int32,
        band: Int32,
        tidx: Int32,
        column: Int64,
        rank: Int32,
        generation: Int32,
        gain: list,
        warp_sums: cute.Tensor,
        warp_faults: cute.Tensor,
        inv_rms: cute.Tensor,
        cta_fault: cute.Tensor,
        band_sums: cute.Tensor,
        band_faults: cute.Tensor,
    ) -> None:
        """Owner of the token: sum, normalize, combine, keep and publish this band of its row."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        # The route weights, loaded while the K-partials are still arriving (not after the norm).
        weights = [Float32(route_weights[token * TOP_K + k]) for k in range(TOP_K)]
        if cutlass.const_expr(self.split > 1):
            # Cluster peers must have started before their shared memory is written.
            cute.arch.cluster_arrive_relaxed()

        # Sum: route rows of every source rank, rank order from +0.0, one BF16 rounding per route.
        first_row = (Int64(generation) * self.tp) * self.route_rows + Int64(slot) * TOP_K
        own_base = Int64(route_mailbox.iterator.toint()) + (first_row * H_DIM + column) * BF16_BYTES
        source_stride = self.route_rows * H_DIM * BF16_BYTES
        route_stride = H_DIM * BF16_BYTES
        values = cute.make_rmem_tensor(cute.make_layout(TOP_K * VEC), Float32)  # [route][element]
        values.fill(Float32(0.0))
        landed = cute.make_rmem_tensor(cute.make_layout(self.batch_vectors * FRAGMENT_WORDS), Uint32)
        timed_out = Int32(0)
        started = ptx.read_globaltimer_u64()
        for batch in self.batches:
            polling = Int32(1) - timed_out
            pending = Uint32(timed_out)
            while polling != 0:
                # The timer is read in the same iteration as the loads: the wait is bounded.
                now = ptx.read_globaltimer_u64()
                pending = Uint32(0)
                for i, (k, s) in enumerate(batch):
                    words = ptx.ld_volatile_global_v4_u32(own_base + s * source_stride + k * route_stride)
                    for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                        landed[i * FRAGMENT_WORDS + j] = words[j]
                        pending = pending | ptx.is_sentinel_word_u32(words[j])
                polling = Int32(pending != 0) & Int32(now - started <= Int64(self.timeout_ns))
            if pending != 0:
                if timed_out == 0:
                    # Name the first (route, source) of the batch still missing.
                    missing_source = Int32(0)
                    missing_route = Int32(0)
                    for i in cutlass.range_constexpr(len(batch) - 1, -1, -1):
                        dirty = Uint32(0)
                        for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                            dirty = dirty | ptx.is_sentinel_word_u32(landed[i * FRAGMENT_WORDS + j])
                        if dirty != 0:
                            missing_source = Int32(batch[i][1])
                            missing_route = Int32(batch[i][0])
                    self.record_fault(fault, rank, missing_source, token * FAULT_SLOTS + missing_route, generation)
                timed_out = Int32(1)
            else:
                # Re-arm exactly what was read: peers write it again three calls later.
                sentinel = Uint32(SENTINEL_BF16X2)
                for i, (k, s) in enumerate(batch):
                    ptx.st_global_v4_u32(own_base + s * source_stride + k * route_stride, sentinel, sentinel, sentinel, sentinel)
            for i, (k, s) in enumerate(batch):
                for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                    word = landed[i * FRAGMENT_WORDS + j]
                    low = ptx.bitcast_u32_to_f32(ptx.bf16x2_low_bits(word))
                    high = ptx.bitcast_u32_to_f32(ptx.bf16x2_high_bits(word))
                    values[k * VEC + 2 * j] = ptx.add_rn_f32(values[k * VEC + 2 * j], low)
                    values[k * VEC + 2 * j + 1] = ptx.add_rn_f32(values[k * VEC + 2 * j + 1], high)
                if s == self.tp - 1:
                    for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                        packed = ptx.cvt_rn_bf16x2_f32(values[k * VEC + 2 * j + 1], values[k * VEC + 2 * j])
                        values[k * VEC + 2 * j] = ptx.bitcast_u32_to_f32(ptx.bf16x2_low_bits(packed))
                        values[k * VEC + 2 * j + 1] = ptx.bitcast_u32_to_f32(ptx.bf16x2_high_bits(packed))

        # u = x * g before the norm (stock mode 1), else u = x.
        if cutlass.const_expr(self.weight_before_norm):
            for k in cutlass.range_constexpr(TOP_K):
                for e in cutlass.range_constexpr(VEC):
                    values[k * VEC + e] = ptx.mul_rn_f32(values[k * VEC + e], gain[e])

        # Sum of squares, the stock's tree: thread chain over its 8 columns from +0.0, warp butterfly.
        squares = []
        for k in cutlass.range_constexpr(TOP_K):
            s = Float32(0.0)
            for e in cutlass.range_constexpr(VEC):
                s = ptx.fma_rn_f32(values[k * VEC + e], values[k * VEC + e], s)
            for offset in BUTTERFLY:
                s = ptx.add_rn_f32(s, cute.arch.shuffle_sync_bfly(s, offset=offset))
            squares.append(s)
        warp_timed_out = cute.arch.vote_any_sync(timed_out != 0)
        if lane == 0:
            for k in cutlass.range_constexpr(TOP_K):
                warp_sums[k * self.warps + warp] = squares[k]
            warp_faults[warp] = Int32(warp_timed_out)
        cute.arch.barrier()

        inv_width = Float32(1.0 / H_DIM)
        eps = Float32(self.eps)
        if cutlass.const_expr(self.split == 1):
            # One warp per route: warp sums in lanes 0..15, +0.0 in lanes 16..31, the same butterfly.
            if warp < TOP_K:
                v = Float32(0.0)
                if lane < ROW_WARPS:
                    v = warp_sums[warp * ROW_WARPS + lane]
                for offset in BUTTERFLY:
                    v = ptx.add_rn_f32(v, cute.arch.shuffle_sync_bfly(v, offset=offset))
                if lane == 0:
                    inv_rms[warp] = ptx.rsqrt_approx_f32(ptx.fma_rn_f32(v, inv_width, eps))
            if tidx == TOP_K * WARP:
                any_fault = Int32(0)
                for w in cutlass.range_constexpr(self.warps):
                    any_fault = any_fault | warp_faults[w]
                cta_fault[0] = any_fault
            cute.arch.barrier()
        else:
            # Band sums: chain over this CTA's warps from +0.0, written into every cluster peer's
            # shared memory; after the cluster barrier every CTA chains over bands 0..S-1.
            cute.arch.cluster_wait()
            sums_base = Int32(band_sums.iterator.toint())
            faults_base = Int32(band_faults.iterator.toint())
            if tidx < TOP_K:
                v = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    v = ptx.add_rn_f32(v, warp_sums[tidx * self.warps + w])
                for peer in cutlass.range_constexpr(self.split):
                    remote = ptx.mapa_shared_cluster_u32(sums_base + (band * TOP_K + tidx) * F32_BYTES, Int32(peer))
                    ptx.st_shared_cluster_f32(remote, v)
            if tidx == TOP_K:
                any_fault = Int32(0)
                for w in cutlass.range_constexpr(self.warps):
                    any_fault = any_fault | warp_faults[w]
                for peer in cutlass.range_constexpr(self.split):
                    remote = ptx.mapa_shared_cluster_u32(faults_base + band * WORD_BYTES, Int32(peer))
                    ptx.st_shared_cluster_u32(remote, Uint32(any_fault))
            cute.arch.barrier()
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            if tidx < TOP_K:
                total = Float32(0.0)
                for b in cutlass.range_constexpr(self.split):
                    total = ptx.add_rn_f32(total, band_sums[b * TOP_K + tidx])
                inv_rms[tidx] = ptx.rsqrt_approx_f32(ptx.fma_rn_f32(total, inv_width, eps))
            if tidx == TOP_K:
                any_fault = Int32(0)
                for b in cutlass.range_constexpr(self.split):
                    any_fault = any_fault | band_faults[b]
                cta_fault[0] = any_fault
            cute.arch.barrier()

        # Normalize and combine the 8 routes with the path's chain.
        scales = [inv_rms[k] for k in range(TOP_K)]
        result = []
        for e in cutlass.range_constexpr(VEC):
            ys = []
            for k in cutlass.range_constexpr(TOP_K):
                if cutlass.const_expr(self.weight_before_norm):
                    ys.append(ptx.mul_rn_f32(values[k * VEC + e], scales[k]))
                else:
                    ys.append(ptx.mul_rn_f32(ptx.mul_rn_f32(values[k * VEC + e], scales[k]), gain[e]))
            acc = Float32(0.0)
            if cutlass.const_expr(self.combine == FMA_CHAIN):
                for k in cutlass.range_constexpr(TOP_K):
                    acc = ptx.fma_rn_f32(weights[k], ys[k], acc)
            elif cutlass.const_expr(self.combine == ROUNDED_PRODUCTS):
                for k in cutlass.range_constexpr(TOP_K):
                    acc = ptx.add_rn_f32(acc, ptx.mul_rn_f32(ys[k], weights[k]))
            else:
                # Owner partials in rank order; the stock's -0.0 scrub of each partial cannot change
                # a sum that starts from +0.0, so it is not spelled out.
                for o in cutlass.range_constexpr(TOP_K // self.group):
                    partial = Float32(0.0)
                    for k in cutlass.range_constexpr(o * self.group, (o + 1) * self.group):
                        partial = ptx.fma_rn_f32(weights[k], ys[k], partial)
                    acc = ptx.add_rn_f32(acc, partial)
            result.append(acc)
        words = [ptx.cvt_rn_bf16x2_f32(result[2 * j + 1], result[2 * j]) for j in range(FRAGMENT_WORDS)]

        if cta_fault[0] == 0:
            out_address = Int64(out.iterator.toint()) + (Int64(token) * H_DIM + column) * BF16_BYTES
            ptx.st_global_v4_u32(out_address, words[0], words[1], words[2], words[3])
            row_offset = (Int64(generation) * self.capacity + Int64(token)) * (self.token_width * BF16_BYTES)
            if cutlass.const_expr(self.transport == MULTICAST):
                # One store per vector into every rank's token mailbox at once (the owner's own
                # row too, which nothing on this rank reads): the same words as the unicast
                # stores below, the switch replicates them unchanged.
                mc_row = token_multicast + row_offset
                if cutlass.const_expr(self.delivery == SCRUBBED):
                    copy = [ptx.scrub_sentinel_word_u32(w) for w in words]
                    ptx.multimem_st_relaxed_sys_global_v4_bf16x2(mc_row + column * BF16_BYTES, copy[0], copy[1], copy[2],
                                                                copy[3])
                else:
                    bits = [ptx.encode_sentinel_word_f32(ptx.bitcast_f32_to_u32(v)) for v in result]
                    ptx.multimem_st_relaxed_sys_global_v4_f32(mc_row + column * F32_BYTES, bits[0], bits[1], bits[2], bits[3])
                    ptx.multimem_st_relaxed_sys_global_v4_f32(mc_row + column * F32_BYTES + 16, bits[4], bits[5], bits[6],
                                                              bits[7])
            else:
                # Every peer's mailbox address in one batch of loads, not one before each peer's
                # store (here, not earlier: at tp 32 and 512 threads the registers would spill).
                peer_bases = []
                for step in cutlass.range_constexpr(1, self.tp):
                    peer_bases.append(Int64(token_peers[(rank + step) % self.tp]))
                for step in cutlass.range_constexpr(1, self.tp):
                    peer_row = peer_bases[step - 1] + row_offset
                    if cutlass.const_expr(self.delivery == SCRUBBED):
                        # The data write is the release; the copy is scrubbed per 32-bit word.
                        copy = [ptx.scrub_sentinel_word_u32(w) for w in words]
                        ptx.st_relaxed_sys_global_v4_u32(peer_row + column * BF16_BYTES, copy[0], copy[1], copy[2], copy[3])
                    else:
                        # FP32 before rounding, sentinel pattern mapped to -0.0: the reader rounds to
                        # the owner's BF16 bits.
                        bits = [ptx.encode_sentinel_word_f32(ptx.bitcast_f32_to_u32(v)) for v in result]
                        ptx.st_relaxed_sys_global_v4_u32(peer_row + column * F32_BYTES, bits[0], bits[1], bits[2], bits[3])
                        ptx.st_relaxed_sys_global_v4_u32(peer_row + column * F32_BYTES + 16, bits[4], bits[5], bits[6],
                                                         bits[7])

    @cute.jit
    def copy(
        self,
        token_mailbox: cute.Tensor,
        fault: cute.Tensor,
        out: cute.Tensor,
        token: Int32,
        owner: Int32,
        column: Int64,
        rank: Int32,
        generation: Int32,
    ) -> None:
        """Another rank owns the token: poll its published band and copy it out."""
        row_offset = (Int64(generation) * self.capacity + Int64(token)) * (self.token_width * BF16_BYTES)
        vectors = 1 if self.delivery == SCRUBBED else 2
        element_bytes = BF16_BYTES if self.delivery == SCRUBBED else F32_BYTES
        source = Int64(token_mailbox.iterator.toint()) + row_offset + column * element_bytes
        landed = cute.make_rmem_tensor(cute.make_layout(vectors * FRAGMENT_WORDS), Uint32)
        started = ptx.read_globaltimer_u64()
        pending = Uint32(1)
        polling = Int32(1)
        while polling != 0:
            now = ptx.read_globaltimer_u64()
            pending = Uint32(0)
            for v in cutlass.range_constexpr(vectors):
                words = ptx.ld_volatile_global_v4_u32(source + v * 16)
                for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                    landed[v * FRAGMENT_WORDS + j] = words[j]
                    pending = pending | ptx.is_sentinel_word_u32(words[j])
            polling = Int32(pending != 0) & Int32(now - started <= Int64(self.timeout_ns))
        if pending != 0:
            self.record_fault(fault, rank, owner, token * FAULT_SLOTS + TOKEN_SLOT, generation)
        else:
            out_address = Int64(out.iterator.toint()) + (Int64(token) * H_DIM + column) * BF16_BYTES
            if cutlass.const_expr(self.delivery == SCRUBBED):
                ptx.st_global_v4_u32(out_address, landed[0], landed[1], landed[2], landed[3])
            else:
                words = [
                    ptx.cvt_rn_bf16x2_f32(ptx.bitcast_u32_to_f32(landed[2 * j + 1]), ptx.bitcast_u32_to_f32(landed[2 * j]))
                    for j in range(FRAGMENT_WORDS)
                ]
                ptx.st_global_v4_u32(out_address, words[0], words[1], words[2], words[3])
            sentinel = Uint32(SENTINEL_BF16X2)
            for v in cutlass.range_constexpr(vectors):
                ptx.st_global_v4_u32(source + v * 16, sentinel, sentinel, sentinel, sentinel)


# ---------------------------------------------------------------------------------------------
# Compilation (fake tensors; `kernels.compilation`'s cache, keyed by the exact compile-time values).

def compile_tp_tail(
    *,
    tp: int,
    capacity: int,
    token_width: int,
    variant: TpVariant,
    weight_before_norm: bool,
    weight_dtype: str,
    eps: float,
    gain_center: float,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
    enable_pdl: bool = True,
    transport: str = UNICAST,
    arch: str | None = None,
    ptx_dir: str | None = None,
) -> Any:
    """The compiled TP tail for these compile-time values (cached; never during capture).

    The rank is a runtime argument: one compilation serves every rank of the group. `transport`:
    UNICAST publishes each owned row through the token peer table, MULTICAST with one multimem
    store per vector to the token mailboxes' multicast address (a runtime argument; the same bits,
    module docstring). `arch` overrides the target (default: CUTE_DSL_ARCH or the current GPU);
    `ptx_dir` keeps the PTX there (`compiled.artifacts.PTX`). All are part of the cache key.
    """
    config = dict(
        tp=tp, capacity=capacity, token_width=token_width, split=variant.split, combine=variant.combine,
        group=variant.group, delivery=variant.delivery, weight_before_norm=bool(weight_before_norm),
        weight_dtype=weight_dtype, eps=float(eps), gain_center=float(gain_center), timeout_ns=timeout_ns,
        enable_pdl=bool(enable_pdl), transport=transport,
    )

    def build() -> Any:
        kernel = _TpTailKernel(**config)
        weight_type = _CUTE_WEIGHT_TYPES[weight_dtype]
        route_words = math.prod(route_mailbox_shape(tp, capacity))
        token_words = math.prod(protocol.mailbox_shape(1, capacity, token_width))
        return compiler(arch, ptx_dir)(
            kernel,
            fake_flat(BFloat16, VEC, 16),
            fake_flat(weight_type, TOP_K, weight_type.width // 8),
            fake_flat(Int32, TOP_K, 4),
            make_fake_compact_tensor(BFloat16, (H_DIM,), assumed_align=16),
            make_fake_compact_tensor(Int16, (route_words,), assumed_align=16),
            make_fake_compact_tensor(Int64, (tp,), assumed_align=8),
            make_fake_compact_tensor(Int16, (token_words,), assumed_align=16),
            make_fake_compact_tensor(Int64, (tp,), assumed_align=8),
            Int64(0),
            make_fake_compact_tensor(Int32, (STAGE_WORDS,), assumed_align=8),
            make_fake_compact_tensor(Int32, (FAULT_WORDS,), assumed_align=16),
            fake_flat(BFloat16, H_DIM, 16),
            Int32(1),
            Int32(1),
            Int32(H_DIM),
            Int32(0),
            cuda.CUstream(0),
        )

    key = compilation.kernel_key(_TpTailKernel, arch=arch, ptx_dir=ptx_dir, **config)
    return compilation.compiled(key, build, what="the TP tail kernel")


# ---------------------------------------------------------------------------------------------
# Host side: one rank's bound tail.


@dataclass(frozen=True)
class TpFault:
    """A decoded fault record: a bounded wait of the TP tail ran out."""

    rank: int  # the waiting rank
    peer: int  # the rank whose words never landed
    token: int
    route: int | None  # the route row waited for (route mailbox), None for the token mailbox
    generation: int

    def message(self) -> str:
        what = f"route {self.route} of token {self.token}" if self.route is not None else f"the row of token {self.token}"
        return f"TP tail: rank {self.rank} timed out waiting for rank {self.peer} ({what}, generation {self.generation})"


def decode_fault(words: list[int]) -> TpFault | None:
    """The fault record int32[4] as read back, or None where no wait timed out."""
    record = protocol.read_fault_record(words)
    if record is None:
        return None
    rank, peer, where, generation = record
    token, slot = divmod(where, FAULT_SLOTS)
    return TpFault(rank=rank, peer=peer, token=token, route=None if slot == TOKEN_SLOT else slot, generation=generation)


class TpTail:
    """One rank's TP tail bound to its mailbox group: `run` is one launch of `_TpTailKernel`.

    Internal: the runner behind `musebench.kernels.tail.TpTail` / `BoundTail`, the public API.

    The host owns the memory, allocated collectively before construction (`DeviceMailbox`
    allocations fit: int16 words armed with -32768, int32 [2] stage words zeroed, int32 [4]
    fault record at -1):

    - `route_mailbox`: this rank's int16 `route_mailbox_shape(tp, capacity)`, armed;
      `route_peers`: int64 [tp], every rank's route mailbox address as this device sees it;
    - `token_mailbox`: int16 `token_mailbox_shape(capacity, delivery)`, armed, width 2H as
      soon as one variant delivers EXACT; `token_peers`: int64 [tp] likewise;
      `token_multicast` (MULTICAST kernels; None: UNICAST): the address of the group's token
      mailboxes in their NVLink multicast mapping (every rank's at the same offset);
    - `stage`: int32 [2] zero on every rank ([NEXT_STAGE, ARRIVAL_COUNT]); `fault`: int32 [4], all -1;
    - `norm_weight`: BF16 [4096] gamma (not written by the kernel that precedes `run`).

    `variants` maps every token count m the group will call with (1..capacity) to the stock
    path's knobs for that m (`TpVariant.from_path(tp_stock_path(m, tp, nsm))` in the harness),
    or is one `TpVariant` used for every m. Construction compiles every distinct variant (not
    during capture) and, with `warm_up`, launches each once on private scratch buffers (lazy
    module loading must not happen behind a spinning peer). `run` is collective (every rank,
    same m, same call order, never overlapping on one rank), graph-capturable, allocates nothing.
    """

    def __init__(
        self,
        *,
        rank: int,
        tp: int,
        capacity: int,
        route_mailbox: torch.Tensor,
        route_peers: torch.Tensor,
        token_mailbox: torch.Tensor,
        token_peers: torch.Tensor,
        stage: torch.Tensor,
        fault: torch.Tensor,
        norm_weight: torch.Tensor,
        weight_before_norm: bool,
        weight_dtype: str,
        eps: float,
        gain_center: float,
        variants: Mapping[int, TpVariant] | TpVariant,
        timeout_ns: int = DEFAULT_TIMEOUT_NS,
        enable_pdl: bool = True,
        warm_up: bool = True,
        token_multicast: int | None = None,
    ) -> None:
        _require(tp >= 2, f"tp must be >= 2, got {tp}")
        _require(token_multicast is None or (isinstance(token_multicast, int) and token_multicast > 0
                                             and token_multicast % 16 == 0),
                 f"token_multicast must be a 16-byte aligned multicast address, got {token_multicast!r}")
        _require(0 <= rank < tp, f"rank {rank} outside 0..{tp - 1}")
        _require(capacity >= 1, f"capacity must be positive, got {capacity}")
        _require(weight_dtype in WEIGHT_DTYPES, f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        if isinstance(variants, TpVariant):
            variants = {m: variants for m in range(1, capacity + 1)}
        plan = dict(variants)
        _require(bool(plan), "variants must name at least one token count")
        for m, variant in plan.items():
            _require(1 <= m <= capacity, f"variant for m={m} outside 1..{capacity}")
            _require(isinstance(variant, TpVariant), f"variant for m={m} is not a TpVariant")
            if variant.combine == OWNER_PARTIALS:
                _require(variant.group * tp == TOP_K, f"owner partials of {variant.group} routes need tp = {TOP_K // variant.group}, got {tp}")
        token_width = token_mailbox.shape[-1] if token_mailbox.dim() == 4 else -1
        needed = EXACT if any(v.delivery == EXACT for v in plan.values()) else SCRUBBED
        _require(token_width in (H_DIM, 2 * H_DIM), f"token_mailbox width must be {H_DIM} or {2 * H_DIM}, got {token_width}")
        if needed == EXACT:
            _require(token_width == 2 * H_DIM, f"EXACT delivery needs token_mailbox {token_mailbox_shape(capacity, EXACT)}")
        self._check(route_mailbox, torch.int16, route_mailbox_shape(tp, capacity), "route_mailbox", 16)
        self._check(token_mailbox, torch.int16, protocol.mailbox_shape(1, capacity, token_width), "token_mailbox", 16)
        self._check(route_peers, torch.int64, (tp,), "route_peers", 8)
        self._check(token_peers, torch.int64, (tp,), "token_peers", 8)
        self._check(stage, torch.int32, (STAGE_WORDS,), "stage", 8)
        self._check(fault, torch.int32, (FAULT_WORDS,), "fault", 16)
        self._check(norm_weight, torch.bfloat16, (H_DIM,), "norm_weight", 16)
        self.rank, self.tp, self.capacity, self.token_width = rank, tp, capacity, token_width
        self.weight_dtype = weight_dtype
        self.fault = fault
        self.plan = plan
        self.transport = UNICAST if token_multicast is None else MULTICAST
        self._token_multicast = Int64(token_multicast or 0)
        compiled = {}
        for variant in sorted(set(plan.values()), key=repr):
            compiled[variant] = compile_tp_tail(
                tp=tp, capacity=capacity, token_width=token_width, variant=variant,
                weight_before_norm=weight_before_norm, weight_dtype=weight_dtype, eps=eps, gain_center=gain_center,
                timeout_ns=timeout_ns, enable_pdl=enable_pdl, transport=self.transport,
            )
        self._kernels = {m: compiled[variant] for m, variant in plan.items()}
        # The fixed buffers are exported once; run converts only the per-call tensors.
        self._gamma = cute_view(norm_weight, 16)
        self._route_mailbox = cute_view(route_mailbox.view(-1), 16)
        self._route_peers = cute_view(route_peers, 8)
        self._token_mailbox = cute_view(token_mailbox.view(-1), 16)
        self._token_peers = cute_view(token_peers, 8)
        self._stage = cute_view(stage, 8)
        self._fault = cute_view(fault, 16)
        self._rank = Int32(rank)
        device = route_mailbox.device
        # Stands in for gemm2_permuted when a rank holds no row at all (never read: every index
        # is then -1), so that run allocates nothing.
        self._no_rows = torch.zeros(1, H_DIM, dtype=torch.bfloat16, device=device)
        self._buffers = (route_mailbox, route_peers, token_mailbox, token_peers, stage, fault, norm_weight)
        if warm_up:
            self._warm_up(device, compiled)

    def _warm_up(self, device: torch.device, compiled: dict) -> None:
        """Launch each compiled variant once on private scratch buffers, then synchronise.

        CUDA loads modules lazily by default, and a kernel's first launch may wait for the device
        to go idle; behind a peer's spinning kernel (virtual ranks sharing one GPU) that wait
        lasts until the peer times out. Here every peer address points at zeroed scratch
        mailboxes (full size: the compiled kernel's mailbox extents are static), so every poll
        finds its words landed and nothing of a peer is touched. A MULTICAST kernel can publish
        only to a multicast address, so it is launched for one token as rank 1, which owns none of
        it: the send and copy phases run, no multimem store does (the module loads all the same).
        """
        route_box = torch.zeros(route_mailbox_shape(self.tp, self.capacity), dtype=torch.int16, device=device)
        token_box = torch.zeros(protocol.mailbox_shape(1, self.capacity, self.token_width), dtype=torch.int16, device=device)
        route_peers = torch.full((self.tp,), route_box.data_ptr(), dtype=torch.int64, device=device)
        token_peers = torch.full((self.tp,), token_box.data_ptr(), dtype=torch.int64, device=device)
        stage = torch.zeros(STAGE_WORDS, dtype=torch.int32, device=device)
        fault = torch.full((FAULT_WORDS,), FAULT_CLEAR, dtype=torch.int32, device=device)
        stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
        first_m = {}
        for m in sorted(self.plan):
            first_m.setdefault(id(self._kernels[m]), m)  # one launch per distinct compiled variant
        multicast = self.transport == MULTICAST
        warm_rank = Int32(1) if multicast else self._rank  # token 0's owner is rank 0
        for first in sorted(first_m.values()):
            m = 1 if multicast else first
            kernel = self._kernels[first]
            weights = torch.zeros(m, TOP_K, dtype=_TORCH_WEIGHT_TYPES[self.weight_dtype], device=device)
            index = torch.full((m, TOP_K), -1, dtype=torch.int32, device=device)  # no row is read
            out = torch.empty(m, H_DIM, dtype=torch.bfloat16, device=device)
            kernel(
                cute_flat(self._no_rows, 16, VEC), cute_flat(weights, weights.element_size(), TOP_K),
                cute_flat(index, 4, TOP_K), self._gamma, cute_view(route_box.view(-1), 16), cute_view(route_peers, 8),
                cute_view(token_box.view(-1), 16), cute_view(token_peers, 8), Int64(0), cute_view(stage, 8),
                cute_view(fault, 16), cute_flat(out, 16, H_DIM), Int32(m), Int32(0), Int32(H_DIM), warm_rank, stream,
            )
            torch.cuda.current_stream(device).synchronize()
            # Back to the state the next variant expects: generation 0, every word landed.
            route_box.zero_()
            token_box.zero_()
            stage.zero_()
        if int(fault[FAULT_RANK]) != FAULT_CLEAR:
            raise RuntimeError(f"TP tail warm-up timed out on scratch mailboxes: {decode_fault(fault.tolist())}")

    @staticmethod
    def _check(tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str, align: int) -> None:
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CUDA {dtype} tensor {shape}, got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        if tensor.data_ptr() % align:
            raise ValueError(f"{name} must be {align}-byte aligned")

    def run(self, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor) -> None:
        """Launch the tail on the current stream; `out` BF16 [m, 4096] gets every token's row.

        `unfinalized`: this rank's `gemm2_permuted` BF16 [rows, width >= 4096] (contiguous, width
        a multiple of 8; the first 4096 columns are read), `route_weights` [m, 8] in
        `weight_dtype` (the same on every rank), `expanded_idx_to_permuted_idx` int32 [m, 8]
        (an index < 0 or >= rows contributes +0.0), all CUDA. m = 0 launches nothing.
        Collective. Bitwise equal to `musebench.stock.tp.tp_rank_output` of the stock reference
        for the path each m was planned with (hardware rsqrt).
        """
        m = out.shape[0]
        if m == 0:
            return
        kernel = self._kernels.get(m)
        if kernel is None:
            raise ValueError(f"no variant planned for m={m} (planned: {sorted(self._kernels)})")
        rows, weights, index = unfinalized.gemm2_permuted, unfinalized.route_weights, unfinalized.expanded_idx_to_permuted_idx
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, H_DIM) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous bfloat16 [{m}, {H_DIM}], got {out.dtype} {tuple(out.shape)}")
        if weights.dtype != _TORCH_WEIGHT_TYPES[self.weight_dtype] or tuple(weights.shape) != (m, TOP_K) or not weights.is_contiguous():
            raise ValueError(f"route_weights must be contiguous {self.weight_dtype} [{m}, {TOP_K}], got {weights.dtype} {tuple(weights.shape)}")
        if index.dtype != torch.int32 or tuple(index.shape) != (m, TOP_K) or not index.is_contiguous():
            raise ValueError(f"expanded_idx_to_permuted_idx must be contiguous int32 [{m}, {TOP_K}]")
        if rows.dtype != torch.bfloat16 or rows.dim() != 2 or rows.shape[1] < H_DIM or rows.shape[1] % VEC or not rows.is_contiguous():
            raise ValueError(f"gemm2_permuted must be contiguous bfloat16 [rows, width >= {H_DIM}], width a multiple of {VEC}")
        num_rows = rows.shape[0]
        if num_rows == 0:
            rows = self._no_rows
        stream = cuda.CUstream(torch.cuda.current_stream(out.device).cuda_stream)
        kernel(
            cute_flat(rows, 16, VEC),
            cute_flat(weights, weights.element_size(), TOP_K),
            cute_flat(index, 4, TOP_K),
            self._gamma,
            self._route_mailbox,
            self._route_peers,
            self._token_mailbox,
            self._token_peers,
            self._token_multicast,
            self._stage,
            self._fault,
            cute_flat(out, 16, H_DIM),
            Int32(m),
            Int32(num_rows),
            Int32(rows.shape[1]),
            self._rank,
            stream,
        )

    def launch_demands(self, m: int) -> list[LaunchDemand]:
        """This rank's launch for m tokens (grid (S, ceil(m / tp), tp), clusters of S), for the
        co-residency check."""
        variant = self.plan[m]
        owners = math.ceil(m / self.tp) * self.tp  # one unit (S CTAs) per (slot, owner): a wait group
        return [LaunchDemand(self._kernels[m], ctas=variant.split * owners, threads=ROW_THREADS // variant.split,
                             smem_bytes=SMEM_BYTES, cluster=variant.split, wait_groups=owners)]

    def check_fault(self) -> None:
        """Synchronise on the fault record; RuntimeError naming rank, peer, token and generation if set."""
        record = decode_fault([int(v) for v in self.fault.tolist()])
        if record is not None:
            raise RuntimeError(record.message())
