"""The PTX wrappers' pure helpers and the host-side helpers of the EP tail.

CPU only: the integer helpers of musebench.kernels.ptx are the same Python functions the kernels
trace, so they are checked here exhaustively over one 16-bit half against torch's own BF16 bits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

from musebench import numerics as nx  # noqa: E402
from musebench.comm import protocol  # noqa: E402
from musebench.kernels import approx, ptx  # noqa: E402
from musebench.kernels import ep_tail as tail  # noqa: E402

ALL_HALVES = torch.arange(1 << 16, dtype=torch.int64)
# The other half of the word: the sentinel, both zeros, its neighbours, a normal, NaN, subnormal.
PARTNERS = (0x8000, 0x0000, 0x7FFF, 0x8001, 0xFFFF, 0x0001, 0x3F80, 0x7FC1, 0x807F)


def _words(other: int) -> list[tuple[str, torch.Tensor]]:
    return [("low", (other << 16) | ALL_HALVES), ("high", (ALL_HALVES << 16) | other)]


def _halves(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return words & 0xFFFF, words >> 16


@pytest.mark.parametrize("other", PARTNERS, ids=hex)
def test_has_negative_zero_is_exact_for_every_half(other):
    for _, words in _words(other):
        low, high = _halves(words)
        expected = (low == 0x8000) | (high == 0x8000)
        got = ptx.has_negative_zero_u32(words) != 0
        assert torch.equal(got, expected), f"first mismatch at word {hex(int(words[(got != expected).nonzero()[0]]))}"


@pytest.mark.parametrize("other", PARTNERS, ids=hex)
def test_scrub_clears_exactly_the_negative_zero_halves(other):
    for _, words in _words(other):
        low, high = _halves(words)
        expected_low = nx.scrub_negative_zero(low.to(torch.int16).view(torch.bfloat16)).view(torch.int16).to(torch.int64) & 0xFFFF
        expected_high = nx.scrub_negative_zero(high.to(torch.int16).view(torch.bfloat16)).view(torch.int16).to(torch.int64) & 0xFFFF
        got = ptx.scrub_negative_zero_u32(words)
        assert torch.equal(got, (expected_high << 16) | expected_low)
        assert not bool((ptx.has_negative_zero_u32(got) != 0).any()), "a scrubbed word must never read as a sentinel"


def test_widening_matches_torch_bf16_to_f32_bits():
    bf16 = ALL_HALVES.to(torch.int16).view(torch.bfloat16)
    expected = bf16.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    for other in (0x0000, 0x8000, 0xFFFF):
        assert torch.equal(ptx.bf16x2_low_bits((other << 16) | ALL_HALVES), expected)
        assert torch.equal(ptx.bf16x2_high_bits((ALL_HALVES << 16) | other), expected)


def test_helpers_take_python_ints():
    assert ptx.scrub_negative_zero_u32(0x80008000) == 0
    assert ptx.scrub_negative_zero_u32(0x80018000) == 0x80010000
    assert ptx.scrub_negative_zero_u32(0x12345678) == 0x12345678
    assert ptx.has_negative_zero_u32(0x00018000) != 0 and ptx.has_negative_zero_u32(0x80000001) != 0
    assert ptx.has_negative_zero_u32(0x00000000) == 0 and ptx.has_negative_zero_u32(0x80018001) == 0
    assert ptx.bf16x2_low_bits(0xABCD3F80) == 0x3F800000 and ptx.bf16x2_high_bits(0x3F80ABCD) == 0x3F800000


def test_mailbox_layout_is_the_protocols():
    tp, capacity, width = 3, 5, 4096
    assert tail.mailbox_shape(tp, capacity, width) == protocol.ep_mailbox_shape(tp, capacity, width)
    assert tail.mailbox_shape(tp, capacity) == protocol.ep_mailbox_shape(tp, capacity, tail.DEFAULT_WIDTH)
    flat = torch.arange(torch.Size(tail.mailbox_shape(tp, capacity, width)).numel()).view(tail.mailbox_shape(tp, capacity, width))
    for stage, slot, token, column in [(0, 0, 0, 0), (2, 1, 4, 4095), (1, 2, 3, 8)]:
        element = tail.slot_element(stage, slot, token, column, tp=tp, capacity=capacity, width=width)
        assert int(flat[stage, slot, token, column]) == element


@pytest.mark.parametrize("tp", [1, 2, 3, 8, 32])
def test_peer_order_visits_every_rank_once_own_last(tp):
    for rank in range(tp):
        order = tail.peer_order(rank, tp)
        assert sorted(order) == list(range(tp)) and order[-1] == rank
        assert order == tuple((rank + 1 + step) % tp for step in range(tp))


def test_fault_record_decodes_and_clear_means_none():
    assert tail.decode_fault([protocol.FAULT_CLEAR] * protocol.FAULT_WORDS, capacity=8) is None
    record = tail.decode_fault([2, 5, 5 * 8 + 3, 1], capacity=8)
    assert (record.rank, record.peer, record.slot, record.token, record.generation) == (2, 5, 5, 3, 1)
    assert "rank 2" in record.message() and "rank 5" in record.message() and "generation 1" in record.message()
    with pytest.raises(ValueError):
        tail.decode_fault([0, 1, 2], capacity=8)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(transport="broadcast"),
        dict(weight_dtype="fp16"),
        dict(threads=96),
        dict(width=4000),
        dict(eps=0.0),
        dict(gain_center=float("nan")),
    ],
    ids=lambda knobs: next(iter(knobs)),
)
def test_publisher_knobs_are_validated(knobs):
    base = dict(tp=8, capacity=8, weight_before_norm=True, weight_dtype="bf16", eps=1e-8, gain_center=1.0,
                transport="unicast", enable_pdl=True)
    with pytest.raises(ValueError):
        tail._EpPublisherKernel(**{**base, **knobs})


@pytest.mark.parametrize("knobs", [dict(timeout_ns=0), dict(timeout_ns=1.5), dict(capacity=0),
                                   dict(fragments=0), dict(fragments=3)], ids=str)
def test_reduce_knobs_are_validated(knobs):
    with pytest.raises(ValueError):
        tail._EpReduceKernel(**{**dict(tp=2, capacity=4, enable_pdl=True), **knobs})


@pytest.mark.parametrize("rank", [-1, 2])
def test_a_rank_outside_the_group_is_refused_before_compiling(rank):
    """The rank is a runtime argument (no kernel takes it at compile time); a rank given to
    `compile_*` or `EpTail` is still checked."""
    with pytest.raises(ValueError, match="rank"):
        tail.compile_publisher(tp=2, rank=rank, capacity=4, weight_before_norm=True, weight_dtype="bf16", eps=1e-8,
                               gain_center=1.0, transport="unicast", enable_pdl=True, arch="sm_90a")
    with pytest.raises(ValueError, match="rank"):
        tail.compile_reduce(tp=2, rank=rank, capacity=4, enable_pdl=True, arch="sm_90a")
    with pytest.raises(ValueError, match="rank"):
        tail.EpTail(
            rank=rank, tp=2, capacity=4, mailbox=torch.zeros(tail.mailbox_shape(2, 4), dtype=torch.int16),
            stage=torch.zeros(2, dtype=torch.int32), fault=torch.full((4,), -1, dtype=torch.int32),
            norm_weight=torch.zeros(4096, dtype=torch.bfloat16), peer_mailboxes=torch.zeros(2, dtype=torch.int64),
            weight_before_norm=True, weight_dtype="bf16", eps=1e-8, gain_center=1.0,
        )


def test_compiling_during_capture_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capture"):
        tail.compile_reduce(tp=2, rank=1, capacity=3, enable_pdl=False, timeout_ns=12345, arch="sm_90a")
    with pytest.raises(RuntimeError, match="capture"):
        approx.compile_elementwise("ex2_approx_f32", arch="sm_90a", ptx_dir="/nonexistent-capture-test")


def test_ep_tail_refuses_host_buffers():
    shape = tail.mailbox_shape(2, 4)
    with pytest.raises(ValueError, match="mailbox"):
        tail.EpTail(
            rank=0, tp=2, capacity=4, mailbox=torch.zeros(shape, dtype=torch.int16), stage=torch.zeros(2, dtype=torch.int32),
            fault=torch.full((4,), -1, dtype=torch.int32), norm_weight=torch.zeros(4096, dtype=torch.bfloat16),
            peer_mailboxes=torch.zeros(2, dtype=torch.int64), weight_before_norm=True, weight_dtype="bf16", eps=1e-8,
            gain_center=1.0,
        )


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize(
    "op, instruction",
    [("ex2_approx_f32", "ex2.approx.f32"), ("div_full_f32", "div.full.f32"), ("rsqrt_approx_ftz_f32", "rsqrt.approx.ftz.f32")],
)
def test_approximation_kernels_emit_exactly_their_instruction(tmp_path, arch, op, instruction):
    text = approx.compile_elementwise(op, arch=arch, ptx_dir=str(tmp_path)).artifacts.PTX
    if "\n" not in text:
        text = open(text).read()
    body = [line.split("//")[0].strip() for line in text.splitlines()]
    arithmetic = [line for line in body if line.split(" ")[0].startswith(("ex2.", "div.", "rsqrt.", "rcp.", "mul.", "fma."))
                  and ".f32" in line.split(" ")[0]]
    assert [line.split(" ")[0] for line in arithmetic] == [instruction]
