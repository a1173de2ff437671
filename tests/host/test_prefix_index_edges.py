"""The prefix index at its edges: how many prefix ids the interner holds, the longest
common prefix of one row and of rows that hold a single block or none, and runs of rows
under prefix id 0."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import longest_common_prefix
from jaxkv.prefix_index import ROOT_PREFIX, PrefixInterner, runs_at_column


def test_interner_length_counts_the_prefix_ids_some_row_holds():
    interner = PrefixInterner()
    a = interner.acquire(ROOT_PREFIX, [7, 2])
    assert len(interner) == 2
    b = interner.acquire(ROOT_PREFIX, [7, 3])  # shares the first id with a
    assert len(interner) == 3
    interner.release(a)
    assert len(interner) == 2  # 7 is still held by b
    interner.release(b)
    assert len(interner) == 0


def test_longest_common_prefix_takes_one_row_given_once_or_repeated():
    table = np.array([[0, 1, -1], [2, 3, 4]], np.int64)
    for rows in ([1], [1, 1], [0, 0]):
        num_blocks = np.array([2] * len(rows))
        assert longest_common_prefix(table, num_blocks, np.array(rows)) == 2
    assert longest_common_prefix(table, np.array([3]), np.array([1])) == 3


def test_longest_common_prefix_refuses_one_block_of_a_row_that_holds_none():
    table = np.array([[0, 1, -1], [-1, -1, -1]], np.int64)
    assert longest_common_prefix(table, np.array([2, 0])) == 0
    with pytest.raises(ValueError, match="must not exceed the blocks each row holds"):
        longest_common_prefix(table, np.array([2, 1]))
    with pytest.raises(ValueError, match="must not exceed the blocks each row holds"):
        longest_common_prefix(table, np.array([1]), np.array([1]))


def test_runs_at_column_groups_rows_under_the_first_prefix_id_interned():
    # The first pair interned gets prefix id 0, a real id unlike the -1 fill.
    interner = PrefixInterner()
    table = np.full((3, 2), -1, np.int64)
    for r, blocks in enumerate([[4], [4, 5], [6]]):
        table[r, : len(blocks)] = interner.acquire(ROOT_PREFIX, blocks)
    assert table[:, 0].tolist() == [0, 0, 2]
    rows = np.arange(3, dtype=np.int32)
    runs = runs_at_column(table, rows, rows + 10, 0, max_runs=4)
    assert [r.tolist() for r in runs] == [[10, 11]]
