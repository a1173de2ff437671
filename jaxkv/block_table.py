"""The host block table: one numpy row of block ids per request, with exact prefix ids.

Plain numpy, no JAX. KVCacheManager owns one and keeps it in step with the blocks each
request holds; attention metadata is sliced from `block_table` without Python loops over
blocks, and shared prefixes are read from `prefix_ids` (jaxkv.prefix_index).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from operator import itemgetter

import numpy as np

from jaxkv.block_pool import NULL_BLOCK_ID
from jaxkv.field_checks import is_bool, is_unordered
from jaxkv.prefix_index import NO_PREFIX, ROOT_PREFIX, PrefixInterner, shared_prefix_of_rows

_INITIAL_ROWS = 16


class UnknownRequestError(ValueError, KeyError):
    """A request id the manager holds no blocks for (never allocated, or already freed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# Up to this many single-block appends are written as scalars: in a serving step the
# numpy fancy-indexing path runs with cold caches and costs more than a few scalar writes.
_SCALAR_WRITES_MAX = 64


def _no_key(ids: list, table: dict):
    """The first of `ids` whose lookup in `table` raises TypeError: one that cannot be a
    dict key, or whose == raises it against a key of its hash."""
    return next((i for i in ids if _lookup_fails(table, i)), None)


def _lookup_fails(table: dict, key) -> bool:
    try:
        table.get(key)
    except TypeError:
        return True
    return False


class HostBlockTable:
    """Rows of block ids and prefix ids, one per request that holds blocks.

    Public arrays (read-only for callers; valid until the next change):

    - `block_table`: i32[num_rows, max_blocks_per_seq]; a request's row holds its block
      ids in order, 0 (the null block) after them. Rows are reused after release; the
      number of rows doubles when needed (so re-read the attribute).
    - `prefix_ids`: i64[num_rows, max_blocks_per_seq], column-major; prefix_ids[r, j]
      == prefix_ids[s, j] iff rows r and s hold identical block ids in columns 0..j; -1
      where the row holds no block at column j.
    - `num_blocks_of_row`: i32[num_rows] blocks each row holds.
    """

    def __init__(self, max_blocks_per_seq: int) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_table = np.zeros((_INITIAL_ROWS, max_blocks_per_seq), np.int32)
        # Column-major: a shared-prefix probe reads one column of many rows contiguously.
        self.prefix_ids = np.full(
            (_INITIAL_ROWS, max_blocks_per_seq), NO_PREFIX, np.int64, order="F"
        )
        self.num_blocks_of_row = np.zeros(_INITIAL_ROWS, np.int32)
        self._publish_views()
        self._row_of: dict[str, int] = {}  # req_id -> row
        self._row_bytes: dict[str, bytes] = {}  # req_id -> row as 4 little-endian bytes
        self._prefix: dict[str, list[int]] = {}  # req_id -> prefix id per held block
        self._free_rows: list[int] = list(range(_INITIAL_ROWS))  # min-heap
        self._interner = PrefixInterner()
        self._row_epoch = 0  # bumped whenever a row is released; guards _rows_memo
        self._rows_memo: tuple[list[str], int, np.ndarray] | None = None  # (ids, epoch, rows)
        # Bumped whenever a row gains blocks another row may also hold (a cache hit);
        # with _row_epoch it guards _common_memo. Fresh blocks cannot change a common
        # prefix of two or more rows (see num_common_prefix_blocks), so they don't bump it.
        self._shared_epoch = 0
        self._common_memo: tuple[np.ndarray, int, int] | None = None  # (rows, epoch, answer)

    # ---------------------------------------------------------------- queries

    @property
    def sharing_version(self) -> tuple[int, int]:
        """Changes whenever a row is released or gains blocks other rows may hold.

        While it is unchanged, every live row's prefix ids at the columns it already
        holds are unchanged, and appended columns hold prefix ids no other row has.
        """
        return self._row_epoch, self._shared_epoch

    @property
    def row_version(self) -> int:
        """Changes whenever a row is released. While it is unchanged, every live row
        belongs to the same request and holds the blocks it held, perhaps with more after."""
        return self._row_epoch

    def rows_of(self, request_ids: Sequence[str]) -> np.ndarray:
        """i32[len(request_ids)] rows of block_table, in order. Raises UnknownRequestError.

        The result of the previous call is reused (a read-only array) when the ids are
        equal and no row has been released since, as in consecutive decode steps of one
        batch; otherwise it costs one C-level dict lookup per id.
        """
        if type(request_ids) is list:
            ids = request_ids
        elif isinstance(request_ids, str):  # list("ab") would be the ids "a" and "b"
            raise ValueError(f"{request_ids=} must be a sequence of request ids, not one str")
        elif is_unordered(request_ids):  # rows in no order one knows
            raise ValueError(f"{request_ids=} must be a sequence of ids, not a set or mapping")
        else:
            try:
                ids = list(request_ids)
            except TypeError:
                raise ValueError(f"{request_ids=} must be a sequence of request ids") from None
        memo = self._rows_memo
        try:
            if memo is not None and memo[1] == self._row_epoch and memo[0] == ids:
                return memo[2]
        except (ValueError, TypeError):  # an item whose == answers an array or raises:
            pass  # refused by name below
        key = list(ids)  # a copy: the caller may mutate its list later
        try:
            if len(key) > 1:  # bytes join + frombuffer: no per-id int conversion
                raw = b"".join(itemgetter(*key)(self._row_bytes))
            else:
                raw = self._row_bytes[key[0]] if key else b""
        except KeyError as e:
            if type(e.args[0]) is not str:  # a Request, say: its id would have been found
                raise ValueError(
                    f"request_ids: {e.args[0]!r} is not a request id (a str, as Request.request_id)"
                ) from None
            raise UnknownRequestError(
                f"request_ids: {e.args[0]!r} holds no blocks (never allocated or already freed)"
            ) from None
        except TypeError:
            raise ValueError(
                f"request_ids: {_no_key(key, self._row_bytes)!r} is not a request id"
            ) from None
        rows = np.frombuffer(raw, np.int32)  # read-only
        self._rows_memo = (key, self._row_epoch, rows)
        return rows

    def num_common_prefix_blocks(self, request_ids: Sequence[str]) -> int:
        """Leading blocks every request in `request_ids` holds at the same positions.

        For ids of two or more distinct rows the answer of the previous call is reused
        while the id list is equal, no row has been released and no shared block
        appended: blocks freshly taken from the pool are held by one row only, so
        appending them to a row lies past every prefix it shares with another row and
        cannot change the answer. (One id repeated is one row: its answer grows with it.)
        """
        rows = self.rows_of(request_ids)
        if len(rows) < 2:
            return self.num_common_prefix_blocks_of_rows(rows)
        memo = self._common_memo
        if memo is not None and memo[0] is rows and memo[1] == self._shared_epoch:
            return memo[2]
        answer = self.num_common_prefix_blocks_of_rows(rows)
        # Not for one row repeated: its answer is its length, which fresh blocks change.
        if answer < self.num_blocks_of_row[rows[0]] or (rows != rows[0]).any():
            self._common_memo = (rows, self._shared_epoch, answer)
        return answer

    def checked_rows(self, rows) -> np.ndarray:
        """`rows` as a 1-D integer array; ValueError unless each is a row of block_table
        (an out-of-range row used to raise numpy's IndexError, a negative one wrapped)."""
        memo = self._rows_memo
        if memo is not None and rows is memo[2]:  # rows_of's latest: rows only ever grow
            return rows
        given = rows
        if type(rows) is not np.ndarray or rows.dtype != np.int32:
            try:
                rows = np.asarray(rows)
            except (ValueError, TypeError):  # ragged nesting
                rows = np.asarray(None)
            # A bool among ints converts to an int array: True was read as row 1.
            if (
                rows.ndim != 1
                or (rows.size and rows.dtype.kind not in "iu")
                or (type(given) is not np.ndarray and any(map(is_bool, given)))
            ):
                raise ValueError(f"rows={given!r} must be a 1-D sequence of block-table rows")
            rows = rows.astype(np.int64)  # an empty list is float64
        elif rows.ndim != 1:
            raise ValueError(f"rows={given!r} must be a 1-D sequence of block-table rows")
        # As unsigned, a negative row is larger than any: one reduction checks both ends.
        unsigned = rows.view(np.uint32 if rows.dtype == np.int32 else np.uint64)
        if rows.size and unsigned.max() >= len(self.block_table):
            raise ValueError(f"rows={given!r} must lie in [0, {len(self.block_table)})")
        return rows

    def num_common_prefix_blocks_of_rows(self, rows: np.ndarray) -> int:
        """The same for live rows (as rows_of returns them), without lookup or reuse."""
        rows = np.asarray(rows)
        if len(rows) < 2:
            return int(self.num_blocks_of_row[rows[0]]) if len(rows) else 0
        return shared_prefix_of_rows(
            self.prefix_ids, rows, self.num_blocks_of_row, self.block_table
        )

    # ---------------------------------------------------------------- changes

    def add_row(self, request_id: str) -> None:
        """Gives `request_id` an empty row (the lowest free one)."""
        if not self._free_rows:
            self._grow()
        row = heapq.heappop(self._free_rows)
        self._row_of[request_id] = row
        self._row_bytes[request_id] = np.int32(row).tobytes()
        self._prefix[request_id] = []

    def append(self, request_id: str, block_ids: list[int], *, shared: bool) -> None:
        """Appends `block_ids` to the request's row. `shared`: some of them may also be
        held by other rows (a cache hit); False only for blocks fresh from the pool.
        Raises ValueError (nothing changed) if they include the null block: it fills the
        unused columns, so a row holding it would share with a shorter row's padding."""
        if NULL_BLOCK_ID in block_ids:
            raise ValueError(f"{block_ids=} include the null block {NULL_BLOCK_ID}")
        pids = self._prefix[request_id]
        row, start = self._row_of[request_id], len(pids)
        parent = pids[-1] if pids else ROOT_PREFIX
        end = start + len(block_ids)
        if end == start + 1:  # a decode step's block: scalar writes are cheaper
            pid = self._interner.acquire_one(parent, block_ids[0])
            pids.append(pid)
            self.block_table[row, start] = block_ids[0]
            self.prefix_ids[row, start] = pid
        else:
            new_pids = self._interner.acquire(parent, block_ids)
            pids.extend(new_pids)
            self.block_table[row, start:end] = block_ids
            self.prefix_ids[row, start:end] = new_pids
        self.num_blocks_of_row[row] = end
        if shared:
            self._shared_epoch += 1

    def append_one_each(self, request_ids: list[str], block_ids: list[int]) -> None:
        """Appends block_ids[i] (fresh from the pool) to request i's row, for distinct
        requests; the same as append(..., shared=False) one by one."""
        acquire, prefix, row_of = self._interner.acquire_one, self._prefix, self._row_of
        if len(request_ids) <= _SCALAR_WRITES_MAX:
            table, prefix_ids = self.block_table, self.prefix_ids
            num_blocks = self.num_blocks_of_row
            for request_id, block_id in zip(request_ids, block_ids, strict=True):
                row_pids, row = prefix[request_id], row_of[request_id]
                col = len(row_pids)
                pid = acquire(row_pids[-1] if row_pids else ROOT_PREFIX, block_id)
                row_pids.append(pid)
                table[row, col] = block_id
                prefix_ids[row, col] = pid
                num_blocks[row] = col + 1
            return
        rows = [row_of[r] for r in request_ids]
        cols = self.num_blocks_of_row[rows]
        pids = []
        for request_id, block_id in zip(request_ids, block_ids, strict=True):
            row_pids = prefix[request_id]
            pid = acquire(row_pids[-1] if row_pids else ROOT_PREFIX, block_id)
            row_pids.append(pid)
            pids.append(pid)
        self.block_table[rows, cols] = block_ids
        self.prefix_ids[rows, cols] = pids
        self.num_blocks_of_row[rows] = cols + 1

    def release(self, request_id: str) -> None:
        """Clears the request's row and returns it to the free rows."""
        self._interner.release(self._prefix.pop(request_id))
        row = self._row_of.pop(request_id)
        del self._row_bytes[request_id]
        n = int(self.num_blocks_of_row[row])
        self.block_table[row, :n] = NULL_BLOCK_ID
        self.prefix_ids[row, :n] = NO_PREFIX
        self.num_blocks_of_row[row] = 0
        heapq.heappush(self._free_rows, row)
        self._row_epoch += 1

    def _grow(self) -> None:
        old = len(self.block_table)
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        prefix_ids = np.full((2 * old, self.max_blocks_per_seq), NO_PREFIX, np.int64, order="F")
        prefix_ids[:old] = self.prefix_ids
        self.prefix_ids = prefix_ids
        self._publish_views()
        self.num_blocks_of_row = np.concatenate(
            [self.num_blocks_of_row, np.zeros_like(self.num_blocks_of_row)]
        )
        self._free_rows.extend(range(old, 2 * old))  # sorted extension keeps the heap valid

    def _publish_views(self) -> None:
        """Read-only views of block_table and prefix_ids, for the manager to hand out: a
        caller's write into them would change which KV a plan reads without any check."""
        self.block_table_view = self.block_table.view()
        self.block_table_view.flags.writeable = False
        self.prefix_ids_view = self.prefix_ids.view()
        self.prefix_ids_view.flags.writeable = False

    # -------------------------------------------------------------- integrity

    def check_integrity(self, block_ids_of: dict[str, list[int]]) -> list[str]:
        """Problems (empty if none) between the rows and each request's held block ids.

        Each request's row holds exactly its block ids then zeros; prefix ids are the
        interned chain of those block ids; rows are owned by exactly one request or free.
        """
        problems = []

        def check(condition: bool, message: str) -> None:
            if not condition:
                problems.append(message)

        check(set(block_ids_of) == set(self._row_of), "requests with blocks != rows")
        live_rows = set(self._row_of.values())
        check(len(live_rows) == len(self._row_of), "two requests share a row")
        free_rows = set(self._free_rows)
        check(len(free_rows) == len(self._free_rows), "a free row is listed twice")
        check(not live_rows & free_rows, "a live row is also free")
        all_rows = set(range(len(self.block_table)))
        check(live_rows | free_rows == all_rows, "rows leak")  # each row live or free
        free = sorted(free_rows & all_rows)
        check(not self.block_table[free].any(), "a free row holds block ids")
        check((self.prefix_ids[free] == NO_PREFIX).all(), "a free row holds prefix ids")
        check(not self.num_blocks_of_row[free].any(), "a free row has num_blocks > 0")
        expected_refs: dict[int, int] = {}
        for req_id, ids in block_ids_of.items():
            row = self._row_of.get(req_id)
            if row is None:
                continue
            if not 0 <= row < len(self.block_table):  # read there, it raised or wrapped
                check(False, f"{req_id!r}: row {row} is not a row of the table")
                continue
            n = len(ids)
            check(self.num_blocks_of_row[row] == n, f"{req_id!r}: num_blocks disagrees")
            check(self.block_table[row, :n].tolist() == ids, f"{req_id!r}: row != blocks")
            check(not self.block_table[row, n:].any(), f"{req_id!r}: row tail not null")
            pids = self._prefix.get(req_id)
            if pids is None or len(pids) != n:
                held = "no" if pids is None else len(pids)
                check(False, f"{req_id!r}: {held} prefix ids for {n} blocks")
                continue
            check(self.prefix_ids[row, :n].tolist() == pids, f"{req_id!r}: prefix ids stale")
            check((self.prefix_ids[row, n:] == NO_PREFIX).all(), f"{req_id!r}: prefix tail")
            row_bytes = self._row_bytes.get(req_id, b"")
            check(
                len(row_bytes) == 4 and int.from_bytes(row_bytes, "little") == row,
                f"{req_id!r}: row",
            )
            parent = ROOT_PREFIX
            for pid, block_id in zip(pids, ids, strict=True):
                check(self._interner.key_of(pid) == (parent, block_id), f"{req_id!r}: chain")
                expected_refs[pid] = expected_refs.get(pid, 0) + 1
                parent = pid
        check(self._interner.ref_counts() == expected_refs, "prefix id ref counts disagree")
        check(self._interner.consistent(), "prefix interner maps disagree")
        return problems
