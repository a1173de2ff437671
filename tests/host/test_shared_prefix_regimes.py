"""Exact shared prefixes in every regime of the search, against a plain loop.

shared_prefix_of_rows and longest_common_prefix take different paths by row count (all
rows searched up to 32, else a sample of at most 8 then one probe of all rows at the
bound), by size (the sample compared along block_table rows or galloped over prefix
ids; the rows that disagree at the bound compared in one pass or bisected), and by
where the rows part. Each case here builds its rows from scratch and checks each path
against the oracle, for a parting at every column.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import longest_common_prefix, prefix_index
from jaxkv.block_table import HostBlockTable

NUM_COLS = 12
BASE = [10 + j for j in range(NUM_COLS)]  # the block ids every row starts from


def _oracle(rows: list[list[int]]) -> int:
    k = 0
    while all(len(r) > k for r in rows) and len({r[k] for r in rows}) == 1:
        k += 1
    return k


def _answers(rows: list[list[int]]) -> tuple[int, int]:
    """(num_common_prefix_blocks, longest_common_prefix) of `rows` in a fresh table."""
    t = HostBlockTable(max_blocks_per_seq=NUM_COLS)
    ids = [f"r{i}" for i in range(len(rows))]
    for rid, blocks in zip(ids, rows, strict=True):
        t.add_row(rid)
        t.append(rid, blocks, shared=True)
    sel = t.rows_of(ids)
    return t.num_common_prefix_blocks(ids), longest_common_prefix(
        t.prefix_ids, t.num_blocks_of_row[sel], sel
    )


@pytest.mark.parametrize("sample_compare_max", [1 << 12, 0])  # 0: gallop over prefix ids
@pytest.mark.parametrize("direct_compare_max", [1 << 16, 0])  # 0: bisect the odd rows
@pytest.mark.parametrize("num_rows", [2, 5, 40])
def test_one_row_parting_at_any_column_anywhere(
    num_rows, direct_compare_max, sample_compare_max, monkeypatch
):
    # One row parts from the others at column `cut` (a new block there, or no block):
    # rows[0], rows[1] (outside the sample of 40 rows), a sample row, or the last row.
    monkeypatch.setattr(prefix_index, "_DIRECT_COMPARE_MAX", direct_compare_max)
    monkeypatch.setattr(prefix_index, "_SAMPLE_COMPARE_MAX", sample_compare_max)
    step = -(-num_rows // 8) if num_rows > 32 else 1
    for odd in sorted({0, 1, step, num_rows - 1}):
        for cut in range(NUM_COLS + 1):
            for tail in ([], [99]):
                rows = [BASE] * num_rows
                rows[odd] = (BASE[:cut] + tail)[:NUM_COLS]
                expected = _oracle(rows)
                assert _answers(rows) == (expected, expected), (odd, cut, tail)


@pytest.mark.parametrize("direct_compare_max", [1 << 16, 0])
def test_rows_outside_the_sample_parting_at_every_pair_of_columns(direct_compare_max, monkeypatch):
    # 40 rows: the sample (every 5th row) parts at column `bound`, two rows outside it
    # part earlier at other columns; the earliest parting sets the answer.
    monkeypatch.setattr(prefix_index, "_DIRECT_COMPARE_MAX", direct_compare_max)
    for bound in range(NUM_COLS + 1):
        for first in range(bound + 1):
            for second in range(first, bound + 1):
                rows = [BASE[:bound] + [98]] * 40
                rows[3] = BASE[:first] + [97]
                rows[38] = BASE[:second]
                rows = [r[:NUM_COLS] for r in rows]
                expected = _oracle(rows)
                assert _answers(rows) == (expected, expected), (bound, first, second)


def test_sample_sharing_nothing_with_a_longer_row_outside_it_gives_zero():
    # 40 rows: sample row 5 shares no block with rows[0], so the sampled bound is 0; row 1,
    # outside the sample, holds all of rows[0]'s blocks and one more. The answer is 0,
    # not a probe of the last column (the -1 past rows[0] against row 1's block).
    rows = [[1, 2]] * 40
    rows[5], rows[1] = [9], [1, 2, 3]
    t = HostBlockTable(max_blocks_per_seq=3)
    ids = [f"r{i}" for i in range(40)]
    for rid, blocks in zip(ids, rows, strict=True):
        t.add_row(rid)
        t.append(rid, blocks, shared=True)
    assert _oracle(rows) == 0
    assert t.num_common_prefix_blocks(ids) == 0
    sel = t.rows_of(ids)
    assert longest_common_prefix(t.prefix_ids, t.num_blocks_of_row[sel], sel) == 0
    assert longest_common_prefix(t.prefix_ids, np.minimum(t.num_blocks_of_row[sel], 1), sel) == 0


@pytest.mark.parametrize("sample_compare_max", [1 << 12, 0])  # 0: gallop over prefix ids
def test_sample_of_short_rows_parting_early_bounds_by_their_own_lengths(
    sample_compare_max, monkeypatch
):
    # 40 rows: the sample (every 5th row, rows[0] first) holds 2 blocks each and row 5
    # parts from rows[0] early; every row outside the sample holds all 12. The search
    # must be capped by the sample's own lengths: probed past them, the sample rows all
    # hold -1 and would agree with each other there.
    monkeypatch.setattr(prefix_index, "_SAMPLE_COMPARE_MAX", sample_compare_max)
    for cut in range(3):
        rows = [BASE if i % 5 else BASE[:2] for i in range(40)]
        rows[5] = (BASE[:cut] + [98, 97])[:2]
        expected = _oracle(rows)
        assert _answers(rows) == (expected, expected), cut
