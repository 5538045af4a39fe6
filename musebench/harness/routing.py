"""Routing cases (GPU): every rank routes the same logits for its own local expert range.

Per case and rank (virtual ranks on one GPU): `musebench.kernels.routing.route` writes ids,
weights and the rank's TRT-LLM-gen metadata into a buffer poisoned one word past
`metadata_size(tile)`; the checks are raw bits: ids and weights identical on every rank and
equal to the project's Triton stock (`stock.triton_routing`) and to the reference with the
hardware's approximations; each rank's live metadata words equal to
`pack_metadata(routing_metadata_reference(ids, ...))`; the guard word untouched.

Faults (`driver.Faults`, `--inject`), to prove the checks fail when they must: `flip:R` flips one
bit of rank R's weights (host copy), `silent:R` never launches rank R (its outputs keep the poison,
named in the row's error), `hang:R` holds rank R's stream busy `timeout_s` + 1 s before its kernel
(`driver.hold_current_stream`), which the bounded wait (`wait_for_device`) reports instead of waiting.

`bench_routing` times, by the CUDA-graph method of `harness.bench` (20 back-to-back calls per
graph, median of 30 replays), the kernel alone, the kernel with metadata, the Triton stock, and
the Triton stock followed by the Triton metadata pass.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from musebench import config
from musebench import numerics as nx
from musebench.harness import checks
from musebench.harness.bench import BenchOptions, graph_median_us
from musebench.harness.cases import expert_owner
from musebench.harness.driver import Faults, hold_current_stream
from musebench.harness.results import CaseResult, RankResult

POISON_WORD = -0x2A2A2A2B  # 0xD5D5D5D5: a word no metadata field holds
ROUTE_SCALE = 2.5
DEFAULT_TIMEOUT_S = 10.0  # a routing call takes microseconds; this bounds a kernel that never ends
ROUTING_FAULTS = ("flip", "silent", "hang")


class RoutingTimeout(RuntimeError):
    pass


def validate_routing_faults(faults: Faults, tp: int) -> None:
    """ValueError, before anything launches, for a fault routing cannot inject or a rank >= tp."""
    unsupported = [kind for kind in faults.kinds() if kind not in ROUTING_FAULTS]
    if unsupported:
        raise ValueError(f"routing injects only {', '.join(ROUTING_FAULTS)} faults, not {', '.join(unsupported)}")
    if faults.max_rank() >= tp:
        raise ValueError(f"a fault names rank {faults.max_rank()}, but tp is {tp}")


def wait_for_device(event, timeout_s: float, what: str, poll_s: float = 1e-4) -> None:
    """Wait for a recorded CUDA event at most `timeout_s`; RoutingTimeout naming `what` after that.

    Host side only: the routing kernel has no device spin-wait, so a kernel that never ends (or a
    stream held busy) is the one way a routing case could hang, and this bounds it.
    """
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise RoutingTimeout(f"{what} did not finish within {timeout_s:g} s")
        time.sleep(poll_s)


@dataclass(frozen=True)
class RoutingCase:
    tp: int
    tokens: int
    tile_n: int = 8
    renormalize: bool = True
    inputs: str = "random"
    seed: int = 0

    def label(self) -> str:
        norm = "renorm" if self.renormalize else "raw"
        return f"routing tp={self.tp} b={self.tokens} tile={self.tile_n} {norm} {self.inputs} seed={self.seed}"


def local_experts(rank: int, tp: int, num_experts: int = config.NUM_EXPERTS) -> tuple[int, int]:
    """(offset, count) of rank's contiguous expert range, the EP sharding of the tails' cases."""
    owned = [e for e in range(num_experts) if expert_owner(e, tp, num_experts) == rank]
    return owned[0], len(owned)


def make_routing_inputs(case: RoutingCase) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits fp32 [b, 256], bias fp32 [256]), deterministic in the case, fresh per seed."""
    key = repr((case.tokens, case.inputs, case.seed)).encode()
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)
    logits = torch.randn(case.tokens, config.NUM_EXPERTS, generator=g) * 2
    bias = torch.randn(config.NUM_EXPERTS, generator=g) * 0.05
    if case.inputs == "adversarial":
        logits[0, 10:40] = 1.25  # a 30-way tie: the lowest indices must win
        if case.tokens > 1:
            logits[1, ::2] = float("inf")  # scores of exactly 1.0, tied
            logits[1, 1::2] = float("-inf")
        if case.tokens > 2:
            logits[2] = torch.where(torch.arange(256) % 2 == 0, torch.tensor(-0.0), torch.tensor(0.0))
        if case.tokens > 3:
            bias[200:208] = 1.5  # biases that reorder the top-8 against the scores
            logits[3, 200:208] = -4.0
    return logits.float().contiguous(), bias.float().contiguous()


