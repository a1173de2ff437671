"""Exact prefix identities of block-table rows, the longest common prefix of a row set, and
the runs of rows that share a column.

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
_DIRECT_COMPARE_MAX = 1 << 16  # most prefix ids compared in one pass instead of bisecting
_SAMPLE_COMPARE_MAX = 1 << 12  # most sample block ids compared in one pass (else gallop)
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

    def acquire_one(self, parent: int, block_id: int) -> int:
        """acquire(parent, [block_id])[0] without the lists (a decode step's block)."""
        key = (parent, block_id)
        pid = self._id_of.get(key)
        if pid is None:
            pid = self._next_id
            self._next_id = pid + 1
            self._id_of[key] = pid
            self._key_of[pid] = key
            self._ref_cnt[pid] = 1
        else:
            self._ref_cnt[pid] += 1
        return pid

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

    def consistent(self) -> bool:
        """Whether the pair -> id and id -> pair maps are inverses over the held ids."""
        id_of, key_of = self._id_of, self._key_of
        return (
            len(id_of) == len(key_of) == len(self._ref_cnt)
            and key_of.keys() == self._ref_cnt.keys()
            and all(id_of.get(key) == pid for pid, key in key_of.items())
        )

    def ref_counts(self) -> dict[int, int]:
        return dict(self._ref_cnt)

    def key_of(self, prefix_id: int) -> tuple[int, int] | None:
        """The (parent id, block id) interned as `prefix_id`; None if no row holds it."""
        return self._key_of.get(prefix_id)


def longest_common_prefix(
    prefix_ids: np.ndarray,  # i64[R, C] (rows=None) or i64[num_rows, C] (rows given)
    num_blocks: np.ndarray,  # i32[R] blocks each selected row may share (<= blocks held)
    rows: np.ndarray | None = None,  # i32[R] row indices into prefix_ids; None = all rows
) -> int:
    """Number of leading columns in which all selected rows hold identical block ids.

    Requires prefix ids as KVCacheManager.prefix_ids keeps them: -1 at and beyond the
    blocks a row holds. `num_blocks` may cap rows below what they hold (e.g. full blocks
    only); the answer never exceeds its minimum. Zero rows give 0; one row gives its
    num_blocks. Pass `rows` to avoid copying R full rows out of a large table.
    Cost: no Python loop over rows or blocks; see `shared_prefix_of_rows`.
    Raises ValueError on arrays of other shapes or of other than integers (prefix_ids
    of floats: NaN never equals itself), num_blocks outside [0, C], rows
    outside [0, num_rows) (they would index or wrap around silently), or a num_blocks
    past the blocks its row holds (rows whose -1 fills agree would count as sharing).
    """
    _check_lcp_args(prefix_ids, num_blocks, rows)
    return longest_common_prefix_unchecked(prefix_ids, num_blocks, rows)


def longest_common_prefix_unchecked(
    prefix_ids: np.ndarray, num_blocks: np.ndarray, rows: np.ndarray | None = None
) -> int:
    """longest_common_prefix without its argument checks, for callers whose arguments
    are right by construction (the cascade planner: rows and counts from the manager)."""
    num_rows = len(num_blocks)
    if num_rows <= 1:
        return int(num_blocks[0]) if num_rows else 0
    if rows is None:
        rows = np.arange(num_rows)
    found = _shared_prefix(prefix_ids, rows, num_blocks[:: _sample_step(num_rows)])
    return min(found, int(num_blocks.min()))


def _check_lcp_args(prefix_ids, num_blocks, rows) -> None:
    """ValueError unless longest_common_prefix's arguments have its shapes and ranges."""
    if not isinstance(prefix_ids, np.ndarray) or prefix_ids.ndim != 2:
        raise ValueError(f"prefix_ids must be a 2-D numpy array, got {type(prefix_ids)}")
    if prefix_ids.size and prefix_ids.dtype.kind not in "iu":  # floats' NaN never match
        raise ValueError(f"prefix_ids must be integers, got dtype {prefix_ids.dtype}")
    for name, a in (("num_blocks", num_blocks), ("rows", rows)):
        if (a is not None or name == "num_blocks") and not (
            isinstance(a, np.ndarray) and a.ndim == 1
        ):
            raise ValueError(f"{name} must be a 1-D numpy array of ints, got {type(a)}")
        if a is not None and a.size and a.dtype.kind not in "iu":
            raise ValueError(f"{name} must be integers, got dtype {a.dtype}")
    num_rows, num_cols = prefix_ids.shape
    if num_blocks.size and not 0 <= num_blocks.min() <= num_blocks.max() <= num_cols:
        raise ValueError(f"num_blocks must lie in [0, {num_cols}] (columns of prefix_ids)")
    if rows is None:
        if num_blocks.size and len(num_blocks) != num_rows:
            raise ValueError(f"{len(num_blocks)=} must equal the {num_rows} rows of prefix_ids")
    elif len(rows) != len(num_blocks):
        raise ValueError(f"{len(rows)=} must equal {len(num_blocks)=}")
    elif rows.size and not 0 <= rows.min() <= rows.max() < num_rows:
        raise ValueError(f"rows must lie in [0, {num_rows}) (rows of prefix_ids)")
    if not num_blocks.size:  # of any dtype: zero rows
        return
    held = num_blocks > 0
    selected = np.flatnonzero(held) if rows is None else rows[held]
    if (prefix_ids[selected, num_blocks[held] - 1] < 0).any():
        raise ValueError("num_blocks must not exceed the blocks each row holds (-1 in prefix_ids)")


def shared_prefix_of_rows(
    prefix_ids: np.ndarray,  # i64[num_rows, C], -1 at and beyond each row's blocks
    rows: np.ndarray,  # i32[R] selected rows
    num_blocks_of_row: np.ndarray,  # i32[num_rows] blocks each row of prefix_ids holds
    block_table: np.ndarray | None = None,  # i32[num_rows, C] row-major, 0 past the blocks
) -> int:
    """Leading columns all `rows` share, bounded only by the blocks they hold.

    A sample of at most 8 rows (all rows when R <= 32; rows[0] always) is searched
    first (probe its shortest row's length, then gallop downward, then bisect), which
    bounds the answer from above. One vectorised probe over all R rows at that bound
    confirms it in the usual case (every scheduled request shares the prefix);
    otherwise only the D rows that disagree with rows[0] there are compared with it,
    along contiguous rows of `block_table` when given (block ids agree in columns
    0..k-1 iff prefix ids agree at k-1, and the table's 0 past a row's blocks never
    equals a held block). Cost: O(R + 8 log C + D C) numpy work (D log C when D C is
    large), no Python loop over rows or blocks. Exact: prefix ids are exact
    identities, and the -1 fill makes a row that lacks column k fail every probe at k.
    A column-major `prefix_ids` makes each probe read contiguous memory.
    """
    if len(rows) <= 1:
        return int(num_blocks_of_row[rows[0]]) if len(rows) else 0
    sample_num_blocks = num_blocks_of_row[rows[:: _sample_step(len(rows))]]
    return _shared_prefix(prefix_ids, rows, sample_num_blocks, block_table)


def _shared_prefix(
    prefix_ids: np.ndarray,  # i64[num_rows, C]
    rows: np.ndarray,  # i32[R], R >= 2
    sample_num_blocks: np.ndarray,  # i32[S] blocks held by rows[::_sample_step(R)]
    block_table: np.ndarray | None = None,  # i32[num_rows, C] row-major
) -> int:
    step = _sample_step(len(rows))
    sample, hi = rows[::step], int(sample_num_blocks.min())
    if block_table is not None and len(sample) * hi <= _SAMPLE_COMPARE_MAX:
        bound = _shared_with_first(block_table, rows[0], sample[1:], hi)
    else:
        bound = _search(prefix_ids, sample, hi, gallop=True)
    if step == 1 or bound == 0:
        return bound
    # One probe of all rows at the bound. A row that agrees there with rows[0] (a sample
    # row) shares all `bound` columns with it, so only the rows that disagree can lower
    # the answer: it is the shared prefix of rows[0] and those rows.
    differs = _differs_at(prefix_ids, rows, bound)
    if not differs.any():
        return bound
    odd = rows[differs]
    if len(odd) * bound <= _DIRECT_COMPARE_MAX:
        # Few odd rows: compare them with rows[0] along the columns in one pass.
        table = prefix_ids if block_table is None else block_table
        return _shared_with_first(table, rows[0], odd, bound - 1)
    return _search(prefix_ids, np.concatenate([rows[:1], odd]), bound - 1, gallop=False)


def _shared_with_first(table: np.ndarray, first: int, others: np.ndarray, width: int) -> int:
    """Columns 0..k-1 in which every row of `others` equals row `first`, k <= width.

    `table` is block_table (row-major, contiguous rows) or prefix_ids; either way the
    first column that differs is a row's shared prefix with `first`.
    """
    if len(others) == 0 or width == 0:
        return width
    mismatch = table[others, :width] != table[first, :width]
    return int(np.where(mismatch.any(axis=1), mismatch.argmax(axis=1), width).min())


def _sample_step(num_rows: int) -> int:
    """Stride of the sample: all rows up to 32 (a probe of them is as cheap), else <= 8."""
    return 1 if num_rows <= 32 else -(-num_rows // 8)


def _search(prefix_ids: np.ndarray, rows: np.ndarray, hi: int, *, gallop: bool) -> int:
    """Largest k <= hi with _shares(k), given that _shares is monotone (true up to the answer)."""
    lo, gap = 0, 1  # the answer lies in [lo, hi]
    while gallop and hi > lo:
        k = max(hi - gap + 1, lo + 1)
        if _shares(prefix_ids, rows, k):
            lo = k
            break
        hi, gap = k - 1, 2 * gap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _shares(prefix_ids, rows, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _differs_at(prefix_ids: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """bool[R]: which rows hold another prefix at column k-1 than rows[0] (k >= 1)."""
    col = prefix_ids[:, k - 1].take(rows)
    return col != col[0]


def _shares(prefix_ids: np.ndarray, rows: np.ndarray, k: int) -> bool:
    """Whether all `rows` hold identical block ids in columns 0..k-1 (k >= 1)."""
    col = prefix_ids[:, k - 1].take(rows)
    return bool((col == col[0]).all())


def runs_at_column(
    prefix_ids: np.ndarray,  # i64[num_rows, C] as KVCacheManager.prefix_ids keeps them
    rows: np.ndarray,  # i32[n] rows, each holding a block at `column`
    labels: np.ndarray,  # i[n] what stands for each row in the runs returned
    column: int,
    max_runs: int,
) -> list[np.ndarray] | None:
    """The runs of two or more `rows` holding the same prefix id at `column` (identical
    block ids in columns 0..column), as sorted `labels`, at most `max_runs` of them,
    largest first, then by their smallest label; None when every id differs. The
    prefix ids' values order nothing: they follow the order in which rows first held
    each prefix, other rows (holders outside a batch) included."""
    keys = prefix_ids[rows, column]
    by_key = np.argsort(keys, kind="stable")
    sorted_keys = keys[by_key]
    new_run = sorted_keys[1:] != sorted_keys[:-1]
    if new_run.all():
        return None
    starts = np.concatenate([[0], np.flatnonzero(new_run) + 1])
    sizes = np.diff(np.append(starts, len(keys)))
    runs = np.flatnonzero((sizes >= 2) & (sorted_keys[starts] >= 0))
    order = labels[by_key]
    first = np.minimum.reduceat(order, starts)[runs]  # each run's smallest label
    runs = runs[np.lexsort((first, -sizes[runs]))][:max_runs]
    return [np.sort(order[starts[c] : starts[c] + sizes[c]]) for c in runs]
