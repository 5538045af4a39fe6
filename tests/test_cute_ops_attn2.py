"""cute_ops' attn2 entry points on the CPU: the deployment sizing, the layer check, the launch's
refusals (musebench.cute_ops, seeds `cute_ops.txt`). The split plan itself: test_attn2_layout."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from musebench import attn2_layout, config, cute_ops
from musebench.attn2_layout import Attn2Layer


def test_constants_are_the_models():
    assert cute_ops.SM_SCALE == 64**-0.5 * 5.473 == 0.684125
    assert cute_ops.ATTN2_EPS == 1e-5
    assert cute_ops.QUERY_LEN == 8
    assert cute_ops.ROW_GROUPS == 1
    assert cute_ops.SHORT_MAX_LEN == attn2_layout.SHORT_MAX_LEN == 64  # 4 pages
    assert attn2_layout.is_power_of_two(cute_ops.SPLIT_TARGET_CLUSTERS)
    assert attn2_layout.is_power_of_two(cute_ops.MAX_SPLITS)


def test_signatures_follow_the_seeds():
    assert list(inspect.signature(cute_ops.attn2_splits).parameters) == ["max_model_len", "window", "num_kv_heads"]
    assert list(inspect.signature(cute_ops.attn2_window).parameters) == ["sliding_window", "max_model_len"]
    assert list(inspect.signature(cute_ops.attn2_workspace_bytes).parameters) == ["num_reqs", "num_kv_heads",
                                                                                   "num_splits"]
    assert list(inspect.signature(cute_ops.unsupported_attn2).parameters) == ["layer"]


@pytest.mark.parametrize("sliding_window, max_model_len, want", [
    (None, 131072, 0),  # no window
    (2048, 131072, 2048),  # Muse Spark's sliding layers
    (2048, 2048, 0),  # the window covers every key
    (4096, 2048, 0),
    (1, 16, 1),  # the smallest window: the row's own key
])
def test_attn2_window(sliding_window, max_model_len, want):
    assert cute_ops.attn2_window(sliding_window, max_model_len) == want


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_attn2_window_refuses(bad):
    with pytest.raises(ValueError):
        cute_ops.attn2_window(bad, 131072)


def test_attn2_window_refuses_bad_length():
    with pytest.raises(ValueError):
        cute_ops.attn2_window(None, 0)


@pytest.mark.parametrize("max_model_len, window, kv_heads, want", [
    (64, 0, 2, 1),  # SHORT_MAX_LEN: one CTA per KV head
    (8, 0, 1, 1),
    (63, 0, 16, 1),
    (65, 0, 2, 2),  # just past it: 5 pages, two a split at least
    (112, 0, 2, 2),  # 7 pages // 2 = 3
    (113, 0, 16, 4),  # 8 pages
    (127, 0, 16, 4),
    (128, 0, 2, 4),  # a split plan since SHORT_MAX_LEN 64
    (128, 32, 2, 2),  # a 39-key window: 4 pages a row can see
    (129, 0, 2, 4),  # 9 pages
    (240, 0, 2, 4),  # 15 pages // 2 = 7
    (241, 0, 2, 8),
    (256, 0, 2, 8),  # 16 pages
    (2048, 0, 2, 64),  # 128 pages: a split plan
    (2048, 100, 2, 4),  # a 107-key window: 8 pages a row can see
    (2049, 0, 2, 64),  # 129 pages, two a split at least
    (131072, 0, 1, 256),  # tp 16: MAX_SPLITS
    (131072, 0, 2, 256),  # tp 8
    (131072, 0, 4, 256),  # tp 4: the same splits at every tp (rank identity)
    (131072, 0, 8, 256),  # tp 2
    (131072, 2048, 2, 64),  # the window: 130 pages a row can see
    (131072, 64, 2, 2),  # a small window: 6 pages, two per split at least
    (16384, 0, 2, 256),  # 1024 pages: MAX_SPLITS, four pages each
    (8192, 0, 3, 256),  # 512 pages, two a split
    (4096, 0, 3, 128),  # 256 pages, two a split
    (2100, 0, 2, 64),  # 132 pages // 2 = 66: rounded down to a power of two
    (2200, 64, 2, 2),  # a 6-page window
])
def test_attn2_splits(max_model_len, window, kv_heads, want):
    assert cute_ops.attn2_splits(max_model_len, window, kv_heads) == want


@pytest.mark.parametrize("args", [(0, 0, 2), (4096, -1, 2), (4096, 0, 0), (4096, 0, 2.0), (True, 0, 2)])
def test_attn2_splits_refuses(args):
    with pytest.raises(ValueError):
        cute_ops.attn2_splits(*args)


def test_attn2_split_constants():
    assert cute_ops.SPLIT_TARGET_CLUSTERS == cute_ops.MAX_SPLITS == 256


def test_attn2_workspace_bytes():
    """One partial per split CTA (`attn2_layout.splits_per_cta`: two sibling splits a CTA at tp 4
    and 2, one at tp 8 and 16)."""
    assert cute_ops.attn2_workspace_bytes(1, 2, 1) == 0  # nothing to merge
    assert attn2_layout.PARTIAL_BYTES == 18432  # 128 threads x (8 float4 of O + one of m, l)
    assert cute_ops.attn2_workspace_bytes(1, 2, 256) == 2 * 256 * attn2_layout.PARTIAL_BYTES  # 512 CTAs of one
    assert cute_ops.attn2_workspace_bytes(1, 4, 256) == 4 * 128 * attn2_layout.PARTIAL_BYTES  # paired
    assert cute_ops.attn2_workspace_bytes(3, 1, 2) == 3 * 2 * attn2_layout.PARTIAL_BYTES  # partials only
    for tp in (2, 4, 8, 16):
        heads = config.NUM_KV_HEADS // tp
        splits = cute_ops.attn2_splits(131072, 0, heads)
        per_cta = 2 if tp <= 4 else 1  # PAIRED_LEAVES: 1024 leaves
        assert attn2_layout.splits_per_cta(heads, splits) == per_cta
        assert cute_ops.attn2_workspace_bytes(4, heads, splits) == 4 * heads * (256 // per_cta) * 18432
        assert cute_ops.attn2_workspace_bytes(4, heads, splits) == attn2_layout.workspace_bytes(4, heads, splits)
    assert cute_ops.attn2_workspace_bytes(1, 2, 512) == 2 * 256 * attn2_layout.PARTIAL_BYTES  # 1024 leaves: paired
    # the small split plans (max_model_len above SHORT_MAX_LEN up to 2048): one split a CTA at every tp
    for max_model_len, splits in ((65, 2), (128, 4), (129, 4), (256, 8), (2048, 64)):
        for heads in (1, 2, 4, 8):
            assert cute_ops.attn2_splits(max_model_len, 0, heads) == splits
            assert cute_ops.attn2_workspace_bytes(2, heads, splits) == 2 * heads * splits * attn2_layout.PARTIAL_BYTES
    assert cute_ops.attn2_workspace_bytes(2, 8, cute_ops.attn2_splits(64, 0, 8)) == 0  # one split


@pytest.mark.parametrize("args", [(0, 2, 2), (1, 0, 2), (1, 2, 0), (1, 2, 3), (1, 2, 2.0)])
def test_attn2_workspace_bytes_refuses(args):
    with pytest.raises(ValueError):
        cute_ops.attn2_workspace_bytes(*args)


def test_unsupported_attn2_accepts_muse_spark_at_every_tp():
    for tp in (2, 4, 8, 16):
        kv = config.NUM_KV_HEADS // tp
        assert cute_ops.unsupported_attn2(Attn2Layer(num_heads=8 * kv, num_kv_heads=kv)) is None
    # the model's own float64 product, and the same value in binary32
    assert cute_ops.unsupported_attn2(Attn2Layer(scaling=math.ldexp(1, -3) * 5.473)) is None


@pytest.mark.parametrize("change, words", [
    (dict(use_o_norm=False), "o-norm"),
    (dict(use_o_gate=False), "o-gate"),
    (dict(head_dim=128), "head_dim 128"),
    (dict(num_heads=12), "12 query heads"),
    (dict(num_kv_heads=0, num_heads=0), "num_kv_heads"),
    (dict(scaling=0.125), "softmax scale"),
    (dict(scaling=float("nan")), "softmax scale"),
    (dict(rms_norm_eps=1e-6), "eps"),
])
def test_unsupported_attn2_names_the_reason(change, words):
    reason = cute_ops.unsupported_attn2(dataclasses.replace(Attn2Layer(), **change))
    assert reason is not None and words in reason


def test_unsupported_attn2_on_a_foreign_object():
    assert "attributes" in cute_ops.unsupported_attn2(object())


# The launch's refusals: every one before anything launches. On this CPU host every tensor is on
# the CPU, so a valid call stops at the device check, the last one: each refusal below names its
# own reason instead (it is found before that).

def _launch_args(**changes):
    import torch

    max_model_len, heads = 4096, 2
    width = heads * 8 * 64
    args = dict(
        q=torch.zeros(8, width, dtype=torch.bfloat16), gate=torch.zeros(8, width, dtype=torch.bfloat16),
        kv_cache=torch.zeros(3, heads, 16, 128, dtype=torch.bfloat16),
        page_table=torch.zeros(1, attn2_layout.max_pages(max_model_len), dtype=torch.int32),
        seq_lens=torch.tensor([40], dtype=torch.int32), out=torch.zeros(8, width, dtype=torch.bfloat16),
        workspace=None, max_model_len=max_model_len, window=0)
    args.update(changes)
    return args


def _misaligned(shape, dtype):
    """A contiguous tensor whose data sits 2 bytes past a 16-byte boundary."""
    import torch

    flat = torch.zeros(math.prod(shape) + 8, dtype=dtype)
    start = next(i for i in range(1, 8) if (flat.data_ptr() + i * flat.element_size()) % 16 == 2)
    return flat[start: start + math.prod(shape)].view(shape)


def _strided_columns(rows, width):
    import torch

    return torch.zeros(rows, width + 64, dtype=torch.bfloat16)[:, 64:]  # rows of 2 (width + 64) bytes


@pytest.mark.parametrize("change, reason", [
    (lambda t: {}, "every tensor must be on one CUDA device"),
    (lambda t: {"q": t.zeros(8, 1024, dtype=t.float16)}, "q must be bf16 \\[8, 1024\\]"),
    (lambda t: {"gate": t.zeros(16, 1024, dtype=t.bfloat16)}, "gate must be bf16 \\[8, 1024\\]"),
    (lambda t: {"q": t.zeros(8, 1024, dtype=t.bfloat16).t().contiguous().t()}, "contiguous last dim"),
    (lambda t: {"q": _misaligned((8, 1024), t.bfloat16)}, "q's rows must be 16-byte aligned"),
    (lambda t: {"out": _strided_columns(8, 1024)}, "out must be contiguous"),
    (lambda t: {"kv_cache": t.zeros(3, 2, 16, 64, dtype=t.bfloat16)}, "kv_cache must be contiguous bf16"),
    (lambda t: {"kv_cache": t.zeros(3, 2, 16, 128, dtype=t.float32)}, "kv_cache must be contiguous bf16"),
    (lambda t: {"kv_cache": _misaligned((3, 2, 16, 128), t.bfloat16)}, "kv_cache must be 16-byte aligned"),
    (lambda t: {"page_table": t.zeros(1, 255, dtype=t.int32)}, "page_table must be contiguous int32 \\[1, 256\\]"),
    (lambda t: {"page_table": t.zeros(1, 256, dtype=t.int64)}, "page_table must be contiguous int32"),
    (lambda t: {"seq_lens": t.tensor([40], dtype=t.int64)}, "seq_lens must be a contiguous int32"),
    (lambda t: {"window": 4096}, "window must be 0 or an int in \\[1, max_model_len\\)"),
    (lambda t: {"max_model_len": 7}, "max_model_len must be an int >= 8"),
])
def test_launch_refuses_before_anything_launches(change, reason):
    import torch

    pytest.importorskip("cutlass")
    with pytest.raises(ValueError, match=reason):
        cute_ops.launch_attn2(**_launch_args(**change(torch)))
