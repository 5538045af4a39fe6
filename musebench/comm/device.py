"""Device mailboxes for the CuTe DSL tails: memory the kernels' Lamport protocol runs over.

A `DeviceMailbox` is one rank's view: its own words (int16 `[3, slots, capacity, width]` on the
GPU, armed with the sentinel), a device table of every rank's mailbox base address (the unicast
transport stores through it), its stage words (int32 `[NEXT_STAGE, ACTIVE_STAGE]`, device memory
so a CUDA-graph replay advances them) and its fault record (int32 [4], -1 when clear; the first
bounded wait that runs out fills it, the kernel module decodes it and the host reports it).

Transports here:
- `local`: virtual ranks in one process on one GPU; the table holds plain device pointers;
- `ipc`: processes sharing GPUs; CUDA IPC handles gathered over the process group;
- `unicast`: one process per GPU; torch SymmetricMemory peer pointers.
Multicast objects are never created here: NVLink multicast is for GB200 racks, compile-tested
only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from musebench.comm import lamport

FAULT_CLEAR = -1


@dataclass
class DeviceMailbox:
    rank: int
    tp: int
    slots: int
    capacity: int
    width: int
    words: torch.Tensor  # int16 [3, slots, capacity, width], this rank's
    peer_table: torch.Tensor  # int64 [tp]: base address of every rank's words
    stage: torch.Tensor  # int32 [2]
    fault: torch.Tensor  # int32 [4]
    transport: str = "local"
    keepalive: object = None  # what keeps the peers' mappings open (IPC tensors, a SymmetricMemory handle)

    def reset(self) -> None:
        """Re-arm every word, restart the generations, clear the fault record (no call in flight)."""
        self.words.fill_(lamport.SENTINEL_BF16_BITS)
        self.stage.zero_()
        self.fault.fill_(FAULT_CLEAR)


def local_device_group(tp: int, slots: int, capacity: int, width: int, device: torch.device | str) -> list[DeviceMailbox]:
    """Mailboxes of `tp` virtual ranks on one GPU (transport `local`), armed."""
    shape = lamport.mailbox_shape(slots, capacity, width)
    words = [torch.full(shape, lamport.SENTINEL_BF16_BITS, dtype=torch.int16, device=device) for _ in range(tp)]
    table = torch.tensor([w.data_ptr() for w in words], dtype=torch.int64, device=device)
    return [
        DeviceMailbox(rank=r, tp=tp, slots=slots, capacity=capacity, width=width, words=words[r], peer_table=table,
                      stage=torch.zeros(2, dtype=torch.int32, device=device),
                      fault=torch.full((4,), FAULT_CLEAR, dtype=torch.int32, device=device))
        for r in range(tp)
    ]


def ipc_device_group(rank: int, tp: int, slots: int, capacity: int, width: int, device: torch.device,
                     group=None) -> DeviceMailbox:
    """This process's mailbox among `tp` processes sharing one GPU (transport `ipc`), collective.

    Each rank allocates and arms its own words, exports a CUDA IPC handle (torch's own tensor
    reduction, which keeps the exporter's storage referenced), gathers every rank's handle over the
    process group and opens the peers' in this process; the table holds the mapped addresses.
    torch SymmetricMemory refuses ranks on one device ("detected allocations from overlapping
    devices"), hence IPC here. Peers on another GPU of the host (more processes than GPUs) are
    mapped the same way; torch opens a handle in the exporter's device context, so this rank's
    device is then granted peer access to that GPU explicitly (a store through the mapping from
    a kernel without it is an illegal address, seen on two H200s).
    """
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    shape = lamport.mailbox_shape(slots, capacity, width)
    words = torch.full(shape, lamport.SENTINEL_BF16_BITS, dtype=torch.int16, device=device)
    torch.cuda.synchronize(device)  # armed before any peer can map and write it
    handles: list[object] = [None] * tp
    dist.all_gather_object(handles, reduce_tensor(words), group=group)
    peers = [words if peer == rank else rebuild(*args) for peer, (rebuild, args) in enumerate(handles)]
    for other in sorted({p.device.index for p in peers} - {words.device.index}):
        enable_peer_access(words.device.index, other)
    table = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=device)
    box = DeviceMailbox(rank=rank, tp=tp, slots=slots, capacity=capacity, width=width, words=words, peer_table=table,
                        stage=torch.zeros(2, dtype=torch.int32, device=device),
                        fault=torch.full((4,), FAULT_CLEAR, dtype=torch.int32, device=device), transport="ipc",
                        keepalive=peers)
    return box


def symmetric_device_group(rank: int, tp: int, slots: int, capacity: int, width: int, device: torch.device,
                           group=None) -> DeviceMailbox:
    """This process's mailbox among `tp` processes on distinct GPUs (transport `unicast`), collective.

    torch SymmetricMemory allocates the words and maps every peer's allocation into this process;
    the table holds those peer addresses. Multicast stays off unless the caller asked for it:
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set (if unset) before the rendezvous, so no multicast
    object is created.
    """
    import os

    import torch.distributed as dist

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    symmetric_memory = enable_symmetric_memory(group)
    shape = lamport.mailbox_shape(slots, capacity, width)
    words = symmetric_memory.empty(*shape, dtype=torch.int16, device=device)
    words.fill_(lamport.SENTINEL_BF16_BITS)
    torch.cuda.synchronize(device)  # armed before any peer can write it
    handle = symmetric_memory.rendezvous(words, group if group is not None else dist.group.WORLD)
    offset = words.data_ptr() - int(handle.buffer_ptrs[rank])  # the words within this rank's allocation
    table = torch.tensor([int(base) + offset for base in handle.buffer_ptrs], dtype=torch.int64, device=device)
    box = DeviceMailbox(rank=rank, tp=tp, slots=slots, capacity=capacity, width=width, words=words, peer_table=table,
                        stage=torch.zeros(2, dtype=torch.int32, device=device),
                        fault=torch.full((4,), FAULT_CLEAR, dtype=torch.int32, device=device), transport="unicast",
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


PEER_MAPPINGS = ("auto", "symmetric", "ipc")


def peer_mapping(local_world: int, gpus: int) -> str:
    """How a process launch maps its peers' mailboxes: `symmetric` (torch SymmetricMemory, one
    process per GPU) or `ipc` (CUDA IPC handles, processes sharing GPUs). MUSEBENCH_PEER_MAPPING
    forces one (`ipc` also works across GPUs with peer access: a diagnostic when SymmetricMemory
    fails on a machine)."""
    import os

    forced = os.environ.get("MUSEBENCH_PEER_MAPPING", "auto")
    if forced not in PEER_MAPPINGS:
        raise ValueError(f"MUSEBENCH_PEER_MAPPING must be one of {', '.join(PEER_MAPPINGS)}, got {forced!r}")
    if forced != "auto":
        return forced
    return "symmetric" if local_world <= gpus else "ipc"


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
