"""CPU model of the MoE tails: the kernels' Lamport protocol (`musebench.comm.protocol`: mailboxes,
sentinels, generations; its own stage-word hand-over) over host mailboxes (`musebench.comm.lamport`),
rank by rank, in torch.

Each `CpuEpTail` / `CpuTpTail` is one rank's bound tail over a `Mailbox` group (virtual ranks
share host tensors, processes share /dev/shm files). Ranks run concurrently and call `run`
back to back with no barrier, as the GPU kernels do; only the mailboxes order them.

EP tail, one call: take NEXT_STAGE, compute this rank's partial (scrubbed of -0.0), store it to
slot [stage, rank] of every rank's mailbox, set ACTIVE_STAGE; then poll slot [stage, 0..tp-1]
of the own mailbox until every word landed (bounded), sum the slots in rank order from 0.0 in
FP32, round to BF16, advance NEXT_STAGE and re-arm what was read.

TP tail, one call (token-owner layout: token t is owned by rank t % tp): take the generation,
push the token's eight K-partial route rows (their first 4096 columns; a zero row where the
index is -1) to the owner's route mailbox (slot = source rank), then, as owner, poll every
source's rows, compute the token's row, keep it, and store to row t of every other rank's token
mailbox what the stock delivers there: on the single launch a copy scrubbed per 32-bit word, on
the other paths the owner's own bits; finally poll the own token mailbox for the other owners'
rows and copy them out. The TP mailboxes' sentinel unit is the 32-bit word (0x80008000), as in
the stock TP kernel, so a lone -0.0 half travels as data; token rows travel widened to FP32,
where no word can equal the sentinel, and are narrowed back by their bits.

The per-row arithmetic is the reference's (musebench.stock): this model checks the protocol,
the harness and the fault paths; the instruction-level contract is checked on the GPU kernels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from musebench import numerics as nx
from musebench.comm import lamport, protocol
from musebench.layout import UnfinalizedMoEOutput
from musebench.stock import ep as stock_ep


@dataclass(frozen=True)
class TailOptions:
    """Compile-time knobs of a bound tail (the norm and how long a wait may last)."""

    eps: float
    gain_center: float
    weight_before_norm: bool
    timeout_s: float = 10.0
    approximations: nx.Approximations = nx.PRECISE
    publish: bool = True  # False models a rank that never publishes (fault injection)

    def __post_init__(self) -> None:
        nx.check_eps(self.eps)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


def _route_rows(rows: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """The first `width` columns of rows[index] (a row stride of the rows' width), a zero row where
    the index is outside the rows (-1: no row for that route), as the stock loads them."""
    held = (index >= 0) & (index < rows.shape[0])
    picked = rows[index.clamp(0, rows.shape[0] - 1), :width] if rows.shape[0] else rows.new_zeros(len(index), width)
    return torch.where(held[:, None], picked, torch.zeros((), dtype=rows.dtype))


def _narrow(widened: torch.Tensor) -> torch.Tensor:
    """The BF16 row a token-mailbox row carries widened to FP32 (int16 words), bit for bit: the
    high half of each 32-bit word (a float conversion would rewrite NaN payloads)."""
    return (widened.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


class CpuEpTail:
    """One rank of the EP tail. `mailbox.slots == tp`; capacity >= tokens of any call."""

    def __init__(self, mailbox: lamport.Mailbox, norm_weight: torch.Tensor, options: TailOptions):
        if mailbox.slots != mailbox.tp:
            raise ValueError(f"the EP mailbox needs one slot per rank ({mailbox.tp}), has {mailbox.slots}")
        self.mailbox = mailbox
        self.norm_weight = norm_weight
        self.options = options

    def run(self, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor) -> None:
        box, o = self.mailbox, self.options
        m = unfinalized.tokens
        if m == 0:
            return
        if m > box.capacity:
            raise ValueError(f"{m} tokens exceed the mailbox capacity {box.capacity}")
        stage = int(box.stage[protocol.NEXT_STAGE])
        partial = stock_ep.ep_partial(
            unfinalized, self.norm_weight, eps=o.eps, gain_center=o.gain_center,
            weight_before_norm=o.weight_before_norm, approximations=o.approximations,
        )
        if o.publish:
            payload = _bits(partial)
            # start at the next rank so that ranks do not all hit rank 0 first
            for step in range(box.tp):
                peer = (box.rank + 1 + step) % box.tp
                lamport.publish(box.words[peer][stage, box.rank, :m], payload)
        box.stage[protocol.ACTIVE_STAGE] = stage

        active = int(box.stage[protocol.ACTIVE_STAGE])
        region = box.own[active, :, :m]
        started = time.monotonic()
        slots = lamport.poll(region, deadline=started + o.timeout_s, started=started, rank=box.rank,
                             generation=active, what="EP partial")
        out.copy_(stock_ep.rank_order_sum([slots[source].view(torch.bfloat16) for source in range(box.tp)]))
        box.stage[protocol.NEXT_STAGE] = (active + 1) % protocol.LAMPORT_GENERATIONS
        lamport.rearm(region)


class CpuTpTail:
    """One rank of the TP tail over a route mailbox (slots = tp sources, rows = capacity * top_k)
    and a token mailbox (one slot, rows = capacity, each row a widened FP32 row of 2 * width words)."""

    def __init__(
        self,
        route_mailbox: lamport.Mailbox,
        token_mailbox: lamport.Mailbox,
        norm_weight: torch.Tensor,
        options: TailOptions,
        *,
        nsm: int,
        top_k: int,
    ):
        if route_mailbox.slots != route_mailbox.tp or token_mailbox.slots != 1:
            raise ValueError("TP tail mailboxes: route slots must equal tp, token slots must be 1")
        self.route_mailbox = route_mailbox
        self.token_mailbox = token_mailbox
        self.norm_weight = norm_weight
        self.options = options
        self.nsm = nsm
        self.top_k = top_k

    def run(self, unfinalized: UnfinalizedMoEOutput, out: torch.Tensor) -> None:
        from musebench.stock import tp as stock_tp

        routes, tokens, o = self.route_mailbox, self.token_mailbox, self.options
        tp, rank, k = routes.tp, routes.rank, self.top_k
        m = unfinalized.tokens
        if m == 0:
            return
        if m * k > routes.capacity or m > tokens.capacity:
            raise ValueError(f"{m} tokens exceed the mailbox capacity")
        generation = int(routes.stage[protocol.NEXT_STAGE])
        path = stock_tp.tp_stock_path(m, tp, self.nsm)
        index = unfinalized.expanded_idx_to_permuted_idx.long()

        # send: my K-partials of token t go to its owner, rows (t // tp) * k + route
        if o.publish:
            for t in range(m):
                owner = t % tp
                payload = lamport.scrub_word32(_bits(_route_rows(unfinalized.gemm2_permuted, index[t], routes.width)))
                base = (t // tp) * k
                lamport.publish(routes.words[owner][generation, rank, base : base + k], payload, word_bits=32)

        # sum: the tokens this rank owns; the owner keeps its row, the copies are scrubbed per word
        owned = list(range(rank, m, tp))
        deadline = time.monotonic() + o.timeout_s
        if owned:
            region = routes.own[generation, :, : len(owned) * k]
            received = lamport.poll(
                region, deadline=deadline, rank=rank, generation=generation, what="TP route",
                owner_of=lambda slot, row: slot, word_bits=32,
            )
            weights = unfinalized.route_weights[owned]
            local_index = torch.arange(len(owned) * k, dtype=torch.int32).reshape(len(owned), k)
            per_source = [
                UnfinalizedMoEOutput(received[s].view(torch.bfloat16).contiguous(), weights, local_index) for s in range(tp)
            ]
            rows, _ = stock_tp.tp_tail_reference(
                per_source, self.norm_weight, eps=o.eps, gain_center=o.gain_center,
                weight_before_norm=o.weight_before_norm, nsm=self.nsm,
                approximations=o.approximations, path=path,
            )
            out[owned] = rows
            # The stock's single launch hands the other ranks a copy scrubbed per 32-bit word;
            # its other paths give every rank the owner's bits. Rows travel widened to FP32.
            copies = lamport.scrub_word32(_bits(rows)).view(torch.bfloat16) if path.scrubbed_copies else rows
            payload = _bits(copies.float().view(torch.bfloat16))
            if o.publish:
                for step in range(1, tp):
                    peer = (rank + step) % tp
                    for i, t in enumerate(owned):
                        lamport.publish(tokens.words[peer][generation, 0, t], payload[i], word_bits=32)
            lamport.rearm(region)

        # copy: every other owner's row (each a live view: polling reads the mailbox anew)
        for t in range(m):
            if t % tp == rank:
                continue
            row = tokens.own[generation, :, t : t + 1]
            final = lamport.poll(
                row, deadline=deadline, rank=rank, generation=generation, what="TP token",
                owner_of=lambda slot, i, t=t: t % tp, word_bits=32,
            )
            out[t] = _narrow(final[0, 0])
            lamport.rearm(row)
        routes.stage[protocol.NEXT_STAGE] = (generation + 1) % protocol.LAMPORT_GENERATIONS
