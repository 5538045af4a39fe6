"""The one-shot all-reduce's host reference (`stock.all_reduce`): rank order, the scrub, the compare."""

from __future__ import annotations

import pytest
import torch

from musebench.comm.protocol import SENTINEL_WORD32_BITS
from musebench.stock.all_reduce import mismatches, rank_order_sum, scrub_f32_sentinel


def _bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def test_bf16_parts_are_summed_in_fp32_from_zero_in_rank_order():
    # 2^24 + 1 - 2^24: in rank order the 1 is lost (2^24 + 1 rounds to 2^24), another order keeps it
    parts = [_bf16([2.0**24]), _bf16([1.0]), _bf16([-(2.0**24)])]
    assert rank_order_sum(parts).float().item() == 0.0
    assert rank_order_sum([parts[0], parts[2], parts[1]]).float().item() == 1.0
    # the sum is rounded once to BF16 at the end, not after every add
    assert rank_order_sum([_bf16([1.0]), _bf16([2.0**-8]), _bf16([2.0**-8])]).float().item() == 1.0078125


def test_negative_zero_gives_positive_zero_and_nan_the_canonical_bf16_nan():
    got = rank_order_sum([_bf16([-0.0, float("nan")]), _bf16([-0.0, 1.0])])
    assert got.view(torch.int16).tolist() == [0, 0x7FFF]


def test_an_fp32_sentinel_word_travels_as_negative_zero():
    sentinel = torch.tensor([SENTINEL_WORD32_BITS], dtype=torch.int32).view(torch.float32)
    assert scrub_f32_sentinel(sentinel).view(torch.int32).item() == -(2**31)
    assert rank_order_sum([sentinel, torch.zeros(1)]).view(torch.int32).item() == 0  # -0.0 + 0.0, not -2^-134
    other = torch.tensor([1.5, -2.0])
    assert torch.equal(scrub_f32_sentinel(other), other)


def test_mismatches_count_raw_bits_and_find_the_first():
    want = rank_order_sum([_bf16([1.0, 2.0, 3.0]), _bf16([0.5, 0.5, 0.5])])
    assert mismatches(want.clone(), want) == (0, None)
    broken = want.clone()
    broken.view(torch.int16)[1] ^= 1  # one bit of one word: the check must see it
    assert mismatches(broken, want) == (1, 1)
    zero = torch.zeros(1, dtype=torch.bfloat16)
    assert mismatches(-zero, zero) == (1, 0)  # -0.0 is not +0.0


def test_fp32_nans_compare_as_nans_and_nothing_else_does():
    nan_a = torch.tensor([float("nan"), 1.0])
    nan_b = torch.tensor([-float("nan"), 1.0])
    assert mismatches(nan_a, nan_b) == (0, None)
    assert mismatches(nan_a, torch.tensor([0.0, 1.0])) == (1, 0)


def test_bad_parts_are_refused():
    with pytest.raises(ValueError, match="none"):
        rank_order_sum([])
    with pytest.raises(ValueError, match="same dtype"):
        rank_order_sum([_bf16([1.0]), torch.ones(1)])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        rank_order_sum([torch.ones(1, dtype=torch.float16)])
