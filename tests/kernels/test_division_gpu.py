"""`kernels.division` on the GPU: its fast path gives IEEE division's bits for every pair of
operands inside its range (random bit patterns of the range, and its edges crossed with the
mantissas where rounding is hardest), and the guarded quotient gives them for every pair at all
(zeros, subnormals, infinities, NaN and the range's neighbours included). The expected bits are
the CPU's IEEE division (torch float32 on the host); a NaN matches any NaN. The comparison itself
is shown to catch a one-ulp difference."""

from __future__ import annotations

import pytest
import torch

from musebench.kernels import division

pytestmark = pytest.mark.gpu

LOW, HIGH = division.FAST_EXPONENT_MIN, division.FAST_EXPONENT_MAX
MANTISSAS = (0, 1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF, 0x2AAAAA, 0x555555)


def _floats(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _in_range(count: int, gen: torch.Generator) -> torch.Tensor:
    """Random signs, biased exponents uniform in [LOW, HIGH], random mantissas."""
    sign = torch.randint(0, 2, (count,), generator=gen, dtype=torch.int64) << 31
    exponent = torch.randint(LOW, HIGH + 1, (count,), generator=gen, dtype=torch.int64) << 23
    mantissa = torch.randint(0, 1 << 23, (count,), generator=gen, dtype=torch.int64)
    return _floats((sign | exponent | mantissa) - ((sign >> 31) << 32))


def _edges() -> torch.Tensor:
    """Exponents at and next to both ends of the range, and 127, with the hard mantissas."""
    values = [((e << 23) | m) for e in (LOW, LOW + 1, 127, HIGH - 1, HIGH) for m in MANTISSAS]
    bits = torch.tensor(values, dtype=torch.int64)
    return _floats(torch.cat([bits, bits | (1 << 31)]) - torch.cat([torch.zeros_like(bits), torch.full_like(bits, 1 << 32)]))


def _specials() -> torch.Tensor:
    values = [0, 1, 0x7FFFFF, 0x800000, 0x3F800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001,
              (LOW - 1) << 23, ((LOW - 1) << 23) | 0x7FFFFF, (HIGH + 1) << 23, 0x00400000]
    bits = torch.tensor(values, dtype=torch.int64)
    return _floats(torch.cat([bits, bits | (1 << 31)]) - torch.cat([torch.zeros_like(bits), torch.full_like(bits, 1 << 32)]))


def _mismatches(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int | None]:
    """(pairs whose bits differ from the host's IEEE a / b, the first such index); NaN == NaN."""
    want = a.cpu() / b.cpu()
    got = got.cpu()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (torch.isnan(got) & torch.isnan(want))
    bad = (~same).nonzero()
    return int(bad.numel()), (int(bad[0]) if bad.numel() else None)


@pytest.fixture(scope="module")
def cuda():
    return torch.device("cuda")


def test_the_fast_path_is_ieee_division_inside_its_range(cuda):
    from musebench.kernels import approx

    gen = torch.Generator().manual_seed(20261202)
    for _ in range(4):
        a, b = _in_range(1 << 22, gen), _in_range(1 << 22, gen)
        assert _mismatches(approx.fast_quotient_f32(a.to(cuda), b.to(cuda)), a, b) == (0, None)
    edges = _edges()
    a, b = edges.repeat_interleave(edges.numel()), edges.repeat(edges.numel())
    assert _mismatches(approx.fast_quotient_f32(a.to(cuda), b.to(cuda)), a, b) == (0, None)
    ones = torch.ones_like(edges)  # the sigmoid's 1 / d
    assert _mismatches(approx.fast_quotient_f32(ones.to(cuda), edges.to(cuda)), ones, edges) == (0, None)


def test_the_guarded_quotient_is_ieee_division_everywhere(cuda):
    from musebench.kernels import approx

    gen = torch.Generator().manual_seed(7)
    operands = torch.cat([_edges(), _specials(), _in_range(64, gen)])
    a, b = operands.repeat_interleave(operands.numel()), operands.repeat(operands.numel())
    assert _mismatches(approx.quotient_rn_f32(a.to(cuda), b.to(cuda)), a, b) == (0, None)
    raw_a = _floats(torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=gen, dtype=torch.int64))
    raw_b = _floats(torch.randint(-(1 << 31), 1 << 31, (1 << 20,), generator=gen, dtype=torch.int64))
    assert _mismatches(approx.quotient_rn_f32(raw_a.to(cuda), raw_b.to(cuda)), raw_a, raw_b) == (0, None)


def test_the_comparison_sees_one_ulp(cuda):
    a = torch.tensor([1.0, 3.0, 5.0])
    b = torch.tensor([3.0, 7.0, 9.0])
    got = (a / b).view(torch.int32).clone()
    got[1] += 1
    assert _mismatches(got.view(torch.float32), a, b) == (1, 1)
