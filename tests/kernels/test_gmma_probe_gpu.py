"""The wgmma building blocks on an H100 / H200 (`kernels.gmma_probe`): for one page, S = Q K^T
(4 chained m64n16k16) and P V (p_lo then p_hi, m64n64k16, V N-major) with wgmma equal, bit for bit,
mma.sync m16n8k16 reading the same swizzled shared memory; both within a tolerance of the CPU
model of a tensor-core step (`cpu.attn2.tc_mma`: exact products, truncated sum); and the check can
fail: a descriptor with a wrong stride byte offset or without the swizzle mode breaks it. The
input families and the bit comparison have CPU tests of their own here (unmarked)."""

from __future__ import annotations

import pytest
import torch

ROWS, DIM, KEYS = 64, 64, 16
# |got - model| <= TOLERANCE * (sum of |products| and |C| over the chain) + ABSOLUTE: a tensor-core
# step keeps a few guard bits (not all, as the model does) and truncates; subnormal results may
# differ by flushing
TOLERANCE = 2.0 ** -20
ABSOLUTE = 2.0 ** -125


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma probe runs on sm_90 only")


def _bf16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16)


def _with_exponents(shape, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """BF16 values sign (1 + m / 128) 2^e, e uniform in [low, high] (exact in BF16)."""
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    mantissa = 1.0 + torch.randint(0, 128, shape, generator=gen).double() / 128
    exponent = torch.randint(low, high + 1, shape, generator=gen).double()
    return _bf16(sign * mantissa * torch.pow(2.0, exponent))


def _subnormal(shape, gen: torch.Generator) -> torch.Tensor:
    """BF16 subnormals (exponent field 0, mantissa 1..127), random sign."""
    bits = torch.randint(1, 128, shape, generator=gen, dtype=torch.int32)
    bits = bits | torch.where(torch.rand(shape, generator=gen) < 0.5, 0x8000, 0)
    return bits.to(torch.int16).view(torch.bfloat16)


def make_inputs(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """page bf16 [16, 128] (K | V per key), q [64, 64], p_lo and p_hi [64, 16] for `family`."""
    gen = torch.Generator().manual_seed(seed)
    normal = lambda *shape: _bf16(torch.randn(shape, generator=gen))  # noqa: E731
    k, v, q = normal(KEYS, DIM), normal(KEYS, DIM), normal(ROWS, DIM)
    p_hi, p_lo = _bf16(torch.rand(ROWS, KEYS, generator=gen)), _bf16(torch.rand(ROWS, KEYS, generator=gen) * 2**-9)
    if family == "huge":  # |q|, |p| ~ 2^100: products near 2^100, no overflow
        q = _with_exponents((ROWS, DIM), 98, 101, gen)
        p_hi = _with_exponents((ROWS, KEYS), 98, 101, gen)
        p_lo = _with_exponents((ROWS, KEYS), 90, 93, gen)
    elif family == "subnormal":  # subnormal operands, products subnormal or flushed
        q, p_hi, p_lo = _subnormal((ROWS, DIM), gen), _subnormal((ROWS, KEYS), gen), _subnormal((ROWS, KEYS), gen)
        k, v = _with_exponents((KEYS, DIM), 0, 8, gen), _with_exponents((KEYS, DIM), 0, 8, gen)
    elif family == "negative_zero":
        # -0.0 rows of q and P against positive keys and values: every product of those dot
        # products is -0.0 (the sign of an all-zero sum: scale-d 0 against a +0.0 accumulator);
        # -0.0 keys and value columns make (-0.0)(-0.0) = +0.0 and mixed-sign zero sums
        k, v = k.abs(), v.abs()
        k[::3] = -0.0
        v[:, ::2] = -0.0
        q[::2] = -0.0
        q[1::4] = 0.0
        p_hi[::2] = -0.0
        p_lo[::2] = -0.0
        p_lo[1::4] = 0.0
    elif family == "mixed_exponents":  # exponents 2^-60 .. 2^60 side by side: alignment and truncation
        q, k = _with_exponents((ROWS, DIM), -60, 60, gen), _with_exponents((KEYS, DIM), -60, 60, gen)
        p_hi, p_lo = _with_exponents((ROWS, KEYS), -60, 60, gen), _with_exponents((ROWS, KEYS), -60, 60, gen)
        v = _with_exponents((KEYS, DIM), -60, 60, gen)
    elif family != "random":
        raise ValueError(family)
    page = torch.cat([k, v], dim=1).contiguous()
    return dict(page=page, q=q.contiguous(), p_lo=p_lo.contiguous(), p_hi=p_hi.contiguous())


def bit_mismatches(got: torch.Tensor, want: torch.Tensor) -> tuple[int, tuple | None]:
    """(count of FP32 words whose bits differ, first differing index or None): raw int32 views."""
    diff = got.view(torch.int32) != want.view(torch.int32)
    count = int(diff.sum())
    first = tuple(int(i) for i in diff.nonzero()[0]) if count else None
    return count, first


def _describe(name, got, want):
    count, first = bit_mismatches(got, want)
    if not count:
        return f"{name}: bitwise equal"
    g, w = got[first], want[first]
    return (f"{name}: {count} of {got.numel()} words differ; first at {first}: wgmma {float(g)!r} "
            f"({int(got.view(torch.int32)[first]) & 0xFFFFFFFF:#010x}), mma.sync {float(w)!r} "
            f"({int(want.view(torch.int32)[first]) & 0xFFFFFFFF:#010x})")


def _models(inputs):
    from musebench.cpu.attn2 import page_scores, page_values

    page = inputs["page"].float()
    k, v = page[:, :DIM], page[:, DIM:]
    q, p_lo, p_hi = inputs["q"].float(), inputs["p_lo"].float(), inputs["p_hi"].float()
    s = page_scores(q, k)
    pv = page_values(p_hi, p_lo, v)
    s_scale = q.double().abs() @ k.double().abs().T
    pv_scale = (p_hi.double().abs() + p_lo.double().abs()) @ v.double().abs()
    return (s, s_scale), (pv, pv_scale)


def _model_error(got: torch.Tensor, model: torch.Tensor, scale: torch.Tensor) -> float:
    """Max over elements of |got - model| / (scale TOLERANCE + ABSOLUTE): at most 1 passes."""
    err = (got.double() - model.double()).abs()
    return float((err / (scale * TOLERANCE + ABSOLUTE)).max())


FAMILIES = ["random", "huge", "subnormal", "negative_zero", "mixed_exponents"]


# random: the common case; huge: exponents near 2^100; subnormal: inputs below 2^-126;
# negative_zero: -0.0 rows and columns (the sign of an all-zero sum); mixed_exponents: 2^-60..2^60
# in one dot product (alignment, guard bits, truncation). explicit_zero: the first step of a chain
# accumulates onto +0.0 (scale-d 1) instead of scale-d 0.
@pytest.mark.gpu
@pytest.mark.parametrize("explicit_zero", [False, True], ids=["scale_d0", "explicit_zero"])
@pytest.mark.parametrize("family", FAMILIES)
def test_wgmma_matches_mma_sync_bit_for_bit(family, explicit_zero):
    _needs_sm90()
    from musebench.kernels.gmma_probe import run_probe

    inputs = make_inputs(family)
    out = run_probe(*(inputs[n].cuda() for n in ("page", "q", "p_lo", "p_hi")), explicit_zero=explicit_zero)
    (s, s_scale), (pv, pv_scale) = _models(inputs)
    report = [_describe("S", out["s_wgmma"], out["s_mma"]), _describe("P V", out["pv_wgmma"], out["pv_mma"])]
    errors = {name: _model_error(out[name], model, scale) for name, model, scale in (
        ("s_wgmma", s, s_scale), ("s_mma", s, s_scale), ("pv_wgmma", pv, pv_scale), ("pv_mma", pv, pv_scale))}
    print(f"\n[gmma probe {family} {'explicit_zero' if explicit_zero else 'scale_d0'}] " + "; ".join(report)
          + " | vs tc_mma (1 = the tolerance " + f"{TOLERANCE:.1e} x scale): "
          + ", ".join(f"{k} {v:.3g}" for k, v in errors.items()))
    for name in out:
        assert not torch.isnan(out[name]).any(), f"{name}: an element was never written"
    assert bit_mismatches(out["s_wgmma"], out["s_mma"])[0] == 0, report[0]
    assert bit_mismatches(out["pv_wgmma"], out["pv_mma"])[0] == 0, report[1]
    assert max(errors.values()) <= 1.0, errors


@pytest.mark.gpu
# "no_swizzle" is not run here: on the H200 (ad89434) that descriptor made wgmma read outside the
# CTA's shared memory, an illegal address that ends the process's CUDA context (and every test after
# it in the process); the SBO fault stays in bounds and shows the comparison failing.
@pytest.mark.parametrize("fault", ["sbo"])
def test_a_wrong_descriptor_breaks_the_agreement(fault):
    """The comparison can fail: with K's and V's descriptors corrupted, wgmma reads other bytes."""
    _needs_sm90()
    from musebench.kernels.gmma_probe import run_probe

    inputs = make_inputs("random", seed=1)
    out = run_probe(*(inputs[n].cuda() for n in ("page", "q", "p_lo", "p_hi")), fault=fault)
    s_count, _ = bit_mismatches(out["s_wgmma"], out["s_mma"])
    pv_count, _ = bit_mismatches(out["pv_wgmma"], out["pv_mma"])
    print(f"\n[gmma probe fault {fault}] S: {s_count} words differ, P V: {pv_count}")
    assert s_count > 0 and pv_count > 0, (s_count, pv_count)


@pytest.mark.gpu
def test_probe_refuses_bad_inputs():
    _needs_sm90()
    from musebench.kernels.gmma_probe import run_probe

    inputs = {n: t.cuda() for n, t in make_inputs("random").items()}
    with pytest.raises(ValueError, match="q must be"):
        run_probe(inputs["page"], inputs["q"][:, :32].contiguous(), inputs["p_lo"], inputs["p_hi"])
    with pytest.raises(ValueError, match="fault must be"):
        run_probe(inputs["page"], inputs["q"], inputs["p_lo"], inputs["p_hi"], fault="lbo")


# CPU: the comparison and the inputs the GPU tests rely on.


def test_bit_mismatches_counts_signed_zeros_and_nan_payloads():
    """The comparison can fail on what a value comparison misses: -0.0 against +0.0, NaN payloads."""
    want = torch.tensor([[0.0, 1.0], [float("nan"), 2.0]])
    got = want.clone()
    assert bit_mismatches(got, want) == (0, None)
    got[0, 0] = -0.0
    got.view(torch.int32)[1, 0] = 0x7FC00001
    assert bit_mismatches(got, want) == (2, (0, 0))


def test_input_families_hold_what_they_claim():
    bits = lambda t: t.view(torch.int16).to(torch.int32) & 0xFFFF  # noqa: E731
    sub = make_inputs("subnormal")
    assert bool(((bits(sub["q"]) & 0x7F80) == 0).all()) and bool((bits(sub["q"]) & 0x7F).ne(0).all())
    neg = make_inputs("negative_zero")
    assert bool((bits(neg["q"][0]) == 0x8000).all()) and bool((bits(neg["p_hi"][0]) == 0x8000).all())
    assert bool((neg["page"][1, :DIM] > 0).all())  # a positive key: q's -0.0 row gives -0.0 products only
    huge = make_inputs("huge")
    assert float(huge["q"].float().abs().min()) >= 2.0 ** 98
    mixed = make_inputs("mixed_exponents")["q"].float().abs()
    assert float(mixed.max() / mixed.min()) > 2.0 ** 100
    assert all(torch.isfinite(t.float()).all() for f in FAMILIES for t in make_inputs(f).values())
