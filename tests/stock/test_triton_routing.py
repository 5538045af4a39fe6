"""musebench's Triton stock router (and vLLM's, where importable) against the bitwise reference.

GPU only: Triton kernels need a CUDA device, and the reference takes ex2.approx / div.full bits
from the hardware (`hardware_approximations()`). `routing_inputs` is shared with the CuTe DSL
router's GPU tests (tests/kernels/test_routing_gpu.py): one generator of random and adversarial
rows for every router. Not yet run on a GPU.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from musebench import config
from musebench import numerics as nx
from musebench.stock.routing import routing_reference

pytestmark = pytest.mark.gpu

E, K, B = config.NUM_EXPERTS, config.TOP_K, config.MAX_DECODE_TOKENS
INF = float("inf")
SCALES = (1.0, 2.5, 0.7303)  # exact, exact in binary32, rounded once to binary32

# Row kinds; each regime says what it exercises.
ADVERSARIAL_ROWS = (
    "all_equal",  # 256-way tie: experts 0..7, lowest index first
    "nine_tied",  # nine equal maxima: the lowest eight indices, in order
    "signed_zeros",  # -0.0 and +0.0 logits give equal scores: index order
    "plus_inf",  # +inf logits: score exactly 1.0, tied
    "minus_inf",  # -inf logits: score +0.0 everywhere, sum = eps only
    "huge",  # |logit| ~ 100: ex2 overflows / underflows, scores 0 or 1
    "tiny",  # subnormal logits: scores all 0.5
    "one_lane",  # the whole top-8 inside one lane (experts 8l..8l+7)
    "last_lane",  # the top-8 in the last lane, ties with the rest
    "near_tie",  # scores one ulp apart
)
BIAS_KINDS = (
    "zero",  # selection by score only
    "small",  # typical trained biases
    "reorder",  # large biases on low-score experts: keys reorder the top-8
    "signed_zero",  # -0.0 and +0.0 biases
    "minus_inf",  # -inf biases on all but 5 experts: expert 0 repeats (the stock's quirk)
)


def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.sha256(repr(parts).encode()).digest()  # stable across processes (no hash())
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def adversarial_row(kind: str, g: torch.Generator) -> torch.Tensor:
    row = torch.randn(E, generator=g)
    if kind == "all_equal":
        row = torch.full((E,), 0.25)
    elif kind == "nine_tied":
        row = torch.full((E,), -2.0)
        row[torch.randperm(E, generator=g)[:9]] = 3.0
    elif kind == "signed_zeros":
        row = torch.where(torch.rand(E, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
        row[torch.randperm(E, generator=g)[:3]] = -1.0
    elif kind == "plus_inf":
        row[torch.randperm(E, generator=g)[:11]] = INF
    elif kind == "minus_inf":
        row = torch.full((E,), -INF)
    elif kind == "huge":
        row = torch.where(torch.rand(E, generator=g) < 0.5, -100.0, 100.0) * torch.rand(E, generator=g).add(1.0)
    elif kind == "tiny":
        row = torch.randn(E, generator=g) * 1e-40
    elif kind == "one_lane":
        lane = int(torch.randint(0, 32, (1,), generator=g))
        row = torch.full((E,), -5.0)
        row[8 * lane : 8 * lane + 8] = 5.0 + torch.randint(0, 3, (8,), generator=g).float() * 0.25  # ties inside the lane
    elif kind == "last_lane":
        row = torch.full((E,), 1.0)
        row[248:] = 1.0 + 2.0**-20
    elif kind == "near_tie":
        base = torch.full((E,), 0.3)
        row = torch.nextafter(base, torch.where(torch.rand(E, generator=g) < 0.5, -INF, INF))
    else:
        raise ValueError(kind)
    return row.float()


def make_bias(kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "zero":
        return torch.zeros(E)
    if kind == "small":
        return torch.randn(E, generator=g) * 0.01
    if kind == "reorder":
        bias = torch.zeros(E)
        bias[torch.randperm(E, generator=g)[:12]] = 0.75
        return bias
    if kind == "signed_zero":
        return torch.where(torch.rand(E, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
    if kind == "minus_inf":
        bias = torch.full((E,), -INF)
        bias[torch.randperm(E, generator=g)[:5]] = 0.0
        return bias
    raise ValueError(kind)


def routing_inputs(seed: int, b: int, *, adversarial: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [b, 256], bias [256]) on CPU, float32, NaN-free; seeded and reproducible."""
    g = _generator("routing", seed, b, adversarial)
    spread = (0.5, 2.0, 8.0, 30.0)[seed % 4]
    logits = torch.randn(b, E, generator=g) * spread
    if not adversarial:
        return logits.float(), make_bias(("zero", "small", "small", "reorder")[seed % 4], g)
    for t in range(b):
        logits[t] = adversarial_row(ADVERSARIAL_ROWS[(seed + t) % len(ADVERSARIAL_ROWS)], g)
    return logits.float(), make_bias(BIAS_KINDS[seed % len(BIAS_KINDS)], g)


