"""The prefix index on its own: prefix ids interned per (parent, block), and the longest
common prefix of a set of rows, against a plain oracle over block-id lists.

jaxkv.prefix_index shares no paging logic with the oracle: it reads interned prefix ids
column by column, the oracle compares the block ids themselves.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import longest_common_prefix, prefix_index
from jaxkv.prefix_index import PrefixInterner, runs_at_column, shared_prefix_of_rows


def test_interner_distinguishes_same_block_after_different_prefixes():
    interner = PrefixInterner()
    r0 = interner.acquire(-1, [7, 2])
    r1 = interner.acquire(-1, [5, 2])
    r2 = interner.acquire(-1, [7, 2, 9])
    assert r0[1] != r1[1]  # block 2 at column 1 after different block 0
    assert r0 == r2[:2]
    interner.release(r0)
    interner.release(r2)
    interner.release(r1)
    assert len(interner) == 0
    assert interner.acquire(-1, [7])[0] not in r0 + r1 + r2  # ids are never reused


def _lcp_oracle(block_rows: list[list[int]]) -> int:
    k = 0
    while all(k < len(r) for r in block_rows) and len({r[k] for r in block_rows}) == 1:
        k += 1
    return k


@pytest.mark.parametrize("seed", range(20))
def test_longest_common_prefix_matches_oracle_on_random_tables(seed):
    rng = np.random.default_rng(seed)
    num_rows, num_cols = int(rng.integers(1, 12)), 10
    shared = rng.integers(1, 5, size=num_cols).tolist()
    rows = []
    for _ in range(num_rows):
        keep = int(rng.integers(0, num_cols + 1))
        tail = rng.integers(1, 5, size=num_cols - keep).tolist()
        rows.append((shared[:keep] + tail)[: int(rng.integers(0, num_cols + 1))])
    interner = PrefixInterner()
    table = np.full((num_rows + 3, num_cols), -1, np.int64)
    for i, blocks in enumerate(rows):
        table[i + 3, : len(blocks)] = interner.acquire(-1, blocks)
    num_blocks = np.array([len(r) for r in rows], np.int32)
    sel = np.arange(3, num_rows + 3, dtype=np.int32)
    perm = rng.permutation(num_rows)
    expected = _lcp_oracle(rows)
    assert longest_common_prefix(table, num_blocks, sel) == expected
    assert longest_common_prefix(table[sel], num_blocks) == expected
    assert longest_common_prefix(table, num_blocks[perm], sel[perm]) == expected


def test_longest_common_prefix_edge_cases():
    table = np.array([[0, 1, 2, -1], [0, 1, 3, -1], [0, 1, 2, 4]], np.int64)
    assert longest_common_prefix(table, np.array([], np.int32)) == 0
    assert longest_common_prefix(table[:1], np.array([3], np.int32)) == 3
    assert longest_common_prefix(table, np.array([3, 3, 4], np.int32)) == 2
    rows = np.array([0, 2], np.int32)
    assert longest_common_prefix(table, np.array([3, 4], np.int32), rows) == 3
    # First and last rows agree everywhere, a middle row does not: the bound is checked.
    table = np.array([[0, 1, 2], [0, 5, 6], [0, 1, 2]], np.int64)
    assert longest_common_prefix(table, np.array([3, 3, 3], np.int32)) == 1


@pytest.mark.parametrize("direct_compare_max", [1 << 16, 0])
@pytest.mark.parametrize("seed", range(12))
def test_longest_common_prefix_many_rows_with_few_divergent(seed, direct_compare_max, monkeypatch):
    monkeypatch.setattr(prefix_index, "_DIRECT_COMPARE_MAX", direct_compare_max)
    # R > 32 exercises the sampled bound, the one full probe and the search over the rows
    # that disagree, with divergent rows placed anywhere (mostly outside the sample).
    rng = np.random.default_rng(100 + seed)
    num_rows, num_cols = int(rng.integers(33, 300)), 24
    shared = rng.integers(1, 50, num_cols).tolist()
    rows = [shared[: int(rng.integers(num_cols - 4, num_cols + 1))] for _ in range(num_rows)]
    for i in rng.choice(num_rows, int(rng.integers(0, 4)), replace=False):
        cut = int(rng.integers(0, num_cols))
        rows[i] = shared[:cut] + [99] * int(rng.integers(0, num_cols - cut + 1))
    interner = PrefixInterner()
    table = np.full((num_rows + 5, num_cols), -1, np.int64, order="F")
    perm = rng.permutation(num_rows)
    for i, blocks in enumerate(rows):
        table[perm[i] + 5, : len(blocks)] = interner.acquire(-1, blocks)
    sel = (perm + 5).astype(np.int32)
    num_blocks = np.array([len(r) for r in rows], np.int32)
    assert longest_common_prefix(table, num_blocks, sel) == _lcp_oracle(rows)
    capped = np.minimum(num_blocks, rng.integers(0, num_cols + 1, num_rows)).astype(np.int32)
    expected = _lcp_oracle([r[:c] for r, c in zip(rows, capped, strict=True)])
    assert longest_common_prefix(table, capped, sel) == expected


def test_interner_acquire_one_matches_acquire():
    a, b = PrefixInterner(), PrefixInterner()
    for parent_block in [(-1, 5), (-1, 5), (0, 7), (-1, 6)]:
        assert a.acquire(*parent_block[:1], [parent_block[1]]) == [b.acquire_one(*parent_block)]
    assert a.ref_counts() == b.ref_counts() == {0: 2, 1: 1, 2: 1}
    b.release([0, 0])
    assert 0 not in b.ref_counts() and b.acquire_one(-1, 5) == 3  # ids are never reused


@pytest.mark.parametrize(
    "num_blocks,rows,match",
    [
        ([-1, 3, 4], None, "num_blocks must lie in"),  # used to answer -1
        ([3, 3, 9], None, "num_blocks must lie in"),  # IndexError
        ([3, 3, 5], None, "num_blocks must lie in"),  # one past the 4 columns
        ([3, 3], None, "must equal the 3 rows"),  # used to compare the first two rows only
        ([3, 4], [0, -1], "rows must lie in"),  # -1 wrapped round to the last row
        ([3, 4], [0, 3], "rows must lie in"),  # one past the 3 rows
        ([3, 4], [0, 1, 2], r"len\(rows\)=3"),
        ([3.0, 4.0, 4.0], None, "integers"),
        ([4, 4, 4], None, "must not exceed the blocks"),
        ([3, 4], [0, 1], "must not exceed the blocks"),
        ([0, 4], [2, 0], "must not exceed the blocks"),
    ],
)
def test_longest_common_prefix_refuses_arguments_it_would_misread(num_blocks, rows, match):
    table = np.array([[0, 1, 2, -1], [0, 1, 3, -1], [0, 1, 2, 4]], np.int64)
    rows = None if rows is None else np.array(rows)
    with pytest.raises(ValueError, match=match):
        longest_common_prefix(table, np.array(num_blocks), rows)
    for bad in ([3, 3, 4], None):  # None raised AttributeError
        with pytest.raises(ValueError, match="num_blocks must be a 1-D numpy array"):
            longest_common_prefix(table, bad)
    for bad_table in (table.tolist(), table[0]):  # a list, and one row only
        with pytest.raises(ValueError, match="prefix_ids must be a 2-D numpy array"):
            longest_common_prefix(bad_table, np.array([3, 3, 4]))


@pytest.mark.parametrize("dtype", [str, float, bool])
def test_longest_common_prefix_refuses_prefix_ids_that_are_no_integers(dtype):
    # Strings raised numpy's UFuncNoLoopError; floats' NaN ids never compare equal.
    table = np.array([[0, 1, 2, -1], [0, 1, 3, -1]], np.int64).astype(dtype)
    with pytest.raises(ValueError, match="prefix_ids must be integers, got dtype"):
        longest_common_prefix(table, np.array([3, 3]))


def test_longest_common_prefix_refuses_num_blocks_past_the_blocks_held():
    # Both rows hold 2 blocks; their -1 fills agree in columns 2 and 3, which a larger
    # num_blocks used to count as shared.
    table = np.array([[0, 1, -1, -1], [0, 1, -1, -1]], np.int64)
    assert longest_common_prefix(table, np.array([2, 2])) == 2
    with pytest.raises(ValueError, match="must not exceed the blocks each row holds"):
        longest_common_prefix(table, np.array([4, 4]))
    with pytest.raises(ValueError, match="must not exceed the blocks each row holds"):
        longest_common_prefix(table, np.array([3, 2]), np.array([1, 0]))
    for empty in (np.array([]), np.array([], np.int32)):  # zero rows, of any dtype: 0
        assert longest_common_prefix(table, empty) == 0
        assert longest_common_prefix(table, empty, empty) == 0


def test_shared_prefix_of_no_rows_is_zero_and_of_one_row_its_length():
    table = np.array([[0, 1, -1], [0, 2, 3]], np.int64, order="F")
    held = np.array([2, 3], np.int32)
    assert shared_prefix_of_rows(table, np.array([], np.int32), held) == 0
    assert shared_prefix_of_rows(table, np.array([1], np.int32), held) == 3
    assert shared_prefix_of_rows(table, np.array([0, 1], np.int32), held) == 1


def _prefix_table(block_rows: list[list[int]], num_cols: int) -> np.ndarray:
    """prefix_ids as the manager keeps them: interned chains, -1 past each row's blocks."""
    interner = PrefixInterner()
    table = np.full((len(block_rows), num_cols), prefix_index.NO_PREFIX, np.int64)
    for r, blocks in enumerate(block_rows):
        table[r, : len(blocks)] = interner.acquire(prefix_index.ROOT_PREFIX, blocks)
    return table


