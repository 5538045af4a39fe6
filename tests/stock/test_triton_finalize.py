"""musebench's Triton stock finalize against the float64 reference (and vLLM's kernel, bit for bit).

CPU: argument checks (ValueError before any launch), the reference's semantics, its one-rounding
BF16 conversion, and the error bound itself against a real fp32 pipeline (the EP stock model).
GPU (@pytest.mark.gpu): the Triton kernel within the bound of `musebench.stock.triton_finalize`,
vLLM's kernel bitwise, CUDA-graph replay bitwise. H200, 06837f0: 69 passed, vLLM's skipped (not installed).
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from musebench import config
from musebench import numerics as nx
from musebench.layout import UnfinalizedMoEOutput
from musebench.stock import ep
from musebench.stock import triton_finalize as tf
from musebench.stock.triton_finalize import finalize_reference

W, K, B = config.MOE_POOLED_WIDTH, config.TOP_K, config.MAX_DECODE_TOKENS
EPS, GAIN = config.POST_NORM_EPS, config.POST_NORM_GAIN_CENTER
ERROR_UNITS = 2.0**-16  # fp32 error budget per unit of sum_k |term_k| (~40 rounding units, 6x slack)
TINY = 2.0**-126  # below this fp32 errors are absolute, not relative
WELL_CONDITIONED = 1 / 16  # budget under this fraction of a BF16 ULP: at most 1 ULP apart

# Adversarial tokens; each says what it exercises.
ADVERSARIAL_TOKENS = (
    "none_held",  # every route -1: the output row is exactly zero
    "zero_rows",  # held all-zero rows: scale = r / sqrt(eps), contribution 0
    "order",  # +-2^24 beside 1.0: the ones vanish from the sum of squares in any order
    "signed_zeros",  # -0.0 / +0.0 entries and an all -0.0 row
    "subnormal",  # BF16 subnormals beside normal values, and an all-subnormal row
    "cancel",  # routes holding x and -x with equal weights: the sum cancels to ~0
    "shared_row",  # two routes index the same permuted row
    "magnitudes",  # rows at 2^40 and 2^-60 in one token: route norms 2^100 apart
    "one_held",  # a single held route
    "zero_weight",  # held routes with route weight 0
)


def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.sha256(repr(parts).encode()).digest()  # stable across processes (no hash())
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _token_routes(kind: str, g: torch.Generator, width: int) -> tuple[list[torch.Tensor | None], list[float | None]]:
    """One token's rows per route (None: -1; the same object twice: one shared row) and weight overrides."""
    def rnd() -> torch.Tensor:
        return torch.randn(width, generator=g)

    held = torch.rand(K, generator=g) < 0.6
    routes: list[torch.Tensor | None] = [rnd() if bool(h) else None for h in held]
    weights: list[float | None] = [None] * K
    if kind == "random":
        return routes, weights
    if kind == "none_held":
        routes = [None] * K
    elif kind == "zero_rows":
        routes[0], routes[3] = torch.zeros(width), torch.zeros(width)
    elif kind == "order":
        big = torch.where(torch.arange(width) % 5 == 0, 2.0**24, 1.0) * torch.where(torch.rand(width, generator=g) < 0.5, -1.0, 1.0)
        routes[1], routes[6] = big, big.roll(1)
    elif kind == "signed_zeros":
        routes[2] = torch.where(torch.rand(width, generator=g) < 0.5, -0.0, rnd())
        routes[5] = torch.full((width,), -0.0)
    elif kind == "subnormal":
        routes[0] = torch.where(torch.rand(width, generator=g) < 0.5, rnd() * 2.0**-130, rnd())
        routes[4] = rnd() * 2.0**-131
    elif kind == "cancel":
        x = rnd()
        routes[2], routes[3] = x, -x
        weights[2] = weights[3] = 0.375
    elif kind == "shared_row":
        routes[1] = routes[7] = rnd()
    elif kind == "magnitudes":
        routes[0], routes[5] = rnd() * 2.0**40, rnd() * 2.0**-60
    elif kind == "one_held":
        routes = [None] * K
        routes[int(torch.randint(0, K, (1,), generator=g))] = rnd()
    elif kind == "zero_weight":
        routes[0], routes[1] = rnd(), rnd()
        weights[0] = weights[1] = 0.0
    else:
        raise ValueError(kind)
    return routes, weights


