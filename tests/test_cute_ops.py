"""The seeds' cute_ops names (`../shared/seeds/cute_ops.txt`) in `musebench.cute_ops`: signatures,
the refusals documented there (raised before anything launches), RoutingMetadata's field views,
split_qkv's views. CPU only: building a MuseRouting compiles two routing variants for the default
target (no GPU needed); calls that would launch stop at the device check.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from musebench import config, cute_ops, routing_metadata
from musebench.layout import MuseRouter
from tests._seeds import EMPTY, POS, assert_seed_signature

E, K = config.NUM_EXPERTS, config.TOP_K

# name -> [(parameter, kind, default)] as the seed documents them.
SEED_SIGNATURES = {
    "MuseRouting.__init__": [("self", POS, EMPTY), ("router", POS, EMPTY)],
    "MuseRouting.__call__": [("self", POS, EMPTY), ("logits", POS, EMPTY), ("ids", POS, EMPTY), ("weights", POS, EMPTY),
                             ("metadata", POS, None)],
    "RoutingMetadata.fields": [("self", POS, EMPTY), ("num_tokens", POS, EMPTY)],
    "unsupported_router": [("router", POS, EMPTY)],
    "sm100_family": [],
    "unavailable": [("kernel", POS, EMPTY)],
    "split_qkv": [("qkv", POS, EMPTY), ("num_kv_heads", POS, EMPTY)],
}


def _resolve(name: str):
    target = cute_ops
    for part in name.split("."):
        target = getattr(target, part)
    return target


@pytest.mark.parametrize("name", sorted(SEED_SIGNATURES))
def test_seed_signatures(name):
    assert_seed_signature(_resolve(name), SEED_SIGNATURES[name])  # no extras


def test_routing_metadata_is_the_seeds_named_tuple():
    assert issubclass(cute_ops.RoutingMetadata, tuple)
    assert cute_ops.RoutingMetadata._fields == ("buffer", "local_expert_offset", "num_local_experts", "tile_n")
    assert set(cute_ops.__all__) >= {"MuseRouting", "RoutingMetadata", "sm100_family", "split_qkv", "unavailable",
                                     "unsupported_router"}  # and each kernel family's own names


def test_importing_cute_ops_needs_no_cutlass():
    code = "import sys, musebench.cute_ops; print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---------------------------------------------------------------------------------------------
# Deployment checks.


def test_sm100_family_without_a_gpu_is_false(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cute_ops.sm100_family() is False


@pytest.mark.parametrize("capability, family", [((10, 0), True), ((10, 3), True), ((9, 0), False), ((12, 0), False)])
def test_sm100_family_is_compute_capability_10(monkeypatch, capability, family):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    assert cute_ops.sm100_family() is family


def test_unavailable_names_the_kernel():
    reason = cute_ops.unavailable("attn2")
    assert isinstance(reason, str) and "attn2" in reason and "SM100" in reason


# ---------------------------------------------------------------------------------------------
# unsupported_router and MuseRouting (moved here from tests/kernels/test_routing_compile.py).


def _misaligned(shape, dtype) -> torch.Tensor:
    n = math.prod(shape)
    return torch.zeros(n + 1, dtype=dtype)[1:].view(shape)


_MISSING = object()


def fake_router(**overrides) -> SimpleNamespace:
    attributes = {
        "top_k": K,
        "global_num_experts": E,
        "expert_bias": torch.zeros(E),
        "route_scale": 2.5,
        "router_output_multiplier": None,
        "router_score_normalization": "sigmoid",
        "router_score_division_eps": 1e-15,
    }
    attributes.update(overrides)
    return SimpleNamespace(**{k: v for k, v in attributes.items() if v is not _MISSING})


def test_the_layout_router_stand_in_is_supported():
    router = MuseRouter(expert_bias=torch.zeros(E), route_scale=2.5)
    assert cute_ops.unsupported_router(router) is None
    assert {f for f in MuseRouter.__dataclass_fields__} == {
        "router_score_normalization", "top_k", "global_num_experts", "router_output_multiplier",
        "router_score_division_eps", "expert_bias", "route_scale"}


def test_muse_routing_binds_bias_and_scale():
    router = fake_router()
    bound = cute_ops.MuseRouting(router)  # compiles the two renormalizing variants
    assert bound.bias is router.expert_bias and bound.route_scale == 2.5
    assert cute_ops.unsupported_router(router) is None
    # vLLM's other spellings, and the multiplier folded to exactly 1.0.
    other = fake_router(expert_bias=_MISSING, e_score_correction_bias=torch.ones(E), global_num_experts=_MISSING,
                        num_experts=E, router_output_multiplier=1.0, route_scale=1)
    assert cute_ops.MuseRouting(other).bias is other.e_score_correction_bias
    # eps given as a value that rounds to the same binary32.
    assert cute_ops.unsupported_router(fake_router(router_score_division_eps=math.nextafter(1e-15, 1.0))) is None


# Every reason the seed documents (scores, top-k / experts, an unfolded multiplier, eps, the bias's
# dtype, layout and alignment), and musebench's further ones (route scale, bias shape, no bias).
REFUSED = [
    ({"router_score_normalization": "softmax"}, "only sigmoid"),
    ({"top_k": 4}, "only top-8"),
    ({"top_k": True}, "only top-8"),
    ({"global_num_experts": 128}, "only 256"),
    ({"global_num_experts": _MISSING}, "only 256"),
    ({"router_output_multiplier": 0.5}, "not folded"),
    ({"router_output_multiplier": 2}, "not folded"),
    ({"router_score_division_eps": None}, "router_score_division_eps None"),
    ({"router_score_division_eps": _MISSING}, "router_score_division_eps None"),
    ({"router_score_division_eps": 1e-6}, "router_score_division_eps 1e-06"),
    ({"router_score_division_eps": 0.0}, "router_score_division_eps 0.0"),
    ({"route_scale": float("nan")}, "route_scale nan"),
    ({"route_scale": None}, "route_scale None"),
    ({"expert_bias": _MISSING}, "no expert bias tensor"),
    ({"expert_bias": [0.0] * E}, "no expert bias tensor"),
    ({"expert_bias": torch.zeros(E, dtype=torch.bfloat16)}, "only float32"),
    ({"expert_bias": torch.zeros(E + 1)}, r"shape \(257,\)"),
    ({"expert_bias": torch.zeros(2 * E)[::2]}, "not contiguous"),
    ({"expert_bias": _misaligned((E,), torch.float32)}, "not 16-byte aligned"),
]


@pytest.mark.parametrize("overrides, reason", REFUSED, ids=[f"{i}" for i in range(len(REFUSED))])
def test_muse_routing_refuses_what_it_cannot_reproduce(overrides, reason):
    router = fake_router(**overrides)
    assert re.search(reason, cute_ops.unsupported_router(router) or ""), cute_ops.unsupported_router(router)
    with pytest.raises(ValueError, match=reason):
        cute_ops.MuseRouting(router)


def test_muse_routing_call_validates_like_route():
    bound = cute_ops.MuseRouting(fake_router())
    with pytest.raises(ValueError, match="batch must be 1..8"):
        bound(torch.zeros(9, E), torch.zeros(9, K, dtype=torch.int32), torch.zeros(9, K))
    with pytest.raises(ValueError, match="CUDA device"):
        bound(torch.zeros(1, E), torch.zeros(1, K, dtype=torch.int32), torch.zeros(1, K))


def test_muse_routing_passes_the_metadata_fields_to_route():
    from musebench.kernels import routing

    bound = cute_ops.MuseRouting(fake_router())
    logits, ids, weights = torch.zeros(2, E), torch.zeros(2, K, dtype=torch.int32), torch.zeros(2, K)
    short = cute_ops.RoutingMetadata(torch.zeros(routing.metadata_size(8) - 1, dtype=torch.int32), 0, E, 8)
    with pytest.raises(ValueError, match=r"at least metadata_size\(8\)"):
        bound(logits, ids, weights, short)
    outside = cute_ops.RoutingMetadata(torch.zeros(routing.metadata_size(8), dtype=torch.int32), 200, 57, 8)
    with pytest.raises(ValueError, match=r"local experts \[200, 257\)"):
        bound(logits, ids, weights, outside)
    no_tile = cute_ops.RoutingMetadata(torch.zeros(routing.metadata_size(8), dtype=torch.int32), 0, E, 0)
    with pytest.raises(ValueError, match="tile_n"):
        bound(logits, ids, weights, no_tile)
    good = cute_ops.RoutingMetadata(torch.zeros(routing.metadata_size(8), dtype=torch.int32), 32, 32, 8)
    with pytest.raises(ValueError, match="CUDA device"):  # every layout check passed; the CPU is refused
        bound(logits, ids, weights, good)


# ---------------------------------------------------------------------------------------------
# RoutingMetadata.fields.


@pytest.mark.parametrize("tile", [1, 8, 256])  # a row per tile, a typical tile, the largest
@pytest.mark.parametrize("tokens", [1, 8])
def test_fields_are_views_at_the_layout_offsets(tile, tokens):
    from musebench.kernels import routing

    buffer = torch.arange(routing.metadata_size(tile), dtype=torch.int32)
    fields = cute_ops.RoutingMetadata(buffer, 0, E, tile).fields(tokens)
    off = routing_metadata.RoutingMetadata(tile).offsets
    routes = tokens * K
    want = {
        "total_num_padded_tokens": (routing.META_PADDED_TOKENS, 1),
        "num_non_exiting_ctas": (routing.META_NUM_CTAS, 1),
        "expanded_idx_to_permuted_idx": (off["expanded_to_permuted"], routes),
        "cta_idx_xy_to_batch_idx": (off["cta_to_expert"], routes),
        "cta_idx_xy_to_mn_limit": (off["cta_row_limit"], routes),
        "permuted_idx_to_token_idx": (off["permuted_to_token"], routes * tile + 1),
    }
    assert set(fields) == set(want)
    for name, (start, length) in want.items():
        view = fields[name]
        assert view.dtype == torch.int32 and view.dim() == 1 and view.numel() == length, name
        assert view.data_ptr() == buffer.data_ptr() + 4 * start, f"{name} is a view at word {start}"
    # 8 tokens reach the guard element, the buffer's last
    if tokens == config.MAX_DECODE_TOKENS:
        assert int(fields["permuted_idx_to_token_idx"][-1]) == buffer.numel() - 1


@pytest.mark.parametrize("tokens", [0, 9, -1, 2.0, True])
def test_fields_refuse_a_batch_outside_1_to_8(tokens):
    metadata = cute_ops.RoutingMetadata(torch.zeros(800, dtype=torch.int32), 0, E, 8)
    with pytest.raises(ValueError, match="num_tokens"):
        metadata.fields(tokens)


def test_fields_refuse_a_short_buffer_or_bad_tile():
    from musebench.kernels import routing

    with pytest.raises(ValueError, match="at least"):
        cute_ops.RoutingMetadata(torch.zeros(routing.metadata_size(8) - 1, dtype=torch.int32), 0, E, 8).fields(1)
    with pytest.raises(ValueError, match="at least"):
        cute_ops.RoutingMetadata(torch.zeros(routing.metadata_size(8), dtype=torch.int64), 0, E, 8).fields(1)
    with pytest.raises(ValueError, match="tile_n"):
        cute_ops.RoutingMetadata(torch.zeros(800, dtype=torch.int32), 0, E, 0).fields(1)


# ---------------------------------------------------------------------------------------------
# split_qkv.


@pytest.mark.parametrize("kv_heads", [1, 2, 16])  # the smallest, a TP shard, Muse Spark's whole layer
def test_split_qkv_views(kv_heads):
    q, kv = 8 * kv_heads * 64, kv_heads * 64
    qkv = torch.arange(3 * (2 * q + 2 * kv), dtype=torch.float32).view(3, -1)
    got_q, got_gate = cute_ops.split_qkv(qkv, kv_heads)
    assert torch.equal(got_q, qkv[:, :q]) and torch.equal(got_gate, qkv[:, q + 2 * kv:])
    assert got_q.data_ptr() == qkv.data_ptr() and got_gate.shape == (3, q)  # views, no copy


@pytest.mark.parametrize("shape, kv_heads", [((3, 100), 1), ((2 * 8 * 64 + 2 * 64,), 1), ((3, 2 * 8 * 64 + 2 * 64), 2)])
def test_split_qkv_refuses_other_widths(shape, kv_heads):
    with pytest.raises(ValueError, match="qkv must be"):
        cute_ops.split_qkv(torch.zeros(shape), kv_heads)
