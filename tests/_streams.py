"""Stream helpers for GPU tests of virtual ranks."""

from __future__ import annotations

import torch

# torch.cuda._sleep spins clock cycles; two cycles per ns holds at least `ns` on any clock up to 2 GHz.
_CYCLES_PER_NS = 2


def hold_current_stream(ns: int) -> None:
    """Hold the current stream for at least `ns` of GPU time: ranks launched on streams forked from
    it while it is held start together when it ends, so a host that launches them slowly (module
    loading, a loaded CPU) cannot make a live rank look missing to a short device timeout."""
    if ns > 0:
        torch.cuda._sleep(ns * _CYCLES_PER_NS)
