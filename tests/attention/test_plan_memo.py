"""PlanMemo: the planner's answers and plans are reused only while they are still what
it would compute (the differential serving runs compare whole plans, step by
step, against a planner that never reuses; these cases reach what those runs cannot)."""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheManager, Request
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from jaxkv.cascade_plan import global_plan, grouped_plan
from jaxkv.plan_memo import MAX_ANSWERS, PlanMemo
from jaxkv.prefix_index import longest_common_prefix_unchecked
from tests.attention.test_cascade_left_out import SYSTEM
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, SYSTEM_A, _decoding, _prefilled

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


def test_nested_members_count_who_shares_past_the_common_prefix_with_another():
    # a and c share their first block; b shares a's first two; a, b, c end there.
    m, c, hit = _a_and_c_sharing_one_of_three_blocks()
    b = Request("b", [1, 2, 3, 4, 8])
    got, _ = m.get_computed_blocks(b)
    m.allocate_slots(b, 1, num_new_computed_tokens=4, new_computed_blocks=got[:2])
    memo, rows = PlanMemo(), m.rows_of(["a", "b", "c"])
    num_blocks = m.num_blocks_of_rows(rows)
    three = np.arange(3)
    assert memo.common_prefix_nesting(m, rows, num_blocks, three) == (1, 1)  # a and b
    assert memo.nested_members(m, rows, three, 1) == 1
    assert memo.common_prefix_nesting(m, rows, num_blocks, np.array([0, 1])) == (2, 0)
    # c gains a's next two blocks as a cache hit: the three share two, a and c three.
    m.allocate_slots(c, 0, num_new_computed_tokens=4, new_computed_blocks=hit[1:])
    assert memo.common_prefix_nesting(m, rows, m.num_blocks_of_rows(rows), three) == (2, 1)


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


def test_a_split_is_remembered_per_column():
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    calls = []

    def compute(manager, rows, eligible, column):
        calls.append(column)
        return [eligible.copy()] if column == 0 else None

    assert [r.tolist() for r in memo.split(m, rows, BOTH, 0, compute)] == [[0, 1]]
    assert memo.split(m, rows, BOTH, 1, compute) is None  # column 1: asked, not column 0's
    assert [r.tolist() for r in memo.split(m, rows, BOTH, 0, compute)] == [[0, 1]]
    assert calls == [0, 1]


def test_the_search_answers_are_kept_per_manager():
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    other = KVCacheManager(32, 2, max_model_len=16)  # a and c share nothing there
    for rid, tokens in (("a", [7, 7, 7, 7, 7]), ("c", [8, 8, 8, 8, 8]), ("d", [7, 7, 9])):
        r = Request(rid, tokens)
        hit, num_hit = other.get_computed_blocks(r)  # d hits a's first block
        other.allocate_slots(
            r, len(tokens) - num_hit, num_new_computed_tokens=num_hit, new_computed_blocks=hit
        )
        r.num_computed_tokens = len(tokens)
        other.allocate_slots(r, 0)  # caches its full blocks
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    assert m.sharing_version == other.sharing_version
    assert other.rows_of(["a", "c"]).tolist() == rows.tolist()
    assert memo.common_prefix(m, rows, m.num_blocks_of_rows(rows), BOTH) == 1
    # The same rows object asked of another manager: its own answer, not m's.
    assert memo.common_prefix(other, rows, other.num_blocks_of_rows(rows), BOTH) == 0
    memo.note_no_groups(other, rows, 0)
    assert not memo.no_groups_past(m, rows, 0)


def test_a_grouped_plan_is_not_reused_for_other_plan_arguments():
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    made_for = (m, m.row_version)
    suffix_start = np.ones(2, np.int32)
    plan = memo.grouped_plan([(BOTH, 1)], rows, suffix_start, None, 1, made_for)
    assert plan.made_for == made_for and plan.num_common_prefix_blocks == 1
    later = (m, m.row_version + 1)
    assert memo.grouped_plan([(BOTH, 1)], rows, suffix_start, None, 1, later).made_for == later
    common = memo.grouped_plan([(BOTH, 1)], rows, suffix_start, None, 0, later)
    assert common.num_common_prefix_blocks == 0
    ends = memo.grouped_plan([(BOTH, 2)], rows, suffix_start, None, 0, later)
    assert ends.levels[-1].block_ends.tolist() == [2]
    two = np.full(2, 2, np.int32)
    suffix = memo.grouped_plan([(BOTH, 2)], rows, two, None, 0, later)
    assert suffix.suffix_start_blocks.tolist() == [2, 2]
    with_global = memo.grouped_plan([(BOTH, 2)], rows, two, 1, 0, later)
    assert [level.name for level in with_global.levels] == ["global", "groups"]


