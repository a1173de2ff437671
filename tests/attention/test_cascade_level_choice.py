"""Whether a groups level runs under a global level or from column 0 without it. The
expected levels come from block counts read from KVCacheManager.block_ids and the
cost model's arithmetic."""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_planner import SHAPE, _decoding, _plan, _prefilled


def header_and_two_prompts(m: KVCacheManager) -> list:
    """a0..a2 and b0..b2 decoding in `m` (block size 4): a 2-block header shared by all
    six, then a 10-block system prompt per letter, then two tokens of their own."""
    header = list(range(100, 108))
    return [
        _decoding(m, f"{p}{i}", header + [1000 * (p == "b") + t for t in range(40)] + [i, 50])
        for p in "ab"
        for i in range(3)
    ]


@pytest.mark.parametrize(
    ("launch_overhead_bytes", "levels"),
    [(10000, ["groups"]), (4097, ["groups"]), (4096, ["global", "groups"])],
)
def test_groups_under_a_short_global_prefix_start_at_column_0_where_that_saves_more(
    launch_overhead_bytes, levels
):
    # Six requests share a 2-block header (8 tokens at 512 bytes); under it two system
    # prompts of three requests each share 10 blocks more. The global level saves
    # 5 x 8 x 512 = 20480 bytes for one call; the two groups starting at column 0 read
    # the header once each instead, saving 2 x 2 x 8 x 512 = 16384 bytes of it without
    # that call: better where the call costs more than 20480 - 16384 bytes.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = header_and_two_prompts(m)
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids), _shared(m, ids[:3]), _shared(m, ids[3:])) == (2, 12, 12)
    model = CascadeCostModel(launch_overhead_bytes=launch_overhead_bytes, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert planner.pays(6, 8, 6) and planner.pays(3, 40, 3)
    plan = _plan(planner, m, reqs)
    assert [lv.name for lv in plan.levels] == levels
    start = 0 if levels == ["groups"] else 2
    got = sorted((sorted(members), b0, b1) for members, b0, b1 in _groups(plan, reqs))
    assert got == [(ids[:3], start, 12), (ids[3:], start, 12)]
    assert sorted(plan.suffix_start_blocks.tolist()) == [12] * 6


@pytest.mark.parametrize(
    ("page_buckets", "levels"), [(None, ["groups"]), ((8, 16, 32), ["global", "groups"])]
)
def test_groups_stay_under_the_global_level_where_from_column_0_they_pad_no_fewer_pages(
    page_buckets, levels
):
    # Five requests share a 4-block header (16 tokens at 512 bytes); a0, a1 and b0, b1
    # share 7 blocks more under it, o only the header, with the longest context (20
    # pages). The global level saves 4 x 8192 bytes for the merge of 5 x 6240; the two
    # groups from column 0 read the header once each, saving 2 x 8192 of it without
    # that merge: more. But o then reads its 20 pages in its own pass, padded to 32
    # like flat attention, where under the global level it reads 16 pages, padded to 16.
    m = KVCacheManager(256, 4, max_model_len=128)
    head = list(range(100, 116))
    reqs = [
        _decoding(m, f"{p}{i}", head + [1000 * (p == "b") + t for t in range(28)] + [i, 50])
        for p in "ab"
        for i in range(2)
    ]
    reqs.append(_decoding(m, "o", head + list(range(500, 560))))
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids), _shared(m, ids[:2]), _shared(m, ids[2:4])) == (4, 11, 11)
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=1, reads_padded_pages=True)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model, page_buckets=page_buckets), m, reqs)
    assert [lv.name for lv in plan.levels] == levels
    start = 0 if levels == ["groups"] else 4
    got = sorted((sorted(members), b0, b1) for members, b0, b1 in _groups(plan, reqs))
    assert got == [(ids[:2], start, 11), (ids[2:4], start, 11)]
    assert plan.suffix_start_blocks[list(plan.order).index(4)] == start


def test_groups_are_laid_out_in_the_order_of_their_first_request():
    # r0 and r3 share one system prompt, r1 and r2 another: the group holding the
    # earliest request comes first, then the other, each in batch order.
    m = KVCacheManager(256, 4, max_model_len=128)
    prompts = [100, 200, 200, 100]
    reqs = [_decoding(m, f"r{i}", list(range(p, p + 24)) + [i, 50]) for i, p in enumerate(prompts)]
    ids = [r.request_id for r in reqs]
    assert _shared(m, ["r0", "r3"]) == _shared(m, ["r1", "r2"]) == 6 and _shared(m, ids) == 0
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model), m, reqs)
    assert plan.order.tolist() == [0, 3, 1, 2]
    assert _groups(plan, reqs) == [(["r0", "r3"], 0, 6), (["r1", "r2"], 0, 6)]


