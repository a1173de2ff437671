"""The host block table's versions and reused answers: what changes them, what does not,
and the answer a reused common prefix gives; check_integrity at the table's edges."""

from __future__ import annotations

from jaxkv.block_table import HostBlockTable


def test_row_version_changes_on_a_release_only():
    t = HostBlockTable(max_blocks_per_seq=4)
    before = t.row_version
    t.add_row("a")
    t.append("a", [5, 6], shared=True)
    t.append_one_each(["a"], [7])
    assert t.row_version == before
    t.release("a")
    released = t.row_version
    assert released != before
    t.add_row("b")
    assert t.row_version == released
    t.release("b")
    assert t.row_version not in (before, released)


def test_sharing_version_changes_on_a_release_or_a_shared_append():
    t = HostBlockTable(max_blocks_per_seq=4)
    t.add_row("a")
    v0 = t.sharing_version
    t.append("a", [5], shared=False)
    t.append_one_each(["a"], [6])
    assert t.sharing_version == v0
    t.append("a", [7], shared=True)
    v1 = t.sharing_version
    assert v1 != v0
    t.release("a")
    assert t.sharing_version not in (v0, v1)


def test_a_reused_common_prefix_answer_is_the_answer_until_a_shared_append():
    t = HostBlockTable(max_blocks_per_seq=6)
    ids = ["a", "b"]
    for rid, shared in (("a", False), ("b", True)):
        t.add_row(rid)
        t.append(rid, [5, 6, 7], shared=shared)
    assert t.num_common_prefix_blocks(ids) == 3
    assert t.num_common_prefix_blocks(ids) == 3  # reused: the same answer
    t.append("a", [8], shared=True)
    t.append("b", [8], shared=True)  # both rows gain a block they share
    assert t.num_common_prefix_blocks(ids) == 4
    t.append_one_each(ids, [9, 10])  # fresh blocks: the answer stays
    assert t.num_common_prefix_blocks(ids) == 4
    assert t.check_integrity({"a": [5, 6, 7, 8, 9], "b": [5, 6, 7, 8, 10]}) == []


def test_check_integrity_sees_a_row_one_past_the_table_and_an_id_just_past_a_row():
    t = HostBlockTable(max_blocks_per_seq=4)
    t.add_row("a")
    t.append("a", [5, 6], shared=False)
    row = t.rows_of(["a"])[0]
    t.block_table[row, 2] = 9  # the column right after the row's blocks
    assert t.check_integrity({"a": [5, 6]}) == ["'a': row tail not null"]
    t.block_table[row, 2] = 0
    t.prefix_ids[row, 2] = 3
    assert t.check_integrity({"a": [5, 6]}) == ["'a': prefix tail"]
    t.prefix_ids[row, 2] = -1
    t._row_of["a"] = len(t.block_table)
    problems = t.check_integrity({"a": [5, 6]})
    assert f"'a': row {len(t.block_table)} is not a row of the table" in problems