def assert_routes_equal(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor], what: str) -> None:
    """ids equal; weights equal on raw bits (two NaNs count as equal). Names the first mismatch."""
    got_ids, got_w = got
    want_ids, want_w = want
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32, what
    if not torch.equal(got_ids.cpu(), want_ids.cpu()):
        row = int((got_ids.cpu() != want_ids.cpu()).any(dim=1).nonzero()[0])
        raise AssertionError(f"{what}: ids differ first in token {row}: got {got_ids[row].tolist()}, want {want_ids[row].tolist()}")
    g, w = got_w.cpu(), want_w.cpu()
    differ = (g.view(torch.int32) != w.view(torch.int32)) & ~(torch.isnan(g) & torch.isnan(w))
    if bool(differ.any()):
        where = tuple(differ.nonzero()[0].tolist())
        ulp = int(nx.ulp_distance(g[differ], w[differ]).max())
        raise AssertionError(
            f"{what}: {int(differ.sum())} weights differ; first at {where}: got {float(g[where])!r} "
            f"({int(g.view(torch.int32)[where]) & 0xFFFFFFFF:#010x}), want {float(w[where])!r} "
            f"({int(w.view(torch.int32)[where]) & 0xFFFFFFFF:#010x}); max ULP {ulp}"
        )


def hardware_reference(logits: torch.Tensor, bias: torch.Tensor, *, scale: float, renormalize: bool, division_eps=config.ROUTER_SCORE_DIVISION_EPS):
    from musebench.kernels.approx import hardware_approximations  # CuTe DSL, GPU only

    return routing_reference(
        logits.cuda(), bias.cuda(), route_scale=scale, renormalize=renormalize, division_eps=division_eps,
        approximations=hardware_approximations(),
    )


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton_routing():
    pytest.importorskip("triton")
    from musebench.stock.triton_routing import triton_routing as run

    return run


# Regimes: every b (1..8) x random / adversarial x renormalize on / off, 12 seeds (each seed a
# different spread, scale and bias kind).
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "scale"])
@pytest.mark.parametrize("b", range(1, B + 1))
def test_triton_stock_matches_reference(triton_routing, b, renormalize, adversarial):
    from musebench.kernels.approx import hardware_approximations

    assert hardware_approximations().name == "hardware"
    for seed in range(12):
        logits, bias = routing_inputs(seed, b, adversarial=adversarial)
        scale = SCALES[seed % len(SCALES)]
        got = triton_routing(logits.cuda(), bias.cuda(), route_scale=scale, renormalize=renormalize)
        want = hardware_reference(logits, bias, scale=scale, renormalize=renormalize)
        assert_routes_equal(got, want, f"b={b} seed={seed} renormalize={renormalize} adversarial={adversarial}")


