"""Requests left out of cascade for their merge cost (cascade_left_out), on a backend
whose work follows each pass's padded page width (xla): a prefill chunk whose queries
cost more to merge than its shared blocks save is still held in a group where its own
pages need one, while a request left out whose pages need none stays out. The expected
plans come from the block ids each request holds and the cost model.
"""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheManager
from jaxkv.buckets import least_suffix_starts
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from jaxkv.cascade_together import global_weight, level_weight
from tests.attention.test_cascade_group_choice import _shared
from tests.attention.test_cascade_padded_groups import PAGE_BUCKETS, _planned, _starts_by_request
from tests.attention.test_cascade_planner import SHAPE, _decoding, _prefilled


def _left_out(model, reqs, computed, query_lens, m):
    """The requests the planner leaves out of every level for their merge cost."""
    planner = CascadePlanner(SHAPE, cost_model=model)
    rows = m.rows_of([r.request_id for r in reqs])
    out = planner._left_out(m, rows, computed, query_lens)
    return [] if out is None else [reqs[i].request_id for i in np.flatnonzero(out)]


def test_a_chunk_left_out_for_its_merge_is_held_in_a_group_where_its_pages_need_one():
    # a0, a1 share a 14-block system prompt, b0, b1 a 2-block one. "chunk" holds the
    # 14 blocks, has computed 8 and prefills 48 tokens (20 pages: flat pads to 32): its
    # merge (48 x 390 bytes) outweighs the read of its 8 blocks, so cascade leaves it
    # out and a0, a1 over 14 blocks are kept. But then its suffix pass (20 pages from
    # block 0) pads as wide as flat's: it needs a group ending at block 4 or later, and
    # the one holding it is the three over its 8 computed blocks.
    model = CascadeCostModel(
        launch_overhead_bytes=16 << 10, merge_cost_factor=1 / 16, reads_padded_pages=True
    )
    m = KVCacheManager(256, 4, max_model_len=128)
    system = list(range(400, 456))
    reqs = [_decoding(m, f"a{i}", system + [i, 50 + i]) for i in range(2)]
    reqs += [_decoding(m, f"b{i}", list(range(700, 708)) + [i, 50 + i]) for i in range(2)]
    reqs.append(_prefilled(m, "chunk", system + list(range(900, 924))))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:2]) == 14 and _shared(m, ids[2:4]) == 2
    assert _shared(m, [ids[0], ids[4]]) == 14
    query_lens = np.ones(len(reqs), int)
    query_lens[4] = 48
    computed = np.array([r.num_tokens for r in reqs]) - query_lens
    assert computed[4] == 32
    assert _left_out(model, reqs, computed, query_lens, m) == ["chunk"]
    assert least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4).tolist() == [0] * 4 + [4]
    names, groups, _ = _planned(m, reqs, computed, query_lens, None, model)
    assert (names, groups) == (["groups"], [(ids[:2], 0, 14), (ids[2:4], 0, 2)])
    holding = [(np.array([0, 1, 4]), 8), (np.array([2, 3]), 2)]
    assert level_weight(model, SHAPE, holding, 0, 4, query_lens) > 0
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, model)
    assert (names, groups) == (["groups"], [([ids[0], ids[1], ids[4]], 0, 8), (ids[2:4], 0, 2)])
    assert _starts_by_request(plan) == {0: 8, 1: 8, 2: 2, 3: 2, 4: 8}  # by request


def test_groups_from_block_0_hold_the_chunk_that_needs_one_and_leave_out_the_one_that_does_not():
    # All six share a 9-block header; a0, a1 share 2 blocks more. Two prefill chunks
    # have computed the header and are left out for their merge: "long" (under a0, a1's
    # prompt, 17 pages: flat pads to 32) needs a group ending at block 1 or later,
    # "short" (15 pages) none. A global level over the header merges all 60 queries;
    # groups from block 0 holding long but not short (a0, a1, b0, b1, long over the
    # header) outweigh it, and short reads the header in its own pass.
    model = CascadeCostModel(
        launch_overhead_bytes=32 << 10, merge_cost_factor=1 / 8, reads_padded_pages=True
    )
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 136))
    system = header + list(range(400, 408))
    reqs = [_decoding(m, f"a{i}", system + [i, 50 + i]) for i in range(2)]
    reqs += [_decoding(m, f"b{i}", header + [i, 50 + i]) for i in range(2)]
    reqs.append(_prefilled(m, "long", system + list(range(900, 924))))
    reqs.append(_prefilled(m, "short", header + list(range(950, 974))))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 9 and _shared(m, [ids[0], ids[1], ids[4]]) == 11
    query_lens = np.array([1, 1, 1, 1, 32, 24])
    computed = np.array([r.num_tokens for r in reqs]) - query_lens
    assert computed.tolist()[4:] == [36, 36]
    assert _left_out(model, reqs, computed, query_lens, m) == ["long", "short"]
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [0, 0, 0, 0, 1, 0]
    total_q = int(query_lens.sum())
    holding = level_weight(model, SHAPE, [(np.arange(5), 9)], 0, 4, query_lens)
    assert holding > global_weight(model, SHAPE, 6, 9 * 4, total_q)
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, model)
    assert (names, groups) == (["groups"], [(ids[:5], 0, 9)])
    assert _starts_by_request(plan) == {0: 9, 1: 9, 2: 9, 3: 9, 4: 9, 5: 0}  # by request


def test_groups_from_block_0_holding_the_request_that_needs_one_leave_out_a_chunk():
    # All five share a 4-block header; b0..b2 share 2 blocks more. "a" (17 pages: flat
    # pads to 32) needs a group ending at block 1 or later; "chunk" holds 13 of a's
    # blocks, has computed 9 and prefills 24 tokens, whose merge (24 x 780 bytes)
    # outweighs the read of its 9 blocks: it is left out. b0..b2 from block 0 outweigh
    # the global level over the header with them as a group past it, but hold no a;
    # a, b0..b2 over the header, without chunk, outweigh it too.
    model = CascadeCostModel(
        launch_overhead_bytes=4 << 10, merge_cost_factor=1 / 8, reads_padded_pages=True
    )
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 116))
    system = header + list(range(400, 448))
    reqs = [_decoding(m, "a", system + [0, 50])]
    reqs += [_decoding(m, f"b{i}", header + list(range(700, 708)) + [i, 50 + i]) for i in range(3)]
    reqs.append(_prefilled(m, "chunk", system[:52] + list(range(900, 908))))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 4 and _shared(m, ids[1:4]) == 6
    assert _shared(m, [ids[0], ids[4]]) == 13
    query_lens = np.array([1, 1, 1, 1, 24])
    computed = np.array([r.num_tokens for r in reqs]) - query_lens
    assert computed[4] == 36
    assert _left_out(model, reqs, computed, query_lens, m) == ["chunk"]
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [1, 0, 0, 0, 0]
    bs = np.array([1, 2, 3])
    kept = global_weight(model, SHAPE, 5, 4 * 4, int(query_lens.sum()))
    kept += level_weight(model, SHAPE, [(bs, 6)], 4, 4, query_lens)
    assert level_weight(model, SHAPE, [(bs, 6)], 0, 4, query_lens) > kept
    assert level_weight(model, SHAPE, [(np.arange(4), 4)], 0, 4, query_lens) > kept
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, model)
    assert (names, groups) == (["groups"], [(ids[:4], 0, 4)])
    assert plan.suffix_start_blocks.tolist() == [4, 4, 4, 4, 0]
