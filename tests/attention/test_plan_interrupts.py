"""A Ctrl-C at any line of CascadePlanner.plan leaves the planner's memo true: the step
that plans the batch again (the engine hands an interrupted step's batch back, and the
next step schedules the same requests) gets the plan a fresh planner makes."""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheManager
from jaxkv.cascade import CascadePlanner
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, SYSTEM_A, _decoding
from tests.host._line_interrupts import LineInterrupts

SYSTEM_B = list(range(200, 224))  # 6 blocks of 4


def _manager():
    """b0 and b1 share 6 blocks, b2 the first 3 of them; a2 shares none with them."""
    m = KVCacheManager(64, 4, max_model_len=64)
    requests = {
        rid: _decoding(m, rid, tokens)
        for rid, tokens in (
            ("a2", SYSTEM_A[:16] + [5, 6]),
            ("b0", SYSTEM_B + [7, 8]),
            ("b1", SYSTEM_B + [9, 10]),
            ("b2", SYSTEM_B[:12] + [12]),
        )
    }
    return m, requests


def _planner():
    return CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=2)


def _plan(planner, m, requests, ids):
    computed = np.array([requests[i].num_computed_tokens for i in ids])
    return planner.plan(ids, computed, np.ones(len(ids), int), m)


def _fields(plan):
    return (
        plan.order.tolist(),
        plan.suffix_start_blocks.tolist(),
        plan.num_common_prefix_blocks,
        [
            (lv.name, lv.group_starts.tolist(), lv.group_ends.tolist(), lv.block_ends.tolist())
            for lv in plan.levels
        ],
    )


def test_a_ctrl_c_at_any_line_of_plan_leaves_the_next_plan_of_its_batch_right():
    # Cut between the memo's new key and its emptied answers, the planner kept answers
    # about the previous batch's rows under the new batch's key: planned again, the
    # batch had b2 share a2's blocks (its queries attended to another request's KV).
    m, requests = _manager()
    before, batch = ["a2", "b1", "b0"], ["b2", "a2", "b0"]
    want = _fields(_plan(_planner(), m, requests, batch))
    at = 0
    while True:
        at += 1
        planner = _planner()
        _plan(planner, m, requests, before)
        lines = LineInterrupts(at)
        try:
            with lines:
                _plan(planner, m, requests, batch)
        except KeyboardInterrupt:
            pass
        if lines.fired is None:
            break
        assert _fields(_plan(planner, m, requests, batch)) == want, lines.fired[:2]
    assert at > 100  # the plan's code was tried throughout