@pytest.mark.parametrize("division_eps", [None, 1e-3], ids=["no-eps", "eps-1e-3"])
def test_triton_stock_other_eps(triton_routing, division_eps):
    # No eps: all-(-inf) rows divide 0 by 0 -> NaN weights, as the stock does.
    for seed in range(6):
        logits, bias = routing_inputs(seed, B, adversarial=True)
        got = triton_routing(logits.cuda(), bias.cuda(), route_scale=2.5, division_eps=division_eps)
        want = hardware_reference(logits, bias, scale=2.5, renormalize=True, division_eps=division_eps)
        assert_routes_equal(got, want, f"seed={seed} eps={division_eps}")


def test_triton_stock_writes_given_outputs_and_empty_batch(triton_routing):
    logits, bias = routing_inputs(0, 3, adversarial=False)
    ids = torch.full((3, K), -7, dtype=torch.int32, device="cuda")
    weights = torch.full((3, K), -7.0, device="cuda")
    got = triton_routing(logits.cuda(), bias.cuda(), route_scale=1.0, ids=ids, weights=weights)
    assert got[0] is ids and got[1] is weights
    assert_routes_equal(got, hardware_reference(logits, bias, scale=1.0, renormalize=True), "given outputs")
    empty = triton_routing(torch.zeros(0, E, device="cuda"), bias.cuda(), route_scale=1.0)
    assert empty[0].shape == (0, K) and empty[1].shape == (0, K)


def test_triton_stock_with_pdl(triton_routing):
    import triton.language as tl

    if not hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait"):
        pytest.skip("this Triton has no tl.extra.cuda.gdc_wait")
    logits, bias = routing_inputs(3, B, adversarial=True)
    got = triton_routing(logits.cuda(), bias.cuda(), route_scale=2.5, enable_pdl=True)
    assert_routes_equal(got, hardware_reference(logits, bias, scale=2.5, renormalize=True), "pdl")


def test_triton_stock_refuses_bad_arguments(triton_routing):
    logits = torch.zeros(2, E, device="cuda")
    bias = torch.zeros(E, device="cuda")
    for args in (
        {"logits": logits.double()},
        {"logits": torch.zeros(2, 100, device="cuda")},
        {"bias": torch.zeros(E + 1, device="cuda")},
        {"top_k": 6},
        {"route_scale": float("nan")},
        {"division_eps": float("inf")},
        {"renormalize": 1},
        {"ids": torch.zeros(2, K, dtype=torch.int64, device="cuda")},
    ):
        call = {"logits": logits, "bias": bias, "route_scale": 1.0} | args
        with pytest.raises(ValueError):
            triton_routing(call.pop("logits"), call.pop("bias"), **call)


def test_vllm_stock_matches_the_project_triton_stock(triton_routing):
    pytest.importorskip("vllm.models.muse_spark.common.ops.fused_routing")
    from musebench.stock.triton_routing import vllm_routing

    for seed in range(12):
        for b in (1, 4, 8):
            logits, bias = routing_inputs(seed, b, adversarial=bool(seed % 2))
            scale = SCALES[seed % len(SCALES)]
            want = triton_routing(logits.cuda(), bias.cuda(), route_scale=scale)
            got = vllm_routing(logits.cuda(), bias.cuda(), route_scale=scale)
            assert_routes_equal(got, want, f"vllm b={b} seed={seed}")


def test_vllm_adapter_explains_a_missing_vllm():
    try:
        import vllm.models.muse_spark.common.ops.fused_routing  # noqa: F401
    except ImportError:
        from musebench.stock.triton_routing import vllm_routing

        with pytest.raises(ImportError, match="vllm_routing needs vLLM with Muse Spark support"):
            vllm_routing(torch.zeros(1, E, device="cuda"), torch.zeros(E, device="cuda"), route_scale=1.0)
    else:
        pytest.skip("vLLM is importable here")
