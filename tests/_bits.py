"""Raw-bit assertions for GPU tests: the harness's own comparison (`harness.checks.compare_bits`),
with a message a kernel engineer can act on."""

from __future__ import annotations

import torch

from musebench.harness import checks


def assert_raw_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str, *, poison_bits: int) -> None:
    """AssertionError unless every element of `got` has the bits of `want` (-0.0 and NaN payloads
    count); the message gives the count, the first index, both words, the max ULP distance and
    how many poisoned (never written) elements are left."""
    count, max_ulp, first = checks.compare_bits(got, want)
    if count:
        left = int((got.detach().cpu().view(torch.int16) == poison_bits).sum())  # poison is a positive int16
        raise AssertionError(
            f"{what}: {count} words differ; first at {first.index}: got {first.got_bits:#06x}, "
            f"want {first.want_bits:#06x}; max ULP {max_ulp}; poison left: {left}"
        )
