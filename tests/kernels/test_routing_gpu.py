"""The CuTe DSL router on a GPU, bitwise against the reference and the Triton stock.

Expected values: `musebench.stock.routing.routing_reference` with the GPU's own ex2.approx /
div.full bits (`hardware_approximations()`), and musebench's Triton stock router where Triton is
installed; metadata against `pack_metadata(routing_metadata_reference(...))` on the live words of
a poisoned buffer of `routing.metadata_size(tile_n)` words (the layout, `routing_metadata.metadata_size`,
and the guard word after it): the guard word and every word
outside the live fields must keep the poison. Then CUDA-graph capture and replay with changing
logits, and `cute_ops.MuseRouting` bound to a vLLM-style router.

Inputs: `tests.stock.test_triton_routing.routing_inputs` (random rows of four spreads; adversarial
rows: ties, signed zeros, +-inf logits, huge and subnormal logits, the top-8 in one lane, near
ties; biases: zero, small, reordering, signed zeros, -inf on all but 5 experts).

Last run: four H200s, 2026-11-29, 74 passed (records/2026-11-29-4xh200-pytest-gpu-kernels.summary.json;
first at 06837f0, records/2026-11-29-h200-pytest-gpu-routing.summary.json).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

from musebench import config  # noqa: E402
from musebench import cute_ops  # noqa: E402
from musebench.kernels import compilation, routing  # noqa: E402
from musebench.kernels.approx import hardware_approximations  # noqa: E402
from musebench.routing_metadata import RoutingMetadata, metadata_size  # noqa: E402
from musebench.stock.routing import pack_metadata, routing_metadata_reference  # noqa: E402
from tests.stock.test_triton_routing import (  # noqa: E402
    SCALES,
    assert_routes_equal,
    hardware_reference,
    routing_inputs,
)

pytestmark = pytest.mark.gpu

E, K, B = config.NUM_EXPERTS, config.TOP_K, config.MAX_DECODE_TOKENS
POISON = 0x5A5A5A5A  # a word the kernel never writes: not -1, not a row, token or count
POISON_F32 = float("nan")
INF = float("inf")
SEEDS = range(16)


@pytest.fixture(scope="module", autouse=True)
def prepared():
    routing.prepare()  # every variant, before any capture


def _run(logits: torch.Tensor, bias: torch.Tensor, *, scale: float, renormalize: bool, **metadata_args):
    b = logits.shape[0]
    ids = torch.full((b, K), -7, dtype=torch.int32, device="cuda")  # poisoned outputs
    weights = torch.full((b, K), POISON_F32, device="cuda")
    routing.route(logits.cuda(), bias.cuda(), ids, weights, scale, renormalize, **metadata_args)
    return ids, weights


def _triton():
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from musebench.stock.triton_routing import triton_routing

    return triton_routing


# Regimes: every b (1..8) x random / adversarial x renormalize on / off, 16 seeds each (spreads,
# scales 1 / 2.5 / 0.7303, every bias kind and adversarial row kind in every token position).
@pytest.mark.parametrize("adversarial", [False, True], ids=["random", "adversarial"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "scale"])
@pytest.mark.parametrize("b", range(1, B + 1))
def test_ids_and_weights_bitwise(b, renormalize, adversarial):
    assert hardware_approximations().name == "hardware"
    triton_routing = _triton()
    for seed in SEEDS:
        logits, bias = routing_inputs(seed, b, adversarial=adversarial)
        scale = SCALES[seed % len(SCALES)]
        what = f"b={b} seed={seed} renormalize={renormalize} adversarial={adversarial}"
        got = _run(logits, bias, scale=scale, renormalize=renormalize)
        assert_routes_equal(got, hardware_reference(logits, bias, scale=scale, renormalize=renormalize), what + " vs reference")
        if triton_routing is not None:  # the project's Triton stock has musebench's scale mode too
            assert_routes_equal(got, triton_routing(logits.cuda(), bias.cuda(), route_scale=scale, renormalize=renormalize), what + " vs triton")


def test_many_random_tokens():
    """8192 random tokens (1024 launches of b = 8), every spread: near ties decided by the last bit."""
    g = torch.Generator().manual_seed(99)
    bias = torch.randn(E, generator=g) * 0.05
    for call in range(1024):
        logits = torch.randn(B, E, generator=g) * (0.5, 2.0, 8.0, 30.0)[call % 4]
        got = _run(logits, bias, scale=2.5, renormalize=True)
        assert_routes_equal(got, hardware_reference(logits, bias, scale=2.5, renormalize=True), f"call {call}")


# ---------------------------------------------------------------------------------------------
# Metadata.

# Regimes: the tile (1: one row per tile; 3: odd; 8, 64, 128: powers of two; 256: the largest),
# the local range (all, halves, an odd window, one expert), random and crowded ids.
TILES = (1, 3, 8, 64, 128, 256)
SPLITS = ((0, 256), (0, 128), (128, 128), (17, 40), (255, 1))


def _metadata_case(logits, bias, *, scale, renormalize, offset, n_local, tile):
    size = metadata_size(tile)
    buffer = torch.full((size + 1,), POISON, dtype=torch.int32, device="cuda")  # + one guard word
    ids, weights = _run(logits, bias, scale=scale, renormalize=renormalize, metadata=buffer,
                        local_expert_offset=offset, num_local_experts=n_local, tile_n=tile)
    return ids, weights, buffer.cpu()


def _assert_metadata(ids: torch.Tensor, buffer: torch.Tensor, *, offset: int, n_local: int, tile: int, what: str) -> None:
    layout = RoutingMetadata(tile)
    assert int(buffer[-1]) == POISON, f"{what}: the guard word after the buffer was written"
    words = buffer[:-1]
    rows_unique = all(len(set(row)) == len(row) for row in ids.cpu().tolist())
    if rows_unique:
        want = pack_metadata(
            routing_metadata_reference(ids.cpu(), local_expert_offset=offset, num_local_experts=n_local, tile_n=tile), tile_n=tile
        )
        got_live, want_live = layout.live_fields(words), layout.live_fields(want)
        for name in want_live:
            if not torch.equal(got_live[name], want_live[name]):
                differ = (got_live[name] != want_live[name]).nonzero()
                first = int(differ[0]) if differ.numel() else -1
                raise AssertionError(
                    f"{what}: {name} differs (first at {first}): got {got_live[name].tolist()[:16]}, want {want_live[name].tolist()[:16]}"
                )
    else:  # repeated ids (-inf biases): undefined in the stock; the header must still be in bounds
        header = layout.live_fields(words)["header"].tolist()
        assert header[2:] == [ids.shape[0], tile], what
    # Only live words are written.
    off = layout.offsets
    padded, ctas, tokens = int(words[0]), int(words[1]), int(words[2])
    live = torch.zeros(layout.size, dtype=torch.bool)
    for name, length in (("header", 4), ("expanded_to_permuted", tokens * K), ("cta_to_expert", ctas),
                         ("cta_row_limit", ctas), ("permuted_to_token", padded)):
        live[off[name] : off[name] + length] = True
    assert bool((words[~live] == POISON).all()), f"{what}: a word outside the live fields was written"


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("offset, n_local", SPLITS)
def test_metadata_matches_reference_and_guard_stays(tile, offset, n_local):
    for seed in range(8):
        for b in (1, 2, 5, 8):
            adversarial = seed % 2 == 1
            logits, bias = routing_inputs(seed, b, adversarial=adversarial)
            renormalize = seed % 4 != 3
            scale = SCALES[seed % len(SCALES)]
            ids, weights, buffer = _metadata_case(logits, bias, scale=scale, renormalize=renormalize,
                                                  offset=offset, n_local=n_local, tile=tile)
            what = f"tile={tile} local=[{offset}, {offset + n_local}) b={b} seed={seed}"
            # Metadata on does not change the routes.
            assert_routes_equal((ids, weights), hardware_reference(logits, bias, scale=scale, renormalize=renormalize), what)
            _assert_metadata(ids, buffer, offset=offset, n_local=n_local, tile=tile, what=what)


def test_metadata_random_ranges_and_tiles():
    """200 random (tile in 1..256, local range, b, seed, row kind) draws."""
    g = torch.Generator().manual_seed(2024)
    for draw in range(200):
        tile = int(torch.randint(1, 257, (1,), generator=g))
        n_local = int(torch.randint(1, E + 1, (1,), generator=g))
        offset = int(torch.randint(0, E - n_local + 1, (1,), generator=g))
        b = int(torch.randint(1, B + 1, (1,), generator=g))
        seed = 100 + draw
        logits, bias = routing_inputs(seed, b, adversarial=draw % 3 == 0)
        ids, weights, buffer = _metadata_case(logits, bias, scale=2.5, renormalize=True, offset=offset, n_local=n_local, tile=tile)
        what = f"draw {draw}: tile={tile} local=[{offset}, {offset + n_local}) b={b}"
        assert_routes_equal((ids, weights), hardware_reference(logits, bias, scale=2.5, renormalize=True), what)
        _assert_metadata(ids, buffer, offset=offset, n_local=n_local, tile=tile, what=what)


@pytest.mark.parametrize("tile", (1, 7, 256))
def test_metadata_worst_case_fills_the_capacity(tile):
    # 64 distinct experts, all local: 64 tiles, 64 * tile rows (the layout's bound).
    logits = torch.full((B, E), -10.0)
    for t in range(B):
        logits[t, 8 * t : 8 * t + 8] = 10.0
    ids, _, buffer = _metadata_case(logits, torch.zeros(E), scale=1.0, renormalize=True, offset=0, n_local=E, tile=tile)
    assert sorted(ids.reshape(-1).tolist()) == list(range(64))
    assert int(buffer[1]) == RoutingMetadata(tile).max_ctas() == 64
    _assert_metadata(ids, buffer, offset=0, n_local=E, tile=tile, what=f"worst case tile={tile}")


def test_metadata_crowded_experts_token_order():
    # Every token routes to experts 0..7: each expert gets b routes, ordered by token.
    logits = torch.full((B, E), -10.0)
    logits[:, :8] = torch.arange(8, 0, -1).float()
    for tile in (1, 3, 8):
        ids, _, buffer = _metadata_case(logits, torch.zeros(E), scale=1.0, renormalize=True, offset=0, n_local=8, tile=tile)
        _assert_metadata(ids, buffer, offset=0, n_local=8, tile=tile, what=f"crowded tile={tile}")


def test_metadata_with_no_local_route():
    logits, bias = routing_inputs(0, 4, adversarial=False)
    bias = torch.zeros(E)
    logits[:, 200:] = -INF  # experts 200.. score +0.0: never chosen
    ids, _, buffer = _metadata_case(logits, bias, scale=1.0, renormalize=True, offset=200, n_local=56, tile=8)
    assert int(buffer[0]) == int(buffer[1]) == 0
    _assert_metadata(ids, buffer, offset=200, n_local=56, tile=8, what="no local route")


# ---------------------------------------------------------------------------------------------
# CUDA graphs, MuseRouting, host checks that need a GPU.


@pytest.mark.parametrize("with_metadata", [False, True], ids=["routes", "routes+metadata"])
def test_graph_capture_and_replay_with_changing_logits(with_metadata):
    tile, offset, n_local = 8, 64, 96
    static_logits = torch.zeros(B, E, device="cuda")
    bias = routing_inputs(1, 1, adversarial=False)[1].cuda()
    ids = torch.empty(B, K, dtype=torch.int32, device="cuda")
    weights = torch.empty(B, K, device="cuda")
    buffer = torch.full((metadata_size(tile) + 1,), POISON, dtype=torch.int32, device="cuda")
    args = {"metadata": buffer, "local_expert_offset": offset, "num_local_experts": n_local, "tile_n": tile} if with_metadata else {}

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        routing.route(static_logits, bias, ids, weights, 2.5, True, **args)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # back-to-back calls in one graph
            routing.route(static_logits, bias, ids, weights, 2.5, True, **args)

    g = torch.Generator().manual_seed(17)
    for replay in range(50):
        logits = torch.randn(B, E, generator=g) * (0.5, 2.0, 8.0, 30.0)[replay % 4]
        static_logits.copy_(logits)
        ids.fill_(-7)
        weights.fill_(POISON_F32)
        buffer.fill_(POISON)  # the live words move between replays: re-poison to see only this one's
        graph.replay()
        torch.cuda.synchronize()
        assert_routes_equal((ids, weights), hardware_reference(logits, bias.cpu(), scale=2.5, renormalize=True), f"replay {replay}")
        if with_metadata:
            _assert_metadata(ids, buffer.cpu(), offset=offset, n_local=n_local, tile=tile, what=f"replay {replay}")


def test_uncompiled_variant_refuses_capture():
    compilation.clear(routing._RoutingKernel)
    logits = torch.zeros(1, E, device="cuda")
    ids = torch.empty(1, K, dtype=torch.int32, device="cuda")
    weights = torch.empty(1, K, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before CUDA graph capture"):
        with torch.cuda.graph(graph):
            routing.route(logits, torch.zeros(E, device="cuda"), ids, weights, 1.0, False)
    routing.prepare()


def test_muse_routing_bound_to_a_vllm_style_router():
    from types import SimpleNamespace

    logits, bias = routing_inputs(5, 6, adversarial=True)
    router = SimpleNamespace(top_k=K, global_num_experts=E, expert_bias=bias.cuda(), route_scale=2.5,
                             router_output_multiplier=None, router_score_normalization="sigmoid",
                             router_score_division_eps=1e-15)
    bound = cute_ops.MuseRouting(router)
    ids = torch.empty(6, K, dtype=torch.int32, device="cuda")
    weights = torch.empty(6, K, device="cuda")
    returned = bound(logits.cuda(), ids, weights)
    assert returned[0] is ids and returned[1] is weights
    assert_routes_equal((ids, weights), hardware_reference(logits, bias, scale=2.5, renormalize=True), "MuseRouting")
    router.expert_bias.mul_(-1.0)  # bound by reference: an in-place update is seen
    torch.cuda.synchronize()  # the bias is read before the PDL wait: not written by the kernel just before
    bound(logits.cuda(), ids, weights)
    assert_routes_equal((ids, weights), hardware_reference(logits, -bias, scale=2.5, renormalize=True), "MuseRouting after update")


def test_mixed_devices_are_refused():
    logits = torch.zeros(2, E, device="cuda")
    ids = torch.empty(2, K, dtype=torch.int32, device="cuda")
    weights = torch.empty(2, K, device="cuda")
    with pytest.raises(ValueError, match="bias must be on a CUDA device"):
        routing.route(logits, torch.zeros(E), ids, weights, 1.0)
    with pytest.raises(ValueError, match="metadata must be on a CUDA device"):
        routing.route(logits, torch.zeros(E, device="cuda"), ids, weights, 1.0, True, torch.zeros(routing.metadata_size(8), dtype=torch.int32),
                      0, E, 8)
