"""What the planner's plans carry besides their levels: the batch's exact common prefix
and whether the schedule order is kept, for an empty batch, one request and a batch
that shares nothing; and the default bound on a groups level's groups."""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheManager
from jaxkv.cascade import CascadePlanner
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, _decoding, _plan


def test_an_empty_batch_plans_no_common_prefix_in_schedule_order():
    m, none = KVCacheManager(64, 4, max_model_len=64), np.zeros(0, np.int32)
    plan = CascadePlanner(SHAPE, cost_model=ALWAYS).plan([], none, none, m)
    assert plan.num_common_prefix_blocks == 0 and plan.keeps_order is True
    assert plan.levels == () and plan.order.size == plan.suffix_start_blocks.size == 0


def test_one_request_plans_flat_with_all_its_blocks_as_the_common_prefix():
    m = KVCacheManager(64, 4, max_model_len=64)
    (req,) = [_decoding(m, "r0", list(range(100, 118)))]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, [req])
    assert plan.num_common_prefix_blocks == len(m.block_ids("r0")) == 5
    assert plan.levels == () and plan.keeps_order is True
    assert plan.suffix_start_blocks.tolist() == [0]


def test_a_batch_sharing_nothing_plans_flat_in_schedule_order():
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, f"r{i}", list(range(100 * i, 100 * i + 18))) for i in range(1, 4)]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    assert plan.num_common_prefix_blocks == 0 and plan.levels == ()
    assert plan.keeps_order is True and plan.order.tolist() == [0, 1, 2]


def test_a_groups_level_keeps_at_most_8_groups_by_default():
    # Nine pairs under nine prompts; pair i shares i + 2 blocks: the default planner
    # keeps the 8 that save most and drops the pair over 2 blocks.
    m = KVCacheManager(512, 4, max_model_len=64)
    reqs = [
        _decoding(m, f"p{i}r{j}", list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * (i + 2))) + [j])
        for i in range(9)
        for j in range(2)
    ]
    assert _shared(m, ["p0r0", "p0r1"]) == 2 and _shared(m, ["p8r0", "p8r1"]) == 10
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    got = [(members, end) for members, _, end in _groups(plan, reqs)]
    assert got == [([f"p{i}r0", f"p{i}r1"], i + 2) for i in range(1, 9)]
