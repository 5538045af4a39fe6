"""The stock router reference and the TRT-LLM-gen metadata reference (CPU, PRECISE stand-ins)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from musebench import config
from musebench.numerics import PRECISE, Approximations, mul
from musebench.routing_metadata import (
    HEADER_WORDS,
    RoutingMetadata,
    max_cta_count,
    metadata_size,
)
from musebench.stock.routing import (
    LOG2_E_F32_BITS,
    first_argmax,
    pack_metadata,
    routing_metadata_reference,
    routing_reference,
    sigmoid_scores,
)

E = config.NUM_EXPERTS
K = config.TOP_K
INF = float("inf")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# ---------------------------------------------------------------------------------------------
# A scalar model of the stock's arithmetic: Python doubles rounded to binary32 after every
# operation (exact for +, *, / of binary32 operands: 53 >= 2 * 24 + 2).


def r32(x: float) -> float:
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # rounds past the largest binary32
        return math.copysign(INF, x)


LOG2E32 = struct.unpack("<f", struct.pack("<I", 0x3FB8AA3B))[0]


def scalar_exp2(t: float) -> float:
    try:
        return r32(2.0**t)
    except OverflowError:
        return INF


def scalar_div(a: float, b: float) -> float:
    if b == 0.0:
        return math.nan if a == 0.0 else math.copysign(INF, a) * math.copysign(1.0, b)
    return r32(a / b)


def scalar_sigmoid(x: float) -> float:
    neg = r32(0.0 - x)
    return scalar_div(1.0, r32(1.0 + scalar_exp2(r32(neg * LOG2E32))))


def scalar_route(logits: list[float], bias: list[float], route_scale: float, eps: float | None, renormalize: bool = True, top_k: int = K):
    scores = [scalar_sigmoid(x) for x in logits]
    keys = [r32(s + b) for s, b in zip(scores, bias)]
    chosen = [False] * len(keys)
    ids, picked, total = [], [], 0.0
    for _ in range(top_k):
        masked = [-INF if c else v for c, v in zip(chosen, keys)]
        best = max(masked)
        winner = next(i for i, v in enumerate(masked) if v == best)
        chosen[winner] = True
        score = r32(scores[winner] + 0.0)
        ids.append(winner)
        picked.append(score)
        total = r32(total + score)
    scale = r32(route_scale)
    if renormalize:
        if eps is not None:
            total = r32(total + r32(eps))
        factor = scalar_div(scale, total)
    else:
        factor = scale
    weights = []
    for s in picked:
        p = s * factor
        weights.append(math.nan if math.isnan(p) else r32(p))
    return ids, weights


def _f32_list_bits(values: list[float]) -> list[int]:
    return [struct.unpack("<I", struct.pack("<f", v))[0] if not math.isnan(v) else 0x7FC00000 for v in values]


def _tensor_bits_list(t: torch.Tensor) -> list[int]:
    out = []
    for v, raw in zip(t.tolist(), (t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF).tolist()):
        out.append(0x7FC00000 if math.isnan(v) else raw)
    return out


def _assert_matches_scalar(logits, bias, *, route_scale, eps, renormalize=True, top_k=K):
    ids, weights = routing_reference(
        logits, bias, route_scale=route_scale, division_eps=eps, renormalize=renormalize, top_k=top_k
    )
    for t in range(logits.shape[0]):
        want_ids, want_w = scalar_route(logits[t].tolist(), bias.tolist(), route_scale, eps, renormalize, top_k)
        assert ids[t].tolist() == want_ids, f"token {t}"
        assert _tensor_bits_list(weights[t]) == _f32_list_bits(want_w), f"token {t}"
    return ids, weights


# ---------------------------------------------------------------------------------------------
# Router.


def test_log2e_constant_is_the_binary32_the_stock_uses():
    from musebench.numerics import LOG2_E, f32

    assert LOG2_E_F32_BITS == 0x3FB8AA3B
    assert int(_bits(f32(LOG2_E)).item()) == LOG2_E_F32_BITS
    assert int(_bits(f32(math.log2(math.e))).item()) == LOG2_E_F32_BITS


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("route_scale,eps", [(1.0, 1e-15), (2.5, 1e-15), (0.7303, None), (3.0, 1e-3)])
def test_matches_scalar_model_on_random_rows(seed, route_scale, eps):
    g = torch.Generator().manual_seed(1000 + seed)
    spread = [0.5, 2.0, 8.0, 30.0][seed % 4]
    logits = torch.randn(8, E, generator=g) * spread
    bias = torch.randn(E, generator=g) * [0.0, 0.01, 0.1, 1.0][seed % 4]
    _assert_matches_scalar(logits, bias, route_scale=route_scale, eps=eps)


def test_matches_scalar_model_renormalize_off():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, E, generator=g) * 3
    bias = torch.randn(E, generator=g) * 0.1
    ids, weights = _assert_matches_scalar(logits, bias, route_scale=2.5, eps=1e-15, renormalize=False)
    scores = sigmoid_scores(logits)
    assert _same_bits(weights, mul(torch.gather(scores, 1, ids.long()), torch.tensor(2.5)))


def test_renormalize_on_divides_by_the_sequential_sum_plus_eps():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, E, generator=g)
    bias = torch.zeros(E)
    ids, weights = routing_reference(logits, bias, route_scale=2.5)
    scores = torch.gather(sigmoid_scores(logits), 1, ids.long())
    total = torch.zeros(4)
    for k in range(K):
        total = total + scores[:, k]
    total = total + torch.tensor(1e-15, dtype=torch.float32)
    inv = torch.tensor(2.5) / total
    assert _same_bits(weights, scores * inv.unsqueeze(1))


def test_small_batches_and_empty_batch():
    g = torch.Generator().manual_seed(11)
    bias = torch.randn(E, generator=g) * 0.05
    for b in range(0, 9):
        logits = torch.randn(b, E, generator=g)
        ids, weights = routing_reference(logits, bias, route_scale=1.0)
        assert ids.shape == (b, K) and ids.dtype == torch.int32
        assert weights.shape == (b, K) and weights.dtype == torch.float32


def test_ties_lowest_index_wins():
    logits = torch.full((1, E), -3.0)
    tied = [3, 7, 10, 50, 90, 120, 121, 200, 255]
    logits[0, tied] = 2.0
    ids, _ = routing_reference(logits, torch.zeros(E), route_scale=1.0)
    assert ids[0].tolist() == sorted(tied)[:K]
    # All equal: the first eight experts, in index order.
    ids, weights = routing_reference(torch.zeros(2, E), torch.zeros(E), route_scale=1.0)
    assert ids.tolist() == [list(range(K))] * 2
    assert torch.all(weights == weights[0, 0])


def test_ties_created_by_the_bias():
    # Unbiased scores differ (0.0 vs 1.0), the biased keys tie at exactly 1.0: index order
    # decides, not the unbiased score.
    logits = torch.full((1, E), -20.0)
    logits[0, 30] = -INF  # score +0.0
    logits[0, 40] = INF  # score 1.0
    bias = torch.zeros(E)
    bias[30] = 1.0
    ids, weights = _assert_matches_scalar(logits, bias, route_scale=1.0, eps=1e-15)
    assert ids[0, :2].tolist() == [30, 40]
    assert _bits(weights[0, 0]).item() == 0 and weights[0, 1] > 0


def test_signed_zero_keys_tie():
    # first_argmax treats -0.0 and +0.0 as equal: lowest index wins either way round.
    keys = torch.tensor([[-1.0, -0.0, 0.0, -2.0], [-1.0, 0.0, -0.0, -2.0]])
    assert first_argmax(keys).tolist() == [1, 1]
    # Through the router: logits -inf give score +0.0; biases of -0.0 / +0.0 keep the keys zero.
    logits = torch.full((1, E), -INF)
    bias = torch.full((E,), -1.0)
    bias[[5, 9, 12, 33, 34, 60, 61, 70, 71]] = torch.tensor([-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0])
    ids, weights = routing_reference(logits, bias, route_scale=1.0)
    assert ids[0].tolist() == [5, 9, 12, 33, 34, 60, 61, 70]
    assert torch.all(_bits(weights) == 0)  # +0.0 exactly: 0 * (1 / eps)


def test_infinite_logits():
    scores = sigmoid_scores(torch.tensor([INF, -INF, 0.0, -0.0, 200.0, -200.0]))
    assert scores[0].item() == 1.0 and _bits(scores[1]).item() == 0
    assert scores[2].item() == 0.5 and scores[3].item() == 0.5
    assert scores[4].item() == 1.0 and _bits(scores[5]).item() == 0
    logits = torch.zeros(3, E)
    logits[0, 100:108] = INF  # eight saturated experts
    logits[1] = -INF  # nothing at all
    logits[2, ::2] = -INF
    logits[2, 1::2] = INF
    ids, weights = _assert_matches_scalar(logits, torch.zeros(E), route_scale=2.5, eps=1e-15)
    assert ids[0].tolist() == list(range(100, 108))
    assert torch.all(weights[0] == 2.5 / 8)
    assert ids[1].tolist() == list(range(K)) and torch.all(_bits(weights[1]) == 0)
    assert ids[2].tolist() == [1, 3, 5, 7, 9, 11, 13, 15]


def test_all_zero_scores_without_eps_give_nan_like_the_stock():
    logits = torch.full((1, E), -INF)
    ids, weights = _assert_matches_scalar(logits, torch.zeros(E), route_scale=1.0, eps=None)
    assert torch.all(torch.isnan(weights))


def test_bias_reorders_selection_but_weights_use_unbiased_scores():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, E, generator=g)
    plain, _ = routing_reference(logits, torch.zeros(E), route_scale=1.0)
    bias = torch.zeros(E)
    boosted = [1, 2, 3, 4]  # pushed into the top-8 ahead of everything
    bias[boosted] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    bias[plain[0, :2].long()] = -5.0  # the two best unbiased experts pushed out
    ids, weights = _assert_matches_scalar(logits, bias, route_scale=1.0, eps=1e-15)
    assert ids[0, :4].tolist() == boosted
    assert not set(plain[0, :2].tolist()) & set(ids[0].tolist())
    # Weights: the unbiased scores of the chosen experts, normalized.
    scores = sigmoid_scores(logits)[0, ids[0].long()]
    total = torch.tensor(0.0)
    for s in scores:
        total = total + s
    inv = torch.tensor(1.0) / (total + torch.tensor(1e-15, dtype=torch.float32))
    assert _same_bits(weights[0], scores * inv)
    biased = (sigmoid_scores(logits)[0] + bias)[ids[0].long()]
    assert not torch.equal(weights[0], biased * inv)


def test_negative_infinite_bias_repeats_the_lowest_index():
    # Only six experts have finite keys; afterwards every key is -inf and the lowest index wins,
    # chosen or not: expert 0 twice, as the stock's masked argmax does.
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(1, E, generator=g)
    bias = torch.full((E,), -INF)
    bias[10:16] = 0.0
    ids, _ = _assert_matches_scalar(logits, bias, route_scale=1.0, eps=1e-15)
    assert sorted(ids[0, :6].tolist()) == list(range(10, 16))
    assert ids[0, 6:].tolist() == [0, 0]


def test_padding_tokens():
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(3, E, generator=g)
    pad = torch.tensor([False, True, False])
    ids, weights = routing_reference(logits, torch.zeros(E), route_scale=2.5, is_padding=pad)
    ref_ids, ref_w = routing_reference(logits, torch.zeros(E), route_scale=2.5)
    assert ids[1].tolist() == [-1] * K and torch.all(_bits(weights[1]) == 0)
    assert torch.equal(ids[[0, 2]], ref_ids[[0, 2]]) and _same_bits(weights[[0, 2]], ref_w[[0, 2]])


def test_approximations_are_used_where_the_stock_uses_them():
    calls = []

    def ex2(x):
        calls.append(("ex2", tuple(x.shape)))
        return PRECISE.ex2(x)

    def div_full(a, b):
        calls.append(("div_full", tuple(a.shape), tuple(b.shape)))
        return PRECISE.div_full(a, b)

    spy = Approximations(name="spy", rsqrt=PRECISE.rsqrt, ex2=ex2, div_full=div_full)
    routing_reference(torch.zeros(3, E), torch.zeros(E), route_scale=1.0, approximations=spy)
    assert calls == [("ex2", (3, E)), ("div_full", (3, E), (3, E)), ("div_full", (3,), (3,))]
    calls.clear()
    routing_reference(torch.zeros(3, E), torch.zeros(E), route_scale=1.0, renormalize=False, approximations=spy)
    assert calls == [("ex2", (3, E)), ("div_full", (3, E), (3, E))]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(logits=torch.zeros(2, E, dtype=torch.float64)),
        dict(logits=torch.zeros(E)),
        dict(logits=torch.zeros(2, 96)),
        dict(bias=torch.zeros(E + 1)),
        dict(bias=torch.zeros(E, dtype=torch.bfloat16)),
        dict(route_scale=INF),
        dict(route_scale="1"),
        dict(division_eps=math.nan),
        dict(top_k=0),
        dict(top_k=E + 1),
        dict(is_padding=torch.zeros(3, dtype=torch.bool)),
        dict(is_padding=torch.zeros(2)),
        dict(renormalize=1),
    ],
)
def test_bad_arguments(kwargs):
    args = dict(logits=torch.zeros(2, E), bias=torch.zeros(E), route_scale=1.0)
    args.update(kwargs)
    logits, bias = args.pop("logits"), args.pop("bias")
    with pytest.raises(ValueError):
        routing_reference(logits, bias, **args)


def test_nan_is_rejected():
    logits = torch.zeros(1, E)
    logits[0, 3] = math.nan
    with pytest.raises(ValueError):
        routing_reference(logits, torch.zeros(E), route_scale=1.0)
    bias = torch.zeros(E)
    bias[0] = math.nan
    with pytest.raises(ValueError):
        routing_reference(torch.zeros(1, E), bias, route_scale=1.0)


# ---------------------------------------------------------------------------------------------
# Metadata.


def _random_ids(g: torch.Generator, b: int, pool: int, *, padding_rows: int = 0, base: int = 0) -> torch.Tensor:
    rows = [torch.randperm(pool, generator=g)[:K] + base for _ in range(b)]
    ids = torch.stack(rows).to(torch.int32) if b else torch.zeros(0, K, dtype=torch.int32)
    for t in range(min(padding_rows, b)):
        ids[b - 1 - t] = -1
    return ids


def _brute_force(ids: torch.Tensor, offset: int, n_local: int, tile: int) -> dict[str, list[int]]:
    """Independent model: sort the local routes by (expert, token) and pad every expert."""
    routes = sorted(
        (int(e), t, k) for t, row in enumerate(ids.tolist()) for k, e in enumerate(row) if offset <= e < offset + n_local
    )
    expanded = [[-1] * ids.shape[1] for _ in range(ids.shape[0])]
    to_token: list[int] = []
    cta_expert: list[int] = []
    cta_limit: list[int] = []
    i = 0
    while i < len(routes):
        e = routes[i][0]
        group = [r for r in routes[i:] if r[0] == e]
        start = len(to_token)
        for j, (_, t, k) in enumerate(group):
            expanded[t][k] = start + j
        padded = -(-len(group) // tile) * tile
        to_token += [t for _, t, _ in group] + [-1] * (padded - len(group))
        for c in range(padded // tile):
            cta_expert.append(e - offset)
            cta_limit.append(min(start + (c + 1) * tile, start + len(group)))
        i += len(group)
    return {
        "padded_row_count": [len(to_token)],
        "cta_count": [len(cta_expert)],
        "expanded_to_permuted": sum(expanded, []),
        "cta_to_expert": cta_expert,
        "cta_row_limit": cta_limit,
        "permuted_to_token": to_token,
    }


def _check_properties(ids: torch.Tensor, meta: dict[str, torch.Tensor], offset: int, n_local: int, tile: int) -> None:
    padded = int(meta["padded_row_count"][0])
    ctas = int(meta["cta_count"][0])
    expanded = meta["expanded_to_permuted"]
    to_token = meta["permuted_to_token"]
    cta_expert = meta["cta_to_expert"]
    cta_limit = meta["cta_row_limit"]
    assert padded == ctas * tile and to_token.numel() == padded
    assert cta_expert.numel() == ctas and cta_limit.numel() == ctas
    for t in meta.values():
        assert t.dtype == torch.int32
    local = (ids >= offset) & (ids < offset + n_local)
    assert torch.all(expanded[~local] == -1)
    rows = expanded[local]
    assert rows.unique().numel() == rows.numel()  # a unique row per local route
    assert torch.all((rows >= 0) & (rows < padded))
    # Every route sits inside its expert's tiles and below the tile's row limit.
    for t, k in local.nonzero().tolist():
        r = int(expanded[t, k])
        c = r // tile
        assert int(cta_expert[c]) == int(ids[t, k]) - offset
        assert r < int(cta_limit[c])
        assert int(to_token[r]) == t
    # Rows not holding a route are padding: -1.
    used = torch.zeros(padded, dtype=torch.bool)
    used[rows.long()] = True
    assert torch.all(to_token[~used] == -1)
    # Experts ascending; each expert's range is whole tiles, its routes first, in token order.
    if ctas:
        assert torch.all(cta_expert[1:] >= cta_expert[:-1])
        assert torch.all((cta_expert >= 0) & (cta_expert < n_local))
    for e in cta_expert.unique().tolist():
        tiles = (cta_expert == e).nonzero().flatten()
        first, last = int(tiles[0]), int(tiles[-1])
        assert last - first + 1 == tiles.numel()
        block = to_token[first * tile : (last + 1) * tile]
        n = int((ids == e + offset).sum())
        assert -(-n // tile) == tiles.numel()
        assert torch.all(block[n:] == -1)
        assert torch.all(block[:n][1:] > block[:n][:-1])  # sorted by token (strictly)
        for j in range(tiles.numel()):
            assert int(cta_limit[first + j]) == min((first + j + 1) * tile, first * tile + n)
            assert int(cta_limit[first + j]) > (first + j) * tile


TILES = [1, 2, 3, 8, 16, 64, 128, 256]
SPLITS = [(0, 256), (0, 128), (128, 128), (32, 32), (255, 1), (17, 40)]


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("offset,n_local", SPLITS)
def test_metadata_matches_brute_force_and_properties(tile, offset, n_local):
    g = torch.Generator().manual_seed(tile * 1000 + offset * 7 + n_local)
    cases = [
        _random_ids(g, b, E, padding_rows=b // 5) for b in range(0, 9)
    ] + [
        _random_ids(g, 8, 12, base=min(offset, E - 12)),  # crowded: experts shared by many tokens
        _random_ids(g, 8, 9, base=min(offset, E - 9)),
    ]
    for ids in cases:
        meta = routing_metadata_reference(ids, local_expert_offset=offset, num_local_experts=n_local, tile_n=tile)
        want = _brute_force(ids, offset, n_local, tile)
        for key, values in want.items():
            assert meta[key].reshape(-1).tolist() == values, key
        _check_properties(ids, meta, offset, n_local, tile)


def test_metadata_worst_case_fills_the_capacity():
    ids = torch.arange(64, dtype=torch.int32).reshape(8, K)  # 64 distinct experts, all local
    for tile in TILES:
        meta = routing_metadata_reference(ids, local_expert_offset=0, num_local_experts=E, tile_n=tile)
        layout = RoutingMetadata(tile)
        assert int(meta["cta_count"][0]) == layout.max_ctas() == 64
        assert int(meta["padded_row_count"][0]) == layout.max_padded_rows() == 64 * tile
        buf = pack_metadata(meta, tile_n=tile)
        assert buf.numel() == metadata_size(tile)


def test_metadata_int64_ids_and_minus_one():
    ids = torch.tensor([[5, -1, 7, 9, 11, 13, 15, 17], [-1] * K], dtype=torch.int64)
    meta = routing_metadata_reference(ids, local_expert_offset=0, num_local_experts=E, tile_n=4)
    assert meta["expanded_to_permuted"][0, 1] == -1 and torch.all(meta["expanded_to_permuted"][1] == -1)
    assert int(meta["cta_count"][0]) == 7


@pytest.mark.parametrize(
    "ids,kwargs",
    [
        (torch.tensor([[1, 2, 3, 4, 5, 6, 7, 1]]), {}),  # duplicate expert in a token
        (torch.tensor([[1, 2, 3, 4, 5, 6, 7, 256]]), {}),
        (torch.tensor([[1, 2, 3, 4, 5, 6, 7, -2]]), {}),
        (torch.zeros(K, dtype=torch.int32), {}),
        (torch.zeros(1, K), {}),
        (torch.arange(K).reshape(1, K), dict(tile_n=0)),
        (torch.arange(K).reshape(1, K), dict(tile_n=257)),
        (torch.arange(K).reshape(1, K), dict(local_expert_offset=-1)),
        (torch.arange(K).reshape(1, K), dict(num_local_experts=0)),
        (torch.arange(K).reshape(1, K), dict(local_expert_offset=200, num_local_experts=57)),
    ],
)
def test_metadata_bad_arguments(ids, kwargs):
    args = dict(local_expert_offset=0, num_local_experts=E, tile_n=8)
    args.update(kwargs)
    with pytest.raises(ValueError):
        routing_metadata_reference(ids, **args)


# ---------------------------------------------------------------------------------------------
# Layout and packing.


@pytest.mark.parametrize("tile", list(range(1, 20)) + [32, 63, 64, 100, 128, 255, 256])
def test_layout_sections(tile):
    layout = RoutingMetadata(tile)
    assert layout.size == metadata_size(tile)
    assert layout.size == HEADER_WORDS + 64 + 2 * 64 + -(-64 * tile // 4) * 4
    off = layout.offsets
    for b in range(0, 9):
        fields = layout.fields(b)
        assert list(fields) == ["header", "expanded_to_permuted", "cta_to_expert", "cta_row_limit", "permuted_to_token"]
        spans = []
        for name, (o, n) in fields.items():
            assert o == off[name] and o % 4 == 0
            assert 0 <= o and o + n <= layout.size
            spans.append((o, o + n))
        capacity_ends = [off["expanded_to_permuted"], off["cta_to_expert"], off["cta_row_limit"], off["permuted_to_token"], layout.size]
        for (start, end), limit in zip(spans, capacity_ends):
            assert end <= limit and start < limit  # no section reaches into the next
        assert fields["expanded_to_permuted"][1] == b * K
        assert fields["cta_to_expert"][1] == max_cta_count(b, K, E, tile) == min(b * K, E)


def test_layout_general_bound_matches_stock_formula():
    # Routes beyond one per active expert need whole extra tiles (FlashInfer's mirror of
    # Routing::getMaxNumCtasInBatchDim).
    assert max_cta_count(64, 8, 256, 8) == 256 + (512 - 256) // 8
    assert max_cta_count(0, 8, 256, 8) == 0
    layout = RoutingMetadata(4, num_tokens_max=40, top_k=8, num_experts=256)
    assert layout.max_ctas() == 256 + 64 // 4


@pytest.mark.parametrize(
    "args",
    [(0,), (257,), (8, 0), (8, 8, 0), (8, 8, 300, 256), (8, 8, 8, 0), (True,), (8.0,)],
)
def test_layout_bad_arguments(args):
    with pytest.raises(ValueError):
        metadata_size(*args)
    with pytest.raises(ValueError):
        RoutingMetadata(*args)


def test_fields_rejects_batches_past_the_layout():
    with pytest.raises(ValueError):
        RoutingMetadata(8).fields(9)
    with pytest.raises(ValueError):
        RoutingMetadata(8).fields(-1)


@pytest.mark.parametrize("tile", [1, 3, 8, 128, 256])
def test_pack_stays_inside_the_buffer_and_round_trips(tile):
    g = torch.Generator().manual_seed(tile)
    layout = RoutingMetadata(tile)
    guard = 64
    for b in [0, 1, 4, 5, 8]:
        for ids in (_random_ids(g, b, E, padding_rows=1), _random_ids(g, b, 10)):
            meta = routing_metadata_reference(ids, local_expert_offset=0, num_local_experts=128, tile_n=tile)
            big = torch.full((guard + layout.size + guard,), 0x5A5A5A5A, dtype=torch.int32)
            out = big[guard : guard + layout.size]
            buf = pack_metadata(meta, tile_n=tile, out=out, fill=-7)
            assert buf.data_ptr() == out.data_ptr()
            assert torch.all(big[:guard] == 0x5A5A5A5A) and torch.all(big[guard + layout.size :] == 0x5A5A5A5A)
            live = layout.live_fields(buf)
            assert live["header"].tolist() == [int(meta["padded_row_count"][0]), int(meta["cta_count"][0]), b, tile]
            assert torch.equal(live["expanded_to_permuted"], meta["expanded_to_permuted"].reshape(-1))
            for key in ("cta_to_expert", "cta_row_limit", "permuted_to_token"):
                assert torch.equal(live[key], meta[key])
            # Every word outside the live parts is the fill.
            dead = torch.ones(layout.size, dtype=torch.bool)
            for name, view in live.items():
                start = view.storage_offset() - buf.storage_offset()
                dead[start : start + view.numel()] = False
            assert torch.all(buf[dead] == -7)


def test_pack_rejects_misfits():
    meta = routing_metadata_reference(torch.arange(64, dtype=torch.int32).reshape(8, K), local_expert_offset=0, num_local_experts=E, tile_n=8)
    with pytest.raises(ValueError):
        pack_metadata(meta, tile_n=8, num_tokens_max=4)
    with pytest.raises(ValueError):
        pack_metadata(meta, tile_n=16)  # counts computed for another tile
    with pytest.raises(ValueError):
        pack_metadata(meta, tile_n=8, out=torch.empty(metadata_size(8) + 1, dtype=torch.int32))
    with pytest.raises(ValueError):
        pack_metadata({k: v for k, v in meta.items() if k != "cta_count"}, tile_n=8)


def test_live_fields_rejects_inconsistent_headers():
    layout = RoutingMetadata(8)
    meta = routing_metadata_reference(torch.arange(16, dtype=torch.int32).reshape(2, K), local_expert_offset=0, num_local_experts=E, tile_n=8)
    buf = pack_metadata(meta, tile_n=8)
    layout.live_fields(buf)
    for word, value in [(0, 8), (1, 99), (2, 9), (3, 16)]:
        bad = buf.clone()
        bad[word] = value
        with pytest.raises(ValueError):
            layout.live_fields(bad)
    with pytest.raises(ValueError):
        layout.live_fields(buf[:-1])
    with pytest.raises(ValueError):
        layout.live_fields(buf.to(torch.int64))


def test_router_output_feeds_the_metadata():
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(8, E, generator=g)
    pad = torch.tensor([False] * 7 + [True])
    ids, _ = routing_reference(logits, torch.zeros(E), route_scale=1.0, is_padding=pad)
    for offset in range(0, E, 32):
        meta = routing_metadata_reference(ids, local_expert_offset=offset, num_local_experts=32, tile_n=8)
        _check_properties(ids, meta, offset, 32, 8)
        assert torch.all(meta["expanded_to_permuted"][7] == -1)
