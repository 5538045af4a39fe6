"""One eps rule for the tails' RMSNorm, everywhere: `musebench.numerics.check_eps`.

The references, the CPU model and both kernels' host checks refuse the same eps and accept the
same eps: a finite number in [2^-126, FP32 max], so the rsqrt argument `fma(Q, 1/width, eps)`
(Q >= +0.0) is never a subnormal that the EP stock's `rsqrt.approx.ftz.f32` would flush.
"""

from __future__ import annotations

import math

import pytest
import torch

from musebench import numerics as nx
from musebench.cases.tail_inputs import TailCase, make_tail_inputs

FP32_MAX = 3.4028234663852886e38
REFUSED = [0.0, -1e-8, 2.0**-127, math.nextafter(2.0**-126, 0.0), 2.0**-149, float("nan"), float("inf"),
           -float("inf"), 1e39, math.nextafter(FP32_MAX, math.inf), True]
ACCEPTED = [2.0**-126, 1e-8, 1e-5, 1.0, FP32_MAX]


def _ep_reference(eps):
    from musebench.stock import ep

    inputs = make_tail_inputs(TailCase(mode="ep", tp=2, tokens=1))
    ep.ep_tail_reference(inputs.per_rank, inputs.norm_weight, eps=eps, gain_center=1.0, weight_before_norm=True)


def _tp_reference(eps):
    from musebench.stock import tp

    inputs = make_tail_inputs(TailCase(mode="tp", tp=2, tokens=1))
    tp.tp_tail_reference(inputs.per_rank, inputs.norm_weight, eps=eps, gain_center=1.0, weight_before_norm=True, nsm=148)


def _cpu_model(eps):
    from musebench.cpu.tail import TailOptions

    TailOptions(eps=eps, gain_center=1.0, weight_before_norm=True)


def _ep_kernel(eps):
    pytest.importorskip("cutlass")
    from musebench.kernels import ep_tail

    ep_tail._EpPublisherKernel(tp=2, capacity=8, weight_before_norm=True, weight_dtype="bf16", eps=eps,
                               gain_center=1.0, transport="unicast", enable_pdl=True)


def _tp_kernel(eps):
    pytest.importorskip("cutlass")
    from musebench.kernels import tp_tail

    tp_tail._TpTailKernel(tp=2, capacity=8, token_width=2 * tp_tail.H_DIM, split=1, combine=tp_tail.FMA_CHAIN, group=0,
                          delivery=tp_tail.EXACT, weight_before_norm=True, weight_dtype="bf16", eps=eps,
                          gain_center=1.0, timeout_ns=1_000_000_000, enable_pdl=True)


CALLERS = {"check_eps": lambda eps: nx.check_eps(eps), "ep_reference": _ep_reference, "tp_reference": _tp_reference,
           "cpu_model": _cpu_model, "ep_kernel": _ep_kernel, "tp_kernel": _tp_kernel}


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("eps", REFUSED, ids=repr)
def test_every_caller_refuses_the_same_eps(caller, eps):
    with pytest.raises(ValueError, match="eps"):
        CALLERS[caller](eps)


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("eps", ACCEPTED, ids=repr)
def test_every_caller_accepts_the_same_eps(caller, eps):
    CALLERS[caller](eps)


def test_check_eps_returns_the_float_and_min_eps_is_the_smallest_normal():
    assert nx.MIN_EPS == 2.0**-126
    assert nx.check_eps(1e-8) == 1e-8 and isinstance(nx.check_eps(1), float)
    smallest_normal = torch.tensor(0x00800000, dtype=torch.int32).view(torch.float32)
    assert float(smallest_normal) == nx.MIN_EPS


def test_below_min_eps_the_flush_would_change_a_zero_row():
    """Why the rule: for a zero row the rsqrt argument is eps itself; below 2^-126 the EP stock's
    ftz rsqrt sees 0 (inf, and 0 * inf = NaN) where a subnormal-keeping rsqrt gives a finite value."""
    tiny = torch.tensor([2.0**-127], dtype=torch.float32)
    argument = nx.fma(torch.zeros(1), nx.f32(2.0**-12), tiny)
    assert float(argument) == 2.0**-127 and float(argument) < nx.MIN_EPS  # subnormal: ftz flushes it
    assert math.isfinite(float(nx.PRECISE.rsqrt(argument)))
    flushed = nx.PRECISE.rsqrt(torch.zeros(1))
    assert math.isinf(float(flushed)) and math.isnan(float(nx.mul(torch.zeros(1), flushed)))


@pytest.mark.gpu
def test_ftz_and_subnormal_keeping_rsqrt_agree_from_min_eps_up():
    """On the GPU: the EP kernel's rsqrt.approx.ftz.f32 and the references' hardware rsqrt
    (torch.rsqrt: rsqrt.approx.f32) give the same bits on every argument the eps rule allows
    (normal, inf, NaN; a sample of every exponent here, exhaustive in the record) and differ on
    subnormal ones."""
    from musebench.kernels import approx

    g = torch.Generator(device="cuda").manual_seed(5)
    exponents = torch.arange(1, 255, device="cuda", dtype=torch.int32)  # every normal exponent
    mantissas = torch.randint(0, 1 << 23, (254, 4096), generator=g, device="cuda", dtype=torch.int32)
    mantissas[:, 0], mantissas[:, 1] = 0, (1 << 23) - 1
    words = (exponents[:, None] << 23) | mantissas
    special = torch.tensor([0x7F800000, 0x7FC00000, 0x7F800001, 0xFFC00000 - (1 << 32)], dtype=torch.int32, device="cuda")
    x = torch.cat([words.reshape(-1), special]).view(torch.float32)
    got, want = approx.rsqrt_approx_ftz_f32(x), torch.rsqrt(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))
    subnormal = torch.arange(1, 1 << 23, 4099, device="cuda", dtype=torch.int32).view(torch.float32)
    assert bool(torch.isinf(approx.rsqrt_approx_ftz_f32(subnormal)).all())  # flushed: rsqrt(0)
    assert bool(torch.isfinite(torch.rsqrt(subnormal)).all())
