"""The host block table: rows mirror held blocks; check_integrity sees every corruption."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import IntegrityError, UnknownRequestError
from jaxkv.block_table import HostBlockTable
from jaxkv.prefix_index import ROOT_PREFIX
from tests.host._util import make_request, prefill, two_request_manager


def test_rows_mirror_blocks_and_rows_are_reused_lowest_first():
    t = HostBlockTable(max_blocks_per_seq=4)
    for rid in ("a", "b", "c"):
        t.add_row(rid)
    t.append("a", [5, 6], shared=False)
    t.append("b", [5, 7], shared=True)
    assert t.rows_of(["a", "b", "c"]).tolist() == [0, 1, 2]
    assert t.block_table[:3].tolist() == [[5, 6, 0, 0], [5, 7, 0, 0], [0, 0, 0, 0]]
    assert t.num_common_prefix_blocks(["a", "b"]) == 1
    t.release("a")
    t.add_row("d")
    assert t.rows_of(["d"]).tolist() == [0]
    assert not t.block_table[0].any() and (t.prefix_ids[0] == -1).all()
    assert t.check_integrity({"b": [5, 7], "c": [], "d": []}) == []


def test_rows_grow_past_the_initial_table():
    t = HostBlockTable(max_blocks_per_seq=2)
    ids = [f"r{i}" for i in range(40)]
    for i, rid in enumerate(ids):
        t.add_row(rid)
        t.append(rid, [i + 1], shared=False)
    assert t.block_table.shape[0] >= 40
    assert t.block_table[t.rows_of(ids), 0].tolist() == list(range(1, 41))
    assert t.check_integrity({rid: [i + 1] for i, rid in enumerate(ids)}) == []


def test_manager_hands_out_read_only_views_that_follow_the_table():
    m = two_request_manager()
    row = int(m.rows_of(["B"])[0])
    before = m.block_table[row].copy()
    for name in ("block_table", "prefix_ids"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(m, name)[row, 0] = 7
        assert getattr(m, name) is getattr(m, name)  # one view while the table keeps its size
    np.testing.assert_array_equal(m.block_table[row], before)
    m.check_integrity()
    rows_before = len(m.block_table)
    for i in range(rows_before):  # one row each: the table doubles its rows
        prefill(m, make_request(f"r{i}", [100 + i]))
    assert len(m.block_table) > rows_before and not m.block_table.flags.writeable
    assert not m.prefix_ids.flags.writeable and m.prefix_ids.flags.f_contiguous
    m.check_integrity()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda m, r: m._table.block_table.__setitem__((r, 0), 31), "row != blocks"),
        (lambda m, r: m._table.block_table.__setitem__((r, 5), 9), "row tail not null"),
        (lambda m, r: m._table.prefix_ids.__setitem__((r, 1), 999), "prefix ids stale"),
        (lambda m, r: m._table.prefix_ids.__setitem__((r, 6), 3), "prefix tail"),
        (lambda m, r: m._table.block_table.__setitem__((15, 0), 4), "a free row holds block ids"),
    ],
)
def test_check_integrity_names_each_corruption(corrupt, message):
    """State corrupted behind the manager's back (its public arrays refuse writes)."""
    m = two_request_manager()
    row = int(m.rows_of(["B"])[0])
    corrupt(m, row)
    with pytest.raises(IntegrityError, match=message):
        m.check_integrity()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t: t.prefix_ids.__setitem__((3, 0), 7), "a free row holds prefix ids"),
        (lambda t: t._interner.acquire_one(t._prefix["a"][0], 9), "ref counts"),
        (lambda t: t._row_bytes.__setitem__("a", np.int32(1).tobytes()), "'a': row"),
    ],
)
def test_check_integrity_sees_state_outside_the_live_rows(corrupt, message):
    t = HostBlockTable(max_blocks_per_seq=4)
    t.add_row("a")
    t.append("a", [5, 6], shared=False)
    assert t.check_integrity({"a": [5, 6]}) == []
    corrupt(t)
    assert any(message in p for p in t.check_integrity({"a": [5, 6]}))


def _two_rows() -> HostBlockTable:
    t = HostBlockTable(max_blocks_per_seq=4)
    for rid, blocks in (("a", [5, 6]), ("b", [5])):
        t.add_row(rid)
        t.append(rid, blocks, shared=True)
    assert t.check_integrity({"a": [5, 6], "b": [5]}) == []
    return t


def _wrong_chain(t):
    # A consistent row, but its second prefix id is interned after the root, not after 5.
    pid = t._interner.acquire_one(ROOT_PREFIX, 6)
    t._prefix["a"][1] = t.prefix_ids[t._row_of["a"], 1] = pid


def _stale_interned_pair(t):
    # Every row is consistent, but the pair (root, 7) looks up block 5's prefix id: a row
    # that appends block 7 would seem to share b's prefix.
    t._interner._id_of[(ROOT_PREFIX, 7)] = t._prefix["b"][0]


