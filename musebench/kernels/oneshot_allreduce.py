"""musebench one-shot (Lamport IPC): an all-reduce of one [m, width] vector per rank, one kernel per call.

Own implementation of the published algorithm of the one-shot all-reduces H200 users pick over
CUDA IPC buffers, read for facts only, nothing copied: TensorRT-LLM's one-shot Lamport all-reduce
(as FlashInfer ships it in `trtllm_custom_all_reduce` / `trtllm_allreduce_fusion`) pushes: every
rank stores its vector into its own slot of every rank's buffer (a -0.0 word means "not arrived",
three buffers rotate), then each rank waits until every slot of its own buffer has landed and sums
them; vLLM's custom all-reduce (world sizes 2, 4, 6, 8, 16, up to 8 MiB) moves the same bytes by
pulling peers' registered buffers after a flag barrier. This kernel is the push form. Here the
buffer is a Lamport mailbox of the tails' protocol (`musebench.comm.protocol`), allocated like theirs (`comm.mailboxes.allocate_process`:
CUDA IPC handles where processes share GPUs, SymmetricMemory peer pointers one process per GPU):
int16 words [3, tp, capacity, row words] per rank, armed with BF16 -0.0, a stage word pair and a
fault record.

Why not FlashInfer's own kernel (decided 2026-12-01, flashinfer-python 0.7.2.post1): its wheel is
`py3-none-any` and holds CUDA sources only (no `.so`, no `.cubin`, no `flashinfer/data/aot`);
`trtllm_custom_all_reduce` and `trtllm_allreduce_fusion` load `gen_trtllm_comm_module()`, which
is compiled at first use by nvcc and ninja (JIT) unless the separate `flashinfer-jit-cache`
package holds it, and that package is not on PyPI, the only Python registry these machines
reach (`flashinfer-cubin` there is 0.6.13, not this version, and holds cubins, not JIT modules). The H200 image has nvcc 13.0
and ninja, but nothing can be installed there: the 62 MB wheel and its binary dependencies
(apache-tvm-ffi, nccl4py, cuda-tile, ...) would have to travel in pieces beside CuTe DSL, and a
JIT build of three TRT-LLM sources per fresh lease is untried. vLLM's kernel is its compiled
`_C` extension (a 336 MB wheel built for torch 2.14; the device runs 2.11). The bench rows
therefore time this kernel and say so in their names ("(own)") and notes.

Kernel (`_OneShotAllReduceKernel`), grid (m, fragments per row / threads), `threads` threads; a
thread owns one 16-byte fragment (8 BF16 or 4 FP32) of one row. Compile time: tp, capacity (the
mailbox's rows), width (elements per row), dtype, threads, PDL, timeout. Run time: m and the
rank (`Int32`): one compilation serves every rank of a group.

1. After `griddepcontrol.wait` (PDL: the input comes from the preceding kernel), the thread loads
   its fragment of the input (`ld.global.v4`) and every peer's mailbox address, and thread 0
   reads NEXT_STAGE and counts its CTA in (`atom.release.gpu` on ARRIVAL_COUNT, as the EP tail,
   `musebench.kernels.ep_tail`); one barrier shares the generation g.
2. Scrub: BF16, each 16-bit half equal to -0.0 becomes +0.0 (`ptx.scrub_negative_zero_u32`; no
   sum from +0.0 changes); FP32, each word equal to the 32-bit sentinel 0x80008000 (-2^-134)
   becomes -0.0 (`ptx.encode_sentinel_word_f32`; the one value that changes,
   `musebench.stock.all_reduce`). No payload unit then reads as "not arrived".
3. Publish: `st.relaxed.sys.global.v4.u32` of the fragment into slot [g, rank, row] of every rank's
   mailbox (peers from rank + 1 upward, wrapping, its own last: `ep_tail.peer_index`).
4. Poll its own mailbox's tp slots [g, 0..tp-1, row] with `ld.volatile.global.v4.u32`, reading
   `%globaltimer` in the same loop, until no unit is the sentinel (BF16: a 16-bit half 0x8000;
   FP32: a 32-bit word 0x80008000) or `timeout_ns` has passed since the first poll.
5. Landed: sum from +0.0 in rank order 0..tp-1 (`add.rn.f32`, so every rank gets the same bits
   whatever order the words arrived in), store `cvt.rn.bf16x2.f32` of the sums (FP32: the sums)
   to out[row], and re-arm exactly the tp fragments read with the sentinel. Timed out: write and
   re-arm nothing; the rank's first thread to time out claims the fault record (`atom.cas` of
   FAULT_RANK from -1 to the rank) and stores the missing peer (the lowest still missing), the
   mailbox row `peer * capacity + row` and g.
6. The last CTA to arrive advances NEXT_STAGE to (g + 1) % 3 and zeroes the count (after a fault
   too), then (PDL) the next kernel may launch.

Why three generations need no reset between calls (the protocol's argument): a peer writes slot
[g, rank, row] of this rank's mailbox again only in call i + 3, which it starts after finishing
call i + 2, which needed this rank's publish of call i + 2, which follows this rank's call i (its
re-arm of generation g) in stream order. After a fault the words are stray: the caller re-arms
every rank's mailbox between two barriers (`DeviceMailbox.reset`), as for the tails.

Lazy module loading: the first launch of a kernel can wait for its device to go idle, which behind
a peer's spinning kernel lasts until that peer times out, so `OneShotAllReduce` launches the
kernel once on scratch memory at construction (`warm_up`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int16, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor

from musebench.comm import protocol
from musebench.comm.protocol import (
    DEFAULT_TIMEOUT_NS,
    FAULT_CLEAR,
    FAULT_GENERATION,
    FAULT_PEER,
    FAULT_RANK,
    FAULT_WHERE,
    FAULT_WORD_BYTES,
    FAULT_WORDS,
    SENTINEL_BF16X2,
    STAGE_WORDS,
)
from musebench.kernels import compilation, ptx
from musebench.kernels.compilation import compiler, cute_flat, cute_view, fake_flat
from musebench.kernels.ep_tail import (
    GENERATION_SLOT_BYTES,
    _advance_if_last,
    _read_generation_and_arrive,
    peer_index,
)

WARP = 32
FRAGMENT_BYTES = 16
FRAGMENT_WORDS = 4  # 32-bit words per fragment
INT16_BYTES = 2
DEFAULT_THREADS = 128
DTYPES = ("bf16", "fp32")
ELEMENT_BYTES = {"bf16": 2, "fp32": 4}
_CUTE_TYPES = {"bf16": BFloat16, "fp32": Float32}
TORCH_TYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def row_words(width: int, dtype: str) -> int:
    """int16 mailbox words one row of `width` elements of `dtype` takes."""
    return width * ELEMENT_BYTES[dtype] // INT16_BYTES


def mailbox_shape(tp: int, capacity: int, width: int, dtype: str) -> tuple[int, int, int, int]:
    """[generations, tp source slots, capacity rows, row words] of one rank's mailbox (int16)."""
    return protocol.mailbox_shape(tp, capacity, row_words(width, dtype))


