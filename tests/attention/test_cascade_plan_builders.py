"""global_plan and grouped_plan lay out the batch as their docs say (the planner's plans
skip check(): these are what it relies on)."""

from __future__ import annotations

import numpy as np

from jaxkv.cascade_plan import global_plan, grouped_plan


def test_a_global_plan_keeps_the_schedule_order():
    # keeps_order lets the engine skip permuting the batch's inputs and outputs.
    plan = global_plan(np.array([5, 3, 7], np.int32), 2, 2, None)
    assert plan.keeps_order and plan.order.tolist() == [0, 1, 2]
    assert plan.suffix_start_blocks.tolist() == [2, 2, 2]
    plan.check()


def test_a_grouped_plan_puts_each_group_first_then_the_rest_in_batch_order():
    rows = np.array([10, 11, 12, 13, 14, 15], np.int32)
    suffix_start = np.array([1, 3, 1, 1, 3, 1], np.int32)
    plan = grouped_plan([(np.array([1, 4]), 3)], rows, suffix_start, 1, 0, None)
    assert plan.order.tolist() == [1, 4, 0, 2, 3, 5]
    assert plan.rows.tolist() == [11, 14, 10, 12, 13, 15]
    assert plan.suffix_start_blocks.tolist() == [3, 3, 1, 1, 1, 1]
    assert not plan.keeps_order
    plan.check()