def _free_row_twice(t):
    # As many rows as before, but row 3 is lost and row 2 free twice: two add_row calls
    # would both get row 2.
    t._free_rows[t._free_rows.index(3)] = 2


def _free_row_past_the_table(t):
    t._free_rows[t._free_rows.index(3)] = 99


def _unknown_prefix_id(t):
    # The row and its prefix-id list agree, but the id was never interned (or was released).
    t._prefix["a"][1] = t.prefix_ids[t._row_of["a"], 1] = 12345


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda t: t._row_of.__setitem__("b", t._row_of["a"]), "two requests share a row"),
        (lambda t: t._free_rows.append(t._row_of["a"]), "a live row is also free"),
        (lambda t: t._free_rows.pop(), "rows leak"),
        (lambda t: t.num_blocks_of_row.__setitem__(9, 1), "a free row has num_blocks > 0"),
        (lambda t: t.num_blocks_of_row.__setitem__(t._row_of["a"], 1), "'a': num_blocks"),
        (lambda t: t._row_of.pop("b"), "requests with blocks != rows"),
        (_wrong_chain, "'a': chain"),
        (lambda t: t._prefix["a"].pop(), "'a': 1 prefix ids for 2 blocks"),
        (lambda t: t._prefix.pop("a"), "'a': no prefix ids for 2 blocks"),
        (lambda t: t._row_bytes.pop("a"), "'a': row"),
        (_unknown_prefix_id, "'a': chain"),
        (_free_row_twice, "a free row is listed twice"),
        (_free_row_twice, "rows leak"),
        (_free_row_past_the_table, "rows leak"),
        (_stale_interned_pair, "prefix interner maps disagree"),
        (lambda t: t._row_of.__setitem__("a", 99), "'a': row 99 is not a row of the table"),
        (lambda t: t._row_of.__setitem__("a", -1), "'a': row -1 is not a row of the table"),
    ],
)
def test_check_integrity_sees_each_break_of_the_row_bookkeeping(corrupt, message):
    t = _two_rows()
    corrupt(t)
    assert any(message in p for p in t.check_integrity({"a": [5, 6], "b": [5]}))


def test_unknown_id_is_rejected_and_changes_nothing():
    m = two_request_manager()
    before = m.block_table.copy(), m.prefix_ids.copy()
    with pytest.raises(ValueError, match="'C' holds no blocks"):
        m.rows_of(["A", "C"])
    assert np.array_equal(m.block_table, before[0]) and np.array_equal(m.prefix_ids, before[1])
    m.check_integrity()


def test_repeated_rows_of_sees_a_release_and_a_row_swap():
    # The rows_of memo must not outlive a release: ids freed then re-added in the other
    # order swap rows, and a stale answer would point a request at another's blocks.
    t = HostBlockTable(max_blocks_per_seq=2)
    for rid, block in (("a", 5), ("b", 6)):
        t.add_row(rid)
        t.append(rid, [block], shared=False)
    assert t.rows_of(["a", "b"]).tolist() == [0, 1]
    t.release("a")
    with pytest.raises(UnknownRequestError) as e:
        t.rows_of(["a", "b"])
    # Its own str(), not KeyError's, which would quote the whole message.
    assert str(e.value) == "request_ids: 'a' holds no blocks (never allocated or already freed)"
    t.release("b")
    for rid in ("b", "a"):
        t.add_row(rid)
    assert t.rows_of(["a", "b"]).tolist() == [1, 0]
    t.rows_of(["b", "b"])  # prime the memo with the same ids as the next call
    t.release("b")
    t.add_row("c")  # takes row 0, which "b" held
    t.add_row("b")
    assert t.rows_of(["b", "b"]).tolist() == [2, 2]


def test_one_column_rows_that_differ_share_no_block():
    # Width-1 comparisons: rows that differ in column 0 share nothing, both when the
    # sample itself differs and when one row outside the sample of many rows does.
    t = HostBlockTable(max_blocks_per_seq=2)
    t.add_row("a")
    t.append("a", [5], shared=False)
    t.add_row("b")
    t.append("b", [6], shared=False)
    assert t.num_common_prefix_blocks(["a", "b"]) == 0
    ids = [f"r{i}" for i in range(40)]  # > 32 rows: a sample of every 5th row
    for rid in ids:
        t.add_row(rid)
        t.append(rid, [7, 8] if rid != "r1" else [9, 8], shared=True)
    assert t.num_common_prefix_blocks(ids) == 0
    assert t.num_common_prefix_blocks([i for i in ids if i != "r1"]) == 2


