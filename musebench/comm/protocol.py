"""The Lamport mailbox protocol of the MoE tails: every constant once, and its invariants.

Everything that speaks the protocol imports its constants from here: the CuTe DSL kernels
(`musebench.kernels.ep_tail`, `musebench.kernels.tp_tail`, the sentinel tests of
`musebench.kernels.ptx`), the device mailboxes (`musebench.comm.device`), the host mailboxes and
the CPU model (`musebench.comm.lamport`, `musebench.cpu.tail`); docs/contract.md cites this
docstring. No other module assigns these names (tests/comm/test_protocol.py scans for it). Plain
Python: importing it loads neither torch nor cutlass.

Mailboxes. A mailbox is int16 words `[LAMPORT_GENERATIONS, slots, rows, width]`
(`mailbox_shape`) in the memory of the rank that reads it, written by every rank of the group
(itself included). EP tail: one slot per source rank, one row per token (`ep_mailbox_shape`). TP
tail: a route mailbox, one slot per source rank, `top_k` rows per token (`tp_route_mailbox_shape`),
and a token mailbox, one slot, one row per token, as BF16 (`width` words) or widened to FP32
(`2 * width` words) where every reader must get the owner's exact bits (`tp_token_mailbox_shape`).

Sentinel. Every word is armed with BF16 -0.0. The unit a reader tests is the 16-bit half in the
EP tail (a half equal to SENTINEL_BF16 has not arrived) and the 32-bit word in the TP tail (only a
word equal to SENTINEL_BF16X2 has not; a lone -0.0 half is data). A publisher scrubs its payload
at the same unit (-0.0 -> +0.0 per half; a word equal to SENTINEL_BF16X2 -> 0; an FP32 row maps
that pattern to -0.0, which rounds to the same BF16), so no payload unit reads as the sentinel.
The data write is therefore the release: no flag, no fence; a unit that no longer reads as the
sentinel has landed. Each unit is written once per generation (sentinel -> value) and tested on
its own, so a torn 16-byte access is harmless.

Readers re-arm. A reader polls its own mailbox (volatile loads) until no unit of the slots it
needs is the sentinel, consumes them, and writes the sentinel back over exactly what it read; a
writer never re-arms. Every wait is bounded (DEFAULT_TIMEOUT_NS on the GPU, from the first poll):
a reader still waiting then gives up, writes and re-arms nothing, and records the fault.

Generations. A call reads and writes generation g (NEXT_STAGE); the next call uses
(g + 1) % LAMPORT_GENERATIONS. A slot of generation g is written again three calls later, after
every reader re-armed it: a peer writes that slot again only in call i + 3, which it starts only
after finishing call i + 2, which needs this rank's publish of call i + 2, which follows this
rank's consumption and re-arm of call i in stream order. Re-arming never races a live write, and
three generations suffice.

Stage words. int32 `[STAGE_WORDS]` in the rank's own memory (device memory on a GPU, so CUDA-graph
replay advances them), zero at first. The CuTe tails: the CTAs that need the generation read
NEXT_STAGE and count themselves in on ARRIVAL_COUNT with an atomic add; the last to arrive stores
(NEXT_STAGE + 1) % 3 and zeroes the count (0 between calls), after a fault too, so the calls that
follow stay in step. The CPU model hands over instead: its publisher stores NEXT_STAGE to
ACTIVE_STAGE, its reader reads ACTIVE_STAGE and stores (ACTIVE_STAGE + 1) % 3 to NEXT_STAGE
(ARRIVAL_COUNT and ACTIVE_STAGE name the same word in the two implementations).

Fault record. int32 `[FAULT_WORDS]` per rank, FAULT_CLEAR in every word until a wait times out.
The rank's first reader to time out claims it with `atom.cas` of word FAULT_RANK from FAULT_CLEAR
to its rank; only the winner then stores FAULT_PEER (the rank whose words never landed),
FAULT_WHERE (EP: the mailbox row, slot * capacity + token; TP: token * FAULT_SLOTS + route, or
TOKEN_SLOT for the token mailbox) and FAULT_GENERATION. After a fault the mailboxes hold stray
words: every rank resets (re-arms every word, zeroes the stage words, clears the record) between
two barriers before the group's next call.

The kernel modules' docstrings give the per-kernel orderings built on this (PDL, the arrival
count's release and fence, the TP tail's lockstep through rank 0).
"""

