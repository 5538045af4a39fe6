"""Stream helpers for GPU tests of virtual ranks."""

from __future__ import annotations

import torch

from musebench.harness.driver import hold_current_stream


def launch_ranks(tails, streams: list[torch.cuda.Stream], per_rank, outs, *, skip: tuple[int, ...] = (),
                 hold_ns: int = 0) -> None:
    """Every virtual rank's `tails[rank].run(per_rank[rank], outs[rank])` on its own stream, forked
    from and joined back to the current one; ranks in `skip` never launch; `hold_ns` holds the
    current stream first (`hold_current_stream`), so that every rank starts at once."""
    origin = torch.cuda.current_stream()
    hold_current_stream(hold_ns)
    for rank, tail in enumerate(tails):
        if rank in skip:
            continue
        streams[rank].wait_stream(origin)
        with torch.cuda.stream(streams[rank]):
            tail.run(per_rank[rank], outs[rank])
    for stream in streams:
        origin.wait_stream(stream)
