"""The read floor: a plain streaming read of a buffer's bytes by a Triton kernel written by
musebench, the least a kernel that must read those bytes can cost as the benches time it.

Who calls it: `musebench bench attn` and `bench front` time `FloorRead` beside the kernel, over the
kernel's own byte count (`cases.attn2.baselines`' and `cases.qkv_front.baselines`' `read floor`
columns, READ_FLOOR: kernel / floor is a same-run ratio; built by `checked_floor`);
`scripts/read-floor.py` sweeps `ReaderConfig`s, each a `FloorRead.over` its copies, and checks
each with `check_partials`.

The reader (`triton_read`): `programs` persistent programs stride the buffer's int32 words in
chunks of `ReaderConfig.chunk_words` (loads_in_flight x num_warps x 32 threads x 4 words: every
thread issues loads_in_flight 16-byte loads a chunk, all in flight before their adds), add them
into an int32 vector and store one wrapped int32 sum a program into `partials`; the last, partial
chunk is read masked. The partials' sum mod 2^32 equals the buffer's int32 words summed mod 2^32
(`check_partials`): a reader that skips a word of random data fails that check (up to a 2^-32
coincidence).

FLOOR_CONFIG, the one configuration the benches use: 4 programs an SM x 8 warps x 4 loads in
flight. The H200 sweep of records/2026-12-02-h200-081ea38-read-floor.json (24 configurations x
qkv_front's weights 18.9 / 37.7 / 75.5 MB and attn2's K + V at 128k 33.6 / 67.1 MB, cold and
warm) puts it within 2.5 % of that point's best at all ten points (cold 6.41 / 10.73 / 18.98 /
9.66 / 17.23 µs against the best 6.31 / 10.47 / 18.92 / 9.56 / 17.09; warm 3.93 / 5.97 / 19.06 /
5.52 / 17.17 against 3.89 / 5.97 / 18.89 / 5.52 / 17.12); the runners-up were 8 an SM x 4 warps
x 4 loads (within 4.3 %: 4.05 µs warm at 18.9 MB) and 8 an SM x 8 warps x 4 loads (within 9.4 %:
6.53 µs warm at 37.7 MB).

Contract: a buffer of `nbytes` bytes, a positive multiple of 16 (the reader's 16-byte loads) and at
most 2^32 (its int32 word offsets), read as an int32 view, contiguous and 16-byte aligned; one
launch reads every byte once and writes int32 [programs] partials; no host read of device data
(graph-capturable once compiled; Triton compiles on the first call: call eagerly before a capture).
Triton is imported inside the functions: this module imports on a host without Triton. A reference:
it imports nothing from musebench.kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

VECTOR_BYTES = 16  # one 128-bit load per thread and chunk step
WORD_BYTES = 4  # the reader sums int32 words
WORDS_PER_VECTOR = VECTOR_BYTES // WORD_BYTES
THREADS_PER_WARP = 32
MAX_BYTES = 1 << 32  # int32 word offsets inside the reader stay below 2^31
WRAP = 1 << 32
READ_FLOOR = "read floor"  # the benches' column of a FloorRead (attn2's and qkv_front's baselines)


@dataclass(frozen=True)
class ReaderConfig:
    """One reader configuration: programs_per_sm x SMs persistent programs of num_warps warps,
    each thread loading loads_in_flight 16-byte vectors a chunk (loads_in_flight and num_warps
    powers of two: Triton's block is one)."""

    programs_per_sm: int
    loads_in_flight: int
    num_warps: int

    @property
    def chunk_words(self) -> int:
        """int32 words one program reads a chunk (a power of two)."""
        return self.loads_in_flight * self.num_warps * THREADS_PER_WARP * WORDS_PER_VECTOR

    def name(self) -> str:
        return f"triton {self.programs_per_sm}/SM x {self.num_warps} warps x {self.loads_in_flight} loads"


FLOOR_CONFIG = ReaderConfig(programs_per_sm=4, loads_in_flight=4, num_warps=8)  # the module docstring's numbers


def check_nbytes(nbytes: int) -> None:
    """ValueError with the reason where the reader cannot read `nbytes` bytes exactly."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0 or nbytes % VECTOR_BYTES:
        raise ValueError(f"the read floor reads a positive multiple of {VECTOR_BYTES} bytes (16-byte loads), "
                         f"got {nbytes!r}")
    if nbytes > MAX_BYTES:
        raise ValueError(f"the read floor reads at most {MAX_BYTES} bytes (int32 word offsets), got {nbytes}")


def wrapped(total: int) -> int:
    """An integer sum as the reader's int32 arithmetic leaves it: mod 2^32, in [0, 2^32)."""
    return total % WRAP


def words_total(words: torch.Tensor) -> int:
    """The exact sum of an int32 tensor's words (int64 accumulation: exact up to 2^32 words)."""
    return int(words.sum(dtype=torch.int64))


def check_partials(partials: torch.Tensor, expected_total: int, what: str) -> None:
    """The reader's per-program int32 sums (any int tensor) must add, mod 2^32, to the buffer's
    int32 words summed (`expected_total`, exact); RuntimeError naming `what` otherwise."""
    got = wrapped(int(partials.long().sum()))
    if got != wrapped(expected_total):
        raise RuntimeError(f"{what}: the programs' sums add to {got} mod 2^32, the buffer's words to "
                           f"{wrapped(expected_total)}: the reader did not read every byte once")


def reader_programs(device: torch.device, config: ReaderConfig = FLOOR_CONFIG) -> int:
    """The reader's grid on `device`: programs_per_sm x its SMs (a CUDA device), programs_per_sm
    elsewhere (Triton's interpreter and the CPU tests count one SM)."""
    if device.type != "cuda":
        return config.programs_per_sm
    return config.programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _reader_kernel() -> Any:
    """Define the Triton streaming reader on first use (Triton is imported lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read_words(words_ptr, partials_ptr, num_words, CHUNK: tl.constexpr):
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        lanes = tl.arange(0, CHUNK)
        acc = tl.zeros([CHUNK], dtype=tl.int32)
        full_chunks = num_words // CHUNK
        for chunk in range(program, full_chunks, programs):  # unmasked: 16-byte vector loads
            acc += tl.load(words_ptr + chunk * CHUNK + lanes)
        for chunk in range(full_chunks + program, tl.cdiv(num_words, CHUNK), programs):  # the last, partial chunk
            offsets = chunk * CHUNK + lanes
            acc += tl.load(words_ptr + offsets, mask=offsets < num_words, other=0)
        tl.store(partials_ptr + program, tl.sum(acc, axis=0))

    return _read_words


def triton_read(words: torch.Tensor, partials: torch.Tensor, config: ReaderConfig) -> None:
    """Launch the reader over `words` (int32, contiguous, 16-byte aligned) on the current stream:
    partials (int32 [programs], any count of programs) receives one wrapped sum per program.
    Graph-capturable once compiled (the first call of a config compiles)."""
    _reader_kernel()[(partials.numel(),)](words, partials, words.numel(), CHUNK=config.chunk_words,
                                          num_warps=config.num_warps)


class FloorRead:
    """A bench path: each call reads, with `triton_read` and `config`, the next of `count` buffers
    of `nbytes` random bytes each on `device` (call j: buffer j mod count, counted from the first
    call; count 1: the same buffer every call, L2-resident across a graph's calls where it fits),
    into partials of its own (int32 [count, programs]). Allocates nothing per call
    (graph-capturable once `check` has compiled it). The buffers are separate allocations,
    random int32 words (from `generator`, or seed 0), so a skipped word changes the sum
    (`FloorRead.over`: the caller's buffers instead)."""

    def __init__(self, nbytes: int, device: torch.device, count: int = 1, config: ReaderConfig = FLOOR_CONFIG,
                 generator: torch.Generator | None = None) -> None:
        check_nbytes(nbytes)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"the read floor reads at least one buffer, got count {count!r}")
        device = torch.device(device)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(0)
        buffers = [torch.randint(-2 ** 31, 2 ** 31, (nbytes // WORD_BYTES,), dtype=torch.int32, device=device,
                                 generator=generator) for _ in range(count)]
        self._hold(buffers, [words_total(words) for words in buffers], config)

    @classmethod
    def over(cls, buffers: list[torch.Tensor], totals: list[int], config: ReaderConfig = FLOOR_CONFIG) -> FloorRead:
        """A floor over the caller's buffers (int32, 1-D, contiguous, the same byte count, one
        device; call j reads buffer j mod len(buffers)) whose exact word sums are `totals`
        (`words_total`), with partials of its own: scripts/read-floor.py times many configurations
        over one set of copies. ValueError with the reason where the buffers break that contract."""
        if not buffers or len(totals) != len(buffers):
            raise ValueError(f"the read floor reads at least one buffer and knows each one's total, got "
                             f"{len(buffers)} buffers and {len(totals)} totals")
        first = buffers[0]
        for words in buffers:
            if (words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous()
                    or words.numel() != first.numel() or words.device != first.device):
                raise ValueError(f"the read floor reads contiguous 1-D int32 buffers of one size on one device, got "
                                 f"{words.dtype} {tuple(words.shape)} on {words.device} beside {tuple(first.shape)} "
                                 f"on {first.device}")
        check_nbytes(first.numel() * WORD_BYTES)
        floor = cls.__new__(cls)
        floor._hold(list(buffers), list(totals), config)
        return floor

    def _hold(self, buffers: list[torch.Tensor], totals: list[int], config: ReaderConfig) -> None:
        self.nbytes, self.config = buffers[0].numel() * WORD_BYTES, config
        self.buffers, self.totals = buffers, totals
        self.partials = torch.zeros(len(buffers), reader_programs(buffers[0].device, config), dtype=torch.int32,
                                    device=buffers[0].device)
        self.turn = 0

    def __call__(self) -> None:
        j = self.turn % len(self.buffers)
        self.turn += 1
        triton_read(self.buffers[j], self.partials[j], self.config)

    def check(self, what: str = "read floor") -> None:
        """One eager read of every buffer (compiling the reader before any capture), each checked
        (`check_partials`): RuntimeError naming `what` and the buffer where the reader skipped a
        byte. Leaves the rotation at its start."""
        for j, words in enumerate(self.buffers):
            self.partials[j].zero_()
            triton_read(words, self.partials[j], self.config)
        if self.partials.is_cuda:
            torch.cuda.synchronize(self.partials.device)
        for j, total in enumerate(self.totals):
            check_partials(self.partials[j], total, f"{what}, {self.nbytes} B, buffer {j} of {len(self.buffers)}")
        self.turn = 0


def checked_floor(nbytes: int, device: torch.device, what: str, count: int = 1) -> FloorRead:
    """A bench's floor: `FloorRead(nbytes, device, count)` (FLOOR_CONFIG), checked once eagerly
    (`FloorRead.check(what)`: compiles the reader before any capture; RuntimeError naming `what`
    where it skipped a byte), returned ready to time. Called by cases.attn2 and cases.qkv_front's
    `baselines`."""
    floor = FloorRead(nbytes, device, count=count)
    floor.check(what)
    return floor


__all__ = ["FLOOR_CONFIG", "READ_FLOOR", "FloorRead", "ReaderConfig", "check_nbytes", "check_partials",
           "checked_floor", "reader_programs", "triton_read", "words_total", "wrapped"]