from __future__ import annotations

LAMPORT_GENERATIONS = 3  # mailbox buffers in rotation; the argument above needs three

# Sentinels: BF16 -0.0, per 16-bit half (EP unit) or per 32-bit word (TP unit).
SENTINEL_BF16 = 0x8000  # one BF16 half equal to -0.0
SENTINEL_BF16_BITS = SENTINEL_BF16 - (1 << 16)  # the same half as int16 (-32768): how torch arms a mailbox
SENTINEL_BF16X2 = (SENTINEL_BF16 << 16) | SENTINEL_BF16  # 0x80008000: two sentinel halves in a 32-bit word
SENTINEL_WORD32_BITS = SENTINEL_BF16X2 - (1 << 32)  # the same word as int32

# Stage words: int32 [STAGE_WORDS] per rank, zero at first.
NEXT_STAGE = 0  # the generation of the current (or next) call
ARRIVAL_COUNT = 1  # CuTe tails: CTAs of the current call counted in; the last one advances NEXT_STAGE, zeroes it
ACTIVE_STAGE = 1  # CPU model: the generation its publisher hands to its reader
STAGE_WORDS = 2
STAGE_WORD_BYTES = 4

# Fault record: int32 [FAULT_WORDS] per rank, FAULT_CLEAR in every word until the first timeout.
FAULT_WORDS = 4
FAULT_WORD_BYTES = 4
FAULT_CLEAR = -1
FAULT_RANK = 0  # the waiting rank (written by the atom.cas that claims the record)
FAULT_PEER = 1  # the rank whose words never landed
FAULT_WHERE = 2  # EP: mailbox row slot * capacity + token; TP: token * FAULT_SLOTS + slot
FAULT_GENERATION = 3
FAULT_SLOTS = 16  # TP: slots per token in FAULT_WHERE (routes 0..top_k - 1, then TOKEN_SLOT)
TOKEN_SLOT = 8  # TP: the token mailbox's slot in FAULT_WHERE

DEFAULT_TIMEOUT_NS = 2_000_000_000  # a GPU reader's bounded wait, from its first poll


def read_fault_record(words: list[int]) -> tuple[int, int, int, int] | None:
    """(rank, peer, where, generation) of a fault record read back as int32 [FAULT_WORDS], or None
    where no wait timed out (FAULT_RANK still FAULT_CLEAR); `where` is the kernel's own encoding
    (each kernel's `decode_fault` names its parts). ValueError for another number of words."""
    if len(words) != FAULT_WORDS:
        raise ValueError(f"a fault record has {FAULT_WORDS} words, got {len(words)}")
    if words[FAULT_RANK] == FAULT_CLEAR:
        return None
    return words[FAULT_RANK], words[FAULT_PEER], words[FAULT_WHERE], words[FAULT_GENERATION]


def mailbox_shape(slots: int, rows: int, width: int) -> tuple[int, int, int, int]:
    """[generations, slots, rows, width] of one rank's mailbox (int16 words)."""
    return (LAMPORT_GENERATIONS, slots, rows, width)


def ep_mailbox_shape(tp: int, capacity: int, width: int) -> tuple[int, int, int, int]:
    """One rank's EP mailbox: a slot per source rank, a row per token."""
    return mailbox_shape(tp, capacity, width)


def tp_route_mailbox_shape(tp: int, capacity: int, width: int, top_k: int) -> tuple[int, int, int, int]:
    """One rank's TP route mailbox: a slot per source rank, `top_k` route rows per token."""
    return mailbox_shape(tp, capacity * top_k, width)


def tp_token_mailbox_shape(capacity: int, width: int, *, fp32_rows: bool) -> tuple[int, int, int, int]:
    """One rank's TP token mailbox: one slot, a row per token, `2 * width` words wide for rows
    widened to FP32 (where every rank gets the owner's bits), `width` for BF16 rows."""
    return mailbox_shape(1, capacity, 2 * width if fp32_rows else width)
