"""EP MoE tail in CuTe DSL: finalize + post-expert RMSNorm + Lamport all-reduce, two kernels (or one).

What it computes (bit for bit, docs/contract.md §1; torch reference `musebench.stock.ep`): per rank
the BF16 partial of each token, the sum over the token's local routes of the route-weighted,
RMS-normalised expert row, then the rank-order FP32 sum of every rank's partial, as BF16.

Phases, one CUDA stream per rank, two launches per call. The rank is a runtime argument of both
kernels (`Int32`), as in the TP tail: one compilation serves every rank of a group.

1. `_EpPublisherKernel`, grid (m,), 128 threads: thread t owns the 16-byte fragments at columns
   8 * (t + 128 * trip) .. +7. Gamma (+ gain centre) is loaded before `griddepcontrol.wait`
   (the weights are not produced by the preceding kernel). After the wait every route's index,
   weight and row fragments are loaded at once (a route of another rank reads gamma's row, unused),
   then the sums of squares of all local routes, one barrier, then the routes in order. Per local
   route: the sum of squares as a chain of 32 `fma.rn.f32` (element-major, trip fastest), a
   butterfly (xor 16..1, `add.rn.f32`), the warp sums from +0.0 in warp order, `rsqrt.approx.ftz.f32` of
   `fma.rn(total, 1/width, eps)`, then `acc = fma.rn(y, w, acc)`. The partial is converted with
   `cvt.rn.bf16x2.f32`, -0.0 is scrubbed to +0.0 and the words are stored to slot
   [stage, rank, token] of every rank's mailbox: `st.relaxed.sys` through the peer table
   (transport "unicast", peers from rank + 1 upward, wrapping, own mailbox last: `peer_index`) or
   one `multimem.st` (transport "multicast"). The generation is NEXT_STAGE, read after the wait;
   the publisher writes no stage word.

   Transports give the same bits: the transport is a compile-time knob that changes only how the
   finished payload words leave the thread (tp `st.relaxed.sys` through the peer table, or one
   `multimem.st`, which the NVLink switch replicates into every bound rank's words at the same
   offset without arithmetic; the `.bf16x2` in its name types the 16 bytes, it converts nothing).
   Every rank's mailbox therefore holds the same words either way, the reduction is one kernel
   for both, and everything before the stores (the loads, every rounding, the scrub) is traced
   from the same code (tests/kernels/test_ep_tail_compile.py compares the two PTX files: the
   same arithmetic, in the same order, on the same operands; only the stores, the peer-address
   loads and, in the single launch, a `fence.proxy.alias` differ).
2. `_EpReduceKernel`, grid (m, width / 8 / 128), 128 threads: a thread owns one 16-byte fragment
   of one token. Thread 0 of each CTA reads NEXT_STAGE and counts the CTA in (the generation
   protocol below), then, without waiting for the publisher's grid, every thread polls the tp
   slots of its own mailbox with `ld.volatile.global.v4.u32` until no BF16 half is the sentinel
   0x8000, adds them from +0.0 in rank order (`add.rn.f32`), stores `cvt.rn.bf16x2.f32` of the
   sum (no scrub) and re-arms exactly the 16 * tp bytes it read. Then `griddepcontrol.wait`, and
   the last CTA to arrive advances NEXT_STAGE.

Generation protocol (both forms; stage words int32 [NEXT_STAGE, ARRIVAL_COUNT], zero at first):
thread 0 of each CTA of the grid that advances the generation (the reduction, or the single
launch) reads NEXT_STAGE, shares it through shared memory behind a barrier and counts the CTA
in with `atom.release.gpu` on ARRIVAL_COUNT, whose result nothing waits for; at its end the last
CTA to arrive (`fence.acq_rel.gpu`) stores NEXT_STAGE + 1 and zeroes the count. Every CTA read
the generation before arriving, so no read sees the advance early; after a fault the advance
happens all the same, so the generations of the calls that follow stay in step.

Single launch (`single_launch=True`, one kernel per call, same bits): the publisher's grid (m,)
also reduces. Thread 0's read and arrival come once every row load is issued, the routes'
barrier shares the generation, and the advance is the kernel's last act. (Until 2026-11-29 the
read and an acq_rel arrival sat behind a barrier of their own before the first load, two round
trips ahead of the load chain, when the single launch measured 1.2 µs over two launches on two
H200s.) After publishing, each thread runs `_EpReduceKernel.reduce_fragments` for its own columns
of its CTA's token under one timer: the same polls (every trip's in one loop where tp * trips <=
32 vectors, tp <= 8 at width 4096; trip by trip beyond), rank-order sums, re-arms and fault
record, inlined.

Memory ordering (the Lamport protocol, `musebench.comm.protocol`): the data write is the release.
The publisher scrubs -0.0 from its payload, so a reader that sees no sentinel half in a fragment
sees the whole fragment (each 16-bit half is written once, sentinel -> value, and checked on
its own, so a torn 16-byte access is harmless). A slot of generation g is written again only at
call i + 3, after every peer consumed call i + 2, which needs this rank's publish of i + 2, which
follows this rank's reduce of call i (its re-arm) in stream order; three generations suffice.
Stage words live in the rank's device memory, so CUDA-graph replay advances them. With PDL the
publisher's `griddepcontrol.wait` waits for the previous reduce's whole grid (its advance and
re-arms included), and the publisher lets the reduction launch right after that wait. The
reduction can then read NEXT_STAGE at once (the previous reduce finished before it could launch)
and poll while the publisher runs: a slot is complete when no half is the sentinel, whoever
wrote it. Its own `griddepcontrol.wait` only precedes the advance, which must follow every
publisher CTA's read of NEXT_STAGE. The reduction (and the single launch) let the next call's
publisher launch only at their end: earlier, that publisher's waiting CTAs could take SMs from a
peer's publisher of this call (virtual ranks on one GPU). Without PDL, stream order gives the
same orderings.

Bounded waits: every polling loop reads `%globaltimer` in the same iteration as its loads. A
fragment still incomplete `timeout_ns` after the reduce started polling is abandoned: the thread
writes no output and re-arms nothing, and the first such thread of the rank records the fault in
`fault` int32[4] (`atom.cas` of word 0 from -1 to the waiting rank, then the missing peer, the
mailbox row `slot * capacity + token` and the generation); the generation advances anyway.

Lazy module loading: a kernel's first launch can wait for the device to go idle, which behind a
peer's spinning reduction (virtual ranks on one GPU) lasts until that peer times out; `EpTail`
therefore launches both kernels once on scratch buffers at construction.

Numbers measured: compile (CPU host, CuTe DSL 4.8.1) about 0.4 s per publisher variant (tp 32:
0.5 s), 0.1-0.3 s per reduction; SASS (nvdisasm 13.5) of the tp 8 publisher, sm_90a and sm_100a:
520 FFMA, 512 FMUL (768 with the weight before the norm: x * gamma is recomputed after the
barrier rather than kept, the same operands), 104 FADD, 8 MUFU.RSQ, no FTZ, no packed f32x2;
ptxas 13.0 (sm_90a -O3), 2026-12-01, with the runtime rank: no spill at tp 2, 3, 8, 32 in either
form; the two-launch unicast publisher 232-255 registers (229-246 with the rank a compile-time
constant: the peer indices are now a compare and a select each), the single launch 235-255
(240-255), the two-launch multicast publisher 229 (227), the reduction unchanged (31 at tp 2,
61 at tp 8, 253 at tp 32); at 128 threads 232 and 255 registers both fit two CTAs per SM. The
runtime rank is not yet run on a GPU: the H200 results below are of the compile-time-rank
kernels (one compilation per rank). H200, 2026-11-29, CuTe DSL
4.8.1 (cu13 libs), torch 2.11+cu130, commit 302d270: `pytest -m gpu tests/kernels` 690 passed
(records/2026-11-29-h200-pytest-gpu-kernels.summary.json), both EP forms bitwise equal to the reference
(tp 2, 3, 4, 8; m 1..8; both weight dtypes and norm orders; random and adversarial rows), the
missing-rank fault and graph replays. Timing, CUDA graph of 20 calls, median of 30 replays:
- one rank per H200, tp 2 (`bench tail --launcher torchrun`,
  records/2026-11-29-2xh200-bench-tail-tp2-torchrun.summary.json, m 1..8, both weight dtypes): the
  two-launch tail 4.6-5.9 µs (publisher alone 3.5-4.7, the reduction exposed 0.9-1.3), the single
  launch 5.8-6.9 µs, the stock finalize alone 3.1-3.5 µs, finalize + NCCL all-reduce 9.8-10.6 µs
  (at 06837f0, before the batched loads and the early PDL trigger: 4.9-6.1, publisher 3.8-4.9);
- virtual ranks sharing one H200 (records/2026-11-29-h200-bench-tail-virtual.summary.json; one call of the
  whole group, fork/join of tp streams included): tp 2: 6.6-7.7 µs, tp 4: 8.0-9.4, tp 8: 11.8-14.6.
The generation protocol above (the reduction polling during the publisher; the single launch's
read and arrival after the row loads) replaced a hand-over through ACTIVE_STAGE on 2026-11-29.
Four H200s, 8773b7e (these kernels, as 5582f64) against d8a9b61 alternating twice on one lease,
one rank per GPU, m 1..8, bf16 weights (records/2026-11-29-4xh200-ab-tp{2,4}-*.summary.json): the two-launch tail
0.88-0.95x in all 16 pairs (tp 2: 4.2-5.1 µs, tp 4: 4.2-5.3), the reduction exposed 0.84-1.51
-> 0.55-1.15 µs, the single launch 0.88-0.96x; 8 virtual ranks on one GPU, one round:
0.95-1.11x (m = 8: 14.5 -> 16.1 µs). 8773b7e's tests/kernels: 690 passed on the H200.
The single launch is slower than the two launches everywhere measured, so two launches stay the
default.
"""

