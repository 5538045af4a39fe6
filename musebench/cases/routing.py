"""The routing family (`routing`): the short tail's top-8 and, fused, this rank's GEMM metadata.

Every rank routes the same FP32 logits [b, 256] for its own contiguous expert range (the EP
sharding of the tail cases, `cases.tail_inputs.expert_owner`). A call writes, through the seeds'
`routing.route`, the ids (int32 [b, 8]) and weights (FP32 [b, 8]) and the rank's TRT-LLM-gen
metadata for GEMM tile `tile_n` into a buffer of the seeds' `metadata_size(tile_n)` words: the
layout (`routing_metadata.metadata_size`) and the guard element after it.

Checks, raw bits: ids and weights equal to the project's Triton stock (`stock.triton_routing`)
and to the reference with the hardware's approximate instructions, identical on every rank; the
metadata's live words equal to `pack_metadata(routing_metadata_reference(...))`, every other
word and the guard element still the poison. No mailboxes: ranks never wait on
each other, so a rank that never finishes is caught by the driver's bounded wait on its stream.
Faults: `flip` (one bit of the host copy), `silent` (never launched: its outputs keep the
poison), `hang` (its stream held busy past `--timeout`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from musebench import config
from musebench.harness import checks
from musebench.harness.case import Expected, MailboxSpec, RunOptions
from musebench.cases.tail_inputs import ROUTING_INPUT_FAMILIES, expert_owner

name = "routing"
faults = ("flip", "silent", "hang")
PARTS = ("without metadata",)
VIRTUAL_STOCK = PROCESS_STOCK = "triton stock+metadata"  # the path without musebench's fused metadata
ROUTE_SCALE = 2.5
IDS, WEIGHTS, METADATA = "ids", "weights", "metadata"


@dataclass(frozen=True)
class RoutingCase:
    tp: int
    tokens: int
    tile_n: int = 8
    renormalize: bool = True
    inputs: str = "random"
    seed: int = 0
    family: str = "routing"

    def label(self) -> str:
        norm = "renorm" if self.renormalize else "raw"
        return f"routing tp={self.tp} b={self.tokens} tile={self.tile_n} {norm} {self.inputs} seed={self.seed}"


@dataclass(frozen=True)
class RoutingInputs:
    logits: torch.Tensor  # FP32 [b, 256]
    bias: torch.Tensor  # FP32 [256]


Case = RoutingCase


def local_experts(rank: int, tp: int, num_experts: int = config.NUM_EXPERTS) -> tuple[int, int]:
    """(offset, count) of rank's contiguous expert range, the EP sharding of the tails' cases."""
    owned = [e for e in range(num_experts) if expert_owner(e, tp, num_experts) == rank]
    return owned[0], len(owned)


def make_inputs(case: RoutingCase) -> RoutingInputs:
    """(logits fp32 [b, 256], bias fp32 [256]), deterministic in the case, fresh per seed."""
    if case.inputs not in ROUTING_INPUT_FAMILIES:  # the tails' edge family has no routing draw
        raise ValueError(f"routing inputs must be one of {ROUTING_INPUT_FAMILIES}, got {case.inputs!r}")
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
    return RoutingInputs(logits.float().contiguous(), bias.float().contiguous())


def mailboxes(case: RoutingCase, capacity: int) -> dict[str, MailboxSpec]:
    return {}


@dataclass
class RoutingRunner:
    """One rank's routing call: `routing.route` of the implementation under test."""

    route: Any
    logits: torch.Tensor
    bias: torch.Tensor
    case: RoutingCase
    offset: int
    count: int
    outputs: dict[str, torch.Tensor]

    def call(self) -> None:
        outs = self.outputs
        self.route(self.logits, self.bias, outs[IDS], outs[WEIGHTS], ROUTE_SCALE, self.case.renormalize,
                   metadata=outs[METADATA], local_expert_offset=self.offset, num_local_experts=self.count,
                   tile_n=self.case.tile_n)

    def check_fault(self) -> None:  # no device spin: nothing to record
        return None

    def parts(self) -> dict:
        """The kernel without the fused metadata, timed apart by a bench."""
        outs = self.outputs
        return {"without metadata": lambda: self.route(self.logits, self.bias, outs[IDS], outs[WEIGHTS], ROUTE_SCALE,
                                                       self.case.renormalize)}

    def launch_demands(self) -> list:
        return []


