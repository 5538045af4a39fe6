"""Device mailboxes for the CuTe DSL tails: memory the kernels' Lamport protocol runs over.

A `DeviceMailbox` is one rank's view: its own words (int16 `[3, slots, capacity, width]` on the
GPU, armed with the sentinel), a device table of every rank's mailbox base address (the unicast
transport stores through it), its two int32 stage words (zero at first; device memory so a
CUDA-graph replay advances them) and its fault record (int32 [4], -1 when clear; the first bounded
wait that runs out fills it, the kernel module decodes it and the host reports it). What the words
mean is the protocol's, `musebench.comm.protocol`.

Transports here:
- `local`: virtual ranks in one process on one GPU; the table holds plain device pointers;
- `ipc`: processes sharing GPUs; CUDA IPC handles gathered over the process group (peers on
  another GPU opened on this rank's device);
- `unicast`: one process per GPU; torch SymmetricMemory peer pointers.
Which one a launch gets is decided in `musebench.comm.transport` alone. Multicast objects are
never created here: NVLink multicast is for GB200 racks, compile-tested only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from musebench.comm.protocol import FAULT_CLEAR, FAULT_WORDS, SENTINEL_BF16_BITS, STAGE_WORDS, mailbox_shape
from musebench.comm.transport import IPC_OPEN_MODES, keep_multicast_off


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
    """This process's mailbox among `tp` processes sharing GPUs (transport `ipc`), collective.

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


def symmetric_device_group(rank: int, tp: int, slots: int, capacity: int, width: int, device: torch.device,
                           group=None) -> DeviceMailbox:
    """This process's mailbox among `tp` processes on distinct GPUs (transport `unicast`), collective.

    torch SymmetricMemory allocates the words and maps every peer's allocation into this process;
    the table holds those peer addresses. Multicast stays off unless the caller asked for it:
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set (if unset) before the rendezvous, so no multicast
    object is created.
    """

    import torch.distributed as dist

    keep_multicast_off()  # every switch, not only SymmetricMemory's
    symmetric_memory = enable_symmetric_memory(group)
    shape = mailbox_shape(slots, capacity, width)
    words = symmetric_memory.empty(*shape, dtype=torch.int16, device=device)
    words.fill_(SENTINEL_BF16_BITS)
    torch.cuda.synchronize(device)  # armed before any peer can write it
    handle = symmetric_memory.rendezvous(words, group if group is not None else dist.group.WORLD)
    offset = words.data_ptr() - int(handle.buffer_ptrs[rank])  # the words within this rank's allocation
    table = torch.tensor([int(base) + offset for base in handle.buffer_ptrs], dtype=torch.int64, device=device)
    box = DeviceMailbox(rank=rank, tp=tp, slots=slots, capacity=capacity, width=width, words=words, peer_table=table,
                        stage=torch.zeros(STAGE_WORDS, dtype=torch.int32, device=device),
                        fault=torch.full((FAULT_WORDS,), FAULT_CLEAR, dtype=torch.int32, device=device), transport="unicast",
                        keepalive=handle)
    return box


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
