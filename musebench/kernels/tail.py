"""The MoE tail's public API: the seeds' `...cutedsl.moe.tail` names over musebench's kernels.

The specification is the seeds' tail module (`../shared/seeds/moe_tail.txt`): per MoE layer, the
post-expert RMSNorm of every local route's row, weighted by its route weight, summed per token
and combined across the group, identical on every rank. Two executor-level objects own the
communication memory and the compiled kernels; each layer binds its norm once (`bind`) and gets
a `BoundTail` whose `run(unfinalized, out)` is graph-capturable and allocates nothing:

- `MoETail`: expert parallelism. One Lamport mailbox per rank; musebench's EP kernels
  (`musebench.kernels.ep_tail`: a publisher and a reduction, or `single_launch=True`, one
  kernel), bitwise the stock MNNVL finalize + one-shot all-reduce (docs/contract.md).
- `TpTail`: expert TP. A route mailbox and a token mailbox per rank; musebench's TP kernel
  (`musebench.kernels.tp_tail`), bitwise the stock TP finalize on *every* path its host dispatch
  takes for m tokens (`musebench.tp_dispatch.tp_stock_path(m, tp, nsm)`: expert-owner,
  single-launch token-owner with XP = 1 or P, chunked), not only the token-owner one
  (docs/contract-tp.md).

The kernels live in ep_tail.py / tp_tail.py; their `EpTail` / `TpTail` there are this module's
internal runners (one per compiled kernel and layer, sharing the executor object's mailboxes).
Callers use this module's names only.

Where musebench differs from the seed, behind the same names:

- Memory: the mailboxes are `musebench.comm.device.DeviceMailbox`es (unicast stores through a
  peer-address table; the seed multicasts, which musebench does where the mailboxes carry a
  multicast address: transport `multicast`). Built collectively over `group` with the transport
  `comm.transport.decide` picks for this host's processes for the musebench extra `transport`
  ("auto": torch SymmetricMemory with one process per GPU, CUDA IPC where processes share GPUs;
  "multicast": SymmetricMemory's multicast mapping too, refused where the machine or its policy
  has none), or given (`mailbox=`, `routes=` / `tokens=`: e.g. virtual ranks on one GPU over
  `comm.device.local_device_group`, `group` None). The kernels' transport follows the mailbox:
  the EP publisher and the TP tail's publish are multimem stores exactly when the EP mailbox /
  the TP token mailbox has a multicast address; the bits are the same either way.
  The generation words are each mailbox's two stage words, the fault record its `fault` words.
- The TP tail's kernel is chosen per m by the stock's dispatch (`TpTail.path(m)`), a
  `TpVariant` (split, combine, delivery); `select` and the cache key by that variant, of which
  the seed's split is one knob. `compile_tp_tail` accepts the seed's arguments and maps them:
  `split` alone is the single-launch token-owner kernel with rounded products (XP = P, the
  seed's arithmetic); `variant=` gives any other; `rank`, `route_peers` and `generations` are
  runtime state in musebench's kernel and only checked.
- Extras: `timeout_ns` on both tails (the bounded spins), `single_launch` on `MoETail`, `nsm` on
  `TpTail` (the group's smallest SM count, which the stock's dispatch reads); `check_fault()`
  (RuntimeError naming the waiting rank, the missing peer, the slot and the generation of a
  spin that timed out), `launch_demands(m)` (the launches' geometry, for the co-residency check
  of virtual ranks), and on a bound EP tail in two launches `run_publisher` / `run_reduce` (the
  bench times them apart). `bind(norm, weight_dtypes=...)` may compile fewer than both
  route-weight dtypes. The compile functions take musebench's target and PTX knobs (`arch`,
  `ptx_dir`) as extra keywords.
- The TP tail takes GEMM2 rows wider than P (a multiple of 8 columns: the first P are read at
  the rows' stride, as the stock's row stride allows; `_check_tail_args(..., wide_rows=True)`);
  the EP tail takes exactly P. `tail_constants` refuses an eps outside musebench's one rule
  (`numerics.check_eps`), which the kernels and references share.
- `MAILBOX_CAPACITY` is musebench's decode batch, 8 tokens.

Compiled kernels are cached per (constants, route-weight dtype[, variant]) on each tail object,
over the kernel modules' own compile caches (keyed by every compile-time value); compiling is
refused during CUDA-graph capture, so bind (or a first call of every batch size) before capture.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from musebench import config, tp_dispatch
from musebench.comm import device as comm_device
from musebench.comm import transport
from musebench.comm.device import DeviceMailbox
from musebench.kernels import ep_tail as _ep
from musebench.kernels import tp_tail as _tp
from musebench.kernels.compilation import refuse_during_capture
from musebench.numerics import check_eps

if TYPE_CHECKING:
    from musebench.kernels.occupancy import LaunchDemand
    from musebench.layout import UnfinalizedMoEOutput

__all__ = [
    "BoundTail",
    "MAILBOX_CAPACITY",
    "MoETail",
    "ROUTE_WEIGHT_DTYPES",
    "SPIN_TIMEOUT_NS",
    "TailConstants",
    "TpTail",
    "compile_publisher",
    "compile_reduce",
    "compile_tp_tail",
    "tail_constants",
    "tail_weight",
    "tp_split",
]

POOLED = config.MOE_POOLED_WIDTH  # P: the columns of a routed row and of the output
TOP_K = config.TOP_K
ROUTE_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
MAILBOX_CAPACITY = config.MAX_DECODE_TOKENS  # tokens per call at most, by default
SPIN_TIMEOUT_NS = _ep.DEFAULT_TIMEOUT_NS  # a bounded spin gives up after this (then check_fault)
TOKEN_WIDTH = 2 * POOLED  # the TP token mailbox carries FP32 rows: the stock's exact-delivery paths
_WEIGHT_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # the kernel modules' spelling


class TailConstants(NamedTuple):
    """The compile-time constants of one layer's post-expert norm: its epsilon, the gain center
    added to the weight in FP32, and whether the weight scales the row before the norm (Muse
    Spark) or the normalized row."""

    eps: float
    gain_center: float
    weight_before_norm: bool


def tail_constants(norm) -> TailConstants:
    """The constants of `norm` (a MuseSpark1xRMSNorm, or `musebench.layout.PostExpertNorm`) as the
    stock finalize passes them. ValueError unless it spans the pooled width and normalizes all of
    it (no variance_size_override), and for an eps outside musebench's one rule
    (`numerics.check_eps`: 2^-126 <= eps <= FP32 max, where the stocks' rsqrt instructions agree)."""
    if norm.hidden_size != POOLED:
        raise ValueError(f"the post-expert norm spans {norm.hidden_size} columns; the MoE tail takes {POOLED}")
    if norm.variance_size_override is not None:
        raise ValueError(f"the post-expert norm takes its variance over {norm.variance_size_override} columns; "
                         f"the MoE tail takes it over all {POOLED}")
    return TailConstants(eps=check_eps(norm.variance_epsilon), gain_center=float(norm.fused_gain_center),
                         weight_before_norm=bool(norm.applies_weight_before_norm))


def tail_weight(norm, device: torch.device | str) -> torch.Tensor:
    """`norm`'s weight as the kernels read it: a contiguous BF16 [P] tensor on `device`, ones
    when the norm has no weight (the kernels add the gain center in FP32). ValueError for a
    weight of another shape."""
    if norm.has_weight:
        weight = norm.weight.detach()
        if tuple(weight.shape) != (POOLED,):
            raise ValueError(f"the post-expert norm weight must be [{POOLED}], got {tuple(weight.shape)}")
    else:
        weight = torch.ones(POOLED)
    return weight.to(device=device, dtype=torch.bfloat16).contiguous()


def tp_split(m: int, tp: int, nsm: int) -> int:
    """H bands per token (the band split S, which fixes the sum-of-squares tree) that the stock
    TP finalize uses for m tokens on tp ranks of nsm SMs: the split of the path its host dispatch
    takes (`musebench.tp_dispatch.tp_stock_path`), 0 for m = 0 (nothing runs). ValueError for
    tp < 2 or nsm outside 1..256."""
    return tp_dispatch.tp_split(m, tp, nsm)


def _check_tensor(name: str, tensor: object, dtype: torch.dtype | None, shape: tuple[int, ...] | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_tail_args(capacity: int, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor, *,
                     wide_rows: bool = False) -> None:
    """Refuse, with ValueError and before anything launches (the other ranks would spin on a rank
    that raised after launching), a call the tails do not take: `out` contiguous BF16 [m, P]
    with m <= capacity (the kernels write its flat view); `gemm2_permuted` contiguous BF16
    [rows, P]; `expert_weights` contiguous BF16 or FP32 [m, 8]; `expanded_idx_to_permuted_idx`
    contiguous int32 [m, 8]; all on out's CUDA device. Shapes and dtypes are checked before
    devices, and nothing reads device memory (the index values are the caller's contract).
    musebench's `wide_rows` (the TP tail's): rows may be wider than P, a multiple of 8 columns;
    the first P are read, at the rows' own stride, as the stock's row stride allows."""
    _check_tensor("out", out, torch.bfloat16, None)
    if out.dim() != 2 or out.shape[1] != POOLED:
        raise ValueError(f"out must be [m, {POOLED}], got {list(out.shape)}")
    m = out.shape[0]
    if m > capacity:
        raise ValueError(f"{m} tokens exceed the tail's capacity of {capacity}")
    rows = unfinalized.gemm2_permuted
    _check_tensor("gemm2_permuted", rows, torch.bfloat16, None)
    if wide_rows:
        if rows.dim() != 2 or rows.shape[1] < POOLED or rows.shape[1] % _tp.VEC:
            raise ValueError(f"gemm2_permuted must be [rows, width >= {POOLED}], width a multiple of {_tp.VEC}, "
                             f"got {list(rows.shape)}")
    elif rows.dim() != 2 or rows.shape[1] != POOLED:
        raise ValueError(f"gemm2_permuted must be [rows, {POOLED}], got {list(rows.shape)}")
    weights = unfinalized.expert_weights
    _check_tensor("expert_weights", weights, None, (m, TOP_K))
    if weights.dtype not in ROUTE_WEIGHT_DTYPES:
        raise ValueError(f"expert_weights must be bfloat16 or float32, got {weights.dtype}")
    _check_tensor("expanded_idx_to_permuted_idx", unfinalized.expanded_idx_to_permuted_idx, torch.int32, (m, TOP_K))
    for name, tensor in (("out", out), ("gemm2_permuted", rows), ("expert_weights", weights),
                         ("expanded_idx_to_permuted_idx", unfinalized.expanded_idx_to_permuted_idx)):
        if not tensor.is_cuda or tensor.device != out.device:
            raise ValueError(f"{name} must be on out's CUDA device, got {tensor.device} (out: {out.device})")


def _check_weight_dtype(weight_dtype: torch.dtype) -> str:
    if weight_dtype not in ROUTE_WEIGHT_DTYPES:
        raise ValueError(f"route weights must be bfloat16 or float32, got {weight_dtype}")
    return _WEIGHT_NAMES[weight_dtype]


def _check_group(tp: int, rank: int, capacity: int) -> None:
    if tp < 2:
        raise ValueError(f"the MoE tail needs a group of at least two ranks, got tp={tp}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside 0..{tp - 1}")
    if capacity < 1:
        raise ValueError(f"capacity must be at least one token, got {capacity}")


# ---------------------------------------------------------------------------------------------
# Compilation: the seeds' functions over the kernel modules' (cached there by every compile-time
# value, so these return the very objects the runners launch).


def compile_publisher(
    constants: TailConstants,
    weight_dtype: torch.dtype,
    *,
    tp: int,
    rank: int,
    capacity: int,
    enable_pdl: bool,
    single_launch: bool = False,
    timeout_ns: int = SPIN_TIMEOUT_NS,
    transport: str = "unicast",
    arch: str | None = None,
    ptx_dir: str | None = None,
) -> Any:
    """The EP tail's publisher for one norm and route-weight dtype, publishing into tp ranks'
    [3, tp, capacity, P] mailboxes (`transport` "unicast": through the peer-address table;
    "multicast": one multimem store through the group's multicast address, the same bits). The
    rank is a runtime argument of musebench's kernel (one compilation serves the group); `rank`
    is checked.

    musebench's extras: `single_launch` compiles the whole tail as one kernel (publish, then
    reduce the CTA's own token, spinning at most `timeout_ns`); `arch` / `ptx_dir` choose the
    target and keep the PTX (compile tests). ValueError for another weight dtype or constants the
    kernel refuses (eps <= 0, non-finite values); RuntimeError during CUDA-graph capture."""
    return _ep.compile_publisher(
        width=POOLED, top_k=TOP_K, tp=tp, rank=rank, capacity=capacity, threads=_ep.DEFAULT_THREADS,
        weight_before_norm=constants.weight_before_norm, weight_dtype=_check_weight_dtype(weight_dtype),
        eps=constants.eps, gain_center=constants.gain_center, transport=transport, enable_pdl=enable_pdl,
        single_launch=single_launch, timeout_ns=timeout_ns, arch=arch, ptx_dir=ptx_dir,
    )


def compile_reduce(
    *,
    tp: int,
    capacity: int,
    enable_pdl: bool,
    rank: int | None = None,
    timeout_ns: int = SPIN_TIMEOUT_NS,
    arch: str | None = None,
    ptx_dir: str | None = None,
) -> Any:
    """The EP tail's reduction of a [3, tp, capacity, P] mailbox: every token's tp partials
    summed in rank order once all have landed (each spin bounded by `timeout_ns`).

    musebench's extras: `rank` (the rank is a runtime argument of musebench's reduction: one
    compilation serves the group; given, it is only checked); `arch` / `ptx_dir` as for
    `compile_publisher`. RuntimeError during capture."""
    return _ep.compile_reduce(width=POOLED, tp=tp, rank=rank, capacity=capacity, threads=_ep.DEFAULT_THREADS,
                              enable_pdl=enable_pdl, timeout_ns=timeout_ns, arch=arch, ptx_dir=ptx_dir)


def compile_tp_tail(
    constants: TailConstants,
    weight_dtype: torch.dtype,
    *,
    tp: int,
    rank: int,
    split: int,
    slots: int,
    route_peers: Sequence[int],
    generations: int,
    enable_pdl: bool,
    timeout_ns: int = SPIN_TIMEOUT_NS,
    capacity: int | None = None,
    variant: _tp.TpVariant | None = None,
    token_width: int = TOKEN_WIDTH,
    transport: str = _tp.UNICAST,
    arch: str | None = None,
    ptx_dir: str | None = None,
) -> Any:
    """The expert-TP tail, one launch, for one norm, route-weight dtype and stock path.

    The seed's arguments map onto musebench's kernel so: `split` is the band split; without
    `variant` the kernel is the single-launch token-owner one with rounded route products and
    scrubbed copies (the seed's), with `variant` (a `tp_tail.TpVariant`, whose split must equal
    `split`) any path of the stock's dispatch; `slots` token slots per rank give the capacity
    (`slots * tp` tokens, unless `capacity` says otherwise); `rank` is a runtime argument of
    musebench's kernel (one compilation serves every rank; it is only checked here);
    `route_peers` and `generations` describe runtime tables (peer addresses, the stage words) and
    are not compiled in. `token_width`: the token mailbox's row, 2P (FP32 rows, every path) or P
    (scrubbed paths only). ValueError for another weight dtype, a split the variant contradicts,
    or knobs the kernel refuses; RuntimeError during capture."""
    name = _check_weight_dtype(weight_dtype)
    if not 2 <= tp <= 32 or len(route_peers) != tp:
        raise ValueError(f"the TP tail needs 2 to 32 ranks and one route peer each, got tp={tp} and "
                         f"{len(route_peers)} peers")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside 0..{tp - 1}")
    if variant is None:
        variant = _tp.TpVariant(split=split, combine=_tp.ROUNDED_PRODUCTS, delivery=_tp.SCRUBBED)
    elif variant.split != split:
        raise ValueError(f"split {split} contradicts the variant's {variant.split}")
    if capacity is None:
        capacity = slots * tp
    return _tp.compile_tp_tail(
        tp=tp, capacity=capacity, token_width=token_width, variant=variant,
        weight_before_norm=constants.weight_before_norm, weight_dtype=name, eps=constants.eps,
        gain_center=constants.gain_center, timeout_ns=timeout_ns, enable_pdl=enable_pdl, transport=transport,
        arch=arch, ptx_dir=ptx_dir,
    )


# ---------------------------------------------------------------------------------------------
# Host objects.


def _group_mailbox(group, *, rank: int, tp: int, slots: int, capacity: int, width: int,
                   device: torch.device, request: str = "auto") -> DeviceMailbox:
    """This rank's mailbox, allocated collectively over `group` (None: the default process group)
    with the transport `comm.transport.decide` picks for this host's process layout and
    `request`: torch SymmetricMemory peers with one process per GPU (unicast; multicast adds the
    multicast mapping), CUDA IPC where processes share GPUs. TransportRefused (a ValueError)
    where none can serve the request; `comm.device.PeerMappingRefused` where a pair of ranks
    cannot be mapped."""
    chosen = transport.decide(transport.layout_here("cute", "torchrun", tp), request)
    if chosen.name in ("unicast", "multicast"):
        return comm_device.symmetric_device_group(rank, tp, slots, capacity, width, device, group=group,
                                                  multicast=chosen.name == "multicast")
    return comm_device.ipc_device_group(rank, tp, slots, capacity, width, device, group=group,
                                        open_mode=chosen.ipc_open or "auto")


def _check_mailbox(name: str, box: object, *, rank: int, tp: int, slots: int, capacity: int,
                   widths: tuple[int, ...]) -> None:
    if not isinstance(box, DeviceMailbox):
        raise ValueError(f"{name} must be a musebench.comm.device.DeviceMailbox, got {type(box).__name__}")
    if (box.rank, box.tp) != (rank, tp):
        raise ValueError(f"{name} is rank {box.rank} of {box.tp}; this tail is rank {rank} of {tp}")
    if (box.slots, box.capacity) != (slots, capacity) or box.width not in widths:
        raise ValueError(f"{name} holds [{box.slots}, {box.capacity}, {box.width}] per generation; "
                         f"this tail needs [{slots}, {capacity}, {' or '.join(map(str, widths))}]")


class _BoundWeight:
    """One layer's norm weight as a tail launches it: an internal runner (ep_tail.EpTail or
    tp_tail.TpTail) per compiled kernel, each holding the weight's CuTe view over the tail's
    mailboxes. Built at bind (or on a first call, refused during capture)."""

    def __init__(self, tail: MoETail | TpTail, constants: TailConstants, weight: torch.Tensor) -> None:
        self.tail, self.constants, self.weight = tail, constants, weight
        self._runners: dict[int, tuple[Any, Any]] = {}  # id(kernel) -> (kernel, runner)

    def runner(self, kernel: Any, weight_dtype: torch.dtype, m: int) -> Any:
        entry = self._runners.get(id(kernel))
        if entry is not None:
            return entry[1]
        refuse_during_capture(f"the MoE tail for {weight_dtype} route weights at {m} tokens (bind first)")
        runner = self.tail._runner(self.constants, weight_dtype, m, self.weight)
        self._runners[id(kernel)] = (kernel, runner)  # the kernel is kept: its id stays its own
        return runner


class BoundTail:
    """One MoE layer's tail on `tail` (a `MoETail`, or a `TpTail` for the expert-TP layers), with
    the layer's norm constants and weight. `run` is graph-capturable and allocates nothing once
    `bind` prepared the call's route-weight dtype (and, TP, its token count)."""

    def __init__(self, tail: MoETail | TpTail, constants: TailConstants, weight: torch.Tensor) -> None:
        self.tail = tail
        self.constants = constants
        self.weight = weight
        self._weight_view = _BoundWeight(tail, constants, weight)
        self._weight_dtypes: tuple[torch.dtype, ...] = ROUTE_WEIGHT_DTYPES  # what bind prepared

    def run(self, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor) -> None:
        """Write the MoE output of the layer into `out` (BF16 [b, P], contiguous), the same bits on
        every rank; `unfinalized` is this rank's GEMM2 output (`_check_tail_args` gives the
        shapes). Collective: every rank calls it with the same b, in the same order of layers;
        b = 0 launches nothing. Arguments outside the contract raise ValueError before anything
        launches. On the current stream of out's device."""
        m = out.shape[0]
        if m == 0:
            return
        _check_tail_args(self.tail.capacity, unfinalized, out, wide_rows=self.tail.wide_rows)
        kernel = self.tail.select(self.constants, unfinalized.expert_weights.dtype, m)
        self.tail.launch(kernel, self._weight_view, unfinalized, out)

    def _two_launches(self) -> MoETail:
        tail = self.tail
        if not isinstance(tail, MoETail) or tail.single_launch:
            raise ValueError("only an EP tail in two launches has a publisher and a reduction to run apart")
        return tail

    def run_publisher(self, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor) -> None:
        """The EP publisher alone (musebench's bench times it apart; arguments as `run`, `out` only
        gives b). It leaves this rank's partials in every peer's mailbox, which a later reduction
        reads as landed: reset every rank's mailbox (`DeviceMailbox.reset`, between barriers)
        before the group's next `run`. ValueError for a TP or single-launch tail."""
        tail = self._two_launches()
        m = out.shape[0]
        if m == 0:
            return
        _check_tail_args(tail.capacity, unfinalized, out)
        dtype = unfinalized.expert_weights.dtype
        self._weight_view.runner(tail.select(self.constants, dtype, m), dtype, m).run_publisher(unfinalized, out)

    def run_reduce(self, out: torch.Tensor) -> None:
        """The EP reduction alone, behind every rank's `run_publisher` of the same b (a profiler that
        serializes kernels needs all publishers launched first). ValueError for a TP or
        single-launch tail or an `out` that is not contiguous BF16 [b <= capacity, P]."""
        tail = self._two_launches()
        _check_tensor("out", out, torch.bfloat16, None)
        if out.dim() != 2 or out.shape[1] != POOLED or out.shape[0] > tail.capacity:
            raise ValueError(f"out must be [b <= {tail.capacity}, {POOLED}], got {list(out.shape)}")
        dtype = self._weight_dtypes[0]  # the reduction is the same whatever the weights' dtype
        self._weight_view.runner(tail.select(self.constants, dtype, tail.capacity), dtype, tail.capacity).run_reduce(out)

    def check_fault(self) -> None:
        """The tail's `check_fault` (it synchronizes on the fault record)."""
        self.tail.check_fault()

    def launch_demands(self, m: int, weight_dtype: torch.dtype | None = None) -> list[LaunchDemand]:
        """This rank's launches for m tokens (compiled kernel and geometry), for the co-residency
        check of virtual ranks (`musebench.kernels.occupancy`): none for m = 0; `weight_dtype`
        defaults to the first dtype bind prepared."""
        dtype = self._weight_dtypes[0] if weight_dtype is None else weight_dtype
        _check_weight_dtype(dtype)
        if m == 0:
            return []
        kernel = self.tail.select(self.constants, dtype, m)
        return self._weight_view.runner(kernel, dtype, m).launch_demands(m)


class _Tail:
    """What both executor-level tails share: binding a layer, launching a bound layer, the
    most recently bound layer (for `launch_demands`)."""

    capacity: int
    device: torch.device
    wide_rows = False  # whether its kernel reads rows wider than P (`_check_tail_args`)

    def _init_common(self, *, tp: int, rank: int, device: torch.device | str, capacity: int, enable_pdl: bool,
                     timeout_ns: int) -> None:
        _check_group(tp, rank, capacity)
        if isinstance(timeout_ns, bool) or not isinstance(timeout_ns, int) or not 0 < timeout_ns < 2**62:
            raise ValueError(f"timeout_ns must be a positive int, got {timeout_ns!r}")
        self.tp, self.rank, self.capacity = tp, rank, capacity
        self.device = torch.device(device)
        self.enable_pdl = bool(enable_pdl)
        self.timeout_ns = timeout_ns
        self._warm: set[tuple] = set()  # runner keys whose first runner warmed the kernel up
        self._last: BoundTail | None = None

    def _prepared_sizes(self) -> Sequence[int]:
        raise NotImplementedError

    def _bind(self, norm, weight_dtypes: Sequence[torch.dtype]) -> BoundTail:
        constants = tail_constants(norm)
        dtypes = tuple(weight_dtypes)
        if not dtypes:
            raise ValueError("bind needs at least one route-weight dtype")
        for dtype in dtypes:
            _check_weight_dtype(dtype)
        bound = BoundTail(self, constants, tail_weight(norm, self.device))  # type: ignore[arg-type]
        bound._weight_dtypes = dtypes
        # Compile and build the runners now, outside capture; a runner's first one also launches
        # its kernel once on scratch buffers (lazy module loading must not wait behind a peer's spin).
        for dtype in dtypes:
            for m in self._prepared_sizes():
                bound._weight_view.runner(self.select(constants, dtype, m), dtype, m)  # type: ignore[attr-defined]
        self._last = bound
        return bound

    def launch(self, kernel: Any, weight_view: _BoundWeight, unfinalized: UnfinalizedMoEOutput,
               out: torch.Tensor) -> None:
        """Launch `kernel` (what `select` returned for this call) for the layer of `weight_view`
        (musebench's: the layer's runners, `BoundTail._weight_view`) on the current stream.
        `BoundTail.run` checked the arguments; the runner checks its own again before launching."""
        weight_view.runner(kernel, unfinalized.expert_weights.dtype, out.shape[0]).run(unfinalized, out)

    def launch_demands(self, m: int, weight_dtype: torch.dtype | None = None) -> list[LaunchDemand]:
        """`BoundTail.launch_demands` of the most recently bound layer; ValueError before any bind."""
        if self._last is None:
            raise ValueError("bind a layer first: the launches are its compiled kernels")
        return self._last.launch_demands(m, weight_dtype)


class MoETail(_Tail):
    """The MoE tail of one executor under expert parallelism: this rank's Lamport mailbox and the
    compiled kernels. Every layer binds its post-expert norm (`bind`); the layers share the
    mailbox, as their calls follow one another on every rank.

    Built before CUDA-graph capture: collectively over `group` (every rank of the tp, with its
    own `rank` and `device`), or over a given `mailbox` (`comm.device.DeviceMailbox` of
    [3, tp, capacity, P] words, e.g. one of `local_device_group`'s virtual ranks; `group` is then
    not used). tp >= 2; `capacity` tokens per call at most. musebench's extras: `timeout_ns`
    bounds every spin (then `check_fault`); `single_launch` runs each call as one kernel (the
    same bits; every rank must choose alike); `transport` the request for an allocated mailbox
    (`_group_mailbox`). The publisher multicasts exactly when the mailbox has a multicast address.
    """

    def __init__(
        self,
        group: Any,
        *,
        tp: int,
        rank: int,
        device: torch.device | str,
        capacity: int = MAILBOX_CAPACITY,
        enable_pdl: bool = True,
        timeout_ns: int = SPIN_TIMEOUT_NS,
        single_launch: bool = False,
        mailbox: DeviceMailbox | None = None,
        transport: str = "auto",
    ) -> None:
        refuse_during_capture("the MoE tail")
        self._init_common(tp=tp, rank=rank, device=device, capacity=capacity, enable_pdl=enable_pdl,
                          timeout_ns=timeout_ns)
        self.single_launch = bool(single_launch)
        if mailbox is None:
            mailbox = _group_mailbox(group, rank=rank, tp=tp, slots=tp, capacity=capacity, width=POOLED,
                                     device=self.device, request=transport)
        else:
            _check_mailbox("mailbox", mailbox, rank=rank, tp=tp, slots=tp, capacity=capacity, widths=(POOLED,))
        self.mailbox = mailbox
        self.transport = "multicast" if mailbox.multicast else "unicast"  # the publisher's stores
        self._publishers: dict[tuple[TailConstants, torch.dtype], Any] = {}

    def select(self, constants: TailConstants, weight_dtype: torch.dtype, m: int) -> Any:
        """The compiled publisher (or single launch) for one norm and route-weight dtype; every m
        takes the same one. Cached; compiled on a miss, which must precede capture."""
        key = (constants, weight_dtype)
        kernel = self._publishers.get(key)
        if kernel is None:
            kernel = compile_publisher(constants, weight_dtype, tp=self.tp, rank=self.rank, capacity=self.capacity,
                                       enable_pdl=self.enable_pdl, single_launch=self.single_launch,
                                       timeout_ns=self.timeout_ns, transport=self.transport)
            self._publishers[key] = kernel
        return kernel

    def bind(self, norm, *, weight_dtypes: Sequence[torch.dtype] = ROUTE_WEIGHT_DTYPES) -> BoundTail:
        """One layer's tail; `norm` is its post-expert norm (`tail_constants`, `tail_weight`). The
        kernels of `weight_dtypes` (both route-weight dtypes unless told) are compiled and loaded
        here, before capture."""
        return self._bind(norm, weight_dtypes)

    def _prepared_sizes(self) -> Sequence[int]:
        return (self.capacity,)  # one publisher serves every m

    def _runner(self, constants: TailConstants, weight_dtype: torch.dtype, m: int, weight: torch.Tensor) -> Any:
        key = (constants, weight_dtype)
        warm = key not in self._warm
        box = self.mailbox
        multicast = self.transport == "multicast"
        runner = _ep.EpTail(
            rank=self.rank, tp=self.tp, capacity=self.capacity, mailbox=box.words, stage=box.stage, fault=box.fault,
            norm_weight=weight, peer_mailboxes=None if multicast else box.peer_table,
            multicast_address=box.multicast if multicast else None, weight_before_norm=constants.weight_before_norm,
            weight_dtype=_check_weight_dtype(weight_dtype), eps=constants.eps, gain_center=constants.gain_center,
            width=POOLED, top_k=TOP_K, enable_pdl=self.enable_pdl, timeout_ns=self.timeout_ns, warm_up=warm,
            single_launch=self.single_launch,
        )
        self._warm.add(key)
        return runner

    def check_fault(self) -> None:
        """Synchronize on this rank's fault record; RuntimeError naming the waiting rank, the
        missing peer, the mailbox slot and token, and the generation if a spin timed out. After a
        fault, reset every rank's mailbox before the next call."""
        record = _ep.decode_fault([int(word) for word in self.mailbox.fault.tolist()], self.capacity)
        if record is not None:
            raise RuntimeError(record.message())


class TpTail(_Tail):
    """The MoE tail of one executor's expert-TP layers: this rank's route and token mailboxes and
    the compiled kernels. Every rank holds a K-partial of every route's row; the output is
    bitwise the stock TP finalize's on the path its dispatch takes for each m (`path`: the
    kernel variant; `split`: its band split). The layers share the mailboxes.

    Built before CUDA-graph capture: collectively over `group`, or over given `routes`
    ([3, tp, 8 capacity, P]) and `tokens` ([3, 1, capacity, 2P]; P serves the scrubbed paths
    only) `DeviceMailbox`es, e.g. `local_device_group`'s (`group` is then not used); the fault
    record and generation words are the route mailbox's. tp >= 2; `capacity` tokens per call at
    most; `batches`: the token counts whose kernels every bind compiles (a captured call must be
    one of them; other counts compile on their first call). `nsm`: the SM count the stock's
    dispatch reads (the group's smallest; None: this GPU's). `timeout_ns` bounds every spin.
    musebench's extra `transport`: the request for allocated mailboxes (`_group_mailbox`); the
    owner publishes its rows by multicast exactly when the token mailbox has a multicast address.
    """

    wide_rows = True  # the TP kernel reads the first P columns at the rows' own stride

    def __init__(
        self,
        group: Any,
        *,
        tp: int,
        rank: int,
        device: torch.device | str,
        capacity: int = MAILBOX_CAPACITY,
        batches: Sequence[int] = (MAILBOX_CAPACITY,),
        enable_pdl: bool = True,
        timeout_ns: int = SPIN_TIMEOUT_NS,
        nsm: int | None = None,
        routes: DeviceMailbox | None = None,
        tokens: DeviceMailbox | None = None,
        transport: str = "auto",
    ) -> None:
        refuse_during_capture("the TP MoE tail")
        self._init_common(tp=tp, rank=rank, device=device, capacity=capacity, enable_pdl=enable_pdl,
                          timeout_ns=timeout_ns)
        self.batches = tuple(int(m) for m in batches)
        if not self.batches or not all(1 <= m <= capacity for m in self.batches):
            raise ValueError(f"batches must be token counts in [1, {capacity}], got {tuple(batches)}")
        if nsm is None:
            nsm = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.nsm = int(nsm)
        tp_dispatch.tp_stock_path(1, tp, self.nsm)  # ValueError for an SM count the stock refuses
        if (routes is None) != (tokens is None):
            raise ValueError("give both the route and the token mailboxes, or neither")
        if routes is None:
            routes = _group_mailbox(group, rank=rank, tp=tp, slots=tp, capacity=capacity * TOP_K, width=POOLED,
                                    device=self.device, request=transport)
            tokens = _group_mailbox(group, rank=rank, tp=tp, slots=1, capacity=capacity, width=TOKEN_WIDTH,
                                    device=self.device, request=transport)
        else:
            _check_mailbox("routes", routes, rank=rank, tp=tp, slots=tp, capacity=capacity * TOP_K, widths=(POOLED,))
            _check_mailbox("tokens", tokens, rank=rank, tp=tp, slots=1, capacity=capacity,
                           widths=(POOLED, TOKEN_WIDTH))
        # Rank d's route mailbox receives every rank's K-partials of the tokens d owns, its token
        # mailbox every owner's finished rows.
        self.routes, self.tokens = routes, tokens
        self.transport = _tp.MULTICAST if tokens.multicast else _tp.UNICAST  # how owners publish their rows
        self.slots = -(-capacity // tp)  # tokens each rank owns per call at most
        self.generations = routes.stage  # the stage words every CTA reads and the last advances
        self._kernels: dict[tuple[TailConstants, torch.dtype, _tp.TpVariant], Any] = {}

    def path(self, m: int) -> tp_dispatch.TpStockPath:
        """The stock dispatch's path for m tokens on this group (`tp_dispatch.tp_stock_path`)."""
        return tp_dispatch.tp_stock_path(m, self.tp, self.nsm)

    def split(self, m: int) -> int:
        """The band split of the kernel for m tokens: the stock's (`tp_split`)."""
        return self.path(m).split

    def _variant(self, m: int) -> _tp.TpVariant:
        if not 1 <= m <= self.capacity:
            raise ValueError(f"{m} tokens outside 1..{self.capacity}")
        return _tp.TpVariant.from_path(self.path(m))

    def select(self, constants: TailConstants, weight_dtype: torch.dtype, m: int) -> Any:
        """The compiled tail for one norm and route-weight dtype at m tokens: the kernel variant of
        the stock's path for m (cached per variant; compiled on a miss, which must precede
        capture)."""
        variant = self._variant(m)
        key = (constants, weight_dtype, variant)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = compile_tp_tail(constants, weight_dtype, tp=self.tp, rank=self.rank, split=variant.split,
                                     slots=self.slots, route_peers=tuple(range(self.tp)),
                                     generations=self.generations.numel(), enable_pdl=self.enable_pdl,
                                     timeout_ns=self.timeout_ns, capacity=self.capacity, variant=variant,
                                     token_width=self.tokens.width, transport=self.transport)
            self._kernels[key] = kernel
        return kernel

    def bind(self, norm, *, weight_dtypes: Sequence[torch.dtype] = ROUTE_WEIGHT_DTYPES) -> BoundTail:
        """One layer's tail; `norm` is its post-expert norm. The kernels of `batches` are compiled
        and loaded here for `weight_dtypes` (both route-weight dtypes unless told), before capture."""
        return self._bind(norm, weight_dtypes)

    def _prepared_sizes(self) -> Sequence[int]:
        return self.batches

    def _runner(self, constants: TailConstants, weight_dtype: torch.dtype, m: int, weight: torch.Tensor) -> Any:
        variant = self._variant(m)
        key = (constants, weight_dtype, variant)
        warm = key not in self._warm
        routes, tokens = self.routes, self.tokens
        runner = _tp.TpTail(
            rank=self.rank, tp=self.tp, capacity=self.capacity, route_mailbox=routes.words,
            route_peers=routes.peer_table, token_mailbox=tokens.words, token_peers=tokens.peer_table,
            stage=routes.stage, fault=routes.fault, norm_weight=weight,
            weight_before_norm=constants.weight_before_norm, weight_dtype=_check_weight_dtype(weight_dtype),
            eps=constants.eps, gain_center=constants.gain_center, variants=variant, timeout_ns=self.timeout_ns,
            enable_pdl=self.enable_pdl, warm_up=warm,
            token_multicast=tokens.multicast if self.transport == _tp.MULTICAST else None,
        )
        self._warm.add(key)
        return runner

    def check_fault(self) -> None:
        """Synchronize on this rank's fault record; RuntimeError naming the waiting rank, the
        missing peer, the token and route (or the token's row) and the generation if a spin timed
        out. After a fault, reset every rank's mailboxes before the next call."""
        record = _tp.decode_fault([int(word) for word in self.routes.fault.tolist()])
        if record is not None:
            raise RuntimeError(record.message())