def test_a_batch_whose_plan_flips_between_kinds_keeps_both_plans():
    """The engine caches a level's metadata per plan object: a batch alternating between
    a global-only and a grouped plan (as its computed tokens cross a cost threshold) gets
    the same two objects back, not a new plan each step."""
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    made_for = (m, m.row_version)
    glob = memo.global_plan(rows, 1, 1, made_for)
    grouped = memo.grouped_plan([(BOTH, 1)], rows, np.ones(2, np.int32), None, 1, made_for)
    assert memo.global_plan(rows, 1, 1, made_for) is glob
    assert memo.grouped_plan([(BOTH, 1)], rows, np.ones(2, np.int32), None, 1, made_for) is grouped


def test_a_planner_remembers_that_no_group_forms_past_its_global_level():
    # Three requests share two blocks and then hold distinct ones: the search past the
    # global level finds every key distinct once, and later steps skip it.
    m = KVCacheManager(64, 4, max_model_len=64)
    ids = [_decoding(m, f"r{i}", SYSTEM_A[:8] + [100 + i] * 4).request_id for i in range(3)]
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan = planner.plan(ids, np.full(3, 12), np.ones(3, int), m)
    assert [lv.name for lv in plan.levels] == ["global"]
    assert plan.suffix_start_blocks.tolist() == [2, 2, 2]
    assert planner._memo.no_groups_past(m, m.rows_of(ids), 2)


def test_no_groups_is_remembered_for_the_requests_left_out_it_was_found_with():
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    out = np.array([True, False])
    memo.note_no_groups(m, rows, 1, out)
    assert memo.no_groups_past(m, rows, 1, out.copy())  # an equal mask
    assert not memo.no_groups_past(m, rows, 1)  # none left out: not what was found
    assert not memo.no_groups_past(m, rows, 1, np.array([False, True]))


def test_a_planner_remembers_that_no_group_forms_past_its_global_level_beside_a_left_out_request():
    # d0..d3 share the 10-block SYSTEM and hold a computed block of their own after it;
    # p's 4-token chunk under SYSTEM merges more than its read saves (test_cascade_left_out):
    # it is left out, and the search past the global level finds no two of the others
    # sharing there once; the next step with the same batch skips that search.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = [_decoding(m, f"d{i}", SYSTEM + [i] * 4 + [50]) for i in range(4)]
    reqs.append(_prefilled(m, "p", SYSTEM + [7] * 4))
    ids = [r.request_id for r in reqs]
    query_lens = np.array([1, 1, 1, 1, 4])
    computed = np.array([r.num_tokens for r in reqs]) - query_lens
    model = CascadeCostModel(launch_overhead_bytes=8192, merge_cost_factor=1)
    planner = CascadePlanner(SHAPE, cost_model=model)
    searched_bases = []
    search = planner._groups

    def counting(manager, rows, num_computed_tokens, query_lens, base, *args):
        searched_bases.append(base)
        return search(manager, rows, num_computed_tokens, query_lens, base, *args)

    planner._groups = counting
    plans = [planner.plan(ids, computed, query_lens, m) for _ in range(2)]
    assert searched_bases.count(10) == 1  # past the global level: once
    for plan in plans:
        plan.check()
        assert [(lv.name, lv.block_ends.tolist()) for lv in plan.levels] == [("groups", [10])]
        assert plan.suffix_start_blocks.tolist() == [10, 10, 10, 10, 0]


def test_no_groups_is_not_remembered_while_a_request_has_not_computed_its_first_block():
    # a and b share SYSTEM_A, c nothing. With a at 0 computed tokens only b and c can
    # form a group, and they do not; once a has computed, a and b form one.
    m = KVCacheManager(128, 4, max_model_len=128)
    reqs = [_decoding(m, rid, SYSTEM_A + [i]) for i, rid in enumerate("ab")]
    reqs.append(_decoding(m, "c", list(range(500, 533))))
    ids, ones = [r.request_id for r in reqs], np.ones(3, int)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    assert not planner.plan(ids, np.array([0, 33, 33]), ones, m).uses_cascade
    plan = planner.plan(ids, np.array([33, 33, 33]), ones, m)
    assert [(lv.name, lv.block_ends.tolist()) for lv in plan.levels] == [("groups", [8])]


