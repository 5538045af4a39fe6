"""The wgmma descriptor encoding and the page layout (`kernels.gmma`), CPU only: the bit fields
against hand-computed words, `page_offset` against the 128-byte swizzle's definition, and the
descriptors' strides against the layout cp.async writes (through the canonical-layout address
model), with a wrong SBO or LBO shown to miss."""

from __future__ import annotations

import pytest

from musebench.kernels import gmma


def test_descriptor_fields_match_hand_computed_words():
    # start 0x400 -> 0x40; LBO 16 -> 1 << 16; SBO 1024 -> 64 << 32; 128-byte swizzle -> 1 << 62
    assert gmma.K_MAJOR_KEYS.encode(0x400) == 0x4000_0040_0001_0040
    assert gmma.K_MAJOR_KEYS.encode(gmma.k_step_start(0x400, 3)) == 0x4000_0040_0001_0046  # + 96 bytes
    # V at 0x400 + 2048: start 0xC0; LBO 2048 -> 128 << 16
    assert gmma.MN_MAJOR_VALUES.encode(0x400 + gmma.V_REGION) == 0x4000_0040_0080_00C0
    # base offset and the other layout types land in their bits
    assert gmma.SharedDescriptor(16, 16, gmma.LAYOUT_SWIZZLE_32B, 5).encode(0) == (3 << 62) | (5 << 49) | (1 << 32) | (1 << 16)
    assert gmma.SharedDescriptor(16, 1024, gmma.LAYOUT_NONE).template() == 0x0000_0040_0001_0000
    assert gmma.K_MAJOR_KEYS.template_signed() == gmma.K_MAJOR_KEYS.template()  # bit 63 clear: same value


@pytest.mark.parametrize("bad", [dict(leading_byte_offset=8, stride_byte_offset=16),
                                 dict(leading_byte_offset=16, stride_byte_offset=1 << 18),
                                 dict(leading_byte_offset=16, stride_byte_offset=16, layout=4),
                                 dict(leading_byte_offset=16, stride_byte_offset=16, base_offset=8)])
def test_descriptor_refuses_fields_it_cannot_hold(bad):
    with pytest.raises(ValueError):
        gmma.SharedDescriptor(**bad)


def test_descriptor_refuses_a_bad_start():
    for start in (8, -16, 1 << 18):
        with pytest.raises(ValueError):
            gmma.K_MAJOR_KEYS.encode(start)


def test_page_offset_is_the_swizzled_k_and_v_regions():
    assert gmma.page_offset(0, 0) == 0
    assert gmma.page_offset(1, 0) == 128 + 16
    assert gmma.page_offset(9, 3) == 9 * 128 + (3 ^ 1) * 16
    assert gmma.page_offset(0, 8) == 2048
    assert gmma.page_offset(5, 10) == 2048 + 5 * 128 + (2 ^ 5) * 16
    offsets = set()
    for slot in range(16):
        for chunk in range(16):
            region = 0 if chunk < 8 else 2048
            linear = region + slot * 128 + (chunk % 8) * 16
            assert gmma.page_offset(slot, chunk) == gmma.swizzle_128b(linear)  # region bases are 1024-aligned
            offsets.add(gmma.page_offset(slot, chunk))
    assert offsets == set(range(0, 4096, 16))  # a permutation of the stage's chunks


