"""The attn2 split plan (musebench.attn2_layout): every page of every L is visited exactly once,
by a split fixed by the page alone; the window's keys."""

from __future__ import annotations

import pytest

from musebench import attn2_layout as lay


@pytest.mark.parametrize("num_splits", [1, 2, 8, 64])
@pytest.mark.parametrize("first, end", [(0, 1), (0, 129), (3, 4), (5, 200), (130, 131)])
def test_split_pages_partition_the_range(num_splits, first, end):
    seen = []
    for split in range(num_splits):
        pages = list(lay.split_pages(split, num_splits, first, end))
        assert pages == sorted(pages)
        assert all(p % num_splits == split for p in pages)  # the page alone decides its split
        seen.extend(pages)
    assert sorted(seen) == list(range(first, end))


@pytest.mark.parametrize("seq_len, window, want", [
    (8, 0, (0, 8)),
    (100, 0, (0, 100)),
    (100, 50, (43, 100)),  # row 0 (position 92) sees 43..92; row 7 sees 50..99
    (8, 2048, (0, 8)),
    (2055, 2048, (0, 2055)),  # row 0 at 2047 sees keys 0..2047: exactly the window
    (2056, 2048, (1, 2056)),
])
def test_visible_keys(seq_len, window, want):
    assert lay.visible_keys(seq_len, window) == want


def test_max_pages():
    assert [lay.max_pages(n) for n in (1, 16, 17, 131072)] == [1, 1, 2, 8192]


def test_partial_layout():
    assert lay.PARTIAL_BYTES == 18432 and lay.CTA_THREADS == 128 and lay.ROWS_PER_KV_HEAD == 64
