"""PlanMemo: the planner's answers and plans are reused only while they are still what
it would compute (the differential serving runs compare whole plans, step by
step, against a planner that never reuses; these cases reach what those runs cannot)."""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheManager, Request
from jaxkv.cascade_plan import global_plan, grouped_plan
from jaxkv.plan_memo import PlanMemo
from jaxkv.prefix_index import longest_common_prefix_unchecked

BOTH = np.arange(2)


def _a_and_c_sharing_one_of_three_blocks():
    """A manager where a holds three cached full blocks and c only the first of them."""
    m = KVCacheManager(32, 2, max_model_len=16)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7])
    assert m.allocate_slots(a, 7) is not None
    a.num_computed_tokens = 7
    m.allocate_slots(a, 0)  # caches a's three full blocks
    c = Request("c", [1, 2, 3, 4, 5, 6, 9])
    hit, _ = m.get_computed_blocks(c)
    m.allocate_slots(c, 0, num_new_computed_tokens=2, new_computed_blocks=hit[:1])
    c.num_computed_tokens = 2
    return m, c, hit


def test_a_cache_hit_appended_to_a_batch_row_renews_the_common_prefix():
    m, c, hit = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    assert memo.common_prefix(m, rows, m.num_blocks_of_rows(rows), BOTH) == 1
    # c gains a's next two blocks as a cache hit: the same rows object, a new answer.
    m.allocate_slots(c, 0, num_new_computed_tokens=4, new_computed_blocks=hit[1:])
    assert m.rows_of(["a", "c"]) is rows
    assert memo.common_prefix(m, rows, m.num_blocks_of_rows(rows), BOTH) == 3


def test_fresh_blocks_keep_the_answers_and_splits_are_read_only():
    m, c, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    calls = []
    runs = memo.split(m, rows, BOTH, 0, lambda *_: calls.append(1) or [np.array([0, 1])])
    m.allocate_slots(c, 3)  # fresh blocks for c's next tokens: held by c alone
    num_blocks = m.num_blocks_of_rows(rows)
    assert memo.common_prefix(m, rows, num_blocks, BOTH) == 1
    assert longest_common_prefix_unchecked(m.prefix_ids, num_blocks, rows) == 1
    again = memo.split(m, rows, BOTH, 0, lambda *_: calls.append(1) or [])
    assert calls == [1] and [r.tolist() for r in again] == [r.tolist() for r in runs] == [[0, 1]]
    assert not again[0].flags.writeable  # shared by later steps: nobody may write it


def test_the_last_grouped_plan_is_reused_for_equal_arguments_only():
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    made_for = (m, m.row_version)
    suffix_start = np.ones(2, np.int32)
    args = ([(BOTH, 1)], rows, suffix_start, None, 1, made_for)
    plan = memo.grouped_plan(*args)
    assert memo.grouped_plan(*args) is plan
    fresh = grouped_plan(*args)
    assert plan.levels[0].block_ends.tolist() == fresh.levels[0].block_ends.tolist() == [1]
    equal_rows = rows.copy()  # equal values, but another batch's rows object
    assert memo.grouped_plan([(BOTH, 1)], equal_rows, suffix_start, None, 1, made_for) is not plan
    two = [(BOTH[:1], 1), (BOTH[1:], 1)]  # other groups: a plan of their own
    assert (
        len(memo.grouped_plan(two, rows, suffix_start, None, 1, made_for).levels[0].block_ends) == 2
    )


def test_no_groups_is_remembered_per_base_until_the_sharing_changes():
    m, c, hit = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    memo.note_no_groups(m, rows, 1)
    assert memo.no_groups_past(m, rows, 1) and not memo.no_groups_past(m, rows, 0)
    m.allocate_slots(c, 3)  # fresh blocks: the fact holds
    assert memo.no_groups_past(m, rows, 1)
    assert not memo.no_groups_past(m, m.rows_of(["c", "a"]), 1)  # another batch
    m.allocate_slots(
        Request("d", [1, 2]), 0, num_new_computed_tokens=2, new_computed_blocks=hit[:1]
    )
    assert not memo.no_groups_past(m, rows, 1)  # a cache hit appended: asked again


def test_the_last_global_plan_is_reused_for_equal_arguments_only():
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    made_for = (m, m.row_version)
    plan = memo.global_plan(rows, 1, 1, made_for)
    assert memo.global_plan(rows, 1, 1, made_for) is plan
    fresh = global_plan(rows, 1, 1, made_for)
    assert plan.suffix_start_blocks.tolist() == fresh.suffix_start_blocks.tolist() == [1, 1]
    assert plan.levels[0].block_ends.tolist() == [1] and plan.levels[0].name == "global"
    assert memo.global_plan(rows, 1, 2, made_for).num_common_prefix_blocks == 2
    assert memo.global_plan(rows, 2, 2, made_for).levels[0].block_ends.tolist() == [2]
    m.free("c")  # a released row: plans name the row version they were made for
    later = memo.global_plan(rows, 2, 2, (m, m.row_version))
    assert later.made_for == (m, m.row_version) != made_for
    assert memo.global_plan(rows.copy(), 2, 2, later.made_for).rows is not rows