def _compare(got: torch.Tensor, want: torch.Tensor, rank: int, row: RankResult) -> None:
    count, ulp, first = checks.compare_bits(got.cpu(), want.cpu(), rank=rank)
    row.mismatches += count
    row.max_ulp = max(row.max_ulp, ulp)
    row.first_mismatch = row.first_mismatch or first


def run_routing_case(case: RoutingCase, faults: Faults = Faults(), timeout_s: float = DEFAULT_TIMEOUT_S) -> CaseResult:
    """One case on virtual ranks of the current GPU; never raises (errors land in the row).

    Each rank's kernel is waited for at most `timeout_s`; a rank past it ends the case (the ranks
    after it are not run) with the rank named in the row's error.
    """
    from musebench.kernels.routing import route
    from musebench.routing_metadata import metadata_size  # the layout; route's buffer is one guard word longer
    from musebench.stock.routing import pack_metadata, routing_metadata_reference, routing_reference
    from musebench.stock.triton_routing import triton_routing

    result = CaseResult(
        kernel="routing", mode="routing", tp=case.tp, tokens=case.tokens, weight_dtype="fp32",
        norm="renorm" if case.renormalize else "raw", inputs=case.inputs, seed=case.seed, backend="cute",
        launcher="virtual", transport="local", stock="triton", stock_path=f"triton + reference metadata, tile {case.tile_n}",
        iters=1,
    )
    try:
        validate_routing_faults(faults, case.tp)
        device = torch.device("cuda", torch.cuda.current_device())
        logits, bias = (t.to(device) for t in make_routing_inputs(case))
        stock_ids, stock_weights = triton_routing(logits, bias, route_scale=ROUTE_SCALE, renormalize=case.renormalize)
        ref_ids, ref_weights = routing_reference(logits, bias, route_scale=ROUTE_SCALE, renormalize=case.renormalize,
                                                 approximations=nx.hardware_approximations())
        stock_ids, stock_weights, ref_ids, ref_weights = (t.cpu() for t in (stock_ids, stock_weights, ref_ids, ref_weights))
        size = metadata_size(case.tile_n)
        digests = set()
        for rank in range(case.tp):
            row = RankResult(rank=rank)
            result.ranks.append(row)
            offset, count = local_experts(rank, case.tp)
            ids = checks.poison(torch.empty(case.tokens, config.TOP_K, dtype=torch.int32, device=device))
            weights = checks.poison(torch.empty(case.tokens, config.TOP_K, dtype=torch.float32, device=device))
            metadata = torch.full((size + 1,), POISON_WORD, dtype=torch.int32, device=device)
            if faults.hang_rank == rank:  # a stream that stays busy past the bound, then frees itself
                hold_current_stream(int((timeout_s + 1.0) * 1e9))
            if faults.silent_rank != rank:
                route(logits, bias, ids, weights, ROUTE_SCALE, case.renormalize, metadata=metadata,
                      local_expert_offset=offset, num_local_experts=count, tile_n=case.tile_n)
            done = torch.cuda.Event()
            done.record()
            wait_for_device(done, timeout_s, f"rank {rank}: routing")
            got_ids, got_weights, got_metadata = ids.cpu(), weights.cpu(), metadata.cpu()
            if faults.flip_rank == rank:
                checks.flip_one_bit(got_weights, index=got_weights.numel() // 2)
            if checks.still_poisoned(got_ids) and checks.still_poisoned(got_weights):
                row.error = f"rank {rank}: its ids and weights still hold the poison: the kernel wrote nothing"
            for got, want in ((got_ids, stock_ids), (got_weights, stock_weights), (got_ids, ref_ids), (got_weights, ref_weights)):
                _compare(got, want, rank, row)
            expected = pack_metadata(
                routing_metadata_reference(ref_ids, local_expert_offset=offset, num_local_experts=count,
                                           tile_n=case.tile_n),
                tile_n=case.tile_n, fill=POISON_WORD,
            )
            _compare(got_metadata[:size], expected, rank, row)
            if int(got_metadata[size]) != POISON_WORD:
                row.error = row.error or f"rank {rank}: the guard word past metadata_size({case.tile_n}) was written"
            digests.add(checks.digest(torch.cat([got_ids.view(torch.int32).flatten(), got_weights.view(torch.int32).flatten()])))
            row.digest = checks.digest(got_metadata)
            result.mismatches += row.mismatches
            result.max_ulp = max(result.max_ulp, row.max_ulp)
            result.first_mismatch = result.first_mismatch or row.first_mismatch
        result.rank_identical = len(digests) == 1
        errors = [r.error for r in result.ranks if r.error]
        result.error = errors[0] if errors else None
    except RoutingTimeout as timeout:
        result.error = str(timeout)
    except Exception as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


def routing_paths(logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  metadata: torch.Tensor, *, local_expert_offset: int, num_local_experts: int,
                  tile_n: int) -> dict[str, Callable[[], object]]:
    """The routing paths `bench routing` times (and scripts/profile-routing.py profiles), by name,
    each writing `ids` and `weights` (those ending in "+metadata" also `metadata`): musebench's
    kernel alone and with metadata, the Triton stock, and the Triton stock followed by the
    separate metadata pass. Call `kernels.routing.prepare()` first."""
    from musebench.kernels.routing import route
    from musebench.stock.triton_metadata import triton_metadata
    from musebench.stock.triton_routing import triton_routing

    local = dict(local_expert_offset=local_expert_offset, num_local_experts=num_local_experts, tile_n=tile_n)

    def stock() -> None:
        triton_routing(logits, bias, route_scale=ROUTE_SCALE, ids=ids, weights=weights)

    return {
        "routing": lambda: route(logits, bias, ids, weights, ROUTE_SCALE),
        "routing+metadata": lambda: route(logits, bias, ids, weights, ROUTE_SCALE, metadata=metadata, **local),
        "triton stock": stock,
        "triton stock+metadata": lambda: (stock(), triton_metadata(ids, metadata, **local)),
    }


def bench_routing(tokens: int, tile_n: int, options: BenchOptions) -> list[CaseResult]:
    """Graph-timed rows: the kernel alone, with metadata (rank 0's range), the Triton stock, and
    the Triton stock followed by a separate metadata pass (`stock.triton_metadata`): the path
    without musebench's fused metadata. `stock_us` of every row is the Triton stock alone.

    Outputs are poisoned before each variant and checked after its replays: ids and weights
    against the reference with the hardware's approximations, the metadata's live words against
    `pack_metadata(routing_metadata_reference(...))`, so every timed row carries its #wrong.
    """
    from musebench.kernels.routing import metadata_size, prepare
    from musebench.stock.routing import pack_metadata, routing_metadata_reference, routing_reference

    device = torch.device("cuda", torch.cuda.current_device())
    case = RoutingCase(tp=8, tokens=tokens, tile_n=tile_n)
    logits, bias = (t.to(device) for t in make_routing_inputs(case))
    ids = torch.empty(tokens, config.TOP_K, dtype=torch.int32, device=device)
    weights = torch.empty(tokens, config.TOP_K, dtype=torch.float32, device=device)
    metadata = torch.empty(metadata_size(tile_n), dtype=torch.int32, device=device)
    offset, count = local_experts(0, case.tp)
    want_ids, want_weights = routing_reference(logits, bias, route_scale=ROUTE_SCALE,
                                               approximations=nx.hardware_approximations())
    want_metadata = pack_metadata(
        routing_metadata_reference(want_ids.cpu(), local_expert_offset=offset, num_local_experts=count, tile_n=tile_n),
        tile_n=tile_n, fill=POISON_WORD,
    )
    prepare()
    variants = routing_paths(logits, bias, ids, weights, metadata, local_expert_offset=offset,
                             num_local_experts=count, tile_n=tile_n)
    rows = []
    stream = torch.cuda.Stream(device)
    for name, call in variants.items():
        row = CaseResult(kernel=name, mode="routing", tp=case.tp, tokens=tokens, weight_dtype="fp32", norm="renorm",
                         inputs="random", seed=0, backend="cute" if name.startswith("routing") else "triton",
                         launcher="virtual", transport="local", stock="triton", stock_path=f"tile {tile_n}",
                         iters=options.calls * options.replays)
        try:
            for out in (ids, weights):
                checks.poison(out)
            metadata.fill_(POISON_WORD)
            with torch.cuda.stream(stream):
                call()  # compiles / warms outside capture
            stream.synchronize()
            row.tail_us = graph_median_us(call, stream, options)
            checked = RankResult(rank=0)
            pairs = [(ids, want_ids), (weights, want_weights)]
            if name.endswith("+metadata"):
                pairs.append((metadata[: want_metadata.numel()], want_metadata))  # the layout, not its guard
            for got, want in pairs:
                _compare(got, want, 0, checked)
            row.ranks = [checked]
            row.mismatches, row.max_ulp, row.first_mismatch = checked.mismatches, checked.max_ulp, checked.first_mismatch
        except Exception as error:
            row.error = f"{type(error).__name__}: {error}"
        rows.append(row)
    stock = next(row.tail_us for row in rows if row.kernel == "triton stock")
    for row in rows:
        row.stock_us = stock
    return rows
