"""build_attention_metadata builds a planner plan's level metadata once per token layout,
and refuses level metadata that does not belong to the plan and query_lens it is given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadePlan, CascadePlanner
from jaxkv.cascade_plan import make_level
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, _decoding, _plan

BUCKETS = BucketConfig(max_num_tokens=32, max_num_seqs=8, max_pages_per_seq=16)


def _two_plans():
    """(manager, plan of 3 requests sharing 12 tokens, plan of 3 others sharing 12 other
    tokens): one global level each, over different blocks."""
    m = KVCacheManager(64, 4, max_model_len=64)
    a = [_decoding(m, f"a{i}", list(range(100, 112)) + [i]) for i in range(3)]
    b = [_decoding(m, f"b{i}", list(range(200, 212)) + [i]) for i in range(3)]
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan_a, plan_b = _plan(planner, m, a), _plan(planner, m, b)
    assert [lv.name for lv in plan_a.levels] == [lv.name for lv in plan_b.levels] == ["global"]
    return m, plan_a, plan_b


def _build(m, plan, *, computed=13, query_lens=(1, 1, 1), buckets=BUCKETS, levels=None):
    query_lens = np.array(query_lens)
    return build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=query_lens,
        num_computed_tokens=np.full(3, computed) + 1 - query_lens, block_size=4,
        buckets=buckets, levels=levels,
    )  # fmt: skip


def _arrays(levels) -> list:
    return [
        (lv.cu_q_lens.tolist(), lv.kv_lens.tolist(), lv.page_indices.tolist(), lv.max_q_len)
        for lv in levels
    ]


def test_a_repeated_layout_gets_the_same_read_only_level_metadata():
    m, plan, _ = _two_plans()
    first = _build(m, plan)
    later = _build(m, plan, computed=14)  # the next decode step of the same batch
    assert later.levels is first.levels
    assert later.positions[:3].tolist() == [14, 14, 14]
    (level,) = first.levels
    assert level.page_indices[0, :3].tolist() == m.block_ids("a0")[:3]
    with pytest.raises(ValueError, match="read-only"):
        level.page_indices[0, 0] = 5  # later steps hand the same arrays out again


def test_another_layout_or_buckets_builds_them_again():
    m, plan, _ = _two_plans()
    decode = _build(m, plan)
    coarse = BucketConfig(
        max_num_tokens=32, max_num_seqs=8, max_pages_per_seq=16, min_pages_per_seq=8
    )
    padded = _build(m, plan, buckets=coarse)  # the same layout
    assert padded.levels is not decode.levels
    assert padded.levels[0].page_indices.shape[1] == 8 != decode.levels[0].page_indices.shape[1]
    prefill = _build(m, plan, query_lens=(1, 2, 1), buckets=coarse)
    assert prefill.levels is not padded.levels
    assert prefill.levels[0].cu_q_lens[:2].tolist() == [0, 4]
    # Each equals a build for an equal plan whose memo is empty.
    for md, kwargs in (
        (prefill, {"query_lens": (1, 2, 1), "buckets": coarse}),
        (padded, {"buckets": coarse}),
    ):
        fresh = _build(m, dataclasses.replace(plan), **kwargs)
        assert fresh.levels is not md.levels and _arrays(fresh.levels) == _arrays(md.levels)


def test_given_levels_must_be_those_of_the_plan_and_layout():
    m, plan_a, plan_b = _two_plans()
    md_a, md_b = _build(m, plan_a), _build(m, plan_b)
    assert _build(m, plan_a, levels=md_a.levels).levels is md_a.levels
    # An equal plan object (its own memo empty) takes an equal tuple as given.
    assert _build(m, dataclasses.replace(plan_a), levels=md_a.levels).levels is md_a.levels
    # Another plan's levels, of the same number and shapes, would read plan_b's blocks.
    with pytest.raises(ValueError, match="levels: the 1 given level metadata differ"):
        _build(m, plan_a, levels=md_b.levels)
    # Equal arrays but another query bound: the level would run another program.
    finer = BucketConfig(max_num_tokens=32, max_num_seqs=8, max_pages_per_seq=16, min_num_tokens=4)
    md_finer = _build(m, dataclasses.replace(plan_a), buckets=finer)
    assert _arrays(md_finer.levels)[0][:3] == _arrays(md_a.levels)[0][:3]
    with pytest.raises(ValueError, match="levels: .* differ"):
        _build(m, plan_a, levels=md_finer.levels)
    # The decode layout's levels cover other tokens than a prefill step's.
    with pytest.raises(ValueError, match="levels: .* differ"):
        _build(m, plan_a, query_lens=(1, 2, 1), levels=md_a.levels)
    with pytest.raises(ValueError, match="plan has no levels"):
        _build(
            m,
            dataclasses.replace(plan_a, levels=(), suffix_start_blocks=np.zeros(3, np.int32)),
            levels=md_a.levels,
        )
    assert _build(m, plan_a).levels is md_a.levels  # refusals leave the memo as it was


def test_a_hand_made_plan_is_built_each_call_and_checked():
    m, plan_a, plan_b = _two_plans()
    fields = {f.name: getattr(plan_a, f.name) for f in dataclasses.fields(CascadePlan) if f.init}
    hand_made = CascadePlan(**{**fields, "made_for": None})
    first, again = _build(m, hand_made), _build(m, hand_made)
    assert first.levels is not again.levels and _arrays(first.levels) == _arrays(again.levels)
    assert first.levels[0].page_indices.flags.writeable  # not shared with a later call
    assert _build(m, hand_made, levels=first.levels).levels is first.levels
    with pytest.raises(ValueError, match="levels: .* differ"):
        _build(m, hand_made, levels=_build(m, plan_b).levels)


def test_a_flat_plan_takes_back_the_empty_levels_it_was_given():
    """A plan without levels accepts the () its earlier metadata holds; only a non-empty
    tuple is refused."""
    m, plan_a, _ = _two_plans()
    flat = dataclasses.replace(plan_a, levels=(), suffix_start_blocks=np.zeros(3, np.int32))
    md = _build(m, flat)
    assert md.levels == ()
    assert _build(m, flat, levels=md.levels).levels == ()


def test_after_a_layout_change_the_new_levels_are_read_only_and_kept():
    # The prefill layout replaces the decode one in the memo: its arrays are handed out
    # again by the next step of that layout, so they are read-only too.
    m, plan, _ = _two_plans()
    _build(m, plan)
    prefill = _build(m, plan, query_lens=(1, 2, 1))
    assert not prefill.levels[0].page_indices.flags.writeable
    assert not prefill.levels[0].cu_q_lens.flags.writeable
    assert _build(m, plan, query_lens=(1, 2, 1)).levels is prefill.levels


def test_a_levels_padded_sequences_hold_no_keys_and_no_queries():
    # Three pairs under three 12-token prompts: a groups level of 3 sequences, padded to
    # the 4-sequence bucket with a sequence of no keys and no query tokens.
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [
        _decoding(m, f"r{i}", list(range(100 * (i // 2 + 1), 100 * (i // 2 + 1) + 12)) + [i])
        for i in range(6)
    ]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    ones = np.ones(6, int)
    md = build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=ones, num_computed_tokens=13 * ones,
        block_size=4, buckets=BUCKETS,
    )  # fmt: skip
    (level,) = md.levels
    assert level.num_seqs.tolist() == [3]
    assert level.kv_lens.tolist() == [12, 12, 12, 0]
    assert level.cu_q_lens.tolist() == [0, 2, 4, 6, 6]


def test_a_level_whose_groups_hold_one_query_token_takes_the_one_token_query_bound():
    # A hand-made level over one decoding request's first 2 blocks: its one sequence
    # holds one query token, and the level's query bound is the 1-token bucket.
    m = KVCacheManager(64, 4, max_model_len=64)
    for i in range(2):
        _decoding(m, f"r{i}", list(range(100 * (i + 1), 100 * (i + 1) + 12)))
    rows = m.rows_of(["r0", "r1"])
    level = make_level("groups", [0], [1], [0], [2], [rows[0]])
    plan = CascadePlan(np.arange(2, dtype=np.int32), rows, np.array([2, 0], np.int32), (level,), 0)
    ones = np.ones(2, int)
    md = build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=ones, num_computed_tokens=12 * ones,
        block_size=4, buckets=BUCKETS,
    )  # fmt: skip
    assert BUCKETS.q_len_buckets[0] == 1 and md.levels[0].max_q_len == 1
