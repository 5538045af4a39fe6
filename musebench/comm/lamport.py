"""Host-memory mailboxes of the Lamport protocol, for the CPU model of the tails.

The protocol itself (mailbox shapes, sentinels, generations, stage words, who re-arms, the fault
record) is written once in `musebench.comm.protocol`; this module runs it over host tensors:
arming, publishing a scrubbed payload, bounded polling (`MailboxTimeout` carrying a
`FaultRecord`: waiting rank, missing peer, slot, generation) and re-arming. The sentinel unit is
the 16-bit half (EP tail) or the 32-bit word (TP tail), chosen per call with `word_bits`. The CPU
model hands the generation over through ACTIVE_STAGE (`musebench.cpu.tail`); the CuTe tails count
arrivals in that word instead.

Transports of this module (host memory, for the CPU model): `local` (virtual ranks in one
process share plain tensors) and `shm` (processes on one host map POSIX shared-memory files).
The device transports (peer pointers, CUDA IPC, multicast) live in `musebench.comm.device`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from musebench.comm.protocol import SENTINEL_BF16_BITS, SENTINEL_WORD32_BITS, STAGE_WORDS, mailbox_shape

POLL_BACKOFF_S = 20e-6  # the CPU model's sleep between two polls


@dataclass(frozen=True)
class FaultRecord:
    """A bounded wait that ran out: who waited, for whom, where."""

    rank: int  # the waiting rank
    peer: int  # the first slot owner whose words never landed
    slot: int  # mailbox slot index (EP: source rank; TP: route or token slot)
    generation: int
    token: int
    waited_s: float
    what: str = "mailbox"

    def message(self) -> str:
        return (
            f"rank {self.rank} timed out after {self.waited_s:.2f}s waiting for rank {self.peer} "
            f"({self.what} slot {self.slot}, token {self.token}, generation {self.generation})"
        )


class MailboxTimeout(RuntimeError):
    def __init__(self, record: FaultRecord):
        super().__init__(record.message())
        self.record = record


@dataclass
class Mailbox:
    """One rank's view of a mailbox group: its own words, every rank's words, its stage words.

    `words[rank]` is rank `rank`'s mailbox as int16 `[generations, slots, capacity, width]`;
    `words[self.rank]` is this rank's. Writes into a peer's tensor land in that peer's memory.
    """

    rank: int
    tp: int
    slots: int
    capacity: int
    width: int
    words: list[torch.Tensor]
    stage: torch.Tensor  # int32 [2]
    transport: str
    _cleanup: tuple[str, ...] = ()

    @property
    def own(self) -> torch.Tensor:
        return self.words[self.rank]

    def close(self) -> None:
        for path in self._cleanup:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _armed(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, SENTINEL_BF16_BITS, dtype=torch.int16)


def local_group(tp: int, slots: int, capacity: int, width: int) -> list[Mailbox]:
    """Mailboxes for `tp` virtual ranks in one process (transport `local`), armed."""
    shape = mailbox_shape(slots, capacity, width)
    words = [_armed(shape) for _ in range(tp)]
    return [
        Mailbox(rank=r, tp=tp, slots=slots, capacity=capacity, width=width, words=words,
                stage=torch.zeros(STAGE_WORDS, dtype=torch.int32), transport="local")
        for r in range(tp)
    ]


def shm_path(job: str, name: str, rank: int) -> str:
    return f"/dev/shm/musebench-{job}-{name}-r{rank}"


def shm_create(job: str, name: str, rank: int, slots: int, capacity: int, width: int) -> None:
    """Create and arm this rank's shared-memory mailbox file (before the group barrier)."""
    shape = mailbox_shape(slots, capacity, width)
    path = shm_path(job, name, rank)
    numel = 1
    for extent in shape:
        numel *= extent
    mapped = torch.from_file(path, shared=True, size=numel, dtype=torch.int16)
    mapped.fill_(SENTINEL_BF16_BITS)


def shm_open(job: str, name: str, rank: int, tp: int, slots: int, capacity: int, width: int) -> Mailbox:
    """Map every rank's mailbox file (after the group barrier): transport `shm`."""
    shape = mailbox_shape(slots, capacity, width)
    numel = 1
    for extent in shape:
        numel *= extent
    words = []
    for peer in range(tp):
        path = shm_path(job, name, peer)
        if not os.path.exists(path):
            raise RuntimeError(f"rank {rank}: mailbox of rank {peer} is missing ({path}); did rank {peer} start?")
        words.append(torch.from_file(path, shared=True, size=numel, dtype=torch.int16).view(shape))
    return Mailbox(rank=rank, tp=tp, slots=slots, capacity=capacity, width=width, words=words,
                   stage=torch.zeros(STAGE_WORDS, dtype=torch.int32), transport="shm",
                   _cleanup=(shm_path(job, name, rank),))


def _pending(words: torch.Tensor, word_bits: int) -> torch.Tensor:
    """Sentinel mask of int16 words [..., width] at the protocol's unit (16- or 32-bit)."""
    if word_bits == 16:
        return words == SENTINEL_BF16_BITS
    if word_bits == 32:
        return words.contiguous().view(torch.int32) == SENTINEL_WORD32_BITS
    raise ValueError(f"word_bits must be 16 or 32, got {word_bits}")


def scrub_word32(payload_bits: torch.Tensor) -> torch.Tensor:
    """int16 payload with every 32-bit word equal to the sentinel pair replaced by 0."""
    words = payload_bits.contiguous().view(torch.int32)
    return torch.where(words == SENTINEL_WORD32_BITS, torch.zeros_like(words), words).view(torch.int16)


def publish(destination: torch.Tensor, payload_bits: torch.Tensor, *, word_bits: int = 16) -> None:
    """Store payload words (int16, already scrubbed at the protocol's unit) into a peer's mailbox region."""
    if bool(_pending(payload_bits, word_bits).any()):
        raise AssertionError("payload holds the sentinel: scrub -0.0 before publishing")
    destination.copy_(payload_bits)


def poll(
    region: torch.Tensor,
    *,
    deadline: float,
    rank: int,
    generation: int,
    owner_of: Callable[[int, int], int] | None = None,
    what: str = "mailbox",
    started: float | None = None,
    word_bits: int = 16,
) -> torch.Tensor:
    """Wait until no word of `region` [slots, tokens, width] is the sentinel; return a copy.

    Bounded: past `deadline` (time.monotonic) raises MailboxTimeout naming the first slot that
    still holds a sentinel word and the rank that should have written it (`owner_of(slot, token)`,
    default: the slot index is the writer's rank).
    """
    started = time.monotonic() if started is None else started
    while True:
        snapshot = region.clone()
        pending = _pending(snapshot, word_bits)
        if not bool(pending.any()):
            return snapshot
        if time.monotonic() > deadline:
            where = pending.nonzero()[0].tolist()
            slot, token = where[0], where[1] if len(where) > 2 else 0
            owner = owner_of(slot, token) if owner_of is not None else slot
            raise MailboxTimeout(
                FaultRecord(rank=rank, peer=owner, slot=slot, generation=generation, token=token,
                            waited_s=time.monotonic() - started, what=what)
            )
        time.sleep(POLL_BACKOFF_S)


def rearm(region: torch.Tensor) -> None:
    """Write the sentinel back over words this rank has consumed."""
    region.fill_(SENTINEL_BF16_BITS)
