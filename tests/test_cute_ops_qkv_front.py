"""The seeds' qkv_front names in `musebench.cute_ops`: signatures, `supports_shape`,
`hidden_rows_ok`, every refusal of `qkv_front_unsupported` / `supports_call` (a reason, before
anything launches), `unsupported_projection` on small fake layers, and `launch_qkv_front`
refusing before it imports the kernel. CPU only: a call that passes every other check stops at
the device check (the kernel needs CUDA tensors).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from musebench import cute_ops
from tests._seeds import EMPTY, KW, POS, assert_seed_signature

H = cute_ops.QKV_FRONT_HIDDEN

SEED_SIGNATURES = {
    "supports_call": [("x", POS, EMPTY), ("weight", POS, EMPTY), ("positions", POS, EMPTY),
                      ("cos_sin_cache", POS, EMPTY), ("slot_mapping", POS, EMPTY), ("kv_cache", POS, EMPTY),
                      ("num_kv_heads", POS, EMPTY), ("out", POS, None)],
    "unsupported_projection": [("attn", POS, EMPTY)],
}


@pytest.mark.parametrize("name", sorted(SEED_SIGNATURES))
def test_seed_signatures(name):
    assert_seed_signature(getattr(cute_ops, name), SEED_SIGNATURES[name])


def test_qkv_front_names_are_exported():
    assert {"supports_call", "unsupported_projection", "launch_qkv_front", "supports_shape",
            "hidden_rows_ok"} <= set(cute_ops.__all__)


def test_launch_signature_is_supports_calls_with_out_the_tap_and_pdl():
    from tests._seeds import parameters

    got = parameters(cute_ops.launch_qkv_front)
    assert got[:8] == [(n, POS, EMPTY) for n in ("x", "weight", "positions", "cos_sin_cache", "slot_mapping",
                                                  "kv_cache", "num_kv_heads", "out")]
    assert got[8:] == [("tap", KW, None), ("enable_pdl", KW, True)]


@pytest.mark.parametrize("n, kv, ok", [
    (1152, 1, True), (2304, 2, True), (4608, 4, True),  # tp 16, 8, 4
    (9216, 8, False),  # tp 2: not built
    (2304, 1, False), (1152, 2, False), (2300, 2, False),  # N that is not 1152 kv
    (True, 1, False), (1152, True, False), (1152.0, 1, False),
])
def test_supports_shape(n, kv, ok):
    assert cute_ops.supports_shape(n, kv) is ok


def test_hidden_rows_ok():
    w = torch.zeros(1152, H, dtype=torch.bfloat16)
    assert cute_ops.hidden_rows_ok(w)
    assert not cute_ops.hidden_rows_ok(w.float())  # dtype
    assert not cute_ops.hidden_rows_ok(torch.zeros(1152, H + 8, dtype=torch.bfloat16)[:, :H])  # row stride
    assert not cute_ops.hidden_rows_ok(torch.zeros(H, 1152, dtype=torch.bfloat16).t())  # columns
    assert not cute_ops.hidden_rows_ok(torch.zeros(1152 * H + 1, dtype=torch.bfloat16)[1:].view(1152, H))  # aligned
    assert not cute_ops.hidden_rows_ok(torch.zeros(H, dtype=torch.bfloat16))  # 1-D
    assert not cute_ops.hidden_rows_ok("weight")


def call_args(tokens=3, kv=1, rope=True, pages=4, max_pos=32):
    n = cute_ops.qkv_front_columns(kv)
    return dict(
        x=torch.zeros(tokens, H, dtype=torch.bfloat16),
        weight=torch.zeros(n, H, dtype=torch.bfloat16),
        positions=torch.zeros(tokens, dtype=torch.int64),
        cos_sin_cache=torch.zeros(max_pos, 64) if rope else None,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        kv_cache=torch.zeros(pages, kv, 16, 128, dtype=torch.bfloat16),
        out=torch.zeros(tokens, n, dtype=torch.bfloat16),
    )


def test_a_valid_call_on_cpu_stops_at_the_device_only():
    for rope in (True, False):
        reason = cute_ops.qkv_front_unsupported(**call_args(rope=rope))
        assert reason is not None and "one CUDA device" in reason
    args = call_args()
    args.pop("out")
    assert "CUDA" in cute_ops.qkv_front_unsupported(**args)
    assert cute_ops.supports_call(**call_args(), num_kv_heads=1) is False


def _unaligned(t):
    flat = torch.zeros(t.numel() + 8, dtype=t.dtype)
    return flat[1:1 + t.numel()].view(t.shape)


REFUSALS = [
    ("x", lambda a: a["x"].float(), "x must be bf16"),
    ("x", lambda a: torch.zeros(3, H - 8, dtype=torch.bfloat16), "x must be bf16"),
    ("x", lambda a: torch.zeros(0, H, dtype=torch.bfloat16), "0 tokens"),
    ("x", lambda a: torch.zeros(17, H, dtype=torch.bfloat16), "17 tokens"),
    ("x", lambda a: _unaligned(a["x"]), "x is not contiguous"),
    ("x", lambda a: torch.zeros(H, 3, dtype=torch.bfloat16).t(), "x is not contiguous"),
    ("weight", lambda a: a["weight"].float(), "unquantized bf16"),
    ("weight", lambda a: torch.zeros(2304, H, dtype=torch.bfloat16), "N = 2304 for 1 KV heads"),
    ("kv_cache", lambda a: torch.zeros(4, 1, 16, 64, dtype=torch.bfloat16), "kv_cache must be"),
    ("kv_cache", lambda a: torch.zeros(4, 1, 16, 128), "kv_cache must be"),
    ("kv_cache", lambda a: torch.zeros(4, 1, 16, 256, dtype=torch.bfloat16)[..., :128], "kv_cache is not"),
    ("positions", lambda a: a["positions"].int(), "positions must be int64"),
    ("positions", lambda a: torch.zeros(2, dtype=torch.int64), "positions must be int64 \\[3\\]"),
    ("slot_mapping", lambda a: a["slot_mapping"].int(), "slot_mapping must be int64"),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"].bfloat16(), "rotary table"),
    ("cos_sin_cache", lambda a: torch.zeros(32, 32), "rotary table"),
    ("cos_sin_cache", lambda a: torch.zeros(64, 32).t(), "cos_sin_cache is not contiguous"),
    ("out", lambda a: a["out"].float(), "out must be bf16"),
    ("out", lambda a: torch.zeros(2, 1152, dtype=torch.bfloat16), "out must be bf16"),
    ("weight", lambda a: "w", "weight is not a tensor"),
]


@pytest.mark.parametrize("name, make, reason", REFUSALS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REFUSALS)])
def test_every_refusal_has_its_reason(name, make, reason):
    args = call_args()
    args[name] = make(args)
    got = cute_ops.qkv_front_unsupported(**args)
    assert got is not None
    import re

    assert re.search(reason, got), got
    assert cute_ops.supports_call(**args, num_kv_heads=1) is False


def test_supports_call_needs_the_layers_kv_heads(monkeypatch):
    monkeypatch.setattr(cute_ops, "qkv_front_unsupported", lambda *a, **k: None)  # as on a GPU
    args = call_args(kv=2)
    assert cute_ops.supports_call(**args, num_kv_heads=2)
    assert not cute_ops.supports_call(**args, num_kv_heads=1)


def test_launch_refuses_before_importing_the_kernel(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "musebench.kernels.qkv_front", raising=False)
    args = call_args()
    with pytest.raises(ValueError, match="cannot take this call: .*CUDA"):
        cute_ops.launch_qkv_front(**args, num_kv_heads=1)
    monkeypatch.setattr(cute_ops, "qkv_front_unsupported", lambda *a, **k: None)
    with pytest.raises(ValueError, match="kv_cache holds 1 KV heads, the layer 2"):
        cute_ops.launch_qkv_front(**args, num_kv_heads=2)
    with pytest.raises(ValueError, match="tap must be bf16"):
        cute_ops.launch_qkv_front(**args, num_kv_heads=1, tap=torch.zeros(3, 1152))
    assert "musebench.kernels.qkv_front" not in sys.modules


def test_launch_returns_out(monkeypatch):
    """launch_qkv_front returns `out`, as its signature and docstring say (a stand-in kernel)."""
    import sys
    import types

    launched = []
    kernel = types.ModuleType("musebench.kernels.qkv_front")
    kernel.launch = lambda *a, **k: launched.append(k)
    monkeypatch.setitem(sys.modules, "musebench.kernels.qkv_front", kernel)
    import musebench.kernels

    monkeypatch.setattr(musebench.kernels, "qkv_front", kernel, raising=False)
    monkeypatch.setattr(cute_ops, "qkv_front_unsupported", lambda *a, **k: None)  # as on a GPU
    args = call_args()
    assert cute_ops.launch_qkv_front(**args, num_kv_heads=1) is args["out"]
    assert launched and launched[0]["eps"] == cute_ops.QKV_FRONT_EPS
    assert launched[0]["enable_pdl"] is True  # PDL by default
    cute_ops.launch_qkv_front(**args, num_kv_heads=1, enable_pdl=False)
    assert launched[1]["enable_pdl"] is False
    with pytest.raises(ValueError, match="enable_pdl must be a bool"):
        cute_ops.launch_qkv_front(**args, num_kv_heads=1, enable_pdl=1)
    assert len(launched) == 2  # refused before the launch


# ---------------------------------------------------------------------------------------------
# unsupported_projection on fake layers (vLLM MuseSpark1xAttention's attributes).


class UnquantizedLinearMethod:  # matched by class name, as the seed matches vLLM's class
    pass


class Fp8LinearMethod:
    pass


def fake_layer(kv=2, **overrides):
    heads = 8 * kv
    n = 2 * (heads + kv) * 64
    proj = SimpleNamespace(quant_method=UnquantizedLinearMethod(), bias=None, gather_output=False, tp_size=8,
                           weight=torch.zeros(n, H, dtype=torch.bfloat16))
    emb = SimpleNamespace(rotary_dim=64, is_neox_style=False, cos_sin_cache=torch.zeros(128, 64))
    layer = SimpleNamespace(qkv_proj=proj, num_heads=heads, num_kv_heads=kv, head_dim=64, use_rope=True,
                            rotary_emb=emb)
    for key, value in overrides.items():
        target, _, attr = key.rpartition(".")
        setattr({"": layer, "proj": proj, "emb": emb}[target], attr, value)
    return layer


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_supported_layers(kv):
    assert cute_ops.unsupported_projection(fake_layer(kv)) is None
    assert cute_ops.unsupported_projection(fake_layer(kv, use_rope=False, rotary_emb=None)) is None


PROJECTION = "a QKV projection other than an unquantized bf16"
ROTARY = "a rotary table other than an interleaved fp32 one"


@pytest.mark.parametrize("overrides, reason", [
    ({"proj.quant_method": Fp8LinearMethod()}, PROJECTION),
    ({"proj.bias": torch.zeros(2304)}, PROJECTION),
    ({"proj.gather_output": True}, PROJECTION),
    ({"proj.weight": None}, PROJECTION),
    ({"proj.weight": torch.zeros(2304, H)}, PROJECTION),
    ({"proj.weight": torch.zeros(1152, H, dtype=torch.bfloat16)}, PROJECTION),
    ({"num_kv_heads": 8, "num_heads": 64, "proj.weight": torch.zeros(9216, H, dtype=torch.bfloat16)}, PROJECTION),
    ({"head_dim": 128}, PROJECTION),
    ({"num_heads": 12}, PROJECTION),
    ({"use_rope": False}, "a rotary table on a layer without RoPE"),
    ({"rotary_emb": None}, ROTARY),
    ({"emb.rotary_dim": 32}, ROTARY),
    ({"emb.is_neox_style": True}, ROTARY),
    ({"emb.cos_sin_cache": torch.zeros(128, 64, dtype=torch.bfloat16)}, ROTARY),
    ({"emb.cos_sin_cache": torch.zeros(64, 128).t()}, ROTARY),
    ({"emb.cos_sin_cache": torch.zeros(128, 32)}, ROTARY),
    ({"emb.cos_sin_cache": None}, ROTARY),
])
def test_unsupported_projections(overrides, reason):
    assert cute_ops.unsupported_projection(fake_layer(2, **overrides)) == reason or \
        cute_ops.unsupported_projection(fake_layer(2, **overrides)).startswith(reason)


def test_gathered_output_on_one_rank_is_fine():
    assert cute_ops.unsupported_projection(fake_layer(2, **{"proj.gather_output": True, "proj.tp_size": 1})) is None
