"""Layout of the routing metadata buffer: one flat int32 buffer, fixed per tile size.

Routing produces, besides the top-k ids and weights, the bookkeeping a grouped expert GEMM needs
to run the routes of one rank expert by expert in tiles of `tile_n` rows. musebench keeps all of
it in a single int32 buffer whose layout depends only on `(tile_n, num_tokens_max, top_k,
num_experts)`, so a kernel can write it into a buffer allocated once (CUDA-graph friendly) for
every batch size up to `num_tokens_max`. The meaning of each field follows the TRT-LLM-gen
routing kernels that FlashInfer ships (see docs/contract-routing.md for the definitions and the
citations); this module only fixes where each field lives.

Layout (all offsets in int32 words, every section starting on a 4-word / 16-byte boundary):

    [HEADER_WORDS]  header
        word 0  padded_row_count  rows of the permuted space in use: sum over local experts of
                                  count rounded up to a multiple of tile_n (stock name:
                                  total_num_padded_tokens / permuted_idx_size)
        word 1  cta_count         tiles in use, padded_row_count / tile_n (stock:
                                  num_non_exiting_ctas)
        word 2  num_tokens        the batch the buffer was written for
        word 3  tile_n            the tile the buffer was written for
    [expanded_capacity]  expanded_to_permuted   route (t, k) at t * top_k + k -> its permuted row,
                                                -1 where the route's expert is not local
    [cta_capacity]       cta_to_expert          tile j -> local expert index (expert - offset)
    [cta_capacity]       cta_row_limit          tile j -> exclusive end of its valid rows, an
                                                absolute row of the permuted space
    [row_capacity]       permuted_to_token      permuted row -> token, -1 on padding rows

Offsets never depend on the batch: they are laid out for `num_tokens_max`. For a batch of
`num_tokens` the *live* part of each section is:

- header: all 4 words;
- expanded_to_permuted: the first num_tokens * top_k words;
- cta_to_expert, cta_row_limit: the first cta_count words;
- permuted_to_token: the first padded_row_count words.

Words outside the live parts are not part of the contract: a kernel need not write them and a
comparison must ignore them (`live_fields`). `fields(num_tokens)` gives each section's offset
and the number of words it can occupy for that batch (exact for the header and
expanded_to_permuted, an upper bound for the CTA tables and the rows).

Capacity bound (the stock's own bound, `Routing::getMaxNumCtasInBatchDim`, mirrored in
flashinfer/fused_moe/trtllm_gen_routing.py `_max_num_ctas_in_batch_dim`): with R = num_tokens *
top_k routes over E experts, at most min(E, R) experts are active and each tile beyond one per
active expert needs tile_n further routes, so cta_count <= min(E, R) + (R - min(E, R)) // tile_n
and padded_row_count <= that * tile_n. For Muse Spark (b <= 8, top-8, 256 experts) R <= 64 <= E,
so the bound is 64 tiles and 64 * tile_n rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from musebench import config

HEADER_WORDS = 4
HEADER_PADDED_ROW_COUNT = 0
HEADER_CTA_COUNT = 1
HEADER_NUM_TOKENS = 2
HEADER_TILE_N = 3

TILE_N_MAX = 256
_ALIGN_WORDS = 4  # 16 bytes
_INT32_MAX = 2**31 - 1

FIELD_NAMES = (
    "header",
    "expanded_to_permuted",
    "cta_to_expert",
    "cta_row_limit",
    "permuted_to_token",
)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {bound}, got {value}")
    return value


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def max_cta_count(num_tokens: int, top_k: int, num_experts: int, tile_n: int) -> int:
    """Most tiles any routing of `num_tokens` tokens can need (see the module docstring).

    Contract: integers with num_tokens >= 0, top_k >= 1, num_experts >= 1, tile_n >= 1;
    returns an int >= 0 that no routing exceeds. ValueError on bad arguments.
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("top_k", top_k, 1)
    _check_int("num_experts", num_experts, 1)
    _check_int("tile_n", tile_n, 1)
    routes = num_tokens * top_k
    active = min(num_experts, routes)
    return active + (routes - active) // tile_n


