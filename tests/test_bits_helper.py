"""The GPU tests' raw-bit assertion fails on every difference a kernel could make."""

from __future__ import annotations

import pytest
import torch

from tests._bits import assert_raw_bits_equal

POISON = 0x7FA5


def _bf16(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("got_bits", [
    [0x3F80, 0x0001],  # a flipped low bit
    [0x3F80, 0x8000],  # -0.0 for +0.0
    [0x3F80, POISON],  # never written (a NaN)
    [0x3F80, 0x7FFF],  # another NaN payload than the reference's
])
def test_any_bit_difference_fails(got_bits):
    want = [0x3F80, 0x0000] if got_bits[1] != 0x7FFF else [0x3F80, 0x7FC0]
    with pytest.raises(AssertionError, match="1 words differ; first at \\(1,\\)"):
        assert_raw_bits_equal(_bf16(got_bits), _bf16(want), "case", poison_bits=POISON)


def test_equal_bits_pass_and_poison_is_counted():
    assert_raw_bits_equal(_bf16([0x8000, 0x7FC0]), _bf16([0x8000, 0x7FC0]), "case", poison_bits=POISON)
    with pytest.raises(AssertionError, match="poison left: 2"):
        assert_raw_bits_equal(_bf16([POISON, POISON]), _bf16([0, 0]), "case", poison_bits=POISON)