# ---------------------------------------------------------------------------------------------
# Device code.


class _OneShotAllReduceKernel:
    """The one-shot all-reduce of this rank's [m, width] input over its mailbox group (module
    docstring); grid (m, width * element bytes / 16 / threads)."""

    def __init__(self, *, tp: int, capacity: int, width: int, dtype: str, threads: int = DEFAULT_THREADS,
                 enable_pdl: bool = True, timeout_ns: int = DEFAULT_TIMEOUT_NS) -> None:
        _require(dtype in DTYPES, f"dtype must be one of {DTYPES}, got {dtype!r}")
        _require(threads > 0 and threads % WARP == 0, f"threads must be a positive multiple of {WARP}, got {threads}")
        _require(tp >= 1, f"tp must be positive, got {tp}")
        _require(capacity >= 1, f"capacity must be positive, got {capacity}")
        row_bytes = width * ELEMENT_BYTES[dtype]
        _require(width > 0 and row_bytes % (threads * FRAGMENT_BYTES) == 0,
                 f"a row of {width} {dtype} ({row_bytes} bytes) must be a multiple of {threads} threads x 16 bytes")
        _require(isinstance(timeout_ns, int) and 0 < timeout_ns < 2**62, f"timeout_ns must be a positive int, got {timeout_ns!r}")
        self.tp, self.capacity, self.width, self.dtype, self.threads = tp, capacity, width, dtype, threads
        self.row_bytes = row_bytes
        self.parts = row_bytes // (threads * FRAGMENT_BYTES)
        self.enable_pdl = bool(enable_pdl)
        self.timeout_ns = int(timeout_ns)

    @cute.jit
    def __call__(self, source: cute.Tensor, out: cute.Tensor, mailbox: cute.Tensor, peer_mailboxes: cute.Tensor,
                 stage: cute.Tensor, fault: cute.Tensor, m: Int32, rank: Int32, stream: cuda.CUstream) -> None:
        self.kernel(source, out, mailbox, peer_mailboxes, stage, fault, rank).launch(
            grid=(m, self.parts, 1),
            block=(self.threads, 1, 1),
            smem=GENERATION_SLOT_BYTES,
            stream=stream,
            use_pdl=self.enable_pdl,
        )

    def _unit_pending(self, word: Uint32) -> Uint32:
        """Nonzero where the polled word still holds a "not arrived" unit (trace-time helper)."""
        if self.dtype == "bf16":
            return ptx.has_negative_zero_u32(word)
        return ptx.is_sentinel_word_u32(word)

    def _scrub(self, word: Uint32) -> Uint32:
        if self.dtype == "bf16":
            return ptx.scrub_negative_zero_u32(word)
        return ptx.encode_sentinel_word_f32(word)

    @cute.kernel
    def kernel(self, source: cute.Tensor, out: cute.Tensor, mailbox: cute.Tensor, peer_mailboxes: cute.Tensor,
               stage: cute.Tensor, fault: cute.Tensor, rank: Int32) -> None:
        row, part, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        column_bytes = Int64(part * self.threads + tidx) * FRAGMENT_BYTES
        row_offset = Int64(row) * self.row_bytes

        # The input is the preceding kernel's output; the previous call's advance is done too.
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_wait()
        words = ptx.ld_global_v4_u32(Int64(source.iterator.toint()) + row_offset + column_bytes)
        peer_bases = []
        for step in cutlass.range_constexpr(self.tp):
            peer_bases.append(Int64(peer_mailboxes[peer_index(rank, step, self.tp, cutlass.select_)]))
        stage_base = Int64(stage.iterator.toint())
        generation_slot = cutlass.memory.SmemAllocator().allocate_tensor(
            Int32, cute.make_layout(GENERATION_SLOT_BYTES // 4), byte_alignment=16)
        current, arrived = _read_generation_and_arrive(stage_base, generation_slot, tidx)
        cute.arch.barrier()
        generation = Int32(generation_slot[0])

        # Publish: the scrubbed fragment to slot [generation, rank, row] of every rank's mailbox.
        payload = [self._scrub(words[j]) for j in range(FRAGMENT_WORDS)]
        slot_bytes = ((Int64(generation) * self.tp + Int64(rank)) * self.capacity + Int64(row)) * self.row_bytes
        for step in cutlass.range_constexpr(self.tp):
            ptx.st_relaxed_sys_global_v4_u32(peer_bases[step] + slot_bytes + column_bytes,
                                             payload[0], payload[1], payload[2], payload[3])

        # Poll this rank's tp slots of the row, the timer read in the same iteration as the loads.
        mailbox_base = Int64(mailbox.iterator.toint())
        slot_stride = Int64(self.capacity * self.row_bytes)
        first_slot = mailbox_base + ((Int64(generation) * self.tp) * self.capacity + Int64(row)) * self.row_bytes + column_bytes
        landed = cute.make_rmem_tensor(cute.make_layout(self.tp * FRAGMENT_WORDS), Uint32)
        started = ptx.read_globaltimer_u64()
        pending = Uint32(1)
        polling = Int32(1)
        while polling != 0:
            now = ptx.read_globaltimer_u64()
            pending = Uint32(0)
            for source_rank in cutlass.range_constexpr(self.tp):
                polled = ptx.ld_volatile_global_v4_u32(first_slot + source_rank * slot_stride)
                for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                    landed[source_rank * FRAGMENT_WORDS + j] = polled[j]
                    pending = pending | self._unit_pending(polled[j])
            waiting = Int32(pending != 0)
            in_time = Int32(now - started <= Int64(self.timeout_ns))
            polling = waiting & in_time

        fault_base = Int64(fault.iterator.toint())
        if pending != 0:
            # Timed out: name the lowest source still missing; the rank's first thread wins.
            missing = Int32(self.tp)
            for source_rank in cutlass.range_constexpr(self.tp - 1, -1, -1):
                dirty = Uint32(0)
                for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                    dirty = dirty | self._unit_pending(landed[source_rank * FRAGMENT_WORDS + j])
                if dirty != 0:
                    missing = Int32(source_rank)
            previous = ptx.atom_cas_relaxed_gpu_global_b32(fault_base + FAULT_RANK * FAULT_WORD_BYTES, Int32(FAULT_CLEAR), rank)
            if previous == Int32(FAULT_CLEAR):
                ptx.st_global_u32(fault_base + FAULT_PEER * FAULT_WORD_BYTES, missing)
                ptx.st_global_u32(fault_base + FAULT_WHERE * FAULT_WORD_BYTES, missing * self.capacity + Int32(row))
                ptx.st_global_u32(fault_base + FAULT_GENERATION * FAULT_WORD_BYTES, generation)
        else:
            out_address = Int64(out.iterator.toint()) + row_offset + column_bytes
            if cutlass.const_expr(self.dtype == "bf16"):
                total = [Float32(0.0) for _ in range(2 * FRAGMENT_WORDS)]
                for source_rank in cutlass.range_constexpr(self.tp):
                    for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                        word = landed[source_rank * FRAGMENT_WORDS + j]
                        total[2 * j] = ptx.add_rn_f32(total[2 * j], ptx.bitcast_u32_to_f32(ptx.bf16x2_low_bits(word)))
                        total[2 * j + 1] = ptx.add_rn_f32(total[2 * j + 1], ptx.bitcast_u32_to_f32(ptx.bf16x2_high_bits(word)))
                result = [ptx.cvt_rn_bf16x2_f32(total[2 * j + 1], total[2 * j]) for j in range(FRAGMENT_WORDS)]
            else:
                total = [Float32(0.0) for _ in range(FRAGMENT_WORDS)]
                for source_rank in cutlass.range_constexpr(self.tp):
                    for j in cutlass.range_constexpr(FRAGMENT_WORDS):
                        total[j] = ptx.add_rn_f32(total[j], ptx.bitcast_u32_to_f32(landed[source_rank * FRAGMENT_WORDS + j]))
                result = [ptx.bitcast_f32_to_u32(total[j]) for j in range(FRAGMENT_WORDS)]
            ptx.st_global_v4_u32(out_address, result[0], result[1], result[2], result[3])
            # Re-arm exactly what this thread consumed; peers write it again three calls later.
            sentinel = Uint32(SENTINEL_BF16X2)
            for source_rank in cutlass.range_constexpr(self.tp):
                ptx.st_global_v4_u32(first_slot + source_rank * slot_stride, sentinel, sentinel, sentinel, sentinel)

        _advance_if_last(stage_base, current, arrived, tidx)
        if cutlass.const_expr(self.enable_pdl):
            # The next kernel launches only once this one is done (its CTAs could otherwise hold
            # SMs a peer's CTAs of this call still need, where ranks share a GPU).
            cute.arch.griddepcontrol_launch_dependents()


def compile_one_shot(*, tp: int, capacity: int, width: int, dtype: str = "bf16", threads: int = DEFAULT_THREADS,
                     enable_pdl: bool = True, timeout_ns: int = DEFAULT_TIMEOUT_NS, arch: str | None = None,
                     ptx_dir: str | None = None) -> Any:
    """The compiled one-shot all-reduce for these compile-time values (`kernels.compilation`'s
    cache; never during capture). The rank and m are runtime arguments; `arch` (default:
    CUTE_DSL_ARCH or the current GPU) and `ptx_dir` (keeps the PTX) are part of the key."""
    config = dict(tp=tp, capacity=capacity, width=width, dtype=dtype, threads=threads, enable_pdl=bool(enable_pdl),
                  timeout_ns=int(timeout_ns))

    def build() -> Any:
        kernel = _OneShotAllReduceKernel(**config)
        element = _CUTE_TYPES[dtype]
        return compiler(arch, ptx_dir)(
            kernel,
            fake_flat(element, width, 16),
            fake_flat(element, width, 16),
            make_fake_compact_tensor(Int16, (math.prod(mailbox_shape(tp, capacity, width, dtype)),), assumed_align=16),
            make_fake_compact_tensor(Int64, (tp,), assumed_align=8),
            make_fake_compact_tensor(Int32, (STAGE_WORDS,), assumed_align=8),
            make_fake_compact_tensor(Int32, (FAULT_WORDS,), assumed_align=16),
            Int32(1),
            Int32(0),
            cuda.CUstream(0),
        )

    _OneShotAllReduceKernel(**config)  # refuse a bad configuration before the cache sees it
    key = compilation.kernel_key(_OneShotAllReduceKernel, arch=arch, ptx_dir=ptx_dir, **config)
    return compilation.compiled(key, build, what="the one-shot all-reduce")


# ---------------------------------------------------------------------------------------------
# Host side.


@dataclass(frozen=True)
class OneShotFault:
    """A decoded fault record: a rank gave up waiting for a peer's slot."""

    rank: int
    peer: int
    slot: int
    row: int
    generation: int

    def message(self) -> str:
        return (f"one-shot all-reduce: rank {self.rank} timed out waiting for rank {self.peer} "
                f"(mailbox slot {self.slot}, row {self.row}, generation {self.generation})")


def decode_fault(words: list[int], capacity: int) -> OneShotFault | None:
    """The fault record int32[4] as read back, or None where no wait timed out."""
    record = protocol.read_fault_record(words)
    if record is None:
        return None
    rank, peer, where, generation = record
    return OneShotFault(rank=rank, peer=peer, slot=where // capacity, row=where % capacity, generation=generation)


class OneShotAllReduce:
    """One rank's one-shot all-reduce over its mailbox group: `run(source, out)` launches one kernel.

    The memory is the caller's, allocated collectively before construction (a
    `comm.device.DeviceMailbox`'s fields; `from_mailbox` takes one):

    - `mailbox`: this rank's int16 [3, tp, capacity, row words] on CUDA, armed with -32768;
    - `peer_mailboxes`: int64 [tp], every rank's mailbox address as this device reaches it;
    - `stage`: int32 [2], zero on every rank; `fault`: int32 [4], all -1.

    Construction compiles (not during capture; one variant per group) and launches the kernel
    once on scratch memory (`warm_up`). `run` is collective (every rank, the same m, calls in the
    same order, never overlapping on one rank), graph-capturable and allocates nothing; `out`
    gets bitwise `musebench.stock.all_reduce.rank_order_sum` of every rank's `source`, on every
    rank. After a fault every rank re-arms its mailbox between two barriers before the next call.
    """

    def __init__(self, *, rank: int, tp: int, capacity: int, width: int, mailbox: torch.Tensor,
                 peer_mailboxes: torch.Tensor, stage: torch.Tensor, fault: torch.Tensor, dtype: str = "bf16",
                 threads: int = DEFAULT_THREADS, enable_pdl: bool = True, timeout_ns: int = DEFAULT_TIMEOUT_NS,
                 warm_up: bool = True) -> None:
        _require(dtype in DTYPES, f"dtype must be one of {DTYPES}, got {dtype!r}")
        _require(0 <= rank < tp, f"rank {rank} outside 0..{tp - 1}")
        _check(mailbox, torch.int16, mailbox_shape(tp, capacity, width, dtype), "mailbox", 16)
        _check(peer_mailboxes, torch.int64, (tp,), "peer_mailboxes", 8)
        _check(stage, torch.int32, (STAGE_WORDS,), "stage", 8)
        _check(fault, torch.int32, (FAULT_WORDS,), "fault", 16)
        self.rank, self.tp, self.capacity, self.width, self.dtype = rank, tp, capacity, width, dtype
        self.fault = fault
        self._kernel = compile_one_shot(tp=tp, capacity=capacity, width=width, dtype=dtype, threads=threads,
                                        enable_pdl=enable_pdl, timeout_ns=timeout_ns)
        self._rank = Int32(rank)
        self._mailbox = cute_view(mailbox.view(-1), 16)
        self._peers = cute_view(peer_mailboxes, 8)
        self._stage = cute_view(stage, 8)
        self._fault = cute_view(fault, 16)
        self._buffers = (mailbox, peer_mailboxes, stage, fault)  # keep the storage alive
        if warm_up:
            self._warm_up(mailbox.device)

    @classmethod
    def from_mailbox(cls, box: Any, *, dtype: str = "bf16", **knobs: Any) -> OneShotAllReduce:
        """Over a `comm.device.DeviceMailbox` (any transport with a peer table): rows of
        `box.width * 2 / element bytes` elements, `box.capacity` rows at most."""
        width = box.width * INT16_BYTES // ELEMENT_BYTES[dtype]
        return cls(rank=box.rank, tp=box.tp, capacity=box.capacity, width=width, mailbox=box.words,
                   peer_mailboxes=box.peer_table, stage=box.stage, fault=box.fault, dtype=dtype, **knobs)

    def _warm_up(self, device: torch.device) -> None:
        """One launch on private scratch memory (zeros: every slot reads as landed; every peer is
        the scratch mailbox), then synchronise: the module is loaded before any peer spins."""
        scratch = torch.zeros(mailbox_shape(self.tp, self.capacity, self.width, self.dtype), dtype=torch.int16, device=device)
        peers = torch.full((self.tp,), scratch.data_ptr(), dtype=torch.int64, device=device)
        stage = torch.zeros(STAGE_WORDS, dtype=torch.int32, device=device)
        fault = torch.full((FAULT_WORDS,), FAULT_CLEAR, dtype=torch.int32, device=device)
        source = torch.zeros(1, self.width, dtype=TORCH_TYPES[self.dtype], device=device)
        out = torch.empty_like(source)
        stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
        self._kernel(cute_flat(source, 16, self.width), cute_flat(out, 16, self.width), cute_view(scratch.view(-1), 16),
                     cute_view(peers, 8), cute_view(stage, 8), cute_view(fault, 16), Int32(1), self._rank, stream)
        torch.cuda.current_stream(device).synchronize()
        if int(fault[FAULT_RANK]) != FAULT_CLEAR:
            raise RuntimeError("one-shot all-reduce warm-up: timed out on a scratch mailbox with every slot landed")

    def run(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """Launch the all-reduce on the current stream: `out` (this rank's, [m, width] of the
        dtype, contiguous) gets the rank-order sum of every rank's `source` ([m, width], m <=
        capacity). m = 0 launches nothing. ValueError before any launch for a bad argument."""
        want = TORCH_TYPES[self.dtype]
        for name, tensor in (("source", source), ("out", out)):
            if (tensor.dtype != want or tensor.dim() != 2 or tensor.shape[1] != self.width or not tensor.is_contiguous()
                    or not tensor.is_cuda):
                raise ValueError(f"{name} must be a contiguous CUDA {want} tensor [m, {self.width}], "
                                 f"got {tensor.dtype} {tuple(tensor.shape)}")
        m = source.shape[0]
        if out.shape[0] != m:
            raise ValueError(f"out has {out.shape[0]} rows, source {m}")
        if m > self.capacity:
            raise ValueError(f"{m} rows exceed the mailbox capacity {self.capacity}")
        if m == 0:
            return
        stream = cuda.CUstream(torch.cuda.current_stream(out.device).cuda_stream)
        self._kernel(cute_flat(source, 16, self.width), cute_flat(out, 16, self.width), self._mailbox, self._peers,
                     self._stage, self._fault, Int32(m), self._rank, stream)

    def check_fault(self) -> None:
        """Synchronise on the fault record; RuntimeError naming rank, peer, slot, row and
        generation if a wait timed out."""
        record = decode_fault([int(v) for v in self.fault.tolist()], self.capacity)
        if record is not None:
            raise RuntimeError(record.message())


def _check(tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], name: str, align: int) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous CUDA {dtype} tensor {shape}, got {tensor.dtype} "
                         f"{tuple(tensor.shape)} on {tensor.device}")
    if tensor.data_ptr() % align:
        raise ValueError(f"{name} must be {align}-byte aligned")
