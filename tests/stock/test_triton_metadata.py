"""The separate metadata pass (the bench's stock path for metadata) against the reference.

On CPU its torch twin, step for step, and, where Triton imports, the kernel in Triton's
interpreter (run so on 2026-11-29 with Triton 3.6: 240 cases exact); on a GPU the kernel
compiled. Each must give the live words of `pack_metadata(routing_metadata_reference(...))` and
leave every other word untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from musebench import config
from musebench.routing_metadata import RoutingMetadata
from musebench.stock.routing import pack_metadata, routing_metadata_reference
from musebench.stock.triton_metadata import metadata_pass_torch

POISON = 0x5A5A5A5A
GUARD = 16  # words past the layout that must stay poisoned

# tile sizes: 1 (a tile per route), odd, the bench's 8 and 64, the largest
CASES = [
    pytest.param(b, tile_n, ranges, seed, id=f"b{b}-tile{tile_n}-{ranges}-seed{seed}")
    for b in (1, 2, 5, 8)
    for tile_n in (1, 3, 8, 64, 256)
    for ranges in ("all", "rank0of8", "rank5of8", "narrow")
    for seed in (0, 1)
]


def _ids(b: int, seed: int, *, clustered: bool) -> torch.Tensor:
    """Distinct experts per token; clustered rows share experts across tokens (counts up to b)."""
    g = torch.Generator().manual_seed(seed)
    pool = 24 if clustered else config.NUM_EXPERTS
    rows = [torch.randperm(pool, generator=g)[: config.TOP_K] for _ in range(b)]
    ids = torch.stack(rows).to(torch.int32)
    if seed % 2:  # a few routes of nobody (-1), as the reference allows
        ids[0, -1] = -1
    return ids


def _range(ranges: str) -> tuple[int, int]:
    return {"all": (0, config.NUM_EXPERTS), "rank0of8": (0, 32), "rank5of8": (160, 32), "narrow": (7, 3)}[ranges]


def _check_pass(run, ids: torch.Tensor, tile_n: int, offset: int, count: int) -> None:
    layout = RoutingMetadata(tile_n)
    want = pack_metadata(routing_metadata_reference(ids, local_expert_offset=offset, num_local_experts=count,
                                                    tile_n=tile_n), tile_n=tile_n, fill=POISON)
    buffer = torch.full((layout.size + GUARD,), POISON, dtype=torch.int32, device=ids.device)
    run(ids, buffer, local_expert_offset=offset, num_local_experts=count, tile_n=tile_n)
    got = buffer.cpu()
    live_got, live_want = layout.live_fields(got[: layout.size]), layout.live_fields(want)
    for name, words in live_want.items():
        assert torch.equal(live_got[name], words), f"{name}: {live_got[name].tolist()} != {words.tolist()}"
    # nothing else written: the dead words and the guard keep their poison
    written = torch.zeros(layout.size + GUARD, dtype=torch.bool)
    offsets = layout.offsets
    for name, words in live_want.items():
        start = offsets[name]
        written[start : start + words.numel()] = True
    assert bool((got[~written] == POISON).all()), "a word past the live fields was written"


@pytest.mark.parametrize("b, tile_n, ranges, seed", CASES)
def test_the_torch_twin_is_the_reference(b, tile_n, ranges, seed):
    offset, count = _range(ranges)
    for clustered in (False, True):
        _check_pass(metadata_pass_torch, _ids(b, seed, clustered=clustered), tile_n, offset, count)


def test_bad_arguments_are_refused():
    ids = torch.zeros(1, config.TOP_K, dtype=torch.int32)
    out = torch.zeros(RoutingMetadata(8).size, dtype=torch.int32)
    with pytest.raises(ValueError, match="ids must be"):
        metadata_pass_torch(ids.long(), out, local_expert_offset=0, num_local_experts=8, tile_n=8)
    with pytest.raises(ValueError, match="out must be"):
        metadata_pass_torch(ids, out[:-1], local_expert_offset=0, num_local_experts=8, tile_n=8)
    with pytest.raises(ValueError, match="local experts"):
        metadata_pass_torch(ids, out, local_expert_offset=250, num_local_experts=8, tile_n=8)
    with pytest.raises(ValueError, match="tile_n"):
        metadata_pass_torch(ids, out, local_expert_offset=0, num_local_experts=8, tile_n=0)


INTERPRETED = [(1, 8, "rank0of8"), (8, 1, "all"), (8, 256, "narrow"), (5, 3, "rank5of8")]


def check_interpreted() -> None:
    """The Triton kernel on CPU tensors; run in a process started with TRITON_INTERPRET=1 (Triton
    reads it when it is first imported)."""
    from musebench.stock.triton_metadata import triton_metadata

    for b, tile_n, ranges in INTERPRETED:
        offset, count = _range(ranges)
        for seed in (0, 1):
            for clustered in (False, True):
                _check_pass(triton_metadata, _ids(b, seed, clustered=clustered), tile_n, offset, count)


def test_the_triton_pass_in_its_interpreter_is_the_reference():
    """Where Triton imports (not in CI): the kernel itself, in Triton's CPU interpreter."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", "import tests.stock.test_triton_metadata as t; t.check_interpreted()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("b, tile_n, ranges, seed", CASES)
def test_the_triton_pass_is_the_reference(b, tile_n, ranges, seed):
    pytest.importorskip("triton")
    from musebench.stock.triton_metadata import triton_metadata

    offset, count = _range(ranges)
    for clustered in (False, True):
        _check_pass(triton_metadata, _ids(b, seed, clustered=clustered).cuda(), tile_n, offset, count)