def _k_byte(stage, key, dim):
    return stage + gmma.page_offset(key, dim // 8) + (dim % 8) * 2


def _v_byte(stage, key, dim):
    return stage + gmma.page_offset(key, 8 + dim // 8) + (dim % 8) * 2


STAGE = 0x1400  # 1024-byte aligned, not 0: the swizzle must hold at any atom


def test_k_descriptor_reads_k_transposed_for_every_step():
    """S = Q K^T: step kk's B element (k = dim - 16 kk, n = key) is the byte cp.async put K[key][dim] at."""
    for kk in range(4):
        start = gmma.k_step_start(STAGE + gmma.K_REGION, kk)
        for key in range(16):
            for k in range(16):
                got = gmma.b_element_address(gmma.K_MAJOR_KEYS, start, k, key, 0)
                assert got == _k_byte(STAGE, key, 16 * kk + k), (kk, key, k)


def test_v_descriptor_reads_v_n_major():
    """P V: B element (k = key, n = dim) is the byte of V[key][dim]."""
    for key in range(16):
        for dim in range(64):
            got = gmma.b_element_address(gmma.MN_MAJOR_VALUES, STAGE + gmma.V_REGION, key, dim, 1)
            assert got == _v_byte(STAGE, key, dim), (key, dim)


def test_wrong_strides_miss():
    """The layout checks can fail: SBO halved (K and V), or V read K-major, reads other bytes."""
    bad_k = gmma.SharedDescriptor(16, 512)
    assert any(gmma.b_element_address(bad_k, STAGE, k, key, 0) != _k_byte(STAGE, key, k)
               for key in range(16) for k in range(16))
    bad_v = gmma.SharedDescriptor(2048, 512)
    assert any(gmma.b_element_address(bad_v, STAGE + gmma.V_REGION, key, dim, 1) != _v_byte(STAGE, key, dim)
               for key in range(16) for dim in range(64))
    assert any(gmma.b_element_address(gmma.MN_MAJOR_VALUES, STAGE + gmma.V_REGION, key, dim, 0)
               != _v_byte(STAGE, key, dim) for key in range(16) for dim in range(16))


RING = 0x2000  # attn2's ring: PIPELINE_STAGES 4 KB stages, then the ones block
STAGES = 8
ONES = RING + STAGES * gmma.PAGE_BYTES


def _values_layout(lbo: int) -> gmma.SharedDescriptor:
    return gmma.SharedDescriptor(lbo, gmma.ATOM_BYTES)


def test_values_with_ones_reach_v_then_the_ones_at_every_stage():
    """attn2's P V over N = 72: the kernel builds stage 0's descriptor once and advances it a stage
    at a time (`advance_values_descriptor`); at every stage that equals the descriptor of the
    stage's V region with LBO = the ones block's distance, and through it columns 0..63 are the
    stage's V and columns 64..71 fall in the ones block (every byte a 1.0 there)."""
    v0 = RING + gmma.V_REGION
    first = gmma.MN_MAJOR_VALUES_WITH_ONES.encode(v0) | gmma.leading_offset_field(ONES - v0)
    for stage in range(STAGES):
        v_start = RING + stage * gmma.PAGE_BYTES + gmma.V_REGION
        step = stage * gmma.PAGE_BYTES >> 4
        want = gmma.SharedDescriptor(ONES - v_start, gmma.ATOM_BYTES).encode(v_start)
        assert gmma.advance_values_descriptor(first, step) == want, stage
        layout = _values_layout(ONES - v_start)
        for key in range(16):
            for n in range(72):
                got = gmma.b_element_address(layout, v_start, key, n, 1)
                if n < 64:
                    assert got == _v_byte(RING + stage * gmma.PAGE_BYTES, key, n), (stage, key, n)
                else:
                    assert ONES <= got < ONES + gmma.ONES_BYTES, (stage, key, n)


def test_a_fixed_leading_offset_misses_the_ones_after_stage_0():
    """The check can fail: stage 0's LBO kept at a later stage reads the ones' columns from past the
    block (the next stage's bytes or beyond), not from it."""
    v_start = RING + 3 * gmma.PAGE_BYTES + gmma.V_REGION
    stale = _values_layout(ONES - (RING + gmma.V_REGION))
    assert any(not ONES <= gmma.b_element_address(stale, v_start, key, n, 1) < ONES + gmma.ONES_BYTES
               for key in range(16) for n in range(64, 72))


def test_keys_descriptor_advances_by_stage_and_step():
    k0 = gmma.K_MAJOR_KEYS.encode(RING + gmma.K_REGION)
    for stage in range(STAGES):
        for kk in range(4):
            start = gmma.k_step_start(RING + stage * gmma.PAGE_BYTES + gmma.K_REGION, kk)
            assert gmma.advance_keys_descriptor(k0, stage * gmma.PAGE_BYTES >> 4, kk) == gmma.K_MAJOR_KEYS.encode(start)
