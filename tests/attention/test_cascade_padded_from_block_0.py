"""Groups from block 0 in place of a global level, on a backend whose work follows each
pass's padded page width (xla): where the groups that outweigh the global level leave a
request whose suffix pass needs a group in none, the groups from block 0 holding it are
weighed against the global level before it is kept. The expected plans come from the
block ids each request holds.
"""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheManager
from jaxkv.cascade_together import global_weight, level_weight
from tests.attention.test_cascade_group_choice import _shared
from tests.attention.test_cascade_padded_groups import (
    COSTED,
    PAGE_BUCKETS,
    _planned,
    _starts_by_request,
    _system_prompts,
)
from tests.attention.test_cascade_planner import SHAPE, _decoding, _prefilled

HEADER = list(range(100, 132))  # 8 blocks of 4


def test_groups_from_block_0_hold_a_member_cut_short_rather_than_keep_the_global_level():
    # All six share the 8-block header; a0..a3 and "chunk" share a 14-block system
    # prompt, of which chunk has computed 12 (it prefills 44 tokens: 23 pages, flat
    # pads to 32). Past the header no group pays a call. From block 0 a0..a3 over 14
    # blocks (3 x 14 saved) outweigh the global level (5 x 8, less every query's merge)
    # and chunk's 44 queries take them over all five over 12; but chunk's suffix pass
    # would then start at block 0. All five over 12 still outweigh the global level.
    m = KVCacheManager(256, 4, max_model_len=128)
    system = HEADER + list(range(400, 424))
    reqs = [_decoding(m, f"a{i}", system + [i, 50 + i]) for i in range(4)]
    reqs.append(_prefilled(m, "chunk", system + list(range(600, 636))))
    reqs.append(_decoding(m, "short", HEADER + [9, 9]))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 8 and _shared(m, ids[:5]) == 14
    query_lens = np.ones(len(reqs), int)
    query_lens[4] = 44
    computed = np.array([r.num_tokens for r in reqs]) - query_lens
    computed[4] = 48
    names, groups, _ = _planned(m, reqs, computed, query_lens, None)
    assert (names, groups) == (["groups"], [(ids[:4], 0, 14)])
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS)
    assert (names, groups) == (["groups"], [(ids[:5], 0, 12)])
    assert plan.suffix_start_blocks.tolist() == [12] * 5 + [0]


def test_groups_under_the_global_level_moved_to_block_0_hold_the_request_that_needs_one():
    # The batch of test_cascade_padded_groups' system prompts under an 8-block header:
    # a global level over it, with a0, a1 and b0, b1 as groups past it. Those groups
    # from block 0 outweigh it but leave chunk in none; the groups from block 0 holding
    # chunk (the three under system A over 12 blocks, b0, b1 over 14) still outweigh
    # the global level with its groups.
    m, reqs, computed, query_lens = _system_prompts(HEADER)
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 8 and _shared(m, ids[:3]) == 22
    names, groups, _ = _planned(m, reqs, computed, query_lens, None)
    assert (names, groups) == (["groups"], [(ids[:2], 0, 24), (ids[3:], 0, 14)])
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS)
    assert (names, groups) == (["groups"], [(ids[:3], 0, 12), (ids[3:], 0, 14)])
    assert plan.suffix_start_blocks.tolist() == [12, 12, 12, 14, 14]


def test_the_global_level_with_its_groups_stays_where_it_outweighs_the_groups_holding_chunk():
    # As above under a 9-block header: the groups from block 0 holding chunk (the three
    # under system A over 12 blocks, b0, b1 over 14) outweigh the global level alone,
    # but not the global level with a0, a1 and b0, b1 as groups past it, which also lets
    # chunk's suffix pass (from block 9, at or past the 7 it needs) pad narrower.
    m, reqs, computed, query_lens = _system_prompts(list(range(100, 136)))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 9 and _shared(m, ids[:3]) == 22
    total_q = int(query_lens.sum())
    kept = global_weight(COSTED, SHAPE, 5, 9 * 4, total_q) + level_weight(
        COSTED, SHAPE, [(np.array([0, 1]), 24), (np.array([3, 4]), 14)], 9, 4, query_lens
    )
    holding = level_weight(
        COSTED, SHAPE, [(np.array([0, 1, 2]), 12), (np.array([3, 4]), 14)], 0, 4, query_lens
    )
    assert kept > holding > global_weight(COSTED, SHAPE, 5, 9 * 4, total_q)
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS)
    assert (names, groups) == (["global", "groups"], [(ids[:2], 9, 24), (ids[3:], 9, 14)])
    assert _starts_by_request(plan) == {0: 24, 1: 24, 2: 9, 3: 14, 4: 14}  # by request
