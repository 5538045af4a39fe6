"""wgmma's shared-memory side on sm_90a: the 64-bit matrix descriptor and the page layout attn2's
wgmma path reads K and V in (pure Python; the kernels add the runtime start address).

The descriptor (PTX ISA, "Matrix Descriptor Format" of the asynchronous warpgroup MMA):

| bits  | field                                   |
| ----- | --------------------------------------- |
| 0-13  | start address >> 4 (of the 18-bit shared address) |
| 16-29 | leading dimension byte offset (LBO) >> 4 |
| 32-45 | stride dimension byte offset (SBO) >> 4  |
| 49-51 | base offset (0 when each swizzle atom starts 1024-byte aligned) |
| 62-63 | layout type: 0 none (interleave), 1 128-byte swizzle, 2 64-byte, 3 32-byte |

The 128-byte swizzle is a function of the shared-memory address itself: the 16-byte chunk bits
4-6 are XORed with the row bits 7-9 (CuTe's Swizzle<3,4,3>), so an atom is 8 rows of 128 bytes
at a 1024-byte aligned address, and chunk j of row r lies at chunk j ^ (r & 7). Because the XOR
is applied to the final address, a descriptor may start inside an atom (32 bytes further for
the next k16 step of a K-major operand) and the hardware still finds every chunk.

The page layout (one 4 KB stage of attn2's ring; `page_offset`): the cache's page is 16 slots
(keys) x 256 bytes = K (64 BF16) | V (64 BF16). In shared memory K and V become two regions of 16
rows x 128 bytes, K at 0 and V at 2048 (each 1024-byte aligned when the stage is), key r in row r,
16-byte chunk j of its K (dims 8 j .. 8 j + 7) at chunk j ^ (r & 7) of row r of the K region,
chunk j of its V likewise in the V region: cp.async moves chunk c of slot s (c < 8: K, else V) to
`page_offset(s, c)`.

The two descriptors, from the canonical layouts CUTLASS documents beside `make_gmma_desc`
(cute/atom/mma_traits_sm90_gmma.hpp, in 16-byte units; T = 8 BF16 per chunk):

(a) S = Q K^T, B = K^T (k = dims, n = keys) stored K-major ([key][dim], dims contiguous):
    128-byte swizzle K-major is ((8, n), 2) : ((8, SBO), 1): 8 rows (n) 128 bytes apart inside an
    atom, groups of 8 rows SBO apart, and the k16 slice's 2 chunks adjacent (the 1 in that layout
    is fixed by the swizzle mode, so LBO is not read: CUTLASS writes 1 there, and so do we). N = 16
    keys = two 8-row groups, the second 1024 bytes on: SBO = 1024. Step kk (dims 16 kk ..) starts
    32 kk bytes into the K region: the swizzle of the absolute address puts chunk 2 kk + i of row r
    at (2 kk + i) ^ (r & 7), which is where cp.async put it.
(b) P V, B = V (k = keys, n = dims) stored [key][dim], dims contiguous: N-major, transpose-b = 1.
    128-byte swizzle MN-major is ((8, n), (8, k)) : ((1, LBO), (8, SBO)): 8 chunks of 8 dims
    contiguous (one 128-byte row = 64 dims = all of N), 8 keys 128 bytes apart, groups of 8 keys
    SBO apart, groups of 64 dims LBO apart. N = 64 is one atom wide, so LBO is not read (we write
    the 2048 a second 64-dim block would sit at if the region were wider: an honest value, never
    used); K = 16 keys = two 8-row groups: SBO = 1024.

Facts taken from CUTLASS's comments and code (read, not copied) and the PTX ISA's descriptor table;
a GPU probe (`kernels.gmma_probe`, tests/kernels/test_gmma_probe_gpu.py) checks them: wgmma with
these descriptors against mma.sync reading the same shared memory, bit for bit, and a wrong SBO
or a missing swizzle must break that agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_BYTES = 4096
PAGE_SLOTS = 16  # keys of a page
ROW_BYTES = 128  # 64 BF16: one key's K, or its V
CHUNK_BYTES = 16
CHUNKS_PER_ROW = ROW_BYTES // CHUNK_BYTES  # 8
SLOT_CHUNKS = 2 * CHUNKS_PER_ROW  # 16: K then V in the cache's 256-byte slot
SWIZZLE_ROWS = 8  # rows of a 128-byte swizzle atom
ATOM_BYTES = SWIZZLE_ROWS * ROW_BYTES  # 1024
K_REGION = 0
V_REGION = PAGE_SLOTS * ROW_BYTES  # 2048
K_STEP_BYTES = 32  # 16 BF16 of k: the start address advance of one k16 step of a K-major operand

LAYOUT_NONE = 0
LAYOUT_SWIZZLE_128B = 1
LAYOUT_SWIZZLE_64B = 2
LAYOUT_SWIZZLE_32B = 3
ADDRESS_LIMIT = 1 << 18  # shared-memory addresses the 14-bit field (>> 4) can hold
FIELD_MASK = (1 << 14) - 1


def page_offset(slot: int, chunk: int) -> int:
    """Byte offset in a 4 KB stage of 16-byte chunk `chunk` (0..15 of the cache's 256-byte slot:
    0-7 K, 8-15 V) of key `slot` (0..15): the region (K at 0, V at 2048), row `slot`, chunk
    (chunk % 8) ^ (slot & 7). Works on ints and on DSL Int32 values alike (the kernel's cp.async
    destination)."""
    region = (chunk // CHUNKS_PER_ROW) * V_REGION
    return region + slot * ROW_BYTES + ((chunk % CHUNKS_PER_ROW) ^ (slot % SWIZZLE_ROWS)) * CHUNK_BYTES


def _field(name: str, byte_value: int) -> int:
    if byte_value < 0 or byte_value % CHUNK_BYTES or (byte_value >> 4) > FIELD_MASK:
        raise ValueError(f"{name} must be a multiple of 16 in [0, {FIELD_MASK << 4}], got {byte_value}")
    return byte_value >> 4


@dataclass(frozen=True)
class SharedDescriptor:
    """A wgmma shared-memory matrix descriptor without its start address (a compile-time value);
    `encode(start)` adds it. Byte offsets as bytes (multiples of 16)."""

    leading_byte_offset: int
    stride_byte_offset: int
    layout: int = LAYOUT_SWIZZLE_128B
    base_offset: int = 0

    def __post_init__(self) -> None:
        _field("leading_byte_offset", self.leading_byte_offset)
        _field("stride_byte_offset", self.stride_byte_offset)
        if self.layout not in (LAYOUT_NONE, LAYOUT_SWIZZLE_128B, LAYOUT_SWIZZLE_64B, LAYOUT_SWIZZLE_32B):
            raise ValueError(f"layout must be 0..3, got {self.layout}")
        if not 0 <= self.base_offset < 8:
            raise ValueError(f"base_offset must be 0..7, got {self.base_offset}")

    def template(self) -> int:
        """The 64-bit descriptor with start address 0 (as an unsigned Python int)."""
        return (_field("leading_byte_offset", self.leading_byte_offset) << 16
                | _field("stride_byte_offset", self.stride_byte_offset) << 32
                | self.base_offset << 49
                | self.layout << 62)

    def template_signed(self) -> int:
        """`template()` as a signed 64-bit value (what an Int64 constant in a kernel holds)."""
        value = self.template()
        return value - (1 << 64) if value >= 1 << 63 else value

    def encode(self, start: int) -> int:
        """The full descriptor of a matrix at shared address `start` (16-byte aligned, < 2^18)."""
        if start < 0 or start % CHUNK_BYTES or start >= ADDRESS_LIMIT:
            raise ValueError(f"start must be a 16-byte aligned shared address below 2^18, got {start}")
        return self.template() | (start >> 4)


# (a) K^T for S = Q K^T, K-major: LBO not read under the swizzle (1 chunk, as CUTLASS writes it),
# the two 8-key groups one atom apart.
K_MAJOR_KEYS = SharedDescriptor(leading_byte_offset=CHUNK_BYTES, stride_byte_offset=ATOM_BYTES)
# (b) V for P V, N-major (transpose-b = 1): the two 8-key groups one atom apart; LBO (the next
# 64 dims) not read at N = 64.
MN_MAJOR_VALUES = SharedDescriptor(leading_byte_offset=V_REGION, stride_byte_offset=ATOM_BYTES)
# (c) V with an n-tile of ones beside it (N = 72, attn2's P V whose columns 64 .. 71 sum P's rows):
# columns 64 .. 127 would be the second 64-column block, read at start + LBO, so the kernel sets
# LBO per stage to the distance from the stage's V region to one block of BF16 ones (ONES_BYTES,
# 1024-byte aligned, every element 1.0: the swizzle cannot misplace a one). The template's LBO is
# 0; `leading_offset_field` is what a kernel adds.
MN_MAJOR_VALUES_WITH_ONES = SharedDescriptor(leading_byte_offset=0, stride_byte_offset=ATOM_BYTES)
ONES_BYTES = PAGE_SLOTS * ROW_BYTES  # 2048: 16 keys x 64 columns of ones (8 are read)
BF16_ONES_WORD = 0x3F803F80  # two BF16 1.0


def leading_offset_field(byte_offset):
    """The LBO field (bits 16-29) of a descriptor for a leading byte offset `byte_offset`
    (a multiple of 16, below 2^18); works on ints and on DSL Int64 values (a kernel's runtime
    offset)."""
    return (byte_offset >> 4) << 16


def advance_keys_descriptor(stage0_descriptor, step, kk: int):
    """K's descriptor of k16 step `kk` in the stage `step` 16-byte units after stage 0 (whose
    full descriptor is `stage0_descriptor`): the address field moves by the stage and by 32 bytes
    a step; it never carries out of its 14 bits (a shared address >> 4). Ints or DSL Int64."""
    return stage0_descriptor + (step + kk * K_STEP_BYTES // CHUNK_BYTES)


def advance_values_descriptor(stage0_descriptor, step):
    """V-with-ones' descriptor (`MN_MAJOR_VALUES_WITH_ONES`) of the stage `step` 16-byte units
    after stage 0: its V region is that much further and that much nearer the ones block, so the
    address field grows by `step` and the LBO field shrinks by it. Ints or DSL Int64."""
    return stage0_descriptor + step - leading_offset_field(step << 4)


def k_step_start(k_region_start: int, kk: int) -> int:
    """Start address of k16 step `kk` (dims 16 kk .. 16 kk + 15) of the K-major K region."""
    return k_region_start + kk * K_STEP_BYTES


def swizzle_128b(address: int) -> int:
    """The 128-byte swizzle on a shared address (CuTe's Swizzle<3,4,3>): bits 4-6 ^= bits 7-9."""
    return address ^ (((address >> 7) & 7) << 4)


def b_element_address(descriptor: SharedDescriptor, start: int, k: int, n: int, transpose_b: int) -> int:
    """Where wgmma reads element (k, n) of a 16-bit B (k < 16) through `descriptor` at `start`, by
    the canonical layouts of the module docstring (a CPU model of the address generation, for
    tests; 128-byte swizzle only):

    - transpose_b 0 (K-major): row n % 8 of the atom (128 bytes each), group n // 8 at SBO, the
      k-th element of the row at 2 k bytes;
    - transpose_b 1 (N-major): element n % 64 of a row at 2 (n % 64) bytes, 64-column blocks at
      LBO, row k % 8 (128 bytes each), group k // 8 at SBO.

    Then the swizzle of the absolute address (atoms 1024-byte aligned, base offset 0)."""
    if descriptor.layout != LAYOUT_SWIZZLE_128B or descriptor.base_offset:
        raise ValueError("only the 128-byte swizzle with base offset 0 is modelled")
    element = 2  # BF16
    if transpose_b == 0:
        linear = start + (n % 8) * ROW_BYTES + (n // 8) * descriptor.stride_byte_offset + k * element
    else:
        per_row = ROW_BYTES // element  # 64
        linear = (start + (n // per_row) * descriptor.leading_byte_offset + (n % per_row) * element
                  + (k % 8) * ROW_BYTES + (k // 8) * descriptor.stride_byte_offset)
    return swizzle_128b(linear)
