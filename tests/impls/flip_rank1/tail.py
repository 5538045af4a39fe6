"""musebench.kernels.tail with rank 1's `out[0, 0]` bit 0 flipped after every `run`."""

from __future__ import annotations

import torch

from musebench.kernels import tail as _tail
from musebench.kernels.tail import *  # noqa: F401,F403  (the rest of the seeds' names, unchanged)

FLIPPED_RANK = 1


class _Flipping:
    """A bound tail whose rank-1 output gets one bit flipped on the device after the call."""

    def __init__(self, bound, rank: int) -> None:
        self._bound, self._rank = bound, rank
        scratch = torch.zeros(1, 1, dtype=torch.int16, device=torch.device("cuda", torch.cuda.current_device()))
        scratch[0, 0] ^= 1  # the xor kernel loads here, never behind a peer's spinning wait
        torch.cuda.synchronize()

    def run(self, unfinalized, out) -> None:
        self._bound.run(unfinalized, out)
        if self._rank == FLIPPED_RANK and out.numel():
            out.view(torch.int16)[0, 0] ^= 1

    def __getattr__(self, name):
        return getattr(self._bound, name)


class MoETail(_tail.MoETail):
    def bind(self, norm):
        return _Flipping(super().bind(norm), self.rank)


class TpTail(_tail.TpTail):
    def bind(self, norm):
        return _Flipping(super().bind(norm), self.rank)
