"""Named mailbox sets: every mailbox a rank's cases need, allocated for the run's transport.

A case family names its mailboxes (`harness.case.MailboxSpec`: source slots, rows, width); the
driver asks for the union over a run's cases, sized for the run's capacity (`--capacity`, never
below its largest token count), once per run, and hands each rank a dict name -> mailbox. The
transport picks the allocation:

- `cpu-local`: host tensors shared by virtual ranks (`lamport.local_group`);
- `shm`: POSIX shared-memory files, one per rank and name, for processes of one host (collective:
  every file exists before a peer maps it);
- `local`: device mailboxes of virtual ranks on one GPU (`device.local_device_group`);
- `ipc` / `unicast` / `multicast`: a process's own device mailbox, its peers mapped through CUDA
  IPC or torch SymmetricMemory, with `multicast` also the words' address in the group's NVLink
  multicast mapping (collective over `group`: the default process group unless given, a
  ProcessGroup or the group's global ranks, `comm.device.resolve_group`).

`reset` re-arms every word, restarts the generations and clears the fault records of one rank's
set (no call in flight: callers put it between two barriers, or after every thread joined);
`close` unmaps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from musebench.comm import lamport


def allocate_virtual(specs: Mapping[str, Any], tp: int, transport: str) -> list[dict[str, Any]]:
    """Every virtual rank's set (`cpu-local` or `local`: `comm.transport.decide`'s name)."""
    sets: list[dict[str, Any]] = [{} for _ in range(tp)]
    for name, spec in specs.items():
        if transport == "cpu-local":
            group = lamport.local_group(tp, spec.slots, spec.rows, spec.width)
        elif transport == "local":
            import torch

            from musebench.comm.device import local_device_group

            device = torch.device("cuda", torch.cuda.current_device())
            group = local_device_group(tp, spec.slots, spec.rows, spec.width, device)
        else:
            raise ValueError(f"virtual ranks take cpu-local or local mailboxes, not {transport!r}")
        for rank, box in enumerate(group):
            sets[rank][name] = box
    return sets


def allocate_process(specs: Mapping[str, Any], rank: int, tp: int, transport: Any, job: str,
                     group: Any = None) -> dict[str, Any]:
    """This process's set for `transport` (`comm.transport.Transport`: `shm`, `ipc` with its open
    mode, `unicast` or `multicast`, the last only as `decide`'s verdict); collective over `group`
    (a torch.distributed group of `tp` processes; the default group when None). `rank` is this
    process's rank within the group and `job` a key no other group of the job shares (the
    shared-memory files are named by it). `comm.device.PeerMappingRefused` on every rank of the
    group where a pair cannot be mapped."""
    from functools import partial

    import torch.distributed as dist

    if transport.name == "shm":
        for name, spec in specs.items():
            lamport.shm_create(job, name, rank, spec.slots, spec.rows, spec.width)
        dist.barrier(group=group)  # every file exists before anyone maps its peers
        boxes = {name: lamport.shm_open(job, name, rank, tp, spec.slots, spec.rows, spec.width)
                 for name, spec in specs.items()}
        dist.barrier(group=group)
        return boxes
    if transport.name not in ("ipc", "unicast", "multicast"):
        raise ValueError(f"processes take shm, ipc, unicast or multicast mailboxes, not {transport.name!r}")
    import torch

    from musebench.comm.device import ipc_device_group, symmetric_device_group

    device = torch.device("cuda", torch.cuda.current_device())
    if transport.name == "ipc":
        group_of = partial(ipc_device_group, open_mode=transport.ipc_open)
    else:
        group_of = partial(symmetric_device_group, multicast=transport.name == "multicast")
    return {name: group_of(rank, tp, spec.slots, spec.rows, spec.width, device, group=group)
            for name, spec in specs.items()}


def reset(boxes: Mapping[str, Any]) -> None:
    """Re-arm one rank's words, restart its generations, clear its fault records."""
    device = False
    for box in boxes.values():
        if isinstance(box, lamport.Mailbox):
            lamport.rearm(box.own)
            box.stage.zero_()
        else:
            box.reset()
            device = True
    if device:  # re-armed before the caller's barrier lets a peer write again
        import torch

        torch.cuda.synchronize()


def close(boxes: Mapping[str, Any]) -> None:
    for box in boxes.values():
        if isinstance(box, lamport.Mailbox):
            box.close()