def bind(case: RoutingCase, impl: Any, rank: int, boxes: dict[str, Any], inputs: RoutingInputs,
         options: RunOptions) -> RoutingRunner:
    """This rank's routing over its expert range (compiles the variants first: before capture)."""
    routing = impl.routing()
    routing.prepare(case.renormalize)
    device = torch.device("cuda", torch.cuda.current_device())
    offset, count = local_experts(rank, case.tp)
    outputs = {
        IDS: torch.empty(case.tokens, config.TOP_K, dtype=torch.int32, device=device),
        WEIGHTS: torch.empty(case.tokens, config.TOP_K, dtype=torch.float32, device=device),
        METADATA: torch.empty(routing.metadata_size(case.tile_n), dtype=torch.int32, device=device),  # with its guard
    }
    return RoutingRunner(routing.route, inputs.logits.to(device), inputs.bias.to(device), case, offset, count,
                         outputs)


def poison_word() -> int:
    """The int32 the driver's poison leaves in an unwritten metadata word (`checks.poison`)."""
    return int(checks.poison(torch.empty(1, dtype=torch.int32))[0])


def expected(case: RoutingCase, inputs: RoutingInputs, options: RunOptions, approximations: Any) -> Expected:
    """Per rank: ids and weights, each equal to both the Triton stock and the reference; the
    metadata's live words from the reference ids, every other word and the guard the poison."""
    from musebench.routing_metadata import metadata_size
    from musebench.stock.routing import pack_metadata, routing_metadata_reference, routing_reference
    from musebench.stock.triton_routing import triton_routing

    device = torch.device("cuda", torch.cuda.current_device())
    logits, bias = inputs.logits.to(device), inputs.bias.to(device)
    stock_ids, stock_weights = triton_routing(logits, bias, route_scale=ROUTE_SCALE, renormalize=case.renormalize)
    ref_ids, ref_weights = routing_reference(logits, bias, route_scale=ROUTE_SCALE, renormalize=case.renormalize,
                                             approximations=approximations)
    stock_ids, stock_weights, ref_ids, ref_weights = (t.cpu() for t in (stock_ids, stock_weights, ref_ids, ref_weights))
    fill = poison_word()
    per_rank = []
    for rank in range(case.tp):
        offset, count = local_experts(rank, case.tp)
        packed = pack_metadata(
            routing_metadata_reference(ref_ids, local_expert_offset=offset, num_local_experts=count,
                                       tile_n=case.tile_n),
            tile_n=case.tile_n, fill=fill,
        )
        guard = torch.full((1,), fill, dtype=torch.int32)
        assert packed.numel() == metadata_size(case.tile_n)
        per_rank.append({IDS: (stock_ids, ref_ids), WEIGHTS: (stock_weights, ref_weights),
                         METADATA: torch.cat([packed, guard])})
    return Expected(per_rank, f"triton + reference metadata, tile {case.tile_n}")


def bytes_moved(case: RoutingCase) -> int:
    return 0


def row_fields(case: RoutingCase, options: RunOptions) -> dict[str, Any]:
    return dict(kernel=name, mode="routing", tp=case.tp, tokens=case.tokens, weight_dtype="fp32",
                norm="renorm" if case.renormalize else "raw", inputs=case.inputs, seed=case.seed, stock="triton")


def variants(case: RoutingCase, options: RunOptions) -> dict[str, RunOptions]:
    return {}


def baselines(case: RoutingCase, inputs: RoutingInputs, rank: int, runner: RoutingRunner, comms: Any) -> dict:
    """The project's Triton stock alone and followed by the separate metadata pass (the path
    without musebench's fused metadata), writing their own buffers."""
    from musebench.cases.tail import Baseline
    from musebench.stock.triton_metadata import triton_metadata
    from musebench.stock.triton_routing import triton_routing

    ids = torch.empty_like(runner.outputs[IDS])
    weights = torch.empty_like(runner.outputs[WEIGHTS])
    metadata = torch.empty_like(runner.outputs[METADATA])

    def stock() -> None:
        triton_routing(runner.logits, runner.bias, route_scale=ROUTE_SCALE, renormalize=case.renormalize, ids=ids,
                       weights=weights)

    def stock_and_metadata() -> None:
        stock()
        triton_metadata(ids, metadata, local_expert_offset=runner.offset, num_local_experts=runner.count,
                        tile_n=case.tile_n)

    return {"triton stock": Baseline(stock), "triton stock+metadata": Baseline(stock_and_metadata)}
