"""Device mailboxes for the CuTe DSL tails: memory the kernels' Lamport protocol runs over.

A `DeviceMailbox` is one rank's view: its own words (int16 `[3, slots, capacity, width]` on the
GPU, armed with the sentinel), a device table of every rank's mailbox base address (the unicast
stores go through it), with transport `multicast` the address of its words in the group's NVLink
multicast mapping (a `multimem.st` there lands in every rank's words at the same offset), its two
int32 stage words (zero at first; device memory so a CUDA-graph replay advances them) and its fault
record (int32 [4], -1 when clear; the first bounded wait that runs out fills it, the kernel module
decodes it and the host reports it). What the words mean is the protocol's, `musebench.comm.protocol`.

Transports here:
- `local`: virtual ranks in one process on one GPU; the table holds plain device pointers;
- `ipc`: processes sharing GPUs of one host; CUDA IPC handles gathered over the process group
  (peers on another GPU opened on this rank's device);
- `unicast`: one process per GPU, on one host or across an NVLink fabric; torch SymmetricMemory
  peer pointers;
- `multicast`: `unicast` plus the multicast mapping torch SymmetricMemory creates for the
  allocation (`multicast_ptr`). Called only behind `comm.transport.decide`'s `multicast` verdict,
  and `symmetric_device_group` reads the policy again before the rendezvous: where the
  environment forbids multicast (the lent GPUs) no code path here creates a multicast object.

Groups: every collective allocation runs over `group` (None: the default group; a ProcessGroup;
or the global ranks of a group, `resolve_group`), so several tp groups of consecutive ranks can
allocate inside one world; `rank` and `tp` are this process's rank in the group and its size.

Refusals before any kernel launches: every allocating rank first gathers where each rank sits
(`RankPlace`: host, GPU, peer access of its GPU), and after the mapping every rank's outcome
(`MappingOutcome`); each rank then computes the same list of pairs that cannot be mapped
(`unmappable_pairs`, `unmapped_pairs`) and raises `PeerMappingRefused` naming them, so the
whole group refuses alike instead of one rank raising while its peers wait in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from musebench.comm.protocol import FAULT_CLEAR, FAULT_WORDS, SENTINEL_BF16_BITS, STAGE_WORDS, mailbox_shape
from musebench.comm.transport import IPC_OPEN_MODES, TransportRefused, keep_multicast_off, multicast_policy


@dataclass
class DeviceMailbox:
    rank: int
    tp: int
    slots: int
    capacity: int
    width: int
    words: torch.Tensor  # int16 [3, slots, capacity, width], this rank's
    peer_table: torch.Tensor  # int64 [tp]: base address of every rank's words
    stage: torch.Tensor  # int32 [STAGE_WORDS]
    fault: torch.Tensor  # int32 [FAULT_WORDS]
    transport: str = "local"
    keepalive: object = None  # what keeps the peers' mappings open (IPC tensors, a SymmetricMemory handle)
    multicast: int = 0  # transport multicast: the words' address in the group's multicast mapping; 0 otherwise

    def reset(self) -> None:
        """Re-arm every word, restart the generations, clear the fault record (no call in flight)."""
        self.words.fill_(SENTINEL_BF16_BITS)
        self.stage.zero_()
        self.fault.fill_(FAULT_CLEAR)


def local_device_group(tp: int, slots: int, capacity: int, width: int, device: torch.device | str) -> list[DeviceMailbox]:
    """Mailboxes of `tp` virtual ranks on one GPU (transport `local`), armed."""
    shape = mailbox_shape(slots, capacity, width)
    words = [torch.full(shape, SENTINEL_BF16_BITS, dtype=torch.int16, device=device) for _ in range(tp)]
    table = torch.tensor([w.data_ptr() for w in words], dtype=torch.int64, device=device)
    return [
        DeviceMailbox(rank=r, tp=tp, slots=slots, capacity=capacity, width=width, words=words[r], peer_table=table,
                      stage=torch.zeros(STAGE_WORDS, dtype=torch.int32, device=device),
                      fault=torch.full((FAULT_WORDS,), FAULT_CLEAR, dtype=torch.int32, device=device))
        for r in range(tp)
    ]


def ipc_device_group(rank: int, tp: int, slots: int, capacity: int, width: int, device: torch.device,
                     group=None, open_mode: str = "auto") -> DeviceMailbox:
    """This process's mailbox among `tp` processes sharing GPUs of one host (transport `ipc`),
    collective over `group` (`resolve_group`; `rank` is this process's rank in it).

    First every rank's `RankPlace` is gathered: ranks on different hosts, or on GPUs of one host
    without peer access, are refused on every rank alike (`PeerMappingRefused` naming the pairs)
    before anything is shared.

    Each rank allocates and arms its own words and gathers every rank's GPU and torch's CUDA IPC
    reduction of the tensor (which keeps the exporter's storage referenced) over the process group,
    then, where some peer is opened raw, the raw handle of the allocation holding it (`IpcExport`). A peer on this GPU is opened
    through torch (measured: 4 and 8 processes on one H200). torch opens a handle in the
    exporter's device context, and a kernel of this GPU storing through such a mapping of another
    GPU's words faulted with an illegal address on two H200s, peer access granted or not (tp 4
    over two GPUs, 2026-11-29); a peer on another GPU is therefore opened on this rank's device
    with lazy peer access (`IpcMapping`), as NCCL's P2P transport opens its peers.
    `open_mode` "this-device" opens every peer that way (a diagnostic, and how one GPU tests that
    path: MUSEBENCH_IPC_OPEN, read by `musebench.comm.transport.decide`, which hands it here as
    `Transport.ipc_open`). The table holds the mapped addresses.
    """
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    if open_mode not in IPC_OPEN_MODES:  # before the collective: every rank refuses alike
        raise ValueError(f"open_mode must be one of {', '.join(IPC_OPEN_MODES)}, got {open_mode!r}")
    group, places = group_places(rank, tp, device, group)
    refused = unmappable_pairs(places, "ipc")
    if refused:
        raise PeerMappingRefused("ipc", refused)
    shape = mailbox_shape(slots, capacity, width)
    words = torch.full(shape, SENTINEL_BF16_BITS, dtype=torch.int16, device=device)
    torch.cuda.synchronize(device)  # armed before any peer can map and write it
    here = words.device.index
    shared: list[object] = [None] * tp
    dist.all_gather_object(shared, (here, reduce_tensor(words)), group=group)
    devices = [peer_device for peer_device, _ in shared]
    every_peer_here = open_mode == "this-device"
    exports: list[object] = [None] * tp
    if every_peer_here or len(set(devices)) > 1:  # the same answer on every rank: a collective
        dist.all_gather_object(exports, export_words(words), group=group)
    opened = IpcMapping(here)
    through_torch: list[torch.Tensor] = []
    addresses = []
    for peer_device in sorted({peer_device for peer_device, _ in shared} - {here}):
        enable_peer_access(here, peer_device)  # once per other GPU, before any of its peers is opened
    for peer, (peer_device, (rebuild, args)) in enumerate(shared):
        if peer == rank:
            addresses.append(words.data_ptr())
        elif peer_device == here and not every_peer_here:
            through_torch.append(rebuild(*args))
            addresses.append(through_torch[-1].data_ptr())
        else:
            addresses.append(opened.open(exports[peer]))
    table = torch.tensor(addresses, dtype=torch.int64, device=device)
    box = DeviceMailbox(rank=rank, tp=tp, slots=slots, capacity=capacity, width=width, words=words, peer_table=table,
                        stage=torch.zeros(STAGE_WORDS, dtype=torch.int32, device=device),
                        fault=torch.full((FAULT_WORDS,), FAULT_CLEAR, dtype=torch.int32, device=device), transport="ipc",
                        keepalive=(through_torch, opened))
    return box


def group_places(rank: int, tp: int, device: torch.device, group=None) -> tuple[object, list[RankPlace]]:
    """(the resolved group, every member's `RankPlace`), collective over the group."""
    group = resolve_group(group)
    members = check_group(group, rank, tp)
    return group, _gather(place_here(rank, members[rank], device), group)


IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


@dataclass(frozen=True)
class IpcExport:
    """One rank's words as another process opens them: the CUDA IPC handle of the allocation that
    holds them, their byte offset in it and the GPU they live on."""

    device: int
    handle: bytes  # cudaIpcMemHandle_t
    offset: int


def _check_cuda(error, call: str) -> None:
    if int(error) != 0:
        raise RuntimeError(f"{call} failed: {error}")


def export_words(words: torch.Tensor) -> IpcExport:
    """The raw IPC export of `words` (a torch CUDA tensor of the caching allocator; expandable
    segments cannot be exported this way, and the error says so)."""
    import ctypes

    from cuda.bindings import driver, runtime

    error, base, _ = driver.cuMemGetAddressRange(words.data_ptr())
    _check_cuda(error, "cuMemGetAddressRange")
    error, handle = runtime.cudaIpcGetMemHandle(int(base))
    _check_cuda(error, "cudaIpcGetMemHandle (PYTORCH_CUDA_ALLOC_CONF=expandable_segments cannot be exported)")
    return IpcExport(device=words.device.index, handle=ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES),
                     offset=words.data_ptr() - int(base))


class IpcMapping:
    """Peers' words opened on one device of this process (cudaIpcOpenMemHandle with lazy peer
    access); `close` (or collection) releases every mapping."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.bases: list[int] = []

    def open(self, export: IpcExport) -> int:
        """The address, usable by kernels on this device, of the exported words."""
        import ctypes

        from cuda.bindings import runtime

        handle = runtime.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), export.handle, IPC_HANDLE_BYTES)
        current = torch.cuda.current_device()
        try:
            (error,) = runtime.cudaSetDevice(self.device)
            _check_cuda(error, f"cudaSetDevice({self.device})")
            error, base = runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
            _check_cuda(error, f"cudaIpcOpenMemHandle (GPU {export.device}'s words on GPU {self.device})")
        finally:
            torch.cuda.set_device(current)
        self.bases.append(int(base))
        return int(base) + export.offset

    def close(self) -> None:
        if not self.bases:
            return
        from cuda.bindings import runtime

        current = torch.cuda.current_device()
        try:
            runtime.cudaSetDevice(self.device)
            for base in self.bases:
                runtime.cudaIpcCloseMemHandle(base)
        finally:
            self.bases = []
            torch.cuda.set_device(current)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may be gone; the driver unmaps at exit
            pass


# ---------------------------------------------------------------------------------------------
# Groups, where ranks sit, and the pairs that cannot be mapped (pure: tested with stand-ins).

_GROUPS: dict[tuple[int, ...], object] = {}


def resolve_group(group=None):
    """The ProcessGroup of `group`: None -> the default group; a ProcessGroup as is; a sequence of
    global ranks -> a group of those ranks, created once per process (`dist.new_group` with
    group-local synchronization: only its members call it, so several disjoint tp groups of one
    world each create their own). ValueError for an empty or repeated rank list, or a process
    outside it."""
    import torch.distributed as dist

    if group is None:
        return dist.group.WORLD
    if isinstance(group, Sequence) and not isinstance(group, str):
        ranks = tuple(int(rank) for rank in group)
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"a group is distinct global ranks, got {list(group)}")
        if dist.get_rank() not in ranks:
            raise ValueError(f"global rank {dist.get_rank()} is not in the group {list(ranks)}")
        key = tuple(sorted(ranks))
        if key not in _GROUPS:
            _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True)
        return _GROUPS[key]
    return group


def check_group(group, rank: int, tp: int) -> tuple[int, ...]:
    """The global ranks of `group` (a ProcessGroup), in group order; ValueError unless it has tp
    members and this process is its rank `rank` (checked before any collective of the group)."""
    import torch.distributed as dist

    members = tuple(dist.get_process_group_ranks(group))
    if len(members) != tp or dist.get_rank(group) != rank:
        raise ValueError(f"this process is rank {dist.get_rank(group)} of a group of {len(members)} (global ranks "
                         f"{list(members)}); the mailbox was asked for rank {rank} of {tp}")
    return members


@dataclass(frozen=True)
class RankPlace:
    """Where one rank of a group sits: its rank in the group and globally, its host name, its GPU
    ordinal and whether that GPU has peer access to each GPU ordinal of its host."""

    rank: int
    global_rank: int
    host: str
    device: int
    peer_access: tuple[bool, ...] = ()

    def name(self) -> str:
        return f"rank {self.global_rank} (host {self.host}, GPU {self.device})"


def place_here(rank: int, global_rank: int, device: torch.device,
               can_access_peer: Callable[[int, int], bool] | None = None,
               device_count: Callable[[], int] | None = None) -> RankPlace:
    """This process's `RankPlace` (asks the driver about peer access; creates nothing)."""
    import socket

    can_access_peer = torch.cuda.can_device_access_peer if can_access_peer is None else can_access_peer
    count = (torch.cuda.device_count if device_count is None else device_count)()
    index = torch.device(device).index or 0
    access = tuple(other == index or bool(can_access_peer(index, other)) for other in range(count))
    return RankPlace(rank=rank, global_rank=global_rank, host=socket.gethostname(), device=index, peer_access=access)


@dataclass(frozen=True)
class UnmappedPair:
    """A rank that cannot map a peer's mailbox, and why (one line)."""

    rank: RankPlace
    peer: RankPlace | None  # None: the rank's whole mapping failed (a rendezvous error names no peer)
    reason: str

    def message(self) -> str:
        if self.peer is None:
            return f"{self.rank.name()}: {self.reason}"
        return f"{self.rank.name()} cannot map {self.peer.name()}: {self.reason}"


class PeerMappingRefused(RuntimeError):
    """Some rank of the group cannot map a peer's mailbox: raised alike on every rank of the
    group, before any kernel launches; the message names every such pair."""

    def __init__(self, transport: str, pairs: Sequence[UnmappedPair]) -> None:
        self.transport = transport
        self.pairs = tuple(pairs)
        shown = "; ".join(pair.message() for pair in self.pairs[:8])
        more = f"; and {len(self.pairs) - 8} more" if len(self.pairs) > 8 else ""
        super().__init__(f"{transport} mailboxes cannot be mapped: {shown}{more}")


def unmappable_pairs(places: Sequence[RankPlace], transport: str) -> list[UnmappedPair]:
    """The ordered pairs of `places` that `transport` cannot map, known before any mapping: with
    `ipc`, ranks on different hosts (CUDA IPC handles do not cross hosts); with any transport,
    ranks on different GPUs of one host without peer access between them. Pairs across hosts of
    `unicast` / `multicast` are SymmetricMemory's to map (fabric handles) and are judged by its
    outcome (`unmapped_pairs`)."""
    pairs = []
    for a in places:
        for b in places:
            if a is b:
                continue
            if a.host != b.host:
                if transport == "ipc":
                    pairs.append(UnmappedPair(a, b, "CUDA IPC handles do not cross hosts"))
                continue
            if a.device != b.device and not (b.device < len(a.peer_access) and a.peer_access[b.device]):
                pairs.append(UnmappedPair(a, b, f"GPU {a.device} has no peer access to GPU {b.device}"))
    return pairs


@dataclass(frozen=True)
class MappingOutcome:
    """One rank's result of a SymmetricMemory rendezvous, as gathered: the address of every
    rank's words as this rank maps them (0: unmapped), the words' address in the multicast
    mapping (0: none), or the rendezvous's error (one line)."""

    peers: tuple[int, ...] = ()
    multicast: int = 0
    error: str | None = None


def symmetric_outcome(handle, words_address: int, rank: int, tp: int, multicast: bool) -> MappingOutcome:
    """What a rendezvous `handle` maps for this rank's words at `words_address`: every peer's base
    (`handle.buffer_ptrs`) plus the words' offset in this rank's allocation (symmetric: the same in
    every rank's), 0 where a peer's base is null; with `multicast`, `handle.multicast_ptr` plus
    that offset (0 where the handle has no multicast mapping)."""
    bases = [int(base or 0) for base in handle.buffer_ptrs]
    if len(bases) != tp:
        return MappingOutcome(error=f"the rendezvous maps {len(bases)} ranks, the group has {tp}")
    offset = words_address - bases[rank]
    if bases[rank] == 0 or not 0 <= offset:
        return MappingOutcome(error=f"its own words (0x{words_address:x}) lie outside its mapped allocation")
    peers = tuple(base + offset if base else 0 for base in bases)
    address = 0
    if multicast:
        base = int(getattr(handle, "multicast_ptr", 0) or 0)
        address = base + offset if base else 0
    return MappingOutcome(peers=peers, multicast=address)


def unmapped_pairs(places: Sequence[RankPlace], outcomes: Sequence[MappingOutcome], multicast: bool) -> list[UnmappedPair]:
    """The pairs the gathered rendezvous outcomes show unmapped: a rank whose rendezvous failed
    (its error), a null peer pointer (that pair), and with `multicast` a rank without a multicast
    mapping."""
    pairs = []
    for place, outcome in zip(places, outcomes):
        if outcome.error is not None:
            pairs.append(UnmappedPair(place, None, f"SymmetricMemory rendezvous failed ({outcome.error})"))
            continue
        for peer, address in zip(places, outcome.peers):
            if address == 0:
                pairs.append(UnmappedPair(place, peer, "SymmetricMemory gave a null peer pointer"))
        if multicast and outcome.multicast == 0:
            pairs.append(UnmappedPair(place, None, "SymmetricMemory created no multicast mapping (multicast_ptr is 0)"))
    return pairs


def _gather(obj, group) -> list:
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def symmetric_device_group(rank: int, tp: int, slots: int, capacity: int, width: int, device: torch.device,
                           group=None, *, multicast: bool = False) -> DeviceMailbox:
    """This process's mailbox among `tp` processes on distinct GPUs (transport `unicast`, or
    `multicast` with `multicast=True`), collective over `group` (`resolve_group`: None, a
    ProcessGroup or a list of global ranks; `rank` is this process's rank in it).

    torch SymmetricMemory allocates the words and maps every peer's allocation into this process
    (fabric handles across hosts); the table holds those peer addresses. Without `multicast`,
    multicast stays off: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (and the other switches) are set, if
    unset, before the rendezvous, so no multicast object is created. With `multicast` (only behind
    `comm.transport.decide`'s `multicast` verdict) the policy is read again first (TransportRefused
    where it forbids multicast: nothing is allocated), and the mailbox carries the words' address
    in the multicast mapping SymmetricMemory creates for the allocation.

    PeerMappingRefused, on every rank alike and before any kernel launches, where a pair of GPUs of
    one host lacks peer access, a rendezvous fails, a peer pointer is null or (multicast) a rank
    has no multicast mapping. ValueError for a group that is not tp ranks with this one `rank`.
    """
    if multicast:
        forbidden = multicast_policy()
        if forbidden:
            raise TransportRefused("multicast", f"multicast is forbidden here: {', '.join(forbidden)}")
    else:
        keep_multicast_off()  # every switch, not only SymmetricMemory's
    import torch.distributed as dist

    group = resolve_group(group)
    members = check_group(group, rank, tp)
    place = place_here(rank, members[rank], device)
    return allocate_symmetric(rank, tp, slots, capacity, width, device, place=place, multicast=multicast,
                              symmetric_memory=enable_symmetric_memory(group), group=group,
                              gather=lambda obj: _gather(obj, group), synchronize=torch.cuda.synchronize,
                              world_group=dist.group.WORLD)


def allocate_symmetric(rank: int, tp: int, slots: int, capacity: int, width: int, device: torch.device, *,
                       place: RankPlace, multicast: bool, symmetric_memory, group, gather: Callable[[object], list],
                       synchronize: Callable[[torch.device], None], world_group=None) -> DeviceMailbox:
    """`symmetric_device_group`'s allocation and binding over given collaborators (the tests'
    stand-ins: `symmetric_memory` with `empty` and `rendezvous`, `gather` an all-gather of one
    object over the group, `synchronize` a device synchronize). Gathers the places and refuses
    the unmappable pairs, allocates and arms the words, rendezvous (an error is gathered, not
    raised alone), gathers the outcomes and refuses the unmapped pairs, then binds."""
    transport_name = "multicast" if multicast else "unicast"
    places = gather(place)
    refused = unmappable_pairs(places, transport_name)
    if refused:
        raise PeerMappingRefused(transport_name, refused)
    shape = mailbox_shape(slots, capacity, width)
    words = symmetric_memory.empty(*shape, dtype=torch.int16, device=device)
    words.fill_(SENTINEL_BF16_BITS)
    synchronize(device)  # armed before any peer can write it
    handle = None
    try:
        handle = symmetric_memory.rendezvous(words, group if group is not None else world_group)
        outcome = symmetric_outcome(handle, words.data_ptr(), rank, tp, multicast)
    except Exception as exc:  # gathered, so that every rank refuses with this rank's reason
        text = str(exc).strip().splitlines()
        outcome = MappingOutcome(error=f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__)
    outcomes = gather(outcome)
    refused = unmapped_pairs(places, outcomes, multicast)
    if refused:
        raise PeerMappingRefused(transport_name, refused)
    table = torch.tensor(list(outcome.peers), dtype=torch.int64, device=device)
    return DeviceMailbox(rank=rank, tp=tp, slots=slots, capacity=capacity, width=width, words=words, peer_table=table,
                         stage=torch.zeros(STAGE_WORDS, dtype=torch.int32, device=device),
                         fault=torch.full((FAULT_WORDS,), FAULT_CLEAR, dtype=torch.int32, device=device),
                         transport=transport_name, keepalive=handle, multicast=outcome.multicast)


def enable_symmetric_memory(group=None):
    """torch's SymmetricMemory module, enabled for `group` (WORLD when None).

    torch before 2.13 needs `enable_symm_mem_for_group` before a rendezvous; later versions
    deprecate it as a no-op, so it is called with its warning silenced.
    """
    import warnings

    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symmetric_memory

    name = (group if group is not None else dist.group.WORLD).group_name
    enable = getattr(symmetric_memory, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(name)
    return symmetric_memory


def enable_peer_access(device: int, peer: int) -> None:
    """Let kernels on `device` load and store memory of GPU `peer` (idempotent); RuntimeError if
    the pair has no peer access."""
    from cuda.bindings import runtime

    if not torch.cuda.can_device_access_peer(device, peer):
        raise RuntimeError(f"GPU {device} has no peer access to GPU {peer}: its ranks cannot share mailboxes")
    current = torch.cuda.current_device()
    try:
        (error,) = runtime.cudaSetDevice(device)
        (error,) = runtime.cudaDeviceEnablePeerAccess(peer, 0)
        if error not in (runtime.cudaError_t.cudaSuccess, runtime.cudaError_t.cudaErrorPeerAccessAlreadyEnabled):
            raise RuntimeError(f"cudaDeviceEnablePeerAccess({device} -> {peer}) failed: {error}")
        runtime.cudaGetLastError()  # clear the sticky-free "already enabled" status
    finally:
        torch.cuda.set_device(current)