def test_runs_at_column_are_runs_of_two_or_more_largest_first_capped_at_max_runs():
    # Column 1 splits the rows into runs of 3 (block 5), 2 (block 6), 4 (block 7, but
    # under another block 0 for row 9: alone) and the singletons 3 and 8.
    block_rows = [
        [1, 5], [1, 7], [1, 5], [1, 9], [1, 7], [1, 6],
        [1, 7], [1, 5], [1, 8], [2, 7], [1, 6], [1, 7],
    ]  # fmt: skip
    prefix_ids = _prefix_table(block_rows, 3)
    rows = np.arange(len(block_rows), dtype=np.int32)
    labels = rows + 100  # what the runs report instead of the rows
    runs = runs_at_column(prefix_ids, rows, labels, 1, max_runs=8)
    assert [r.tolist() for r in runs] == [[101, 104, 106, 111], [100, 102, 107], [105, 110]]
    # The cap keeps the largest runs, not the first or the smallest ones.
    capped = runs_at_column(prefix_ids, rows, labels, 1, max_runs=2)
    assert [r.tolist() for r in capped] == [[101, 104, 106, 111], [100, 102, 107]]
    # Ties keep the run of the smallest label, not the one of the smaller prefix id.
    tied = runs_at_column(prefix_ids, rows[[0, 2, 5, 10]], labels[[0, 2, 5, 10]], 1, 1)
    assert [r.tolist() for r in tied] == [[100, 102]]
    reversed_labels = 200 - rows[[0, 2, 5, 10]]
    tied = runs_at_column(prefix_ids, rows[[0, 2, 5, 10]], reversed_labels, 1, 1)
    assert [r.tolist() for r in tied] == [[190, 195]]
    # Every id distinct: None, not an empty list.
    assert runs_at_column(prefix_ids, rows[[0, 1, 3, 5]], labels[[0, 1, 3, 5]], 1, 8) is None


def test_runs_at_column_never_groups_rows_that_hold_no_block_there():
    # Rows 1 and 2 hold no block at column 2 (-1 there): they share nothing at it.
    prefix_ids = _prefix_table([[1, 2, 3], [1, 2], [1, 4], [1, 2, 3]], 3)
    rows = np.arange(4, dtype=np.int32)
    runs = runs_at_column(prefix_ids, rows, rows, 2, max_runs=8)
    assert [r.tolist() for r in runs] == [[0, 3]]
