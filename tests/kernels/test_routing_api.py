"""The seeds' routing names (`../shared/seeds/routing.txt`) in `musebench.kernels.routing`: their
signatures, the refusals `route` documents (raised before anything compiles or launches), the
guard element of `metadata_size`, and one compile through the seeds' option string. CPU only;
the full contract of `route` is in test_routing_compile.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

from musebench import config, routing_metadata  # noqa: E402
from musebench.kernels import routing  # noqa: E402
from tests._seeds import EMPTY, POS, assert_seed_signature  # noqa: E402

E, K = config.NUM_EXPERTS, config.TOP_K

SEED_FUNCTIONS = {
    routing.compile_routing: ([("metadata", POS, EMPTY), ("renormalize", POS, EMPTY), ("options", POS, "")], ("build",)),
    routing.compiled_routing: ([("metadata", POS, EMPTY), ("renormalize", POS, EMPTY)], ()),
    routing.metadata_size: ([("tile_n", POS, EMPTY)], ()),
    routing.prepare: ([("renormalize", POS, True)], ()),
    routing.route: (
        [("logits", POS, EMPTY), ("bias", POS, EMPTY), ("ids", POS, EMPTY), ("weights", POS, EMPTY), ("scale", POS, EMPTY),
         ("renormalize", POS, True), ("metadata", POS, None), ("local_expert_offset", POS, 0),
         ("num_local_experts", POS, 0), ("tile_n", POS, 0)],
        (),
    ),
}


@pytest.mark.parametrize("function", list(SEED_FUNCTIONS), ids=lambda f: f.__name__)
def test_seed_signatures(function):
    seed, extras = SEED_FUNCTIONS[function]
    assert_seed_signature(function, seed, extras=extras)


def test_public_names():
    assert set(routing.__all__) == {"compile_routing", "compiled_routing", "metadata_size", "prepare", "route",
                                    "META_PADDED_TOKENS", "META_NUM_CTAS", "META_EXPANDED_TO_PERMUTED",
                                    "META_CTA_BATCH", "META_CTA_LIMIT", "META_PERMUTED_TO_TOKEN"}
    assert not hasattr(routing, "MuseRouting") and not hasattr(routing, "unsupported_router")  # cute_ops's


@pytest.mark.parametrize("tile", [1, 3, 8, 128, 256])  # a row per tile, odd, typical, large, the largest
def test_metadata_size_is_the_layout_and_a_guard_element(tile):
    assert routing.metadata_size(tile) == routing.META_PERMUTED_TO_TOKEN + routing.MAX_CTAS * tile + 1
    assert routing.metadata_size(tile) == routing_metadata.metadata_size(tile) + 1


@pytest.mark.parametrize("tile", [0, 257, 8.0, True])
def test_metadata_size_refuses_bad_tiles(tile):
    with pytest.raises(ValueError, match="tile_n"):
        routing.metadata_size(tile)


def _args(b: int = 2, **overrides) -> dict:
    args = dict(logits=torch.zeros(b, E), bias=torch.zeros(E), ids=torch.zeros(b, K, dtype=torch.int32),
                weights=torch.zeros(b, K), scale=1.0)
    args.update(overrides)
    return args


def _meta(tile: int = 8, **overrides) -> dict:
    meta = dict(metadata=torch.zeros(routing.metadata_size(tile), dtype=torch.int32), local_expert_offset=0,
                num_local_experts=E, tile_n=tile)
    meta.update(overrides)
    return _args(**meta)


# The seed's documented ValueErrors, each before anything launches.
SEED_REFUSALS = [
    ("b = 0", _args(0), "1..8"),
    ("b = 9", _args(9), "1..8"),
    ("logits not [b, 256]", _args(logits=torch.zeros(2, 128)), r"\[b, 256\]"),
    ("misaligned logits rows", _args(logits=torch.zeros(2, E + 2)[:, :E]), "logits must be contiguous"),
    ("misaligned logits", _args(logits=torch.zeros(2 * E + 1)[1:].view(2, E)), "16-byte aligned"),
    ("ids dtype", _args(ids=torch.zeros(2, K, dtype=torch.int64)), "ids must be torch.int32"),
    ("tile_n 0", _meta(tile_n=0), "tile_n"),
    ("tile_n 257", _meta(tile_n=257), "tile_n"),
    ("no local expert", _meta(num_local_experts=0), "num_local_experts"),
    ("offset below 0", _meta(local_expert_offset=-1), "local_expert_offset"),
    ("experts past 256", _meta(local_expert_offset=250, num_local_experts=7), r"local experts \[250, 257\)"),
    ("metadata dtype", _meta(metadata=torch.zeros(routing.metadata_size(8), dtype=torch.int64)), "metadata must be torch.int32"),
    ("metadata 2-D", _meta(metadata=torch.zeros(1, routing.metadata_size(8), dtype=torch.int32)), "1-D"),
    ("short metadata", _meta(metadata=torch.zeros(routing.metadata_size(8) - 1, dtype=torch.int32)), r"metadata_size\(8\)"),
]


@pytest.mark.parametrize("what, args, message", SEED_REFUSALS, ids=[w for w, _, _ in SEED_REFUSALS])
def test_route_refuses_before_launch(what, args, message, monkeypatch):
    def no_compile(*_args, **_kwargs):
        raise AssertionError("a refused call reached the compiled kernel")

    monkeypatch.setattr(routing, "compiled_routing", no_compile)
    with pytest.raises(ValueError, match=message):
        routing.route(**args)


def test_metadata_aliasing_the_outputs_is_refused():
    buffer = torch.zeros(routing.metadata_size(8) + 16, dtype=torch.int32)
    ids = buffer[704:720].view(2, K)  # 16-byte aligned, inside the metadata's words
    with pytest.raises(ValueError, match="must not alias ids"):
        routing.route(**_meta(metadata=buffer, ids=ids))


def test_compile_routing_returns_a_kernel_with_the_seeds_option_string():
    build = routing.RoutingOptions(arch="sm_90a")
    plain = routing.compile_routing(True, True, build=build)
    tuned = routing.compile_routing(True, True, "--opt-level 2", build=build)
    assert callable(plain) and callable(tuned) and tuned is not plain
    assert routing.compile_routing(True, True, " --opt-level 2 ", build=build) is tuned  # the key strips blanks
