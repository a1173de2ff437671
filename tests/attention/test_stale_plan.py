"""A plan outlives its manager's rows only as long as no request is freed.

A freed request's row is handed to the next request that allocates, so a plan made
before the free would point its batch positions at another request's blocks: the metadata
builder refuses it, and keeps taking a plan whose requests only grew.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadePlanner
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, SYSTEM_A, _decoding

BUCKETS = BucketConfig(max_num_tokens=32, max_num_seqs=8, max_pages_per_seq=16)
STALE = "plan: made before its manager freed a request"


def _planned(cascade: bool):
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A[:12] + [i]) for i in range(3)]
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS, enable_cascade=cascade)
    plan = planner.plan(["r0", "r1"], np.full(2, 13), np.ones(2, int), m)
    assert plan.uses_cascade == cascade
    return m, reqs, planner, plan


def _build(m: KVCacheManager, plan):
    return build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=np.ones(2, int),
        num_computed_tokens=np.full(2, 13), block_size=4, buckets=BUCKETS,
    )  # fmt: skip


@pytest.mark.parametrize("cascade", [False, True])
def test_a_plan_made_before_a_free_is_refused_where_its_row_now_holds_another_request(cascade):
    m, reqs, planner, plan = _planned(cascade)
    m.free(reqs[1])  # r1's row goes back to the free rows...
    other = Request("x", list(range(500, 513)))
    assert m.allocate_slots(other, 13) is not None  # ...and x takes it
    assert m.rows_of(["x"])[0] == plan.rows[plan.order.tolist().index(1)]
    with pytest.raises(ValueError, match=STALE):
        _build(m, plan)
    m.check_integrity()


def test_freeing_a_request_outside_the_plan_also_refuses_it():
    # Which rows a free touched is not tracked: any free ends the plan's validity.
    m, reqs, _, plan = _planned(True)
    m.free(reqs[2])
    with pytest.raises(ValueError, match=STALE):
        _build(m, plan)


def test_a_plan_stays_valid_while_requests_only_grow():
    m, reqs, _, plan = _planned(True)
    want = _build(m, plan)
    reqs[0].append_output_token_ids([8] * 4)
    assert m.allocate_slots(reqs[0], 4) is not None  # a fresh block for r0
    late = [_decoding(m, f"late{i}", SYSTEM_A[:12] + [50 + i]) for i in range(16)]
    assert len(m.block_table) > 16 and late  # the table grew (its rows doubled)
    got = _build(m, plan)
    for name in ("slot_mapping", "positions", "kv_lens"):  # (pages past kv_lens may differ)
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_the_planner_plans_again_after_a_free():
    # A repeated batch reuses its plan only while no request was freed.
    m, reqs, planner, plan = _planned(True)
    assert planner.plan(["r0", "r1"], np.full(2, 13), np.ones(2, int), m) is plan
    m.free(reqs[2])
    again = planner.plan(["r0", "r1"], np.full(2, 13), np.ones(2, int), m)
    assert again is not plan
    _build(m, again)


def test_another_block_size_than_the_plans_manager_is_refused():
    m, _, _, plan = _planned(True)
    with pytest.raises(ValueError, match="block_size=8 must be the plan's manager's 4"):
        build_attention_metadata(
            block_table=m.block_table, plan=plan, query_lens=np.ones(2, int),
            num_computed_tokens=np.full(2, 13), block_size=8, buckets=BUCKETS,
        )  # fmt: skip
