"""qkv_front, balanced plan: the cluster kernel's bits (`kernels.qkv_front`: out, tap and cache)
from fine work units that spread evenly over the SMs, reduced in slice order through global memory.

Contract: `kernels.qkv_front`'s (and `cute_ops.launch_qkv_front`'s with plan="balanced"), plus a
workspace (`qkv_front_plan.workspace_layout`) whose counters are 0 before a launch; a launch
leaves them 0.

Units. A CTA of W = `warps` warps (1, 2 or 4; `qkv_front_plan.DEFAULT_WARPS`) owns one (head,
k-slice of 1024, column group of 8 W columns); warp w of it the n-tile 8 (group W + w) .. + 7 of
the head: grid (8 / W, 8, heads), 32 W threads, no clusters. The balance arithmetic (CTAs per SM,
busiest SM over the mean) and the ring's depth per N are in `qkv_front_plan`'s docstring: 1152 /
2304 / 2304 CTAs at N = 1152 / 2304 / 4608 with the default warps, 3% over the mean on the
busiest SM (the cluster plan: 83%, 38%, 15%).

Same bits as the cluster kernel, element by element. A warp issues exactly the MMA chain the
cluster kernel's warp issues for that n-tile: the same ring stages of 64 k (weight rows 8 at a
time, x's 16 rows, zero past the tokens, the same swizzle and fragment reads), the same
per-warp-step k permutation, two m16n8k16 MMAs per 32 k, from 0.0 over the slice in increasing
k. The slice partials are then added in slice order 0 + 1 + .. + 7 (`add.rn`, starting from slice
0's value, as CTA 0 of the cluster does), rounded once (`cvt.rn.bf16x2.f32`), and the epilogue is
`qkv_front.FrontEpilogue`'s code (its tap stores, its thread program), not a copy of it.

Reduction without waiting (nobody spins, so nothing can hang, and CTAs need not be co-resident:
at N = 4608 with 1-warp CTAs they are not):
1. every warp stores its four FP32 accumulators per lane into `partials` (st.global.v4);
2. the CTA's barrier, then one thread's `atom.acq_rel.gpu.global.add.u32` on the (head, group)
   counter; the CTA that reads 7 (the last of the 8 slices) re-arms it to 0 and, per warp, loads
   the 8 slices' partials (ld.global.cg: L2, never a stale L1 line), adds them in slice order,
   rounds, stores the BF16 pairs into `projection` (and `tap`);
3. the same again on the head counter: the CTA that reads 8 / W - 1 (its head's last column
   group) re-arms it and runs the epilogue on the head's 16 x 64 projection (the thread program's
   128 threads in 4 / W passes), reading the rows' slots, positions and table words only then.
Memory order: each writer's stores precede its CTA's barrier, which precedes the release half of
that CTA's atomic (causality: barrier, then program order); the last arriver's atomic reads the
value every earlier arrival's release wrote (a chain of read-modify-writes on one word), so its
acquire half orders every partial before its own loads, and its barrier passes that on to its
other threads. The same holds for the projection at the head counter. The second-level counter
exists so that a head's 8 x 8 FP32 sums are done by 8 / W CTAs at once rather than one warp
(the latency at the end of the launch); each element's sum is still slice 0 + 1 + .. + 7.

PDL (`enable_pdl`, default True), as the cluster kernel: the first STAGES - 1 stages' weight
copies go out before `griddepcontrol.wait`; x (cp.async, one commit group per prologue stage after
the wait), positions, slots and the table are read after it, and nothing is written before it
(partials, counters, projection, out, tap and cache all follow). With x's prologue groups
committed after every weight group, `cp.async.wait_group STAGES - 2` still waits for exactly the
stage about to be consumed (and every group before it: stage 0 waits for the prologue's weight,
STAGES - 1 KB of it a warp, mostly landed while the preceding kernel finished). Dependents are
released after the stream; the dependent grid starts only once every CTA of this one has passed
that point (or exited), so it never takes an SM a CTA of ours still waits for. The workspace is
written only after the wait, and a launch's predecessor ends only after its own predecessors
(each waits before it ends), so two launches on one stream never overlap their use of it;
launches that may overlap (other streams) need workspaces of their own.
"""

from __future__ import annotations

import threading
from typing import Any

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32