from __future__ import annotations

import math
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
    FAULT_WHERE,
    FAULT_WORD_BYTES,
    FAULT_WORDS,
    LAMPORT_GENERATIONS,
    NEXT_STAGE,
    SENTINEL_BF16X2,
    STAGE_WORD_BYTES,
    STAGE_WORDS,
)
from musebench.kernels import compilation, ptx
from musebench.kernels.compilation import compiler, cute_flat, cute_view, fake_flat
from musebench.kernels.occupancy import LaunchDemand
from musebench.numerics import check_eps

if TYPE_CHECKING:
    from musebench.layout import UnfinalizedMoEOutput

WARP = 32
FRAGMENT = 8  # BF16 elements per 16-byte fragment
FRAGMENT_WORDS = 4  # 32-bit words per fragment
BF16_BYTES = 2
GENERATION_SLOT_BYTES = 16  # a CTA's shared generation word (thread 0 reads it), padded to its alignment

DEFAULT_WIDTH = 4096
DEFAULT_TOP_K = 8
DEFAULT_THREADS = 128
# The single launch polls all its trips' tp vectors in one loop up to this many 16-byte vectors
# (4 registers each: 128 at tp 8); beyond, trip by trip.
SINGLE_LAUNCH_POLL_VECTORS = 32
TRANSPORTS = ("unicast", "multicast")
WEIGHT_DTYPES = ("bf16", "fp32")
_CUTE_WEIGHT_TYPES = {"bf16": BFloat16, "fp32": Float32}
_TORCH_WEIGHT_TYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def publisher_smem_bytes(top_k: int, threads: int, single_launch: bool) -> int:
    """The publisher's dynamic shared memory: the warp sums of every route, then (single launch)
    the generation thread 0 reads for its CTA."""
    return top_k * (threads // WARP) * 4 + (GENERATION_SLOT_BYTES if single_launch else 0)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def mailbox_shape(tp: int, capacity: int, width: int = DEFAULT_WIDTH) -> tuple[int, int, int, int]:
    """[generations, source slots, capacity, width] of one rank's EP mailbox (int16 words):
    `musebench.comm.protocol.ep_mailbox_shape` at this module's default width."""
    return protocol.ep_mailbox_shape(tp, capacity, width)


def slot_element(stage: int, slot: int, token: int, column: int, *, tp: int, capacity: int, width: int) -> int:
    """Element offset of mailbox word [stage, slot, token, column] (host twin of the kernels' math)."""
    return ((stage * tp + slot) * capacity + token) * width + column


def peer_order(rank: int, tp: int) -> tuple[int, ...]:
    """The order the unicast publisher visits mailboxes: rank + 1 upward, wrapping, own last."""
    return tuple(peer_index(rank, step, tp) for step in range(tp))


def _python_select(condition, if_true, if_false):
    return if_true if condition else if_false


def peer_index(rank, step: int, tp: int, select=_python_select):
    """`(rank + 1 + step) % tp` without a division, for a rank known only at run time (the
    publisher's `Int32`; 0 <= rank < tp): rank + 1 + step < 2 tp, so one conditional subtraction
    wraps it, and the last step is the own mailbox. `select` is `cutlass.select_` in the kernel,
    a Python conditional on the host (the same function, so `peer_order` tests the kernel's)."""
    if step == tp - 1:
        return rank
    peer = rank + (1 + step)
    return select(peer >= tp, peer - tp, peer)


# ---------------------------------------------------------------------------------------------
# Device code.


@cute.jit
def _read_generation_and_arrive(stage_base: Int64, generation_slot: cute.Tensor, tidx: Int32):
    """Thread 0: read NEXT_STAGE into the CTA's shared slot, then count the CTA in (a release:
    the read comes before it; nothing waits for it). Returns (generation, arrivals before this
    CTA), meaningful in thread 0; the CTA reads the generation from the slot after a barrier."""
    current = Int32(0)
    arrived = Uint32(0)
    if tidx == 0:
        current = Int32(ptx.ld_volatile_global_u32(stage_base + NEXT_STAGE * STAGE_WORD_BYTES))
        generation_slot[0] = current
        arrived = ptx.atom_add_gpu_global_u32(stage_base + ARRIVAL_COUNT * STAGE_WORD_BYTES, Uint32(1), "release")
    return current, arrived


@cute.jit
def _advance_if_last(stage_base: Int64, current: Int32, arrived: Uint32, tidx: Int32) -> None:
    """Thread 0 of the last CTA to arrive: NEXT_STAGE = generation + 1, the count back to 0. Every
    CTA read NEXT_STAGE before arriving (release); the fence orders these stores after all of
    those reads. Called after a fault too: the generation stays in step for the calls that follow."""
    if tidx == 0:
        grid_x, grid_y, grid_z = cute.arch.grid_dim()
        if arrived == Uint32(grid_x * grid_y * grid_z - 1):
            ptx.fence_acq_rel_gpu()
            ptx.st_global_u32(stage_base + NEXT_STAGE * STAGE_WORD_BYTES, (current + 1) % LAMPORT_GENERATIONS)
            ptx.st_global_u32(stage_base + ARRIVAL_COUNT * STAGE_WORD_BYTES, Int32(0))


class _EpPublisherKernel:
    """Per-rank partial of the EP tail, published to every rank's mailbox (grid (m,)); with
    `single_launch` the whole tail: each CTA then reduces its own token (`_EpReduceKernel`'s
    fragments, inlined) after publishing, and advances the generation itself.

    Compile time: every constructor knob (width, top_k, tp, capacity, threads, the norm's order,
    weight dtype, eps and gain centre, transport, PDL, single launch, timeout). Run time: m, the
    rows' count and the rank (`Int32`, 0 <= rank < tp, not checked on the device), so one
    compilation serves every rank of the group."""

    def __init__(
        self,
        *,
        width: int = DEFAULT_WIDTH,
        top_k: int = DEFAULT_TOP_K,
        tp: int,
        capacity: int,
        threads: int = DEFAULT_THREADS,
        weight_before_norm: bool,
        weight_dtype: str,
        eps: float,
        gain_center: float,
        transport: str,
        enable_pdl: bool,
        single_launch: bool = False,
        timeout_ns: int = DEFAULT_TIMEOUT_NS,
    ) -> None:
        _require(threads > 0 and threads % WARP == 0, f"threads must be a positive multiple of {WARP}, got {threads}")
        _require(width > 0 and width % (threads * FRAGMENT) == 0, f"width {width} must be a multiple of {threads * FRAGMENT}")
        _require(top_k >= 1, f"top_k must be positive, got {top_k}")
        _require(tp >= 1, f"tp must be positive, got {tp}")
        _require(capacity >= 1, f"capacity must be positive, got {capacity}")
        _require(weight_dtype in WEIGHT_DTYPES, f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        _require(transport in TRANSPORTS, f"transport must be one of {TRANSPORTS}, got {transport!r}")
        check_eps(eps)
        _require(math.isfinite(gain_center), f"gain_center must be finite, got {gain_center}")
        self.width = width
        self.top_k = top_k
        self.tp = tp
        self.capacity = capacity
        self.threads = threads
        self.warps = threads // WARP
        self.trips = width // (threads * FRAGMENT)
        self.weight_before_norm = bool(weight_before_norm)
        self.weight_dtype = weight_dtype
        self.eps = float(eps)
        self.gain_center = float(gain_center)
        self.transport = transport
        self.enable_pdl = bool(enable_pdl)
        self.single_launch = bool(single_launch)
        # the single launch's inlined reduction (it validates timeout_ns), polling every trip's
        # fragments together where tp * trips vectors fit in registers
        together = self.trips if tp * self.trips <= SINGLE_LAUNCH_POLL_VECTORS else 1
        self.reduction = (_EpReduceKernel(width=width, tp=tp, capacity=capacity, threads=threads,
                                          enable_pdl=enable_pdl, timeout_ns=timeout_ns, fragments=together)
                          if single_launch else None)
        self.smem_bytes = publisher_smem_bytes(top_k, threads, single_launch)

    @cute.jit
    def __call__(
        self,
        rows: cute.Tensor,
        route_weights: cute.Tensor,
        permuted_idx: cute.Tensor,
        norm_weight: cute.Tensor,
        stage: cute.Tensor,
        peer_mailboxes: cute.Tensor,
        multicast_base: Int64,
        mailbox: cute.Tensor,
        out: cute.Tensor,
        fault: cute.Tensor,
        m: Int32,
        num_rows: Int32,
        rank: Int32,
        stream: cuda.CUstream,
    ) -> None:
        self.kernel(rows, route_weights, permuted_idx, norm_weight, stage, peer_mailboxes, multicast_base, mailbox, out,
                    fault, num_rows, rank).launch(
            grid=(m, 1, 1),
            block=(self.threads, 1, 1),
            smem=self.smem_bytes,
            stream=stream,
            use_pdl=self.enable_pdl,
        )

    def _route_value(self, fragments, index: int, gamma: list) -> Float32:
        """Value `index` (trip + trips * element, CuTe order) of one route's fragments as FP32,
        times gamma when the weight comes before the norm (trace-time helper, no control flow)."""
        trip, element = index % self.trips, index // self.trips
        word = fragments[trip][element // 2]
        bits = ptx.bf16x2_low_bits(word) if element % 2 == 0 else ptx.bf16x2_high_bits(word)
        x = ptx.bitcast_u32_to_f32(bits)
        if self.weight_before_norm:
            x = ptx.mul_rn_f32(x, gamma[index])
        return x

    @cute.kernel
    def kernel(
        self,
        rows: cute.Tensor,
        route_weights: cute.Tensor,
        permuted_idx: cute.Tensor,
        norm_weight: cute.Tensor,
        stage: cute.Tensor,
        peer_mailboxes: cute.Tensor,
        multicast_base: Int64,
        mailbox: cute.Tensor,
        out: cute.Tensor,
        fault: cute.Tensor,
        num_rows: Int32,
        rank: Int32,
    ) -> None:
        # mailbox, out and fault (this rank's) are read only by the single launch
        token, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        values = self.trips * FRAGMENT
        gain_center = Float32(self.gain_center)

        # gamma + gain centre, per owned column; index trip + trips * element (CuTe order).
        gamma = []
        for _ in cutlass.range_constexpr(values):
            gamma.append(Float32(0.0))
        gamma_base = Int64(norm_weight.iterator.toint())
        for trip in cutlass.range_constexpr(self.trips):
            column = Int64(tidx + trip * self.threads) * FRAGMENT
            words = ptx.ld_global_v4_u32(gamma_base + column * BF16_BYTES)
            for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                low = ptx.bitcast_u32_to_f32(ptx.bf16x2_low_bits(words[j]))
                high = ptx.bitcast_u32_to_f32(ptx.bf16x2_high_bits(words[j]))
                gamma[trip + self.trips * (2 * j)] = ptx.add_rn_f32(low, gain_center)
                gamma[trip + self.trips * (2 * j + 1)] = ptx.add_rn_f32(high, gain_center)

        # The rows, weights and indices come from the preceding kernel (expert GEMM2).
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_wait()
            if cutlass.const_expr(not self.single_launch):
                # The reduction may launch now: its launch overlaps this grid, and its own
                # griddepcontrol.wait still waits for this whole grid and its stores.
                cute.arch.griddepcontrol_launch_dependents()

        smem = cutlass.memory.SmemAllocator()
        # One set of warp slots per route: no second barrier needed between routes.
        warp_sums = smem.allocate_tensor(Float32, cute.make_layout(self.top_k * self.warps), byte_alignment=16)
        stage_base = Int64(stage.iterator.toint())
        if cutlass.const_expr(self.single_launch):
            generation_slot = smem.allocate_tensor(Int32, cute.make_layout(GENERATION_SLOT_BYTES // 4), byte_alignment=16)
        acc = cute.make_rmem_tensor(cute.make_layout(values), Float32)
        acc.fill(Float32(0.0))
        rows_base = Int64(rows.iterator.toint())
        inv_width = Float32(1.0 / self.width)
        eps = Float32(self.eps)

        # Every route's index and weight, then every route's row, before any arithmetic: one
        # memory latency each instead of a chain of three per route (index, row, weight) with a
        # barrier between routes. A route of another rank loads gamma's row instead (as wide, and
        # always there); its values are never used. The arithmetic and its order are unchanged.
        route_rows = []
        route_weight = []
        for k in cutlass.range_constexpr(self.top_k):
            route = Int64(token) * self.top_k + k
            route_rows.append(Int32(permuted_idx[route]))
            route_weight.append(Float32(route_weights[route]))
        row_words = []  # [route][trip]: the four words of the thread's fragment
        for k in cutlass.range_constexpr(self.top_k):
            row = route_rows[k]
            in_range = cutlass.select_(row < num_rows, rows_base + Int64(row) * (self.width * BF16_BYTES), gamma_base)
            row_base = cutlass.select_(row >= Int32(0), in_range, gamma_base)
            fragments = []
            for trip in cutlass.range_constexpr(self.trips):
                column = Int64(tidx + trip * self.threads) * FRAGMENT
                fragments.append(ptx.ld_global_v4_u32(row_base + column * BF16_BYTES))
            row_words.append(fragments)
        # The slot's generation, in flight with the rows.
        if cutlass.const_expr(self.single_launch):
            # NEXT_STAGE changes during this grid (the last CTA to arrive advances it), so thread 0
            # alone reads it and hands it to its CTA through shared memory (read after the barrier
            # below). Its arrival is a release (the read comes before it), issued once the rows are
            # in flight and not waited for: only the last arriver acts on the count, at the end.
            current, arrived = _read_generation_and_arrive(stage_base, generation_slot, tidx)
        else:
            generation = Int32(ptx.ld_volatile_global_u32(stage_base + NEXT_STAGE * STAGE_WORD_BYTES))

        # Sums of squares, every local route, into its own warp slots; one barrier for all.
        for k in cutlass.range_constexpr(self.top_k):
            row = route_rows[k]
            # Uniform over the CTA: every thread read the same index.
            if row >= Int32(0) and row < num_rows:
                # Ordered chain from +0.0 in CuTe coordinate order (trip fastest): the contract's.
                sum_of_squares = Float32(0.0)
                for index in cutlass.range_constexpr(values):
                    x = self._route_value(row_words[k], index, gamma)
                    sum_of_squares = ptx.fma_rn_f32(x, x, sum_of_squares)
                for offset in (16, 8, 4, 2, 1):
                    partner = cute.arch.shuffle_sync_bfly(sum_of_squares, offset=offset)
                    sum_of_squares = ptx.add_rn_f32(sum_of_squares, partner)
                if lane == 0:
                    warp_sums[k * self.warps + warp] = sum_of_squares
        cute.arch.barrier()
        if cutlass.const_expr(self.single_launch):
            generation = Int32(generation_slot[0])
        for k in cutlass.range_constexpr(self.top_k):
            row = route_rows[k]
            if row >= Int32(0) and row < num_rows:
                total = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    total = ptx.add_rn_f32(total, warp_sums[k * self.warps + w])
                inv_rms = ptx.rsqrt_approx_ftz_f32(ptx.fma_rn_f32(total, inv_width, eps))
                for index in cutlass.range_constexpr(values):
                    # The same bits as the chain's x: mul.rn is recomputed, not kept (registers).
                    y = ptx.mul_rn_f32(self._route_value(row_words[k], index, gamma), inv_rms)
                    if cutlass.const_expr(not self.weight_before_norm):
                        y = ptx.mul_rn_f32(y, gamma[index])
                    acc[index] = ptx.fma_rn_f32(y, route_weight[k], acc[index])

        # Payload words, -0.0 scrubbed: the data write is the release.
        payload = []
        for trip in cutlass.range_constexpr(self.trips):
            for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                low = acc[trip + self.trips * (2 * j)]
                high = acc[trip + self.trips * (2 * j + 1)]
                payload.append(ptx.scrub_negative_zero_u32(ptx.cvt_rn_bf16x2_f32(high, low)))

        # Every peer's mailbox address in one batch of loads (not one load before each peer's
        # stores), once the rows' registers are free.
        peer_bases = []
        if cutlass.const_expr(self.transport != "multicast"):
            for step in cutlass.range_constexpr(self.tp):
                # `peer_order` with the runtime rank: a compare and a select per peer, no division
                peer_bases.append(Int64(peer_mailboxes[peer_index(rank, step, self.tp, cutlass.select_)]))
        slot_bytes = ((Int64(generation) * self.tp + Int64(rank)) * self.capacity + Int64(token)) * (self.width * BF16_BYTES)
        if cutlass.const_expr(self.transport == "multicast"):
            for trip in cutlass.range_constexpr(self.trips):
                column = Int64(tidx + trip * self.threads) * FRAGMENT
                w = payload[trip * FRAGMENT_WORDS : (trip + 1) * FRAGMENT_WORDS]
                ptx.multimem_st_relaxed_sys_global_v4_bf16x2(multicast_base + slot_bytes + column * BF16_BYTES, w[0], w[1], w[2], w[3])
        else:
            for step in cutlass.range_constexpr(self.tp):
                for trip in cutlass.range_constexpr(self.trips):
                    column = Int64(tidx + trip * self.threads) * FRAGMENT
                    w = payload[trip * FRAGMENT_WORDS : (trip + 1) * FRAGMENT_WORDS]
                    ptx.st_relaxed_sys_global_v4_u32(peer_bases[step] + slot_bytes + column * BF16_BYTES, w[0], w[1], w[2], w[3])

        if cutlass.const_expr(self.single_launch):
            if cutlass.const_expr(self.transport == "multicast"):
                # This thread stored its own slot through the multicast mapping and now polls it
                # through the unicast one: the two aliases are ordered by a proxy fence.
                ptx.fence_proxy_alias()
            # This CTA's token, all its fragments under one timer.
            started = ptx.read_globaltimer_u64()
            mailbox_base = Int64(mailbox.iterator.toint())
            out_base = Int64(out.iterator.toint())
            fault_base = Int64(fault.iterator.toint())
            for trip in cutlass.range_constexpr(0, self.trips, self.reduction.fragments):
                column = Int64(tidx + trip * self.threads) * FRAGMENT
                self.reduction.reduce_fragments(mailbox_base, out_base, fault_base, generation, Int32(token), column, started,
                                                rank)
            _advance_if_last(stage_base, current, arrived, tidx)
        if cutlass.const_expr(self.enable_pdl and self.single_launch):
            # The next call's publisher launches only once this one is done: launched earlier, its
            # waiting CTAs could hold SMs that a peer's publisher of this call still needs.
            cute.arch.griddepcontrol_launch_dependents()


class _EpReduceKernel:
    """Rank-order sum of the tp partials in this rank's mailbox (grid (m, width / 8 / threads)).

    Compile time: width, tp, capacity, threads, PDL, timeout and the fragments one thread polls
    together. Run time: m and the rank (`Int32`, written to the fault record only), so one
    compilation serves every rank of the group."""

    def __init__(
        self,
        *,
        width: int = DEFAULT_WIDTH,
        tp: int,
        capacity: int,
        threads: int = DEFAULT_THREADS,
        enable_pdl: bool,
        timeout_ns: int = DEFAULT_TIMEOUT_NS,
        fragments: int = 1,
    ) -> None:
        _require(threads > 0 and threads % WARP == 0, f"threads must be a positive multiple of {WARP}, got {threads}")
        _require(width > 0 and width % (threads * FRAGMENT) == 0, f"width {width} must be a multiple of {threads * FRAGMENT}")
        _require(fragments >= 1 and (width // (threads * FRAGMENT)) % fragments == 0,
                 f"fragments must divide the {width // (threads * FRAGMENT)} trips, got {fragments}")
        _require(tp >= 1, f"tp must be positive, got {tp}")
        _require(capacity >= 1, f"capacity must be positive, got {capacity}")
        _require(isinstance(timeout_ns, int) and 0 < timeout_ns < 2**62, f"timeout_ns must be a positive int, got {timeout_ns!r}")
        self.width = width
        self.tp = tp
        self.capacity = capacity
        self.threads = threads
        self.parts = width // (threads * FRAGMENT)
        self.enable_pdl = bool(enable_pdl)
        self.timeout_ns = int(timeout_ns)
        # fragments one `reduce_fragments` call polls together: columns column + f * threads * 8
        self.fragments = fragments

    @cute.jit
    def __call__(
        self,
        mailbox: cute.Tensor,
        out: cute.Tensor,
        stage: cute.Tensor,
        fault: cute.Tensor,
        m: Int32,
        rank: Int32,
        stream: cuda.CUstream,
    ) -> None:
        self.kernel(mailbox, out, stage, fault, rank).launch(
            grid=(m, self.parts, 1),
            block=(self.threads, 1, 1),
            smem=GENERATION_SLOT_BYTES,
            stream=stream,
            use_pdl=self.enable_pdl,
        )

    @cute.kernel
    def kernel(self, mailbox: cute.Tensor, out: cute.Tensor, stage: cute.Tensor, fault: cute.Tensor, rank: Int32) -> None:
        token, part, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        column = Int64(part * self.threads + tidx) * FRAGMENT
        stage_base = Int64(stage.iterator.toint())

        # NEXT_STAGE holds this call's generation: the previous reduction advanced it and finished
        # before this grid could launch (behind this call's publisher's wait). No CTA advances it
        # before every CTA has read it (the arrival count), so it is read before the wait.
        generation_slot = cutlass.memory.SmemAllocator().allocate_tensor(
            Int32, cute.make_layout(GENERATION_SLOT_BYTES // 4), byte_alignment=16)
        current, arrived = _read_generation_and_arrive(stage_base, generation_slot, tidx)
        cute.arch.barrier()
        generation = Int32(generation_slot[0])

        # The slots carry their own completeness (Lamport): polled while the publisher still runs.
        started = ptx.read_globaltimer_u64()
        self.reduce_fragments(Int64(mailbox.iterator.toint()), Int64(out.iterator.toint()), Int64(fault.iterator.toint()),
                              generation, Int32(token), column, started, rank)

        # This call's publisher reads NEXT_STAGE after its own wait: the advance waits for its grid.
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_wait()
        _advance_if_last(stage_base, current, arrived, tidx)
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def reduce_fragments(self, mailbox_base: Int64, out_base: Int64, fault_base: Int64, generation: Int32,
                         token: Int32, column: Int64, started: Int64, rank: Int32) -> None:
        """One thread's fragments of the reduction (`self.fragments` of them, the f-th at columns
        column + f * threads * 8 .. +7 of `token`), inlined into the reduce kernel (one fragment)
        and the single-launch tail: poll the tp slots of `generation` of every fragment in one
        loop until no half is the sentinel, or until `timeout_ns` has passed since `started`;
        then per fragment: sum from +0.0 in rank order, store the BF16 result to out[token] and
        re-arm exactly the tp vectors read, or, if it is still incomplete, record the fault (the
        rank's first wins) and write and re-arm nothing."""
        slot_stride = Int64(self.capacity * self.width * BF16_BYTES)
        fragment_stride = self.threads * FRAGMENT
        vectors = self.fragments * self.tp
        first_slot = (
            mailbox_base
            + ((Int64(generation) * self.tp) * self.capacity + Int64(token)) * (self.width * BF16_BYTES)
            + column * BF16_BYTES
        )
        landed = cute.make_rmem_tensor(cute.make_layout(vectors * FRAGMENT_WORDS), cutlass.Uint32)
        pending = cutlass.Uint32(1)
        polling = Int32(1)
        while polling != 0:
            # The timer is read in the same iteration as the loads: the wait is bounded.
            now = ptx.read_globaltimer_u64()
            pending = cutlass.Uint32(0)
            for f in cutlass.range_constexpr(self.fragments):
                for source in cutlass.range_constexpr(self.tp):
                    words = ptx.ld_volatile_global_v4_u32(first_slot + source * slot_stride + f * fragment_stride * BF16_BYTES)
                    for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                        landed[(f * self.tp + source) * FRAGMENT_WORDS + j] = words[j]
                        pending = pending | ptx.has_negative_zero_u32(words[j])
            waiting = Int32(pending != 0)
            in_time = Int32(now - started <= Int64(self.timeout_ns))
            polling = waiting & in_time

        for f in cutlass.range_constexpr(self.fragments):
            slot = first_slot + f * fragment_stride * BF16_BYTES
            out_address = out_base + (Int64(token) * self.width + column + f * fragment_stride) * BF16_BYTES
            incomplete = pending  # one fragment: the poll's own verdict
            if cutlass.const_expr(self.fragments > 1):
                incomplete = cutlass.Uint32(0)
                for v in cutlass.range_constexpr(f * self.tp * FRAGMENT_WORDS, (f + 1) * self.tp * FRAGMENT_WORDS):
                    incomplete = incomplete | ptx.has_negative_zero_u32(landed[v])
            if incomplete != 0:
                # Timed out: name the lowest source still missing; the first thread to time out wins.
                missing = Int32(self.tp)
                for source in cutlass.range_constexpr(self.tp - 1, -1, -1):
                    dirty = cutlass.Uint32(0)
                    for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                        dirty = dirty | ptx.has_negative_zero_u32(landed[(f * self.tp + source) * FRAGMENT_WORDS + j])
                    if dirty != 0:
                        missing = Int32(source)
                previous = ptx.atom_cas_relaxed_gpu_global_b32(fault_base + FAULT_RANK * FAULT_WORD_BYTES, Int32(FAULT_CLEAR), rank)
                if previous == Int32(FAULT_CLEAR):
                    ptx.st_global_u32(fault_base + FAULT_PEER * FAULT_WORD_BYTES, missing)
                    ptx.st_global_u32(fault_base + FAULT_WHERE * FAULT_WORD_BYTES, missing * self.capacity + token)
                    ptx.st_global_u32(fault_base + FAULT_GENERATION * FAULT_WORD_BYTES, generation)
            else:
                total = []
                for _ in cutlass.range_constexpr(FRAGMENT):
                    total.append(Float32(0.0))
                for source in cutlass.range_constexpr(self.tp):
                    for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                        word = landed[(f * self.tp + source) * FRAGMENT_WORDS + j]
                        total[2 * j] = ptx.add_rn_f32(total[2 * j], ptx.bitcast_u32_to_f32(ptx.bf16x2_low_bits(word)))
                        total[2 * j + 1] = ptx.add_rn_f32(total[2 * j + 1], ptx.bitcast_u32_to_f32(ptx.bf16x2_high_bits(word)))
                result = [ptx.cvt_rn_bf16x2_f32(total[2 * j + 1], total[2 * j]) for j in range(FRAGMENT_WORDS)]
                ptx.st_global_v4_u32(out_address, result[0], result[1], result[2], result[3])
                # Re-arm exactly what this thread consumed; peers write it again three calls later.
                sentinel = cutlass.Uint32(SENTINEL_BF16X2)
                for source in cutlass.range_constexpr(self.tp):
                    ptx.st_global_v4_u32(slot + source * slot_stride, sentinel, sentinel, sentinel, sentinel)


# ---------------------------------------------------------------------------------------------
# Compilation (fake tensors; `kernels.compilation`'s cache, keyed by the exact compile-time values).

def _check_rank(rank: int | None, tp: int) -> None:
    """A rank given to `compile_*` (not part of any key) must still be one of the group's."""
    _require(rank is None or 0 <= rank < tp, f"rank {rank} outside 0..{tp - 1}")


def compile_publisher(
    *,
    width: int = DEFAULT_WIDTH,
    top_k: int = DEFAULT_TOP_K,
    tp: int,
    rank: int | None = None,
    capacity: int,
    threads: int = DEFAULT_THREADS,
    weight_before_norm: bool,
    weight_dtype: str,
    eps: float,
    gain_center: float,
    transport: str,
    enable_pdl: bool,
    single_launch: bool = False,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
    arch: str | None = None,
    ptx_dir: str | None = None,
) -> Any:
    """The compiled EP publisher for these compile-time values (cached; never during capture);
    `single_launch`: the whole tail in one kernel (its polls bounded by `timeout_ns`).

    The rank is a runtime argument of the compiled kernel (`Int32`, after `num_rows`): one
    compilation serves every rank of the group. `rank`, accepted for the callers that pass it,
    is only checked (0 <= rank < tp) and is not part of the cache key. `arch` overrides the
    target (default: CUTE_DSL_ARCH or the current GPU); `ptx_dir` keeps the PTX there
    (`compiled.artifacts.PTX`). Both are part of the cache key.
    """
    _check_rank(rank, tp)
    timeout_ns = int(timeout_ns) if single_launch else DEFAULT_TIMEOUT_NS  # the publisher alone never waits
    config = dict(
        width=width, top_k=top_k, tp=tp, capacity=capacity, threads=threads,
        weight_before_norm=bool(weight_before_norm), weight_dtype=weight_dtype, eps=float(eps),
        gain_center=float(gain_center), transport=transport, enable_pdl=bool(enable_pdl),
        single_launch=bool(single_launch), timeout_ns=timeout_ns,
    )

    def build() -> Any:
        kernel = _EpPublisherKernel(**config)
        weight_type = _CUTE_WEIGHT_TYPES[weight_dtype]
        peers = make_fake_compact_tensor(Int64, (tp,), assumed_align=8) if transport == "unicast" else None
        return compiler(arch, ptx_dir)(
            kernel,
            fake_flat(BFloat16, width, 16),
            fake_flat(weight_type, top_k, weight_type.width // 8),
            fake_flat(Int32, top_k, 4),
            make_fake_compact_tensor(BFloat16, (width,), assumed_align=16),
            make_fake_compact_tensor(Int32, (STAGE_WORDS,), assumed_align=8),
            peers,
            Int64(0),
            make_fake_compact_tensor(Int16, (math.prod(mailbox_shape(tp, capacity, width)),), assumed_align=16),
            fake_flat(BFloat16, width, 16),
            make_fake_compact_tensor(Int32, (FAULT_WORDS,), assumed_align=16),
            Int32(1),
            Int32(1),
            Int32(0),
            cuda.CUstream(0),
        )

    key = compilation.kernel_key(_EpPublisherKernel, arch=arch, ptx_dir=ptx_dir, **config)
    return compilation.compiled(key, build, what="the EP tail kernels")


def compile_reduce(
    *,
    width: int = DEFAULT_WIDTH,
    tp: int,
    rank: int | None = None,
    capacity: int,
    threads: int = DEFAULT_THREADS,
    enable_pdl: bool,
    timeout_ns: int = DEFAULT_TIMEOUT_NS,
    arch: str | None = None,
    ptx_dir: str | None = None,
) -> Any:
    """The compiled EP reduction for these compile-time values (cached; never during capture).

    The rank is a runtime argument of the compiled kernel (`Int32`, after `m`); `rank`, as in
    `compile_publisher`, is only checked and is not part of the cache key."""
    _check_rank(rank, tp)
    config = dict(width=width, tp=tp, capacity=capacity, threads=threads, enable_pdl=bool(enable_pdl),
                  timeout_ns=timeout_ns)

    def build() -> Any:
        return compiler(arch, ptx_dir)(
            _EpReduceKernel(**config),
            make_fake_compact_tensor(Int16, (math.prod(mailbox_shape(tp, capacity, width)),), assumed_align=16),
            fake_flat(BFloat16, width, 16),
            make_fake_compact_tensor(Int32, (STAGE_WORDS,), assumed_align=8),
            make_fake_compact_tensor(Int32, (FAULT_WORDS,), assumed_align=16),
            Int32(1),
            Int32(0),
            cuda.CUstream(0),
        )

    key = compilation.kernel_key(_EpReduceKernel, arch=arch, ptx_dir=ptx_dir, **config)
    return compilation.compiled(key, build, what="the EP tail kernels")


# ---------------------------------------------------------------------------------------------
# Host side: one rank's bound tail.


@dataclass(frozen=True)
class EpFault:
    """A decoded fault record: a reduce gave up waiting."""

    rank: int
    peer: int
    slot: int
    token: int
    generation: int

    def message(self) -> str:
        return (
            f"EP tail: rank {self.rank} timed out waiting for rank {self.peer} "
            f"(mailbox slot {self.slot}, token {self.token}, generation {self.generation})"
        )


def decode_fault(words: list[int], capacity: int) -> EpFault | None:
    """The fault record int32[4] as read back, or None where no wait timed out."""
    record = protocol.read_fault_record(words)
    if record is None:
        return None
    rank, peer, row, generation = record
    return EpFault(rank=rank, peer=peer, slot=row // capacity, token=row % capacity, generation=generation)


class EpTail:
    """One rank's EP tail bound to its mailbox group: `run` launches publisher then reduction.

    Internal: the runner behind `musebench.kernels.tail.MoETail` / `BoundTail`, the public API.

    The host owns the memory, allocated collectively before construction:

    - `mailbox`: this rank's int16 [3, tp, capacity, width] on CUDA, armed with -32768 (0x8000);
    - `peer_mailboxes`: int64 [tp] on CUDA, `data_ptr()` of every rank's mailbox as this device
      addresses it (transport "unicast"), or `multicast_address`: the multicast mapping of the
      group's mailboxes (transport "multicast");
    - `stage`: int32 [2] on CUDA, zero on every rank; `fault`: int32 [4] on CUDA, all -1;
    - `norm_weight`: BF16 [width] gamma (not written by the kernel that precedes `run`).

    Construction compiles (not during capture; one variant per group, the rank is an argument of
    each launch) and launches each kernel once on scratch buffers (`warm_up`: lazy module loading
    must not happen behind a spinning peer). `run` is collective
    (every rank, same m, calls in the same order, never overlapping on one rank),
    graph-capturable and allocates nothing. `single_launch=True` runs the whole tail as one
    kernel (publisher and reduction per token in one CTA), bitwise the same; every rank of a
    group must choose the same. Both forms keep the stage words [NEXT_STAGE, ARRIVAL_COUNT]
    (the count is 0 between calls).
    """

    def __init__(
        self,
        *,
        rank: int,
        tp: int,
        capacity: int,
        mailbox: torch.Tensor,
        stage: torch.Tensor,
        fault: torch.Tensor,
        norm_weight: torch.Tensor,
        peer_mailboxes: torch.Tensor | None = None,
        multicast_address: int | None = None,
        weight_before_norm: bool,
        weight_dtype: str,
        eps: float,
        gain_center: float,
        width: int = DEFAULT_WIDTH,
        top_k: int = DEFAULT_TOP_K,
        threads: int = DEFAULT_THREADS,
        enable_pdl: bool = True,
        timeout_ns: int = DEFAULT_TIMEOUT_NS,
        warm_up: bool = True,
        single_launch: bool = False,
    ) -> None:
        transport = "multicast" if multicast_address is not None else "unicast"
        _require((peer_mailboxes is None) != (multicast_address is None), "give exactly one of peer_mailboxes and multicast_address")
        _require(weight_dtype in WEIGHT_DTYPES, f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
        _require(0 <= rank < tp, f"rank {rank} outside 0..{tp - 1}")
        self._check(mailbox, torch.int16, mailbox_shape(tp, capacity, width), "mailbox", 16)
        self._check(stage, torch.int32, (STAGE_WORDS,), "stage", 8)
        self._check(fault, torch.int32, (FAULT_WORDS,), "fault", 16)
        self._check(norm_weight, torch.bfloat16, (width,), "norm_weight", 16)
        if peer_mailboxes is not None:
            self._check(peer_mailboxes, torch.int64, (tp,), "peer_mailboxes", 8)
        self.rank, self.tp, self.capacity, self.width, self.top_k = rank, tp, capacity, width, top_k
        self._threads = threads
        self.weight_dtype = weight_dtype
        self.transport = transport
        self.fault = fault
        self.single_launch = bool(single_launch)
        # One compilation per group: the rank is a runtime argument of both kernels.
        self._publisher = compile_publisher(
            width=width, top_k=top_k, tp=tp, capacity=capacity, threads=threads,
            weight_before_norm=weight_before_norm, weight_dtype=weight_dtype, eps=eps, gain_center=gain_center,
            transport=transport, enable_pdl=enable_pdl, single_launch=single_launch, timeout_ns=timeout_ns,
        )
        self._reduce = None if single_launch else compile_reduce(
            width=width, tp=tp, capacity=capacity, threads=threads, enable_pdl=enable_pdl, timeout_ns=timeout_ns
        )
        self._rank = Int32(rank)
        # The fixed buffers are exported once; run converts only the per-call tensors.
        self._mailbox = cute_view(mailbox.view(-1), 16)
        self._stage = cute_view(stage, 8)
        self._fault = cute_view(fault, 16)
        self._gamma = cute_view(norm_weight, 16)
        self._peers = cute_view(peer_mailboxes, 8) if peer_mailboxes is not None else None
        self._multicast = Int64(multicast_address if multicast_address is not None else 0)
        self._buffers = (mailbox, stage, fault, norm_weight, peer_mailboxes)  # keep the storage alive
        if warm_up:
            self._warm_up(mailbox.device)

    def _warm_up(self, device: torch.device) -> None:
        """Launch each kernel once on private scratch buffers, then synchronise.

        CUDA loads modules lazily by default, and a kernel's first launch may wait for the device
        to go idle. Behind a peer's spinning reduction (virtual ranks sharing one GPU) that wait
        lasts until the peer times out, so the first launch happens here, touching no peer. The
        scratch mailbox holds +0.0 everywhere, so the reduction finds every slot landed (the single
        launch publishes +0.0 into it, then finds the same). The multicast publisher is not warmed
        up (it can only store to a multicast address); it runs one GPU per rank, where a
        first-launch wait only delays.
        """
        scratch_box = torch.zeros(mailbox_shape(self.tp, self.capacity, self.width), dtype=torch.int16, device=device)
        stage = torch.zeros(STAGE_WORDS, dtype=torch.int32, device=device)
        fault = torch.full((FAULT_WORDS,), FAULT_CLEAR, dtype=torch.int32, device=device)
        out = torch.empty(1, self.width, dtype=torch.bfloat16, device=device)
        stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
        scratch = (cute_view(scratch_box.view(-1), 16), cute_flat(out, 16, self.width), cute_view(fault, 16))
        if self.transport == "unicast":
            peers = torch.full((self.tp,), scratch_box.data_ptr(), dtype=torch.int64, device=device)
            rows = torch.zeros(1, self.width, dtype=torch.bfloat16, device=device)
            weights = torch.zeros(1, self.top_k, dtype=_TORCH_WEIGHT_TYPES[self.weight_dtype], device=device)
            index = torch.full((1, self.top_k), -1, dtype=torch.int32, device=device)  # no local route
            self._publisher(
                cute_flat(rows, 16, self.width), cute_flat(weights, weights.element_size(), self.top_k),
                cute_flat(index, 4, self.top_k), self._gamma, cute_view(stage, 8), cute_view(peers, 8), Int64(0),
                *scratch, Int32(1), Int32(1), self._rank, stream,
            )
        if self._reduce is not None:
            self._reduce(scratch[0], scratch[1], cute_view(stage, 8), scratch[2], Int32(1), self._rank, stream)
        torch.cuda.current_stream(device).synchronize()
        if int(fault[FAULT_RANK]) != FAULT_CLEAR:
            raise RuntimeError("EP tail warm-up: the reduction timed out on a scratch mailbox with every slot landed")

    @staticmethod
    def _check(tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str, align: int) -> None:
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CUDA {dtype} tensor {shape}, got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        if tensor.data_ptr() % align:
            raise ValueError(f"{name} must be {align}-byte aligned")

    def run(self, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor) -> None:
        """Launch publisher then reduction (or the single kernel) on the current stream; `out` BF16
        [m, width] gets the sum.

        `unfinalized`: this rank's `gemm2_permuted` BF16 [rows, width], `route_weights`
        [m, top_k] in `weight_dtype`, `expanded_idx_to_permuted_idx` int32 [m, top_k] (-1: not
        local), all contiguous CUDA tensors. m = 0 launches nothing. Bitwise equal to
        `musebench.stock.ep.ep_tail_reference` with the hardware's rsqrt.
        """
        m = out.shape[0]
        if m == 0:
            return
        stream, out_view = self._launch_publisher(unfinalized, out)
        if not self.single_launch:
            self._launch_reduce(out_view, m, stream)

    def run_publisher(self, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor) -> None:
        """The publisher alone, for `musebench bench tail`'s per-kernel median (arguments as `run`;
        `out` only gives m and is not written). It leaves this rank's partials published in
        every peer's mailbox, which a later reduction would read as landed: every rank resets its
        mailboxes (`DeviceMailbox.reset`, between two barriers) before the group's next `run`.
        ValueError for a single-launch tail (its publisher is the whole tail)."""
        if self.single_launch:
            raise ValueError("a single-launch EP tail has no separate publisher")
        if out.shape[0] != 0:
            self._launch_publisher(unfinalized, out)

    def run_reduce(self, out: torch.Tensor) -> None:
        """The reduction alone on the current stream, behind this rank's `run_publisher` of the same
        m (`run` is the two in a row): for a profiler that serialises kernels, which needs every
        rank's publisher launched before any reduction that waits for it. ValueError for a
        single-launch tail or an `out` that is not contiguous BF16 [m <= capacity, width]."""
        if self.single_launch:
            raise ValueError("a single-launch EP tail has no separate reduction")
        m = self._check_out(out)
        if m != 0:
            self._launch_reduce(cute_flat(out, 16, self.width), m, cuda.CUstream(torch.cuda.current_stream(out.device).cuda_stream))

    def _check_out(self, out: torch.Tensor) -> int:
        """m of `out`, which must be contiguous BF16 [m <= capacity, width] (ValueError otherwise)."""
        m = out.shape[0] if out.dim() == 2 else -1
        if m > self.capacity:
            raise ValueError(f"{m} tokens exceed the mailbox capacity {self.capacity}")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, self.width) or not out.is_contiguous():
            raise ValueError(f"out must be contiguous bfloat16 [m, {self.width}], got {out.dtype} {tuple(out.shape)}")
        return m

    def _launch_reduce(self, out_view: cute.Tensor, m: int, stream: cuda.CUstream) -> None:
        self._reduce(self._mailbox, out_view, self._stage, self._fault, Int32(m), self._rank, stream)

    def _launch_publisher(self, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor) -> tuple[cuda.CUstream, cute.Tensor]:
        """Check `run`'s arguments (ValueError before anything launches), launch the publisher on
        the current stream; return that stream and `out` as the kernels take it."""
        m = self._check_out(out)
        rows, weights, index = unfinalized.gemm2_permuted, unfinalized.route_weights, unfinalized.expanded_idx_to_permuted_idx
        if weights.dtype != _TORCH_WEIGHT_TYPES[self.weight_dtype] or tuple(weights.shape) != (m, self.top_k):
            raise ValueError(f"route_weights must be {self.weight_dtype} [{m}, {self.top_k}], got {weights.dtype} {tuple(weights.shape)}")
        if index.dtype != torch.int32 or tuple(index.shape) != (m, self.top_k):
            raise ValueError(f"expanded_idx_to_permuted_idx must be int32 [{m}, {self.top_k}]")
        if rows.dtype != torch.bfloat16 or rows.dim() != 2 or rows.shape[1] != self.width or not rows.is_contiguous():
            raise ValueError(f"gemm2_permuted must be contiguous bfloat16 [rows, {self.width}]")
        stream = cuda.CUstream(torch.cuda.current_stream(out.device).cuda_stream)
        out_view = cute_flat(out, 16, self.width)
        self._publisher(
            cute_flat(rows, 16, self.width),
            cute_flat(weights, weights.element_size(), self.top_k),
            cute_flat(index, 4, self.top_k),
            self._gamma,
            self._stage,
            self._peers,
            self._multicast,
            self._mailbox,
            out_view,
            self._fault,
            Int32(m),
            Int32(rows.shape[0]),
            self._rank,
            stream,
        )
        return stream, out_view

    def launch_demands(self, m: int) -> list[LaunchDemand]:
        """This rank's launches for m tokens (publisher, reduction; or the single launch), for the
        co-residency check."""
        threads = self._threads
        publisher = LaunchDemand(self._publisher, ctas=m, threads=threads,
                                 smem_bytes=publisher_smem_bytes(self.top_k, threads, self.single_launch))
        if self.single_launch:
            return [publisher]
        return [publisher, LaunchDemand(self._reduce, ctas=m * (self.width // (threads * FRAGMENT)), threads=threads,
                                        smem_bytes=GENERATION_SLOT_BYTES)]

    def check_fault(self) -> None:
        """Synchronise on the fault record; RuntimeError naming rank, peer, slot and generation if set."""
        record = decode_fault([int(v) for v in self.fault.tolist()], self.capacity)
        if record is not None:
            raise RuntimeError(record.message())
