"""Groups that a member cuts short: a request that has computed fewer of the blocks its
group holds alike (loading or computing them) ends the group there, and the planner
weighs the members past that cut as a group of their own at their longer end. The
expected groups come from the block ids each request holds and the counts given.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, _decoding


def _capped_group(computed_blocks: list[int], max_groups: int = 8):
    """Five (or len(computed_blocks)) requests share 10 blocks of 4, of which a{i} has
    computed computed_blocks[i] (as while a request loads or computes them; the others
    all 10), and a pair shares 6 others; every level pays. Returns (plan, reqs)."""
    m = KVCacheManager(256, 4, max_model_len=64)
    num_shared = max(5, len(computed_blocks))
    reqs = [_decoding(m, f"a{i}", list(range(100, 140)) + [i, 50 + i]) for i in range(num_shared)]
    reqs += [_decoding(m, f"b{i}", list(range(200, 224)) + [i, 60 + i]) for i in range(2)]
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:-2]) == 10 and _shared(m, ids[-2:]) == 6 and _shared(m, ids) == 0
    query_lens = np.ones(len(reqs), int)
    computed = np.array([r.num_tokens for r in reqs]) - query_lens
    computed[: len(computed_blocks)] = np.array(computed_blocks) * 4
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=max_groups)
    plan = planner.plan(ids, computed, query_lens, m)
    plan.check()
    return plan, reqs


@pytest.mark.parametrize(
    ("computed_blocks", "want"),
    [
        ([1], [(["a1", "a2", "a3", "a4"], 10)]),  # 3 x 10 blocks saved, not 4 x 1
        # 2 x 10 beside a0, a1 over 1 (21), not 4 x 1, 3 x 3 or 2 x 10 alone
        ([1, 3], [(["a0", "a1"], 1), (["a2", "a3", "a4"], 10)]),
        ([9], [(["a0", "a1", "a2", "a3", "a4"], 9)]),  # 4 x 9 blocks saved, not 3 x 10
        # two past the last cut: 1 x 10 beside a1, a2 over 2 (12), not 3 x 2 or 2 x 3
        ([1, 2, 3], [(["a1", "a2"], 2), (["a3", "a4"], 10)]),
    ],
)
def test_a_group_cut_short_by_a_member_is_weighed_against_the_others_at_their_end(
    computed_blocks, want
):
    # a0 (and a1) have computed fewer of the 10 blocks the five share: a group of all
    # five ends there. The members that computed more are tried as a group of their own
    # at their longer end, beside a group of the others where two or more remain (they
    # share the blocks up to the cut), and the groups that save most are kept; the pair
    # b0, b1 is the level's other group (no global level: the batch shares nothing).
    plan, reqs = _capped_group(computed_blocks)
    got = sorted((sorted(m), start, e) for m, start, e in _groups(plan, reqs))
    assert got == sorted([(m, 0, end) for m, end in want] + [(["b0", "b1"], 0, 6)])
    members = [rid for m, _ in want for rid in m]
    left_out = [i for i, r in enumerate(reqs) if r.request_id not in members + ["b0", "b1"]]
    position = {int(s): i for i, s in enumerate(plan.order)}
    assert [int(plan.suffix_start_blocks[position[i]]) for i in left_out] == [0] * len(left_out)


@pytest.mark.parametrize(("max_groups", "first", "end"), [(1, 3, 4), (2, 5, 10)])
def test_groups_past_a_members_cap_are_bounded_by_max_groups(max_groups, first, end):
    # Eight requests share 10 blocks, a0..a4 having computed 1..5 of them: groups a0..a7
    # at 1 block, a1..a7 at 2, ... a4..a7 at 5 (saving 7, 12, 15, 16, 15 blocks), then
    # a5..a7 at 10 (saving 20). At most 4 x max_groups of them past a cap are examined:
    # with max_groups=1 the search stops at a4..a7, and keeps a3..a7.
    plan, reqs = _capped_group([1, 2, 3, 4, 5, 10, 10, 10], max_groups=max_groups)
    groups = _groups(plan, reqs)
    assert groups[0] == ([f"a{i}" for i in range(first, 8)], 0, end)


def test_members_past_a_cut_are_weighed_by_their_own_queries():
    # a0..a2 share 7 blocks of 4; a0 has computed 4 of them. With merges of 3120 bytes a
    # query and no call cost, the three over 4 blocks save 2 x 8192 for 3 x 3120 (7024),
    # a1 and a2 over 7 save 14336 for their own 2 x 3120 (8096): the pair is kept. Their
    # group does not merge a0's query (with it, the pair would weigh 4976).
    m = KVCacheManager(256, 4, max_model_len=64)
    reqs = [_decoding(m, f"a{i}", list(range(100, 128)) + [i, 50 + i]) for i in range(3)]
    reqs.append(_decoding(m, "d", list(range(200, 228)) + [9, 59]))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:3]) == 7 and _shared(m, ids) == 0
    query_lens = np.ones(len(reqs), int)
    computed = np.array([r.num_tokens for r in reqs]) - query_lens
    computed[0] = 4 * 4
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0.5)
    plan = CascadePlanner(SHAPE, cost_model=model).plan(ids, computed, query_lens, m)
    plan.check()
    assert _groups(plan, reqs) == [(["a1", "a2"], 0, 7)]