@dataclass(frozen=True)
class RoutingMetadata:
    """The fixed layout for one (tile_n, num_tokens_max, top_k, num_experts).

    Contract:
    - construction validates: tile_n in [1, 256], num_tokens_max >= 1, num_experts >= 1,
      top_k in [1, num_experts], and the whole buffer addressable with int32 (ValueError);
    - `size` is the buffer length in int32 words; every section lies inside [0, size) and the
      sections do not overlap; offsets are multiples of 4 words;
    - `fields(num_tokens)` -> {name: (offset, length)}, offsets independent of num_tokens;
    - `live_fields(buffer)` -> {name: int32 tensor view}, exactly the words a writer must
      produce, read back from the header.
    """

    tile_n: int
    num_tokens_max: int = config.MAX_DECODE_TOKENS
    top_k: int = config.TOP_K
    num_experts: int = config.NUM_EXPERTS

    def __post_init__(self) -> None:
        _check_int("tile_n", self.tile_n, 1, TILE_N_MAX)
        _check_int("num_tokens_max", self.num_tokens_max, 1)
        _check_int("num_experts", self.num_experts, 1)
        _check_int("top_k", self.top_k, 1, self.num_experts)
        if self.size > _INT32_MAX:
            raise ValueError(f"metadata of {self.size} words is not addressable with int32 indices")

    # -- capacities -------------------------------------------------------------------------

    @property
    def expanded_capacity(self) -> int:
        """Words reserved for expanded_to_permuted (num_tokens_max * top_k, 16-byte aligned)."""
        return _round_up(self.num_tokens_max * self.top_k, _ALIGN_WORDS)

    def max_ctas(self, num_tokens: int | None = None) -> int:
        """Tile bound for a batch of num_tokens (default: num_tokens_max)."""
        n = self.num_tokens_max if num_tokens is None else self._check_tokens(num_tokens)
        return max_cta_count(n, self.top_k, self.num_experts, self.tile_n)

    def max_padded_rows(self, num_tokens: int | None = None) -> int:
        """Row bound of the permuted space for a batch of num_tokens (default: num_tokens_max)."""
        return self.max_ctas(num_tokens) * self.tile_n

    @property
    def cta_capacity(self) -> int:
        """Words reserved for each CTA table (16-byte aligned)."""
        return _round_up(self.max_ctas(), _ALIGN_WORDS)

    @property
    def row_capacity(self) -> int:
        """Words reserved for permuted_to_token (16-byte aligned)."""
        return _round_up(self.max_padded_rows(), _ALIGN_WORDS)

    # -- offsets ----------------------------------------------------------------------------

    @property
    def offsets(self) -> dict[str, int]:
        """Word offset of every section (independent of the batch)."""
        expanded = HEADER_WORDS
        cta_to_expert = expanded + self.expanded_capacity
        cta_row_limit = cta_to_expert + self.cta_capacity
        permuted_to_token = cta_row_limit + self.cta_capacity
        return {
            "header": 0,
            "expanded_to_permuted": expanded,
            "cta_to_expert": cta_to_expert,
            "cta_row_limit": cta_row_limit,
            "permuted_to_token": permuted_to_token,
        }

    @property
    def size(self) -> int:
        """Buffer length in int32 words."""
        return HEADER_WORDS + self.expanded_capacity + 2 * self.cta_capacity + self.row_capacity

    def _check_tokens(self, num_tokens: int) -> int:
        return _check_int("num_tokens", num_tokens, 0, self.num_tokens_max)

    def fields(self, num_tokens: int) -> dict[str, tuple[int, int]]:
        """{name: (offset, length)} for a batch of num_tokens (0 <= num_tokens <= num_tokens_max).

        Lengths: header 4; expanded_to_permuted num_tokens * top_k (exact); the CTA tables
        max_ctas(num_tokens) and permuted_to_token max_padded_rows(num_tokens) (upper bounds;
        the live lengths are cta_count and padded_row_count from the header).
        """
        self._check_tokens(num_tokens)
        off = self.offsets
        ctas = self.max_ctas(num_tokens)
        return {
            "header": (off["header"], HEADER_WORDS),
            "expanded_to_permuted": (off["expanded_to_permuted"], num_tokens * self.top_k),
            "cta_to_expert": (off["cta_to_expert"], ctas),
            "cta_row_limit": (off["cta_row_limit"], ctas),
            "permuted_to_token": (off["permuted_to_token"], ctas * self.tile_n),
        }

    def live_fields(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the live words of a written buffer, sized from its header.

        ValueError if the buffer is not a 1-D int32 tensor of `size` words or if its header is
        inconsistent with this layout (tile_n, a batch above num_tokens_max, a cta_count above
        the bound, padded_row_count != cta_count * tile_n).
        """
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.int32 or buffer.dim() != 1:
            raise ValueError("the metadata buffer must be a 1-D int32 tensor")
        if buffer.numel() != self.size:
            raise ValueError(f"the metadata buffer must hold {self.size} words, got {buffer.numel()}")
        header = [int(v) for v in buffer[:HEADER_WORDS].tolist()]
        padded, ctas, tokens, tile = (
            header[HEADER_PADDED_ROW_COUNT],
            header[HEADER_CTA_COUNT],
            header[HEADER_NUM_TOKENS],
            header[HEADER_TILE_N],
        )
        if tile != self.tile_n:
            raise ValueError(f"header tile_n {tile} != layout tile_n {self.tile_n}")
        if not 0 <= tokens <= self.num_tokens_max:
            raise ValueError(f"header num_tokens {tokens} outside [0, {self.num_tokens_max}]")
        if not 0 <= ctas <= self.max_ctas(tokens):
            raise ValueError(f"header cta_count {ctas} outside [0, {self.max_ctas(tokens)}]")
        if padded != ctas * self.tile_n:
            raise ValueError(f"header padded_row_count {padded} != cta_count {ctas} * tile_n {self.tile_n}")
        off = self.offsets
        return {
            "header": buffer[:HEADER_WORDS],
            "expanded_to_permuted": buffer[off["expanded_to_permuted"] : off["expanded_to_permuted"] + tokens * self.top_k],
            "cta_to_expert": buffer[off["cta_to_expert"] : off["cta_to_expert"] + ctas],
            "cta_row_limit": buffer[off["cta_row_limit"] : off["cta_row_limit"] + ctas],
            "permuted_to_token": buffer[off["permuted_to_token"] : off["permuted_to_token"] + padded],
        }


def metadata_size(
    tile_n: int,
    num_tokens_max: int = config.MAX_DECODE_TOKENS,
    top_k: int = config.TOP_K,
    num_experts: int = config.NUM_EXPERTS,
) -> int:
    """Length in int32 words of the metadata buffer for this layout (ValueError on bad args)."""
    return RoutingMetadata(tile_n, num_tokens_max, top_k, num_experts).size