def test_append_one_each_past_the_scalar_path_keeps_lengths_and_prefix_chains():
    # More rows than the scalar-write path takes: the vectorised writes must set each
    # row's length and chain each new prefix id to the row's previous one.
    t = HostBlockTable(max_blocks_per_seq=3)
    ids = [f"r{i}" for i in range(70)]
    for rid in ids:
        t.add_row(rid)
        t.append(rid, [1], shared=True)
    t.append_one_each(ids, [i + 2 for i in range(70)])
    assert t.num_blocks_of_row[t.rows_of(ids)].tolist() == [2] * 70
    assert t.check_integrity({rid: [1, i + 2] for i, rid in enumerate(ids)}) == []
    assert t.num_common_prefix_blocks(ids) == 1
    t.append_one_each(ids, [80] * 70)  # one block id after different prefixes
    assert t.check_integrity({rid: [1, i + 2, 80] for i, rid in enumerate(ids)}) == []


def test_rows_of_is_not_fooled_by_a_caller_changing_its_list_afterwards():
    table = HostBlockTable(4)
    for request_id in "abc":
        table.add_row(request_id)
    ids = ["a", "b"]
    assert table.rows_of(ids).tolist() == [0, 1]
    ids[0] = "c"  # the same list object, other contents: the memo must not answer
    assert table.rows_of(ids).tolist() == [2, 1]


def _common_oracle(rows: list[list[int]]) -> int:
    k = 0
    while all(len(r) > k for r in rows) and len({r[k] for r in rows}) == 1:
        k += 1
    return k


@pytest.mark.parametrize("num_rows", [33, 40, 58])
def test_rows_outside_the_sample_that_diverge_early_set_the_answer(num_rows):
    # > 32 rows: the bound comes from every ceil(R/8)-th row; the probe at that bound
    # must find every other row that disagrees with the first, also the last row and
    # several rows that agree with each other but not with the first.
    step = -(-num_rows // 8)
    outside = [i for i in range(num_rows) if i % step]
    assert num_rows - 1 in outside
    shared = [7, 8, 9, 10]
    for odd in ([num_rows - 1], [outside[0], num_rows - 1], outside[:3]):
        t = HostBlockTable(max_blocks_per_seq=6)
        blocks = {}
        for i in range(num_rows):
            rid = f"r{i}"
            blocks[rid] = shared[:1] + [50, 51, 52] if i in odd else shared + [100 + i]
            t.add_row(rid)
            t.append(rid, blocks[rid], shared=True)
        ids = list(blocks)
        assert t.num_common_prefix_blocks(ids) == 1 == _common_oracle(list(blocks.values()))
        rest = [rid for i, rid in enumerate(ids) if i not in odd]
        assert t.num_common_prefix_blocks(rest) == 4 == _common_oracle([blocks[r] for r in rest])


def test_append_refuses_the_null_block_with_nothing_changed():
    # Block 0 fills the columns past a row's blocks. A row holding it matched a shorter
    # row's padding: with 40 rows, [5, 0, 7] against [5] gave a common prefix of 2.
    t = HostBlockTable(max_blocks_per_seq=4)
    ids = [f"r{i}" for i in range(40)]
    for i, rid in enumerate(ids):
        t.add_row(rid)
        t.append(rid, [5] if i == 1 else [5, 6, 7], shared=True)
    before = (t.block_table.copy(), t.prefix_ids.copy(), t.num_blocks_of_row.copy())
    for block_ids in ([0], [8, 0], [0, 9]):
        with pytest.raises(ValueError, match="null block"):
            t.append("r0", block_ids, shared=True)
    after = (t.block_table, t.prefix_ids, t.num_blocks_of_row)
    assert all((x == y).all() for x, y in zip(before, after, strict=True))
    assert t.num_common_prefix_blocks(ids) == 1
    assert t.check_integrity({rid: [5] if i == 1 else [5, 6, 7] for i, rid in enumerate(ids)}) == []


class _ComparesOnlyToItsOwn:
    """An id hashed as 'b' whose == raises TypeError against anything else: a dict lookup
    that meets the key 'b' raises it, as an unhashable id's lookup does."""

    def __hash__(self) -> int:
        return hash("b")

    def __eq__(self, other):
        raise TypeError("compared with another type")

    def __repr__(self) -> str:
        return "<own kind>"


def test_an_id_whose_comparison_raises_is_refused_by_name():
    # Its lookup raised TypeError, taken for an unhashable id; no id was unhashable, so
    # the error named None. After a call of as many ids, the list comparison with that
    # call's raised the TypeError itself.
    t = HostBlockTable(max_blocks_per_seq=4)
    for rid, blocks in (("a", [5, 6]), ("b", [5, 7])):
        t.add_row(rid)
        t.append(rid, blocks, shared=True)
    named = r"request_ids: <own kind> is not a request id"
    for call in (t.num_common_prefix_blocks, t.rows_of):
        with pytest.raises(ValueError, match=named):
            call(["a", _ComparesOnlyToItsOwn()])
        call(["a", "a"])  # the answer kept: the next list is compared with this one
        with pytest.raises(ValueError, match=named):
            call(["a", _ComparesOnlyToItsOwn()])
    assert t.num_common_prefix_blocks(["a", "b"]) == 1
    assert t.check_integrity({"a": [5, 6], "b": [5, 7]}) == []