from musebench import config, qkv_front_plan as plan
from musebench.kernels import compilation, ptx
from musebench.kernels.qkv_front import (BF16_BYTES, CACHE_BLOCK, CHUNK_BYTES, CHUNKS_PER_LINE, HEAD_DIM, HIDDEN,
                                         K_CTA, LINE_BYTES, MAX_TOKENS, SPLIT, STAGE_K, STAGES_PER_CTA, STEP_K,
                                         FrontEpilogue)

LANES = 32
TILE_ROWS = 8  # weight rows of an n-tile
EPILOGUE_THREADS = MAX_TOKENS * (HEAD_DIM // 8)  # 128: the thread program's (row, l8) pairs
PARTIAL_WORDS = 4  # a lane's accumulators of one n-tile
assert SPLIT == plan.SPLIT and HEAD_DIM == plan.HEAD_DIM and LINE_BYTES == plan.LINE_BYTES


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class _BalancedFrontKernel(FrontEpilogue):
    """The balanced QKV front of one layer shape: grid (8 / warps, 8, heads), 32 x warps threads."""

    def __init__(self, *, num_kv_heads: int, rope: bool, tap: bool, eps: float, enable_pdl: bool = True,
                 warps: int) -> None:
        super().__init__(num_kv_heads=num_kv_heads, rope=rope, tap=tap, eps=eps, enable_pdl=enable_pdl)
        self.warps = plan._check_warps(warps)
        self.threads = LANES * warps
        self.groups = plan.groups(warps)
        self.stages = plan.balanced_stages(num_kv_heads, warps)
        self.stage_bytes = plan.balanced_stage_bytes(warps)
        self.weight_stage_bytes = TILE_ROWS * warps * LINE_BYTES
        self.copy_rows = self.threads // CHUNKS_PER_LINE  # rows one copy instruction of the CTA covers
        self.weight_copies = TILE_ROWS * warps // self.copy_rows  # 2 per thread and stage
        self.x_copies = MAX_TOKENS // self.copy_rows  # 4, 2, 1 per thread and stage
        self.passes = EPILOGUE_THREADS // self.threads  # 4, 2, 1
        self.layout = plan.workspace_layout(num_kv_heads)

    @cute.jit
    def __call__(self, x: Int64, weight: Int64, positions: Int64, cos_sin: Int64, slots: Int64, kv_cache: Int64,
                 out: Int64, tap: Int64, workspace: Int64, tokens: Int32, max_pos: Int64, slot_limit: Int64,
                 stream: cuda.CUstream) -> None:
        self.kernel(x, weight, positions, cos_sin, slots, kv_cache, out, tap, workspace, tokens, max_pos,
                    slot_limit).launch(
            grid=(self.groups, SPLIT, self.heads), block=(self.threads, 1, 1),
            smem=plan.balanced_smem_bytes(self.kv, self.warps), stream=stream, use_pdl=self.enable_pdl)

    @cute.kernel
    def kernel(self, x: Int64, weight: Int64, positions: Int64, cos_sin: Int64, slots: Int64, kv_cache: Int64,
               out: Int64, tap: Int64, workspace: Int64, tokens: Int32, max_pos: Int64, slot_limit: Int64) -> None:
        group, k_slice, head = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane >> 2
        t = lane & 3
        n_tile = group * self.warps + warp  # of the head's 8

        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(Uint32, cute.make_layout(self.stages * self.stage_bytes // 4), byte_alignment=128)
        flags = smem.allocate_tensor(Uint32, cute.make_layout(4), byte_alignment=16)
        ring_base = Int32(ring.iterator.toint())
        flag_base = Int32(flags.iterator.toint())

        # Copies: thread tidx moves chunk tidx % 8 of rows tidx / 8 + copy_rows i (weight: the
        # group's 8 W rows; x: 16 rows, zero-filled past the tokens, x's row 0 named but not read).
        copy_row = tidx >> 3
        copy_chunk = tidx & 7
        swizzled = copy_chunk ^ ((copy_row & 1) << 2)  # copy_rows is even: every copy row has this parity
        k_first = Int64(k_slice * K_CTA + copy_chunk * 8)
        weight_row = head * HEAD_DIM + group * (TILE_ROWS * self.warps) + copy_row
        weight_source = Int64(weight) + (Int64(weight_row) * HIDDEN + k_first) * BF16_BYTES
        x_sources = []
        x_bytes = []
        for i in cutlass.range_constexpr(self.x_copies):
            row = copy_row + i * self.copy_rows
            live = row < tokens
            x_sources.append(Int64(x) + (Int64(cutlass.select_(live, row, Int32(0))) * HIDDEN + k_first) * BF16_BYTES)
            x_bytes.append(cutlass.select_(live, Int32(CHUNK_BYTES), Int32(0)))
        copy_target = ring_base + copy_row * LINE_BYTES + swizzled * CHUNK_BYTES

        # Fragment reads (the cluster kernel's): weight rows 8 warp + g, x rows g and g + 8, chunk 4 s + t.
        g_odd = g & 1
        chunk_offset = [((4 * s + t) ^ (g_odd << 2)) * CHUNK_BYTES for s in range(STAGE_K // STEP_K)]
        weight_read = ring_base + (warp * TILE_ROWS + g) * LINE_BYTES
        x_read = ring_base + self.weight_stage_bytes + g * LINE_BYTES

        if cutlass.const_expr(self.enable_pdl):
            # PDL: the static weight's first STAGES - 1 stages before the wait; x (and everything
            # else) after it, one commit group per stage (module docstring: why the waits still hold).
            for st in cutlass.range_constexpr(self.stages - 1):
                self.issue_weight(st, st, weight_source, copy_target)
                cute.arch.cp_async_commit_group()
            cute.arch.griddepcontrol_wait()
            for st in cutlass.range_constexpr(self.stages - 1):
                self.issue_x(st, st, x_sources, x_bytes, copy_target)
                cute.arch.cp_async_commit_group()
        else:
            for st in cutlass.range_constexpr(self.stages - 1):
                self.issue_weight(st, st, weight_source, copy_target)
                self.issue_x(st, st, x_sources, x_bytes, copy_target)
                cute.arch.cp_async_commit_group()

        acc = [Float32(0.0) for _ in range(PARTIAL_WORDS)]
        for st in cutlass.range_constexpr(STAGES_PER_CTA):
            cute.arch.cp_async_wait_group(self.stages - 2)
            cute.arch.barrier()  # stage st landed for every thread; stage st - 1 is consumed
            ahead = st + self.stages - 1
            if cutlass.const_expr(ahead < STAGES_PER_CTA):
                self.issue_weight(ahead, ahead % self.stages, weight_source, copy_target)
                self.issue_x(ahead, ahead % self.stages, x_sources, x_bytes, copy_target)
            cute.arch.cp_async_commit_group()
            stage = (st % self.stages) * self.stage_bytes
            for s in cutlass.range_constexpr(STAGE_K // STEP_K):
                a_low = ptx.ld_shared_v4_u32(x_read + stage + chunk_offset[s])
                a_high = ptx.ld_shared_v4_u32(x_read + stage + 8 * LINE_BYTES + chunk_offset[s])
                b = ptx.ld_shared_v4_u32(weight_read + stage + chunk_offset[s])
                for half in cutlass.range_constexpr(2):
                    d = ptx.mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32(
                        a_low[2 * half], a_high[2 * half], a_low[2 * half + 1], a_high[2 * half + 1],
                        b[2 * half], b[2 * half + 1], acc[0], acc[1], acc[2], acc[3],
                    )
                    for i in cutlass.range_constexpr(PARTIAL_WORDS):
                        acc[i] = d[i]
        cute.arch.cp_async_wait_group(0)
        if cutlass.const_expr(self.enable_pdl):
            cute.arch.griddepcontrol_launch_dependents()

        # 1. This warp's partial of (head, k_slice, n_tile), lane-major.
        ws = Int64(workspace)
        tile_partials = ws + Int64(self.layout.partials) + Int64((head * plan.N_TILES + n_tile) * SPLIT) * (
            LANES * PARTIAL_WORDS * 4) + lane * (PARTIAL_WORDS * 4)
        ptx.st_global_v4_u32(tile_partials + k_slice * (LANES * PARTIAL_WORDS * 4),
                             ptx.bitcast_f32_to_u32(acc[0]), ptx.bitcast_f32_to_u32(acc[1]),
                             ptx.bitcast_f32_to_u32(acc[2]), ptx.bitcast_f32_to_u32(acc[3]))

        # 2. The (head, group) counter: its 8th arrival sums the slices in order.
        group_counter = ws + Int64(self.layout.group_counters) + Int64(head * plan.N_TILES + group) * 4
        if self.last_arrival(group_counter, SPLIT, flag_base, tidx) != Uint32(0):
            v = [Float32(0.0)] * PARTIAL_WORDS
            words = [ptx.ld_global_cg_v4_u32(tile_partials + r * (LANES * PARTIAL_WORDS * 4)) for r in range(SPLIT)]
            for i in cutlass.range_constexpr(PARTIAL_WORDS):
                v[i] = ptx.bitcast_u32_to_f32(words[0][i])
                for r in cutlass.range_constexpr(1, SPLIT):
                    v[i] = ptx.add_rn_f32(v[i], ptx.bitcast_u32_to_f32(words[r][i]))
            projection = ws + Int64(self.layout.projection) + Int64(head) * plan.HEAD_PROJECTION_BYTES
            # Fragment half: row g + 8 half, columns 8 n_tile + 2t, + 1 -> one BF16 pair.
            for half in cutlass.range_constexpr(2):
                word = ptx.cvt_rn_bf16x2_f32(v[2 * half + 1], v[2 * half])
                row = g + 8 * half
                pair = n_tile * 4 + t  # column / 2
                ptx.st_global_u32(projection + (row * (HEAD_DIM // 2) + pair) * 4, word)
                self.store_tap(tap, row, head, pair, word, tokens)

            # 3. The head counter: its last column group runs the epilogue.
            head_counter = ws + Int64(self.layout.head_counters) + Int64(head) * 4
            if self.last_arrival(head_counter, self.groups, flag_base + 4, tidx) != Uint32(0):
                self.epilogue(projection, head, tidx, tokens, positions, cos_sin, slots, kv_cache, out, max_pos,
                              slot_limit)

    @cute.jit
    def last_arrival(self, counter: Int64, arrivals: int, flag: Int32, tidx) -> Uint32:
        """After the CTA's barrier, one thread adds 1 to `counter` (acq_rel, gpu scope); the
        arrival that reads `arrivals` - 1 re-arms it to 0. 1 for every thread of that CTA, else 0
        (through the shared word `flag` and a second barrier)."""
        cute.arch.barrier()
        if tidx == 0:
            arrived = ptx.atom_add_gpu_global_u32(counter, Uint32(1), "acq_rel")
            last = arrived == Uint32(arrivals - 1)
            if last:
                ptx.st_global_u32(counter, Uint32(0))
            ptx.st_shared_u32(flag, cutlass.select_(last, Uint32(1), Uint32(0)))
        cute.arch.barrier()
        return ptx.ld_shared_u32(flag)

    @cute.jit
    def epilogue(self, projection: Int64, head, tidx, tokens: Int32, positions: Int64, cos_sin: Int64, slots: Int64,
                 kv_cache: Int64, out: Int64, max_pos: Int64, slot_limit: Int64) -> None:
        """The head's epilogue: the thread program's 128 (row, l8) threads in `passes` passes of
        this CTA's threads (pass p: thread tidx is 32 W p + tidx). Every pass's inputs are loaded
        first (the projection's 16 bytes, the row's slot and position, then its table words)."""
        l8 = tidx & 7
        rows = [(p * self.threads + tidx) >> 3 for p in range(self.passes)]
        raws = []
        inputs = []
        for p in cutlass.range_constexpr(self.passes):
            raws.append(list(ptx.ld_global_cg_v4_u32(projection + (rows[p] * (HEAD_DIM // 2) + l8 * 4) * 4)))
            epilogue_row = Int64(cutlass.select_(rows[p] < tokens, rows[p], Int32(0)))
            inputs.append(self.slot_and_position(slots, positions, epilogue_row))
        tables = [self.table_words(cos_sin, inputs[p][1], max_pos, l8) for p in range(self.passes)]
        for p in cutlass.range_constexpr(self.passes):
            self.thread_program(raws[p], rows[p], l8, head, tokens, inputs[p][0], tables[p][0], tables[p][1],
                                kv_cache, out, slot_limit)

    @cute.jit
    def issue_weight(self, st: int, slot: int, weight_source: Int64, copy_target: Int32) -> None:
        """The weight's cp.async copies of stage `st` (k 1024 slice + 64 st ..) into ring slot `slot`."""
        target = copy_target + slot * self.stage_bytes
        for i in cutlass.range_constexpr(self.weight_copies):
            ptx.cp_async_cg_shared_global_16(
                target + i * self.copy_rows * LINE_BYTES,
                weight_source + (i * self.copy_rows * HIDDEN * BF16_BYTES + st * LINE_BYTES), Int32(CHUNK_BYTES))

    @cute.jit
    def issue_x(self, st: int, slot: int, x_sources, x_bytes, copy_target: Int32) -> None:
        """x's cp.async copies of stage `st` into ring slot `slot` (after the weight rows)."""
        target = copy_target + slot * self.stage_bytes + self.weight_stage_bytes
        for i in cutlass.range_constexpr(self.x_copies):
            ptx.cp_async_cg_shared_global_16(target + i * self.copy_rows * LINE_BYTES, x_sources[i] + st * LINE_BYTES,
                                             x_bytes[i])


def compile_balanced_front(*, num_kv_heads: int, rope: bool, tap: bool, eps: float, enable_pdl: bool = True,
                           warps: int | None = None, arch: str | None = None, ptx_dir: str | None = None) -> Any:
    """The compiled balanced QKV front for these compile-time values (cached; never during capture).

    `warps` (default `qkv_front_plan.DEFAULT_WARPS[num_kv_heads]`): warps per CTA, one n-tile
    each. Other knobs as `qkv_front.compile_qkv_front`. All are in the cache key."""
    plan._check_kv(num_kv_heads)
    warps = plan.DEFAULT_WARPS[num_kv_heads] if warps is None else warps
    config_ = dict(num_kv_heads=num_kv_heads, rope=bool(rope), tap=bool(tap), eps=float(eps), enable_pdl=enable_pdl,
                   warps=warps)

    def build() -> Any:
        kernel = _BalancedFrontKernel(**config_)
        address = Int64(0)
        return compilation.compiler(arch, ptx_dir)(
            kernel, address, address, address, address, address, address, address, address, address, Int32(1),
            Int64(1), Int64(1), cuda.CUstream(0))

    _BalancedFrontKernel(**config_)  # validate before the cache is touched
    key = compilation.kernel_key(_BalancedFrontKernel, arch=arch, ptx_dir=ptx_dir, **config_)
    return compilation.compiled(key, build, what="the balanced QKV front kernel")


# The per-device workspaces of launches that pass none: (device index, num_kv_heads) -> tensor.
_WORKSPACES: dict[tuple[int, int], torch.Tensor] = {}
_WORKSPACES_LOCK = threading.Lock()


def new_workspace(num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """A fresh workspace (uint8 [`qkv_front_plan.workspace_bytes`], zeroed: every counter 0)."""
    return torch.zeros(plan.workspace_bytes(num_kv_heads), dtype=torch.uint8, device=device)


def shared_workspace(num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The workspace of this device and N for launches that pass none: allocated zeroed on the
    first (eager) request, then reused. RuntimeError where that first request comes during
    CUDA-graph capture (allocate before capture: one eager call, or `new_workspace`)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, num_kv_heads)
    with _WORKSPACES_LOCK:
        found = _WORKSPACES.get(key)
        if found is None:
            compilation.refuse_during_capture("(allocate) the balanced QKV front's workspace")
            found = _WORKSPACES[key] = new_workspace(num_kv_heads, torch.device("cuda", index))
        return found


def launch(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor | None,
           slot_mapping: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, *, tap: torch.Tensor | None = None,
           eps: float = config.RMS_NORM_EPS, enable_pdl: bool = True, workspace: torch.Tensor | None = None,
           warps: int | None = None) -> None:
    """One balanced launch on the current stream (arguments checked by `cute_ops.launch_qkv_front`,
    the workspace included): compiles the variant on first use and takes the shared workspace
    where none is given (both refused during capture), then passes raw addresses."""
    num_kv_heads = kv_cache.shape[1]
    compiled = compile_balanced_front(num_kv_heads=num_kv_heads, rope=cos_sin_cache is not None, tap=tap is not None,
                                      eps=eps, enable_pdl=enable_pdl, warps=warps)
    if workspace is None:
        workspace = shared_workspace(num_kv_heads, x.device)
    stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    max_pos = cos_sin_cache.shape[0] if cos_sin_cache is not None else 1
    compiled(
        Int64(x.data_ptr()), Int64(weight.data_ptr()), Int64(positions.data_ptr()),
        Int64(cos_sin_cache.data_ptr() if cos_sin_cache is not None else 0), Int64(slot_mapping.data_ptr()),
        Int64(kv_cache.data_ptr()), Int64(out.data_ptr()), Int64(tap.data_ptr() if tap is not None else 0),
        Int64(workspace.data_ptr()), Int32(x.shape[0]), Int64(max_pos), Int64(kv_cache.shape[0] * CACHE_BLOCK), stream,
    )