def test_the_global_level_gives_way_to_groups_from_column_0_that_pay_only_its_call():
    # Six requests share a 2-block header (8 tokens at 512 bytes); a0..a3 share 2 blocks
    # more, o0 and o1 only the header. The global level saves 5 x 2 blocks, 20480 bytes,
    # for a 16384-byte call. The four past it save 3 x 2 blocks, 12288 bytes: too little
    # for a second call. From column 0 they save 3 x 4 blocks and the two o's 1 x 2,
    # 28672 bytes for the one call, 8192 more than the global level alone.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 108))
    reqs = [_decoding(m, f"a{i}", header + list(range(200, 208)) + [i, 50]) for i in range(4)]
    reqs += [_decoding(m, f"o{i}", header + [300 + 10 * i + t for t in range(6)]) for i in range(2)]
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids), _shared(m, ids[:4]), _shared(m, ids[4:])) == (2, 4, 2)
    model = CascadeCostModel(launch_overhead_bytes=16384, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert planner.pays(6, 8, 6) and not planner.pays(4, 8, 4)
    plan = _plan(planner, m, reqs)
    assert [lv.name for lv in plan.levels] == ["groups"]
    assert _groups(plan, reqs) == [(ids[:4], 0, 4), (ids[4:], 0, 2)]


def test_a_global_level_cut_short_by_a_prefill_gives_way_to_a_group_past_the_cut():
    # Five decoding requests share a 6-block prompt (24 tokens at 512 bytes); p holds
    # it too but has computed 3 blocks of it, so the global level ends at block 3 and
    # saves 5 x 3 blocks, 30720 bytes, for a 28000-byte call. The five past it save
    # 4 x 3 blocks, 24576 bytes: no second call. Without the global level they save
    # 4 x 6 blocks, 49152 bytes, for that one call, and p reads its 3 blocks itself.
    m = KVCacheManager(256, 4, max_model_len=128)
    prompt = list(range(100, 124))
    reqs = [_decoding(m, f"d{i}", prompt + [i, 50]) for i in range(5)]
    reqs.append(_prefilled(m, "p", prompt + list(range(500, 508))))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == _shared(m, ids[:5]) == 6
    model = CascadeCostModel(launch_overhead_bytes=28000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert planner.pays(6, 12, 25) and not planner.pays(5, 12, 5)
    plan = _plan(planner, m, reqs, query_lens=[1] * 5 + [20])
    assert [lv.name for lv in plan.levels] == ["groups"]
    assert _groups(plan, reqs) == [(ids[:5], 0, 6)]
    assert plan.suffix_start_blocks.tolist() == [6] * 5 + [0]


def test_groups_moved_to_column_0_take_the_others_under_the_global_prefix_as_a_group():
    # Five requests share a 4-block header (16 tokens at 512 bytes); a0..a2 share 8
    # blocks more. The global level saves 4 x 16 tokens (32768 bytes) for a 24000-byte
    # call, the a's 2 x 32 tokens past it for a second call: from column 0 the a's save
    # 2 x 48 tokens for one call, more. There the o's still share the header: as a
    # group they save 16 tokens more (8192 bytes), where they used to read it each.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 116))
    reqs = [_decoding(m, f"a{i}", header + list(range(200, 232)) + [i, 50]) for i in range(3)]
    reqs += [_decoding(m, f"o{i}", header + [300 + 10 * i + t for t in range(6)]) for i in range(2)]
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids), _shared(m, ids[:3]), _shared(m, ids[3:])) == (4, 12, 4)
    model = CascadeCostModel(launch_overhead_bytes=24000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert planner.pays(5, 16, 5) and planner.pays(3, 32, 3) and not planner.pays(2, 16, 2)
    plan = _plan(planner, m, reqs)
    assert [lv.name for lv in plan.levels] == ["groups"]
    assert _groups(plan, reqs) == [(ids[:3], 0, 12), (ids[3:], 0, 4)]
