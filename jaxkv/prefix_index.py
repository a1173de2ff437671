"""Exact prefix identities of block-table rows and the longest common prefix of a row set.

Every (prefix id of column j-1, block id at column j) pair is interned into one prefix id,
so two rows carry the same prefix id at column j iff they hold identical block ids in
columns 0..j. "Rows share their first k blocks" is then a single column compare, which is
monotone in k: the longest common prefix of R rows is a binary search over columns with
one vectorised compare of R values per probe. Exact by construction (no hashing), and
independent of how many other rows hold the same blocks.
"""

from __future__ import annotations

import numpy as np

NO_PREFIX = -1  # prefix id of a column a row holds no block at
ROOT_PREFIX = -1  # parent of column 0


class PrefixInterner:
    """Interns (parent prefix id, block id) pairs into prefix ids, reference counted.

    A prefix id lives while at least one row holds it; ids are never reused, so a stale id
    can never alias a live prefix.
    """

    def __init__(self) -> None:
        self._id_of: dict[tuple[int, int], int] = {}  # (parent id, block id) -> prefix id
        self._key_of: dict[int, tuple[int, int]] = {}  # prefix id -> (parent id, block id)
        self._ref_cnt: dict[int, int] = {}  # prefix id -> number of rows holding it
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._ref_cnt)

    def acquire(self, parent: int, block_ids: list[int]) -> list[int]:
        """Prefix ids for `block_ids` appended after `parent`; one reference each."""
        out = []
        id_of, ref_cnt = self._id_of, self._ref_cnt
        for block_id in block_ids:
            key = (parent, block_id)
            pid = id_of.get(key)
            if pid is None:
                pid = self._next_id
                self._next_id += 1
                id_of[key] = pid
                self._key_of[pid] = key
                ref_cnt[pid] = 1
            else:
                ref_cnt[pid] += 1
            out.append(pid)
            parent = pid
        return out

    def release(self, prefix_ids: list[int]) -> None:
        """Drops one reference from each id; ids nobody holds are forgotten."""
        ref_cnt = self._ref_cnt
        for pid in prefix_ids:
            n = ref_cnt[pid] - 1
            if n:
                ref_cnt[pid] = n
            else:
                del ref_cnt[pid]
                del self._id_of[self._key_of.pop(pid)]

    def ref_counts(self) -> dict[int, int]:
        return dict(self._ref_cnt)

    def key_of(self, prefix_id: int) -> tuple[int, int]:
        return self._key_of[prefix_id]


def longest_common_prefix(
    prefix_ids: np.ndarray,  # i64[R, C] (rows=None) or i64[num_rows, C] (rows given)
    num_blocks: np.ndarray,  # i32[R] blocks held by each selected row
    rows: np.ndarray | None = None,  # i32[R] row indices into prefix_ids; None = all rows
) -> int:
    """Number of leading columns in which all selected rows hold identical block ids.

    Columns at or beyond a row's num_blocks do not count as shared. Zero rows give 0; one
    row gives its num_blocks. Cost: O(R log C) numpy work, no Python loop over rows or
    blocks. Pass `rows` to avoid copying R full rows out of a large table.
    """
    num_rows = len(num_blocks)
    if num_rows == 0:
        return 0
    k_hi = int(num_blocks.min())
    if num_rows == 1 or k_hi == 0:
        return k_hi
    sel = slice(None) if rows is None else rows
    r0, r1 = (0, num_rows - 1) if rows is None else (int(rows[0]), int(rows[-1]))
    # Cheap upper bound from two rows (one vectorised compare along the row; equality of
    # prefix ids is a prefix property, so the count of equal columns is their LCP), then
    # one probe over all rows confirms it in the common case where every row shares it.
    k_hi = int(np.count_nonzero(prefix_ids[r0, :k_hi] == prefix_ids[r1, :k_hi]))
    if k_hi == 0 or _all_equal(prefix_ids, sel, k_hi):
        return k_hi
    lo, hi = 0, k_hi - 1  # answer in [lo, hi]; lo always holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _all_equal(prefix_ids, sel, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _all_equal(table: np.ndarray, sel, k: int) -> bool:
    """Whether all selected rows share their first k blocks (k >= 1)."""
    col = table[sel, k - 1]
    return bool((col == col[0]).all())
