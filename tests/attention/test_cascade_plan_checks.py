"""Hand-made cascade plans and levels the metadata builder would misread are refused.

CascadePlan.check (run on construction unless the planner builds the plan) and
CascadeLevel's own checks: groups in batch order and non-empty, every batch position's
block columns read exactly once, order a permutation.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadePlanner
from jaxkv.cascade_plan import CascadeLevel, CascadePlan, make_level
from tests.attention.test_cascade_planner import (
    ALWAYS,
    SHAPE,
    SYSTEM_A,
    _decoding,
    _two_group_plan,
)


def _reversed_groups(level):
    names = ("group_starts", "group_ends", "block_starts", "block_ends", "leader_rows")
    return {f: getattr(level, f)[::-1].copy() for f in names}


@pytest.mark.parametrize(
    "change,match",
    [
        (_reversed_groups, "in batch order"),
        (lambda lv: {"group_ends": np.array([4, 6], np.int32)}, "in batch order"),  # overlap
        (lambda lv: {"group_ends": np.array([0, 6], np.int32)}, "non-empty"),
        (lambda lv: {"block_ends": np.array([0, 6], np.int32)}, "non-empty"),
        (lambda lv: {"block_starts": np.array([-1, 0], np.int32)}, "non-empty"),  # column -1
        (lambda lv: {"leader_rows": np.array([0], np.int32)}, "one length"),
    ],
    ids=["out_of_order", "overlapping", "empty_group", "empty_blocks", "negative_block", "ragged"],
)
def test_a_malformed_level_is_refused(change, match):
    (level,) = _two_group_plan().levels
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(level, **change(level))


def test_a_level_past_the_batch_or_ragged_plan_arrays_are_refused():
    plan = _two_group_plan()
    (level,) = plan.levels
    longer = dataclasses.replace(level, group_ends=np.array([3, 7], np.int32))
    with pytest.raises(ValueError, match="within the 6 requests"):
        dataclasses.replace(plan, levels=(longer,))
    with pytest.raises(ValueError, match="must be equal"):
        dataclasses.replace(plan, rows=plan.rows[:-1])
    with pytest.raises(ValueError, match="must be equal"):  # one start would broadcast
        dataclasses.replace(plan, suffix_start_blocks=plan.suffix_start_blocks[:1])


def _refused(plan, match, **changes):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(plan, **changes)


def test_a_plan_that_reads_a_block_twice_or_never_is_refused():
    plan = _two_group_plan()  # suffix starts [8, 8, 8, 6, 6, 6]: after each group's blocks
    (level,) = plan.levels
    starts = plan.suffix_start_blocks
    end = "must be where the levels' block columns end"
    _refused(plan, end, suffix_start_blocks=np.zeros_like(starts))  # read twice
    _refused(plan, end, suffix_start_blocks=starts + 1)  # block 8 or 6 never read
    one_off = starts.copy()
    one_off[-1] += 1  # one position alone: its block 6 never read
    _refused(plan, end, suffix_start_blocks=one_off)
    _refused(plan, end, levels=())  # the groups' blocks never read
    late = dataclasses.replace(level, block_starts=np.array([1, 0], np.int32))
    _refused(plan, "must start where the earlier levels end", levels=(late,))  # block 0
    # A global level over blocks 0:2 under the groups' levels, which also start at 0.
    glob = make_level("global", [0], [6], [0], [2], [int(plan.rows[0])])
    _refused(plan, "must start where the earlier levels end", levels=(glob, level))
    shifted = dataclasses.replace(level, block_starts=np.array([2, 2], np.int32))
    assert dataclasses.replace(plan, levels=(glob, shifted)).levels[0] is glob  # consistent


def test_a_plan_whose_order_is_not_a_permutation_is_refused():
    plan = _two_group_plan()
    _refused(plan, "must be a permutation", order=np.array([0, 2, 4, 1, 3, 3], np.int32))
    _refused(plan, "must be a permutation", order=np.array([0, 2, 4, 1, 3, 6], np.int32))
    _refused(plan, "needs the identity order", keeps_order=True)  # order is [0, 2, 4, 1, 3, 5]
    _refused(plan, "must be a permutation", order=np.array([0, 2, 4, 1, 3, -1], np.int32))
    _refused(plan, "block-table rows", rows=np.array([0, 1, 2, 3, 4, -1], np.int32))
    with pytest.raises(ValueError, match="must be distinct"):  # two requests, one row
        CascadePlan(
            np.arange(2, dtype=np.int32), np.array([3, 3], np.int32), np.zeros(2, np.int32), (), 0
        )


def test_a_negative_leader_row_or_non_integer_arrays_are_refused():
    # numpy reads leader row -1 as the table's last row: another request's (or no) KV.
    plan = _two_group_plan()
    (level,) = plan.levels
    with pytest.raises(ValueError, match="leader_rows"):
        dataclasses.replace(level, leader_rows=np.array([0, -1], np.int32))
    with pytest.raises(ValueError, match="integer numpy arrays"):
        dataclasses.replace(level, block_ends=level.block_ends.astype(float) - 0.5)
    with pytest.raises(ValueError, match="integer numpy arrays"):
        dataclasses.replace(level, group_starts=level.group_starts.tolist())
    _refused(plan, "integer numpy arrays", order=plan.order.tolist())
    _refused(plan, "1-D integer numpy arrays", order=plan.order[None, :])
    _refused(plan, "integer numpy arrays", suffix_start_blocks=plan.suffix_start_blocks * 1.0)


def _global_level_over_system_a() -> dict:
    """build_attention_metadata's arguments but the query and cached lengths: two
    requests holding SYSTEM_A's 8 blocks (and one of their own), under one global
    level over those 8 blocks."""
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A + [i]) for i in range(2)]
    rows = m.rows_of([r.request_id for r in reqs])
    level = make_level("global", [0], [2], [0], [8], [int(rows[0])])
    plan = CascadePlan(np.arange(2, dtype=np.int32), rows, np.full(2, 8, np.int32), (level,), 8)
    return dict(
        block_table=m.block_table, plan=plan, block_size=4,
        buckets=BucketConfig(max_num_tokens=8, max_num_seqs=4, max_pages_per_seq=16),
    )  # fmt: skip


def test_metadata_refuses_a_level_past_a_requests_cached_tokens():
    # Both hold SYSTEM_A's 8 blocks; r1 is given 30 cached tokens, so a level over all 8
    # blocks would show its query tokens at positions 30 and 31 keys after their own.
    build = _global_level_over_system_a()
    build_attention_metadata(query_lens=np.array([1, 1]), num_computed_tokens=[33, 33], **build)
    with pytest.raises(ValueError, match="batch position 1: the cascade levels read 8 blocks"):
        build_attention_metadata(query_lens=np.array([1, 4]), num_computed_tokens=[33, 30], **build)
    with pytest.raises(ValueError, match="batch position 1"):  # one token short of 8 blocks
        build_attention_metadata(query_lens=np.array([1, 2]), num_computed_tokens=[33, 31], **build)


def test_a_level_over_exactly_the_cached_tokens_is_built_and_a_later_one_past_them_named():
    # Batch position 0 has exactly the level's 32 tokens cached: its query tokens follow
    # every key the level shows them. Position 1, two tokens short, is the one refused.
    build = _global_level_over_system_a()
    md = build_attention_metadata(
        query_lens=np.array([2, 2]), num_computed_tokens=[32, 32], **build
    )
    assert md.kv_lens[:2].tolist() == [2, 2] and md.levels[0].kv_lens[0] == 32
    with pytest.raises(ValueError, match="batch position 1: the cascade levels read 8 blocks"):
        build_attention_metadata(query_lens=np.array([2, 4]), num_computed_tokens=[32, 30], **build)


@pytest.mark.parametrize(
    "args,match",
    [
        ((["r0", "r1"], [13.0, 13.0], [1, 1]), "num_computed_tokens.dtype"),
        ((["r0", "r1"], [13, 13], [True, True]), "query_lens.dtype"),
        (("r0", [13, 13], [1, 1]), "request_ids='r0' must be a sequence of request ids"),
        (("r0", [13], [1]), "request_ids='r0' must be a sequence of request ids"),  # not shapes
        ((None, [], []), "request_ids=None must be a sequence of request ids"),  # TypeError
        ((["r0", "r1"], [13, 13], [1]), r"query_lens.shape=\(1,\) must be \(2,\)"),
    ],
    ids=["float_computed", "bool_query_lens", "str_ids", "str_ids_one_count", "no_ids", "short"],
)
def test_the_planner_refuses_arguments_of_the_wrong_type_by_name(args, match):
    m = KVCacheManager(64, 4, max_model_len=64)
    for i in range(2):
        _decoding(m, f"r{i}", SYSTEM_A[:12] + [i])
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    planner.plan(["r0", "r1"], [13, 13], [1, 1], m)
    with pytest.raises(ValueError, match=match):
        planner.plan(*args, m)
    with pytest.raises(ValueError, match="manager=dict must be a KVCacheManager"):
        planner.plan(["r0", "r1"], [13, 13], [1, 1], {"r0": 0})


@pytest.mark.parametrize(
    "computed, query_lens, match",
    [
        ([13, -1], [1, 1], r"num_computed_tokens\[1\]=-1 must be >= 0"),
        ([13, 13], [1, -2], r"query_lens\[1\]=-2 must be >= 0"),
        ([17, 13], [1, 1], r"num_computed_tokens\[0\]=17 lies past the 16 token slots"),
        ([13, 10**6], [1, 1], r"num_computed_tokens\[1\]=1000000 lies past"),
    ],
    ids=["negative_computed", "negative_query", "one_past_held", "far_past_held"],
)
def test_the_planner_refuses_counts_outside_the_blocks_held_by_name(computed, query_lens, match):
    # Each request holds 4 blocks of 4 (14 tokens). A count past them planned a level over
    # blocks it does not hold, and a negative one a suffix from a negative column.
    m = KVCacheManager(64, 4, max_model_len=64)
    for i in range(2):
        _decoding(m, f"r{i}", SYSTEM_A[:12] + [i])
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    assert planner.plan(["r0", "r1"], [16, 13], [0, 1], m).levels  # at the bound: accepted
    with pytest.raises(ValueError, match=match):
        planner.plan(["r0", "r1"], np.array(computed), np.array(query_lens), m)
    m.check_integrity()


@pytest.mark.parametrize(
    "ids, twice", [(["a", "b", "a"], "a"), (["c", "b", "b"], "b"), (["b", "b"], "b")]
)
def test_a_request_given_twice_is_refused_by_the_planner_and_the_plan(ids, twice):
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, rid, SYSTEM_A + [i]) for i, rid in enumerate("abc")]
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    ones = np.ones(3, np.int32)
    computed = np.array([r.num_tokens - 1 for r in reqs], np.int32)
    plan = planner.plan(["a", "b", "c"], computed, ones, m)
    for _ in range(2):  # the second call gets rows_of's memoised rows
        with pytest.raises(ValueError, match=f"{twice!r} is given more than once"):
            planner.plan(ids, computed[: len(ids)], ones[: len(ids)], m)
    assert planner.plan(["a", "b", "c"], computed, ones, m).rows.tolist() == plan.rows.tolist()
    _refused(plan, "must be distinct", rows=np.array([plan.rows[0]] * 3, np.int32))


class _PaysOnly:
    """A cost model with pays but no reads_padded_pages, which page_buckets needs."""

    def pays(self, *args, **kwargs):
        return True


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shape=(4, 2, 16)), "shape=.* must be an AttentionShape"),  # was AttributeError
        (dict(cost_model={"merge_cost_factor": 0}), "cost_model=.* must be a CascadeCostModel"),
        (dict(cost_model=_PaysOnly(), page_buckets=(4, 8)), "and reads_padded_pages with"),
        (dict(enable_cascade="no"), "enable_cascade='no' must be a bool"),  # planned cascade
        (dict(enable_groups=None), "enable_groups=None must be a bool"),
        (dict(enable_groups=1), "enable_groups=1 must be a bool"),  # 1 == True, not a bool
        (dict(sliding_window=-3), "sliding_window=-3 must be None or an int >= 1"),
        (dict(sliding_window=0), "sliding_window=0"),
        (dict(sliding_window=8.0), "sliding_window=8.0"),
    ],
)
def test_planner_settings_it_cannot_use_are_refused_on_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CascadePlanner(**{"shape": SHAPE, "cost_model": ALWAYS, **kwargs})
    planner = CascadePlanner(SHAPE, sliding_window=np.int64(8), enable_groups=False)
    assert not planner.enable_cascade  # a window turns cascade off


def test_a_level_of_no_group_is_refused():
    # It passed, and the metadata builder failed on max() of an empty sequence.
    with pytest.raises(ValueError, match="level 'groups' must have at least one group"):
        make_level("groups", [], [], [], [], [])


def test_a_hand_made_plan_of_unsigned_arrays_builds_the_metadata_of_a_signed_one():
    # Accepted as integer arrays, uint64 ones made the builder's in-place main-pass
    # length update fail numpy's casting rule (uint64 with int64 is float64).
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A[:12] + [i]) for i in range(2)]
    rows = m.rows_of([r.request_id for r in reqs])

    def plan_of(dtype):
        level = CascadeLevel(
            "global", *np.array([[0], [2], [0], [3], [rows[0]]], dtype)
        )  # fmt: skip
        return CascadePlan(np.arange(2, dtype=dtype), rows.astype(dtype),
                           np.full(2, 3, dtype), (level,), 3)  # fmt: skip

    build = dict(
        block_table=m.block_table, query_lens=np.ones(2, np.int32),
        num_computed_tokens=np.full(2, 12, np.int32), block_size=4,
        buckets=BucketConfig(max_num_tokens=8, max_num_seqs=4, max_pages_per_seq=16),
    )  # fmt: skip
    want = build_attention_metadata(plan=plan_of(np.int32), **build)
    got = build_attention_metadata(plan=plan_of(np.uint64), **build)
    assert got.levels and got.kv_lens.tolist() == want.kv_lens.tolist() == [1, 1, 0, 0]
    for name in ("page_indices", "slot_mapping", "cu_q_lens"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert got.levels[0].page_indices.tolist() == want.levels[0].page_indices.tolist()


def test_a_plan_whose_levels_count_or_flag_is_of_the_wrong_kind_is_refused_by_name():
    # levels=(None,) raised AttributeError and one level given bare TypeError, naming
    # nothing; a str count and a "no" flag (read by its truthiness) were taken.
    plan = _two_group_plan()
    (level,) = plan.levels
    for levels in ((None,), level, None, (level, "global")):
        _refused(plan, "levels=", levels=levels)
    for count in ("8", -1, 2.0, True):
        _refused(plan, "num_common_prefix_blocks=", num_common_prefix_blocks=count)
    _refused(plan, "keeps_order=", keeps_order="no")
    listed = dataclasses.replace(plan, levels=[level], num_common_prefix_blocks=np.int64(2))
    assert listed.levels == (level,) and type(listed.num_common_prefix_blocks) is int


def test_distinct_rows_are_checked_without_an_array_as_long_as_the_largest_row():
    # np.bincount(rows) allocated max(rows) + 1 counts: a row id of 2**40 failed the
    # check with a MemoryError (7 TiB) instead of passing it or naming a repeat.
    order, zeros = np.arange(2, dtype=np.int32), np.zeros(2, np.int32)
    far = np.array([0, 2**40], np.int64)
    assert CascadePlan(order, far, zeros, (), 0).rows.tolist() == [0, 2**40]
    with pytest.raises(ValueError, match="must be distinct"):
        CascadePlan(order, np.array([2**40, 2**40], np.int64), zeros, (), 0)


def test_a_plan_of_an_empty_batch_passes_its_checks_and_builds_metadata_of_no_sequence():
    # An empty order is a permutation of the empty batch: its check must not reduce over
    # no entries (numpy's min of an empty array raises ValueError).
    m, none = KVCacheManager(64, 4, max_model_len=64), np.zeros(0, np.int32)
    CascadePlanner(SHAPE, cost_model=ALWAYS).plan([], none, none, m).check()
    plan = CascadePlan(none, none, none, (), 0)  # hand-made: checked on construction
    md = build_attention_metadata(
        plan=plan, block_table=m.block_table, query_lens=none, num_computed_tokens=none,
        block_size=4, buckets=BucketConfig(max_num_tokens=8, max_num_seqs=4, max_pages_per_seq=16),
    )  # fmt: skip
    assert md.num_seqs.tolist() == [0] and not md.kv_lens.any() and not md.levels


def test_a_level_whose_first_group_starts_before_the_batch_is_refused():
    # A group from position -1 would take the batch's last request into the first group.
    with pytest.raises(ValueError, match="from position 0 on"):
        make_level("global", [-1], [2], [0], [1], [0])


def test_keeps_order_is_refused_unless_a_bool_and_stored_as_a_python_bool():
    # 0 and 1 are not flags (0 on an identity order was taken as False); numpy's bool is,
    # and is stored as bool like the planner's own plans.
    zeros, identity = np.zeros(2, np.int32), np.arange(2, dtype=np.int32)
    for flag in (0, 1):
        with pytest.raises(ValueError, match="keeps_order="):
            CascadePlan(identity, identity, zeros, (), 0, keeps_order=flag)
    plan = CascadePlan(identity, identity, zeros, (), 0, keeps_order=np.True_)
    assert plan.keeps_order is True