def finalize_inputs(
    seed: int, m: int, *, weights_dtype: torch.dtype, adversarial: bool, width: int = W
) -> tuple[UnfinalizedMoEOutput, torch.Tensor]:
    """(one rank's UnfinalizedMoEOutput, BF16 gamma [width]) on CPU; seeded and reproducible."""
    g = _generator("finalize", seed, m, str(weights_dtype), adversarial, width)
    spread = (0.5, 3.0, 40.0)[seed % 3]
    route_weights = torch.rand(m, K, generator=g) * 0.5
    index = torch.full((m, K), -1, dtype=torch.int32)
    held_rows: list[torch.Tensor] = []
    placed: list[tuple[int, int, int]] = []
    for t in range(m):
        kind = ADVERSARIAL_TOKENS[(seed + t) % len(ADVERSARIAL_TOKENS)] if adversarial else "random"
        routes, overrides = _token_routes(kind, g, width)
        distinct: dict[int, int] = {}  # id(row) -> slot in `held_rows`; per token, while its rows are alive
        for k, row in enumerate(routes):
            if overrides[k] is not None:
                route_weights[t, k] = overrides[k]
            if row is None:
                continue
            if id(row) not in distinct:
                distinct[id(row)] = len(held_rows)
                held_rows.append(row * (spread if kind == "random" else 1.0))
            placed.append((t, k, distinct[id(row)]))
    fillers = [torch.randn(width, generator=g) for _ in range(3)]  # rows no route of this rank reads
    stacked = torch.stack(held_rows + fillers)
    order = torch.randperm(stacked.shape[0], generator=g)  # permuted order, as the expert GEMM leaves it
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel())
    for t, k, slot in placed:
        index[t, k] = int(position[slot])
    rows = stacked[order].to(torch.bfloat16).contiguous()
    gamma = torch.randn(width, generator=g) * 0.1
    if adversarial:
        gamma[torch.randperm(width, generator=g)[: width // 16]] = -GAIN  # w = 0 exactly
        gamma[torch.randperm(width, generator=g)[: width // 16]] = 3.0
    return UnfinalizedMoEOutput(rows, route_weights.to(weights_dtype), index), gamma.to(torch.bfloat16)


def error_budget(unfinalized: UnfinalizedMoEOutput, gamma: torch.Tensor, *, eps: float, before: bool) -> torch.Tensor:
    """float64 [m, width]: ERROR_UNITS * sum_k (|s_k| + TINY) * |scale_k| (* |w| after the norm)."""
    index = unfinalized.expanded_idx_to_permuted_idx.long()
    held = index >= 0
    rows = unfinalized.gemm2_permuted.to(torch.float64)
    x = torch.where(held[..., None], rows[index.clamp(min=0)], 0.0)
    w = gamma.to(torch.float64) + GAIN
    s = x * w if before else x
    scale = unfinalized.route_weights.to(torch.float64).abs() / torch.sqrt((s * s).mean(dim=-1) + eps)
    total = ((s.abs() + TINY * held[..., None]) * scale[..., None]).sum(dim=1)
    return ERROR_UNITS * (total if before else total * w.abs())


def bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """float64: the BF16 ULP at |values| (2^-133 at and below the subnormal range)."""
    exponent = torch.floor(torch.log2(values.abs())).clamp(min=-126)
    return torch.exp2(exponent - 7)


def assert_within_budget(got: torch.Tensor, want: torch.Tensor, budget: torch.Tensor, what: str) -> tuple[int, float]:
    """|got - want| <= ULP + budget everywhere, and <= 1 ULP where budget <= ULP/16.

    Returns (max ULP distance where well conditioned, fraction well conditioned). Names the first
    failing element with its bits on failure.
    """
    got, want, budget = got.cpu(), want.cpu(), budget.cpu()
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, what
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite output at {tuple((~torch.isfinite(got)).nonzero()[0].tolist())}"
    g64, w64 = got.to(torch.float64), want.to(torch.float64)
    error = (g64 - w64).abs()
    distance = nx.ulp_distance(got, want)
    well = budget <= bf16_ulp(w64) * WELL_CONDITIONED

    def describe(mask: torch.Tensor, rule: str) -> str:
        where = tuple(mask.nonzero()[0].tolist())
        return (
            f"{what}: {int(mask.sum())} elements break '{rule}'; first at {where}: got {float(got[where])!r} "
            f"({int(nx.bits(got)[where]) & 0xFFFF:#06x}), want {float(want[where])!r} ({int(nx.bits(want)[where]) & 0xFFFF:#06x}), "
            f"{int(distance[where])} ULP, budget {float(budget[where]):.3g}; max ULP overall {int(distance.max())}"
        )

    outside = error > bf16_ulp(torch.maximum(g64.abs(), w64.abs())) + budget
    assert not bool(outside.any()), describe(outside, "|got - want| <= ULP + budget")
    loose = well & (distance > 1)
    assert not bool(loose.any()), describe(loose, "<= 1 ULP where well conditioned")
    return int(distance[well].max()) if bool(well.any()) else 0, float(well.double().mean())


# --------------------------------------------------------------------------------------------- CPU


def _small_arguments(m: int = 2, width: int = 64) -> dict:
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(5, width, generator=g).to(torch.bfloat16)
    index = torch.tensor([[0, -1, 2, 3, -1, 4, -1, 1], [-1, -1, -1, 0, 1, -1, 2, -1]][:m], dtype=torch.int32)
    weights = torch.rand(m, K, generator=g)
    return {
        "unfinalized": UnfinalizedMoEOutput(rows, weights, index),
        "norm_weight": (torch.randn(width, generator=g) * 0.1).to(torch.bfloat16),
        "out": torch.empty(m, width, dtype=torch.bfloat16),
        "eps": EPS,
        "gain_center": GAIN,
        "weight_before_norm": True,
    }


def _misaligned(shape: tuple[int, int]) -> torch.Tensor:
    flat = torch.empty(shape[0] * shape[1] + 8, dtype=torch.bfloat16)
    return flat[1 : 1 + shape[0] * shape[1]].view(shape)


def _with(arguments: dict, **fields) -> dict:
    u = arguments["unfinalized"]
    parts = {"gemm2_permuted": u.gemm2_permuted, "route_weights": u.route_weights, "expanded_idx_to_permuted_idx": u.expanded_idx_to_permuted_idx}
    parts.update({k: v for k, v in fields.items() if k in parts})
    rest = {k: v for k, v in fields.items() if k not in parts}
    return arguments | {"unfinalized": UnfinalizedMoEOutput(**parts)} | rest


def _bad_arguments() -> list[tuple[str, dict, str]]:
    a = _small_arguments()
    return [
        ("rows-dtype", _with(a, gemm2_permuted=a["unfinalized"].gemm2_permuted.float()), "gemm2_permuted must be"),
        ("rows-width", _with(a, gemm2_permuted=torch.zeros(5, 60, dtype=torch.bfloat16)), "multiple of 8"),
        ("rows-stride", _with(a, gemm2_permuted=torch.zeros(5, 68, dtype=torch.bfloat16)[:, :64]), "16-byte aligned rows"),
        ("rows-base", _with(a, gemm2_permuted=_misaligned((5, 64))), "16-byte aligned rows"),
        ("weights-dtype", _with(a, route_weights=a["unfinalized"].route_weights.half()), "route_weights must be"),
        ("weights-columns", _with(a, route_weights=torch.zeros(K, 2).t()), "unit column stride"),
        ("index-dtype", _with(a, expanded_idx_to_permuted_idx=a["unfinalized"].expanded_idx_to_permuted_idx.long()), "expanded_idx_to_permuted_idx"),
        ("index-shape", _with(a, expanded_idx_to_permuted_idx=torch.zeros(2, 4, dtype=torch.int32)), "expanded_idx_to_permuted_idx"),
        ("gamma-dtype", a | {"norm_weight": a["norm_weight"].float()}, "norm_weight must be"),
        ("gamma-shape", a | {"norm_weight": a["norm_weight"][:32]}, "norm_weight must be"),
        ("out-dtype", a | {"out": torch.empty(2, 64)}, "out must be"),
        ("out-shape", a | {"out": torch.empty(3, 64, dtype=torch.bfloat16)}, "out must be"),
        ("out-base", a | {"out": _misaligned((2, 64))}, "out must have unit column stride and 16-byte aligned rows"),
        ("eps", a | {"eps": float("nan")}, "eps must be"),
        ("gain", a | {"gain_center": float("inf")}, "gain_center must be"),
        ("order", a | {"weight_before_norm": 1}, "weight_before_norm must be"),
        ("type", a | {"unfinalized": tuple(vars(a["unfinalized"]).values())}, "UnfinalizedMoEOutput"),
        ("tile", _with(a, gemm2_permuted=torch.zeros(5, 16384, dtype=torch.bfloat16)) | {
            "norm_weight": torch.zeros(16384, dtype=torch.bfloat16), "out": torch.empty(2, 16384, dtype=torch.bfloat16)}, "single-tile"),
        ("cpu", a, "one CUDA device"),  # everything else valid: the device is the last check
    ]


@pytest.fixture
def no_launch(monkeypatch):
    """Any attempt to build or launch the kernel fails the test (and never imports Triton)."""
    def refuse():
        raise AssertionError("the kernel was reached")

    monkeypatch.setattr(tf, "_kernel", refuse)


@pytest.mark.parametrize("name,arguments,message", _bad_arguments(), ids=[c[0] for c in _bad_arguments()])
def test_bad_arguments_raise_before_launch(no_launch, name, arguments, message):
    call = dict(arguments)
    with pytest.raises(ValueError, match=message):
        tf.triton_finalize(call.pop("unfinalized"), call.pop("norm_weight"), call.pop("out"), **call)


def test_vllm_adapter_explains_a_missing_vllm():
    try:
        import vllm.models.muse_spark.common.ops.fused_finalize  # noqa: F401
    except ImportError:
        call = _small_arguments()
        with pytest.raises(ImportError, match="vllm_finalize needs vLLM with Muse Spark support"):
            tf.vllm_finalize(call.pop("unfinalized"), call.pop("norm_weight"), call.pop("out"), **call)
    else:
        pytest.skip("vLLM is importable here")


def test_float64_to_bf16_rounds_once():
    one_step = 2.0**-7  # BF16 ULP at 1.0
    values = torch.tensor(
        [
            1.0 + one_step / 2 + 2.0**-30,  # just above a tie: up (float32 first would make it a tie, then even = down)
            -(1.0 + one_step / 2 + 2.0**-30),
            1.0 + one_step / 2,  # an exact tie: to even
            1.0 + 3 * one_step / 2 - 2.0**-30,  # just below a tie: down
            2.5 * 2.0**-133 + 2.0**-160,  # subnormal just above a tie: up (torch: to even, down)
            0.1,
            0.0,
        ],
        dtype=torch.float64,
    )
    want = [1.0 + one_step, -(1.0 + one_step), 1.0, 1.0 + one_step, 3.0 * 2.0**-133, 0.10009765625, 0.0]
    got = tf._float64_to_bf16(values)
    assert got.to(torch.float64).tolist() == want
    twice = values.float().to(torch.bfloat16).to(torch.float64).tolist()
    assert twice[0] != want[0] and twice[4] != want[4]  # torch's two roundings miss both


def test_reference_weight_before_and_after_the_norm():
    # width 8, one route of ones, w = 2 on half the columns: both orders by hand. eps 1e-30 vanishes
    # beside a mean square of 1 in float64 yet keeps the -1 routes at 0 * finite (eps 0: 0 * inf).
    ones = torch.ones(1, 8, dtype=torch.bfloat16)
    gamma = torch.tensor([1.0] * 4 + [0.0] * 4, dtype=torch.bfloat16)  # + gain 1 -> w = 2, 1
    index = torch.tensor([[0] + [-1] * (K - 1)], dtype=torch.int32)
    weights = torch.tensor([[0.5] + [0.25] * (K - 1)])
    u = UnfinalizedMoEOutput(ones, weights, index)
    after = finalize_reference(u, gamma, eps=1e-30, gain_center=1.0, weight_before_norm=False)
    assert after.double().tolist() == [[1.0] * 4 + [0.5] * 4]  # x / rms(x) = 1, times r = 0.5, times w
    before = finalize_reference(u, gamma, eps=1e-30, gain_center=1.0, weight_before_norm=True)
    rms = (20.0 / 8) ** 0.5  # mean of 2^2 (x4) and 1^2 (x4)
    want = tf._float64_to_bf16(torch.tensor([[2.0 * 0.5 / rms] * 4 + [0.5 / rms] * 4], dtype=torch.float64))
    assert torch.equal(before.view(torch.int16), want.view(torch.int16))


def test_reference_minus_one_routes_contribute_nothing():
    u, gamma = finalize_inputs(5, 4, weights_dtype=torch.float32, adversarial=False, width=256)
    index = u.expanded_idx_to_permuted_idx
    for before in (True, False):
        got = finalize_reference(u, gamma, eps=EPS, gain_center=GAIN, weight_before_norm=before)
        # the same routes through their rows but with weight 0: the same result
        pointed = torch.where(index < 0, 0, index)
        zero_weight = torch.where(index < 0, 0.0, u.route_weights)
        same = finalize_reference(UnfinalizedMoEOutput(u.gemm2_permuted, zero_weight, pointed), gamma, eps=EPS, gain_center=GAIN, weight_before_norm=before)
        assert torch.equal(got.view(torch.int16), same.view(torch.int16))
        nothing = finalize_reference(UnfinalizedMoEOutput(u.gemm2_permuted, u.route_weights, torch.full_like(index, -1)), gamma,
                                     eps=EPS, gain_center=GAIN, weight_before_norm=before)
        assert not bool(nothing.view(torch.int16).any())  # +0.0 bits, never -0.0


def test_reference_empty_batch_and_no_rows():
    u = UnfinalizedMoEOutput(torch.zeros(0, 64, dtype=torch.bfloat16), torch.zeros(0, K), torch.zeros(0, K, dtype=torch.int32))
    out = finalize_reference(u, torch.zeros(64, dtype=torch.bfloat16), eps=EPS, gain_center=GAIN, weight_before_norm=True)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    u = UnfinalizedMoEOutput(torch.zeros(0, 64, dtype=torch.bfloat16), torch.ones(2, K), torch.full((2, K), -1, dtype=torch.int32))
    out = finalize_reference(u, torch.zeros(64, dtype=torch.bfloat16), eps=EPS, gain_center=GAIN, weight_before_norm=False)
    assert out.shape == (2, 64) and not bool(out.view(torch.int16).any())


def test_reference_refuses_an_index_outside_the_rows():
    a = _small_arguments()
    bad = a["unfinalized"].expanded_idx_to_permuted_idx.clone()
    bad[0, 0] = 5
    with pytest.raises(ValueError):
        finalize_reference(UnfinalizedMoEOutput(a["unfinalized"].gemm2_permuted, a["unfinalized"].route_weights, bad), a["norm_weight"],
                           eps=EPS, gain_center=GAIN, weight_before_norm=True)


# Regimes: both norm orders x random / adversarial tokens: a real fp32 pipeline (the EP stock's
# exact model, another reduction order, fma accumulation) stays inside the budget the GPU tests use.
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
@pytest.mark.parametrize("before", [True, False], ids=["weight-before", "weight-after"])
def test_budget_holds_for_an_fp32_pipeline(before, adversarial):
    for seed in range(3):
        u, gamma = finalize_inputs(seed, 4, weights_dtype=torch.float32, adversarial=adversarial)
        got = ep.ep_partial(u, gamma, eps=EPS, gain_center=GAIN, weight_before_norm=before)
        want = finalize_reference(u, gamma, eps=EPS, gain_center=GAIN, weight_before_norm=before)
        worst, well = assert_within_budget(got, want, error_budget(u, gamma, eps=EPS, before=before), f"seed={seed}")
        if not adversarial:
            assert well > 0.9, f"only {well:.1%} well conditioned: the 1-ULP check would be vacuous"


# --------------------------------------------------------------------------------------------- GPU


@pytest.fixture(scope="module")
def triton_finalize():
    pytest.importorskip("triton")
    return tf.triton_finalize


def _run(run, u: UnfinalizedMoEOutput, gamma: torch.Tensor, before: bool, out: torch.Tensor | None = None, eps: float = EPS) -> torch.Tensor:
    u, gamma = u.to("cuda"), gamma.cuda()
    if out is None:
        out = torch.full((u.tokens, u.width), float("nan"), dtype=torch.bfloat16, device="cuda")
    return run(u, gamma, out, eps=eps, gain_center=GAIN, weight_before_norm=before)


# Regimes: every m (1..8) x route weights BF16 / FP32 x weight before / after the norm x random /
# adversarial tokens (each seed starts the adversarial cycle at another kind).
@pytest.mark.gpu
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
@pytest.mark.parametrize("before", [True, False], ids=["weight-before", "weight-after"])
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weights", "fp32-weights"])
@pytest.mark.parametrize("m", range(1, B + 1))
def test_triton_stock_matches_reference(triton_finalize, m, weights_dtype, before, adversarial):
    for seed in range(4):
        u, gamma = finalize_inputs(seed, m, weights_dtype=weights_dtype, adversarial=adversarial)
        got = _run(triton_finalize, u, gamma, before)
        want = finalize_reference(u, gamma, eps=EPS, gain_center=GAIN, weight_before_norm=before)
        what = f"m={m} {weights_dtype} before={before} adversarial={adversarial} seed={seed}"
        _, well = assert_within_budget(got, want, error_budget(u, gamma, eps=EPS, before=before), what)
        if not adversarial:
            assert well > 0.9, f"{what}: only {well:.1%} well conditioned"
        none_held = (u.expanded_idx_to_permuted_idx < 0).all(dim=1).cuda()
        assert not bool(got[none_held].float().abs().sum()), f"{what}: a token with no held route is not zero"


@pytest.mark.gpu
def test_triton_stock_other_eps_and_padded_strides(triton_finalize):
    # eps 1e-5 and rows / outputs with a padded row stride (still 16-byte aligned)
    u, gamma = finalize_inputs(11, B, weights_dtype=torch.float32, adversarial=True)
    padded = torch.zeros(u.gemm2_permuted.shape[0], W + 64, dtype=torch.bfloat16, device="cuda")[:, :W]
    padded.copy_(u.gemm2_permuted)
    out = torch.zeros(B, W + 8, dtype=torch.bfloat16, device="cuda")[:, :W]
    for before in (True, False):
        got = triton_finalize(UnfinalizedMoEOutput(padded, u.route_weights.cuda(), u.expanded_idx_to_permuted_idx.cuda()),
                              gamma.cuda(), out, eps=1e-5, gain_center=GAIN, weight_before_norm=before)
        assert got is out
        want = finalize_reference(u, gamma, eps=1e-5, gain_center=GAIN, weight_before_norm=before)
        assert_within_budget(got, want, error_budget(u, gamma, eps=1e-5, before=before), f"padded before={before}")


@pytest.mark.gpu
def test_triton_stock_drops_a_route_whose_squares_overflow(triton_finalize):
    # A fact of the stock, outside the reference's bound: sum(x*x) = inf, rsqrt(inf) = 0.
    u, gamma = finalize_inputs(2, 1, weights_dtype=torch.float32, adversarial=False)
    held = int((u.expanded_idx_to_permuted_idx[0] >= 0).nonzero()[0])
    rows = u.gemm2_permuted.clone()
    rows[int(u.expanded_idx_to_permuted_idx[0, held])] = (torch.randn(W) * 2.0**70).to(torch.bfloat16)
    index_without = u.expanded_idx_to_permuted_idx.clone()
    index_without[0, held] = -1
    for before in (True, False):
        got = _run(triton_finalize, UnfinalizedMoEOutput(rows, u.route_weights, u.expanded_idx_to_permuted_idx), gamma, before)
        dropped = _run(triton_finalize, UnfinalizedMoEOutput(rows, u.route_weights, index_without), gamma, before)
        assert torch.equal(got.float(), dropped.float())


@pytest.mark.gpu
def test_triton_stock_empty_batch_launches_nothing(triton_finalize, monkeypatch):
    u, gamma = finalize_inputs(0, 1, weights_dtype=torch.float32, adversarial=False)
    empty = UnfinalizedMoEOutput(u.gemm2_permuted.cuda(), torch.zeros(0, K, device="cuda"), torch.zeros(0, K, dtype=torch.int32, device="cuda"))
    monkeypatch.setattr(tf, "_kernel", lambda: pytest.fail("m = 0 reached the kernel"))
    out = torch.empty(0, W, dtype=torch.bfloat16, device="cuda")
    assert triton_finalize(empty, gamma.cuda(), out, eps=EPS, gain_center=GAIN, weight_before_norm=True) is out


@pytest.mark.gpu
def test_triton_stock_graph_replay_gives_the_eager_bits(triton_finalize):
    u, gamma = finalize_inputs(7, B, weights_dtype=torch.bfloat16, adversarial=True)
    u, gamma = u.to("cuda"), gamma.cuda()
    for before in (True, False):
        eager = triton_finalize(u, gamma, torch.empty(B, W, dtype=torch.bfloat16, device="cuda"), eps=EPS, gain_center=GAIN, weight_before_norm=before)
        out = torch.full((B, W), float("nan"), dtype=torch.bfloat16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            triton_finalize(u, gamma, out, eps=EPS, gain_center=GAIN, weight_before_norm=before)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16)), f"before={before}: replay differs from eager"
        # the graph reads the live buffers: new rows in place, replay again
        g = torch.Generator().manual_seed(8)
        u.gemm2_permuted.copy_(torch.randn(u.gemm2_permuted.shape, generator=g).to(torch.bfloat16))
        graph.replay()
        again = triton_finalize(u, gamma, torch.empty_like(out), eps=EPS, gain_center=GAIN, weight_before_norm=before)
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), again.view(torch.int16)), f"before={before}: replay after new rows differs"


@pytest.mark.gpu
def test_triton_stock_refuses_to_compile_under_capture(triton_finalize, monkeypatch):
    u, gamma = finalize_inputs(9, 3, weights_dtype=torch.float32, adversarial=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="call it once eagerly"):
        # a row stride never launched before: a new specialization
        rows = torch.zeros(u.gemm2_permuted.shape[0], W + 24, dtype=torch.bfloat16, device="cuda")[:, :W]
        triton_finalize(UnfinalizedMoEOutput(rows, u.route_weights.cuda(), u.expanded_idx_to_permuted_idx.cuda()), gamma.cuda(),
                        torch.empty(3, W, dtype=torch.bfloat16, device="cuda"), eps=EPS, gain_center=GAIN, weight_before_norm=True)


@pytest.mark.gpu
def test_vllm_stock_matches_the_project_triton_stock(triton_finalize):
    pytest.importorskip("vllm.models.muse_spark.common.ops.fused_finalize")
    from musebench.cases.tail_inputs import TailCase, make_tail_inputs

    def check(u: UnfinalizedMoEOutput, gamma: torch.Tensor, before: bool, what: str) -> None:
        want = _run(triton_finalize, u, gamma, before)
        got = _run(tf.vllm_finalize, u, gamma, before)
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            differ = got.view(torch.int16) != want.view(torch.int16)
            where = tuple(differ.nonzero()[0].tolist())
            raise AssertionError(
                f"vllm {what}: {int(differ.sum())} differ, first at {where}: {float(got[where])!r} vs "
                f"{float(want[where])!r}; max ULP {int(nx.ulp_distance(got, want).max())}"
            )

    for seed in range(6):
        for m in (1, 4, B):
            for weights_dtype in (torch.bfloat16, torch.float32):
                u, gamma = finalize_inputs(seed, m, weights_dtype=weights_dtype, adversarial=bool(seed % 2))
                for before in (True, False):
                    check(u, gamma, before, f"m={m} seed={seed} {weights_dtype} before={before}")
    # the benches' EP inputs, overflowing rows included (outside the reference's bound, not vLLM's bits)
    for inputs in ("random", "adversarial"):
        for weight_dtype in ("bf16", "fp32"):
            case = TailCase(mode="ep", tp=2, tokens=B, weight_dtype=weight_dtype, inputs=inputs, seed=3)
            tail = make_tail_inputs(case)
            for rank, u in enumerate(tail.per_rank):
                for before in (True, False):
                    check(u, tail.norm_weight, before, f"{case.label()} rank={rank} before={before}")