def test_members_given_as_other_integers_with_the_same_bytes_get_their_own_prefix():
    m, _, hit = _a_and_c_sharing_one_of_three_blocks()
    b = Request("b", [1, 2, 3, 4, 5, 6, 8])  # holds all three of a's cached blocks
    m.allocate_slots(b, 0, num_new_computed_tokens=6, new_computed_blocks=hit)
    memo, rows = PlanMemo(), m.rows_of(["c", "a", "b"])
    num_blocks = m.num_blocks_of_rows(rows)
    assert memo.common_prefix(m, rows, num_blocks, np.array([1, 2], np.int64)) == 3
    # int32 [1, 0, 2, 0] has the bytes of int64 [1, 2], but takes in c at position 0.
    assert memo.common_prefix(m, rows, num_blocks, np.array([1, 0, 2, 0], np.int32)) == 1


def test_a_grouped_plan_is_not_reused_for_other_members_in_groups_of_the_same_sizes():
    memo, rows = PlanMemo(), np.arange(4, dtype=np.int32)
    suffix_start = np.full(4, 2, np.int32)
    pairs = [(np.array([0, 1]), 2), (np.array([2, 3]), 2)]
    crossed = [(np.array([0, 2]), 2), (np.array([1, 3]), 2)]
    assert memo.grouped_plan(pairs, rows, suffix_start, None, 0, None).order.tolist() == [
        0,
        1,
        2,
        3,
    ]
    plan = memo.grouped_plan(crossed, rows, suffix_start, None, 0, None)
    assert plan.order.tolist() == [0, 2, 1, 3]
    leaders = plan.levels[0].leader_rows.tolist()
    assert leaders[0] in (0, 2) and leaders[1] in (1, 3)  # a row of each group


def test_the_answers_of_one_batch_start_over_once_they_reach_max_answers():
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    calls = []

    def compute(manager, rows, eligible, column):
        calls.append(column)
        return None

    for column in range(MAX_ANSWERS):
        memo.split(m, rows, BOTH, column, compute)
    memo.split(m, rows, BOTH, 0, compute)  # remembered, but the memo is full: asked again
    assert len(calls) == MAX_ANSWERS + 1 and calls[-1] == 0
    memo.split(m, rows, BOTH, 0, compute)
    assert len(calls) == MAX_ANSWERS + 1


def test_splits_and_grouped_plans_of_members_with_the_same_bytes_are_kept_apart():
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    wide, narrow = np.array([1], np.int64), np.array([1, 0], np.int32)  # the same bytes
    runs = [memo.split(m, rows, e, 0, lambda *a: [a[2].copy()])[0].tolist() for e in (wide, narrow)]
    assert runs == [[1], [1, 0]]
    suffix_start = np.ones(2, np.int32)
    for members, size in ((wide, 1), (narrow, 2)):
        plan = memo.grouped_plan([(members, 1)], rows, suffix_start, None, 0, None)
        assert plan.levels[0].group_ends.tolist() == [size]


def test_which_rows_share_a_column_is_renewed_with_the_sharing():
    # c holds a's first block only: at column 1 nobody shares, at column 0 both do; once
    # c gains a's next two blocks (a cache hit) both share column 1.
    m, c, hit = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    assert memo.shares_column(m, rows, 0).tolist() == [True, True]
    assert memo.shares_column(m, rows, 1).tolist() == [False, False]  # c holds none there
    assert memo.shares_through(m, rows, 0) and not memo.shares_through(m, rows, 1)
    m.allocate_slots(c, 0, num_new_computed_tokens=4, new_computed_blocks=hit[1:])
    assert memo.shares_column(m, rows, 1).tolist() == [True, True]
    assert memo.shares_through(m, rows, 2)


def test_a_reused_plan_cannot_be_changed_in_place_by_the_step_that_got_it():
    # The memo hands the same plan to every step that asks for an equal one, and the
    # metadata builder trusts a planner's plan without checking its block columns: a
    # step writing into its plan's arrays would change the next step's plan.
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    made_for = (m, m.row_version)
    plans = [
        memo.global_plan(rows, 1, 1, made_for),
        memo.grouped_plan([(BOTH, 1)], rows, np.ones(2, np.int32), None, 1, made_for),
    ]
    for plan in plans:
        arrays = [plan.order, plan.rows, plan.suffix_start_blocks]
        for level in plan.levels:
            arrays += [level.group_starts, level.group_ends, level.block_starts]
            arrays += [level.block_ends, level.leader_rows]
        assert not any(a.flags.writeable for a in arrays)


def test_which_rows_share_a_column_cannot_be_changed_in_place_by_a_caller():
    # The memo hands the same array to every later question about that column.
    m, _, _ = _a_and_c_sharing_one_of_three_blocks()
    memo, rows = PlanMemo(), m.rows_of(["a", "c"])
    shares = memo.shares_column(m, rows, 0)
    assert not shares.flags.writeable
    assert memo.shares_column(m, rows, 0) is shares
