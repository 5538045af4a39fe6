"""The TRT-LLM-gen routing metadata as a separate pass after the stock router: what a deployment
without musebench's fused router runs, the baseline of `musebench bench routing`.

`triton_metadata(ids, out, ...)` is one Triton program (written by musebench from the metadata's
definition in `musebench.stock.routing`, nothing copied) that reads the router's ids [b, top_k]
and writes the live words of `musebench.routing_metadata.RoutingMetadata` for one rank's local
experts; `metadata_pass_torch` is its step-for-step twin in torch (the same broadcast
compares, cumsum and masked stores), which is what the CPU tests check against
`routing_metadata_reference`.

Algorithm (b <= 8 tokens, so at most 64 routes and at most 8 routes of one expert):
- route r < b * top_k is local when its expert e_r lies in [offset, offset + count);
- its rank: the local routes before it with the same expert (route order = token order);
- per expert: count of local routes, tiles = ceil(count / tile_n), first tile = exclusive
  cumsum of tiles over the experts in index order; cta_count and padded = cta_count * tile_n;
- expanded_to_permuted[r] = first_tile[e_r] * tile_n + rank (-1: not local);
- tile first_tile[e] + j (j < tiles[e]): cta_to_expert = e - offset, cta_row_limit =
  min((tile + 1) * tile_n, first_tile[e] * tile_n + count[e]);
- permuted_to_token[0, padded) = -1, then row expanded_to_permuted[r] = r // top_k (after a CTA
  barrier, so the token wins over the padding fill).
Words past the live ones are not written.

Triton is imported inside the functions: this module imports on a CPU-only host. Bit-equality with
the reference is checked by tests/stock/test_triton_metadata.py: the twin on CPU, the kernel in
Triton's CPU interpreter where Triton imports (2026-11-29, Triton 3.6: 240 cases exact, dead
words and a guard untouched), and compiled on the H200 (2026-11-29, commit 06837f0: 160 cases
exact, records/2026-11-29-h200-pytest-gpu-routing.summary.json). Not tuned: one program of 8 warps, 6.5-7.0 µs
inside the GPU under ncu and 8.5-8.8 µs with the stock router in `bench routing`, an upper bound
for such a separate pass, not a claim about the best one.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from musebench import config
from musebench.routing_metadata import (
    HEADER_CTA_COUNT,
    HEADER_NUM_TOKENS,
    HEADER_PADDED_ROW_COUNT,
    HEADER_TILE_N,
    RoutingMetadata,
)

MAX_ROUTES = config.MAX_DECODE_TOKENS * config.TOP_K  # 64: the decode batch's routes
MAX_TILES_PER_EXPERT = config.MAX_DECODE_TOKENS  # an expert appears at most once per token
ROW_BLOCK = 1024  # permuted_to_token words filled per step
NUM_WARPS = 8
if RoutingMetadata(1).offsets["header"] != 0 or (
        HEADER_PADDED_ROW_COUNT, HEADER_CTA_COUNT, HEADER_NUM_TOKENS, HEADER_TILE_N) != (0, 1, 2, 3):
    raise ImportError("the Triton metadata kernel writes the header as words 0..3 in layout order")


def _check(ids: torch.Tensor, out: torch.Tensor, local_expert_offset: int, num_local_experts: int,
           tile_n: int) -> RoutingMetadata:
    layout = RoutingMetadata(tile_n)
    if ids.dtype != torch.int32 or ids.dim() != 2 or ids.shape[1] != config.TOP_K or not ids.is_contiguous():
        raise ValueError(f"ids must be contiguous int32 [b, {config.TOP_K}], got {ids.dtype} {tuple(ids.shape)}")
    if not 0 <= ids.shape[0] <= config.MAX_DECODE_TOKENS:
        raise ValueError(f"{ids.shape[0]} tokens outside 0..{config.MAX_DECODE_TOKENS}")
    if out.dtype != torch.int32 or out.dim() != 1 or out.numel() < layout.size or out.device != ids.device:
        raise ValueError(f"out must be int32 [>= {layout.size}] on {ids.device}")
    if not (0 <= local_expert_offset and 1 <= num_local_experts
            and local_expert_offset + num_local_experts <= config.NUM_EXPERTS):
        raise ValueError(f"local experts [{local_expert_offset}, {local_expert_offset + num_local_experts}) "
                         f"outside [0, {config.NUM_EXPERTS})")
    return layout


def metadata_pass_torch(ids: torch.Tensor, out: torch.Tensor, *, local_expert_offset: int, num_local_experts: int,
                        tile_n: int) -> torch.Tensor:
    """The Triton pass's steps in torch on `ids`' device (fixed shapes; the twin the CPU tests
    check). Writes the live words of `out` and returns it."""
    layout = _check(ids, out, local_expert_offset, num_local_experts, tile_n)
    device = ids.device
    num_tokens, top_k = ids.shape
    offsets = layout.offsets
    routes = torch.arange(MAX_ROUTES, device=device)
    live = routes < num_tokens * top_k
    expert_of_route = torch.full((MAX_ROUTES,), -1, dtype=torch.int64, device=device)
    expert_of_route[: num_tokens * top_k] = ids.reshape(-1).long()
    local = live & (expert_of_route >= local_expert_offset) & (expert_of_route < local_expert_offset + num_local_experts)
    earlier_same = ((expert_of_route[:, None] == expert_of_route[None, :]) & (routes[None, :] < routes[:, None])
                    & local[None, :])
    rank = earlier_same.sum(1)
    experts = torch.arange(config.NUM_EXPERTS, device=device)
    counts = ((experts[:, None] == expert_of_route[None, :]) & local[None, :]).sum(1)
    tiles = (counts + tile_n - 1) // tile_n
    first_tile = torch.cumsum(tiles, 0) - tiles
    cta_count = tiles.sum()
    padded = cta_count * tile_n
    first_of_route = ((experts[None, :] == expert_of_route[:, None]).long() * first_tile[None, :]).sum(1)
    row_of_route = first_of_route * tile_n + rank

    header = torch.stack([padded, cta_count, torch.tensor(num_tokens, device=device), torch.tensor(tile_n, device=device)])
    order = [HEADER_PADDED_ROW_COUNT, HEADER_CTA_COUNT, HEADER_NUM_TOKENS, HEADER_TILE_N]
    out[offsets["header"] + torch.tensor(order, device=device)] = header.int()
    expanded = torch.where(local, row_of_route, torch.full_like(row_of_route, -1))
    out[offsets["expanded_to_permuted"] : offsets["expanded_to_permuted"] + num_tokens * top_k] = \
        expanded[: num_tokens * top_k].int()
    j = torch.arange(MAX_TILES_PER_EXPERT, device=device)
    tile = first_tile[:, None] + j[None, :]
    valid = j[None, :] < tiles[:, None]
    limit = torch.minimum((tile + 1) * tile_n, (first_tile * tile_n + counts)[:, None])
    out[offsets["cta_to_expert"] + tile[valid]] = (experts[:, None] - local_expert_offset).expand_as(tile)[valid].int()
    out[offsets["cta_row_limit"] + tile[valid]] = limit[valid].int()
    out[offsets["permuted_to_token"] : offsets["permuted_to_token"] + int(padded)] = -1
    out[offsets["permuted_to_token"] + row_of_route[local]] = (routes[local] // top_k).int()
    return out


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    """Define the Triton kernel on first use (Triton is imported lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _metadata_kernel(
        ids_ptr,
        out_ptr,
        num_routes,
        num_tokens,
        local_expert_offset,
        num_local_experts,
        tile_n,
        expanded_offset,
        cta_to_expert_offset,
        cta_row_limit_offset,
        permuted_to_token_offset,
        TOP_K: tl.constexpr,
        NUM_EXPERTS: tl.constexpr,
        MAX_ROUTES: tl.constexpr,
        MAX_TILES: tl.constexpr,
        ROW_BLOCK: tl.constexpr,
        MAX_ROWS: tl.constexpr,
    ):
        routes = tl.arange(0, MAX_ROUTES)
        live = routes < num_routes
        expert_of_route = tl.load(ids_ptr + routes, mask=live, other=-1)
        local = live & (expert_of_route >= local_expert_offset) & (expert_of_route < local_expert_offset + num_local_experts)
        earlier_same = ((expert_of_route[:, None] == expert_of_route[None, :]) & (routes[None, :] < routes[:, None])
                        & local[None, :])
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)
        experts = tl.arange(0, NUM_EXPERTS)
        counts = tl.sum(((experts[:, None] == expert_of_route[None, :]) & local[None, :]).to(tl.int32), axis=1)
        tiles = (counts + tile_n - 1) // tile_n
        first_tile = tl.cumsum(tiles, axis=0) - tiles
        cta_count = tl.sum(tiles, axis=0)
        padded = cta_count * tile_n
        first_of_route = tl.sum(tl.where(experts[None, :] == expert_of_route[:, None], first_tile[None, :], 0), axis=1)
        row_of_route = first_of_route * tile_n + rank

        slot = tl.arange(0, 4)
        header = tl.where(slot == 0, padded, tl.where(slot == 1, cta_count, tl.where(slot == 2, num_tokens, tile_n)))
        tl.store(out_ptr + slot, header)
        tl.store(out_ptr + expanded_offset + routes, tl.where(local, row_of_route, -1), mask=live)
        j = tl.arange(0, MAX_TILES)
        tile = first_tile[:, None] + j[None, :]
        valid = j[None, :] < tiles[:, None]
        limit = tl.minimum((tile + 1) * tile_n, (first_tile * tile_n + counts)[:, None])
        owner = experts[:, None] - local_expert_offset + j[None, :] * 0
        tl.store(out_ptr + cta_to_expert_offset + tile, owner, mask=valid)
        tl.store(out_ptr + cta_row_limit_offset + tile, limit, mask=valid)
        for start in tl.static_range(0, MAX_ROWS, ROW_BLOCK):  # the layout's bound on padded, masked to it
            rows = start + tl.arange(0, ROW_BLOCK)
            tl.store(out_ptr + permuted_to_token_offset + rows, tl.full([ROW_BLOCK], -1, tl.int32), mask=rows < padded)
        tl.debug_barrier()  # the padding fill is ordered before the routed rows (bar.sync)
        tl.store(out_ptr + permuted_to_token_offset + row_of_route, routes // TOP_K, mask=local)

    return _metadata_kernel


def triton_metadata(ids: torch.Tensor, out: torch.Tensor, *, local_expert_offset: int, num_local_experts: int,
                    tile_n: int) -> torch.Tensor:
    """One launch on the current stream: the live words of `out` (int32, at least
    `RoutingMetadata(tile_n).size` words) for the router's `ids` (int32 [b, top_k], b <= 8).
    Graph-capturable once compiled (call it once before capture); allocates nothing. Returns `out`."""
    layout = _check(ids, out, local_expert_offset, num_local_experts, tile_n)
    offsets = layout.offsets
    num_tokens = ids.shape[0]
    _kernel()[(1,)](
        ids, out, num_tokens * config.TOP_K, num_tokens, local_expert_offset, num_local_experts, tile_n,
        offsets["expanded_to_permuted"], offsets["cta_to_expert"], offsets["cta_row_limit"],
        offsets["permuted_to_token"],
        TOP_K=config.TOP_K, NUM_EXPERTS=config.NUM_EXPERTS, MAX_ROUTES=MAX_ROUTES, MAX_TILES=MAX_TILES_PER_EXPERT,
        ROW_BLOCK=ROW_BLOCK, MAX_ROWS=layout.max_padded_rows(), num_warps=NUM_WARPS,
    )
    return out
