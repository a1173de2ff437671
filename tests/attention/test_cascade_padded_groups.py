"""Groups on a backend whose work follows each pass's padded page width (xla): the
groups kept must let every suffix pass pad to fewer pages than flat attention, so a
request whose own pages need it is held in a group even where a group without it saves
more bytes. The expected groups come from the block ids each request holds.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.buckets import least_suffix_starts, pads_fewer_pages
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from jaxkv.cascade_together import _outermost_holding
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_planner import SHAPE, _decoding, _plan, _prefilled

PADDED = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, reads_padded_pages=True)
PAGE_BUCKETS = (4, 8, 16, 32)
PROMPT = list(range(100, 132))  # 8 blocks of 4


@pytest.mark.parametrize("max_groups", [1, 8])
def test_a_group_holds_the_longest_request_where_its_suffix_pass_needs_it(max_groups):
    # Five requests share 8 blocks; four of them share 4 more. By bytes the four over 12
    # blocks (3 x 12 saved) outweigh all five over 8 (4 x 8). But "long" (73 tokens, 19
    # pages) sets flat's width: 32 pages. Without a group its suffix pass is as wide, so
    # cascade could read no fewer pages; in the five's group it starts at block 8 and
    # pads to 16. "solo" shares nothing, so there is no global level.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = [_decoding(m, f"a{i}", PROMPT + list(range(200, 216)) + [i]) for i in range(4)]
    reqs.append(_decoding(m, "long", PROMPT + [5] * 40))
    reqs.append(_decoding(m, "solo", list(range(300, 312))))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:4]) == 12 and _shared(m, ids[:5]) == 8 and _shared(m, ids) == 0
    assert [r.num_tokens for r in reqs][4] == 73
    planner = CascadePlanner(SHAPE, cost_model=PADDED, max_groups=max_groups)
    assert _groups(_plan(planner, m, reqs), reqs) == [(ids[:4], 0, 12)]  # bytes alone
    planner = CascadePlanner(
        SHAPE, cost_model=PADDED, max_groups=max_groups, page_buckets=PAGE_BUCKETS
    )
    plan = _plan(planner, m, reqs)
    assert _groups(plan, reqs) == [(ids[:5], 0, 8)]
    assert plan.suffix_start_blocks.tolist() == [8, 8, 8, 8, 8, 0]


def test_a_member_cut_short_stays_in_the_group_where_its_suffix_pass_needs_it():
    # Five requests share 10 blocks; "chunk" has computed 6 of them and prefills 44
    # tokens (68 in all, 17 pages: flat pads to 32). The four that computed all 10 save
    # 3 x 10 blocks, all five over 6 save 4 x 6; only the five let chunk's suffix pass
    # (11 pages) pad to 16.
    m = KVCacheManager(256, 4, max_model_len=128)
    shared = list(range(100, 140))
    reqs = [_decoding(m, f"a{i}", shared + [i, 50 + i]) for i in range(4)]
    reqs.append(_decoding(m, "chunk", shared + [9] * 28))
    reqs.append(_decoding(m, "solo", list(range(300, 312))))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:5]) == 10 and _shared(m, ids) == 0
    query_lens = np.ones(len(reqs), int)
    query_lens[4] = 44
    computed = np.array([r.num_tokens for r in reqs]) - 1
    computed[4] = 24
    for page_buckets, want in ((None, [(ids[:4], 0, 10)]), (PAGE_BUCKETS, [(ids[:5], 0, 6)])):
        planner = CascadePlanner(SHAPE, cost_model=PADDED, page_buckets=page_buckets)
        plan = planner.plan(ids, computed, query_lens, m)
        plan.check()
        assert _groups(plan, reqs) == want


def test_no_group_is_planned_where_none_holding_the_longest_request_exists():
    # The longest request shares nothing: no groups let its suffix pass pad narrower.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = [_decoding(m, f"a{i}", PROMPT + [i]) for i in range(3)]
    reqs.append(_decoding(m, "long", list(range(300, 372))))
    plan = _plan(CascadePlanner(SHAPE, cost_model=PADDED, page_buckets=PAGE_BUCKETS), m, reqs)
    assert not plan.uses_cascade


@pytest.mark.parametrize(
    ("contexts", "want"),
    [
        ([73, 50, 10], [3, 0, 0]),  # flat pads 19 pages to 32: suffixes of 16 pages pad less
        ([64, 50, 10], [8, 5, 0]),  # 16 pages pad to 16: suffixes of 8 pages pad less
        ([400, 50, 10], [84, 0, 0]),  # 100 pages, past the widest: pads to 32
        ([12, 5, 1], None),  # flat pads to the narrowest width
    ],
)
def test_least_suffix_starts_is_where_the_suffix_pass_begins_to_pad_narrower(contexts, want):
    computed = np.array(contexts) - 1
    query_lens = np.ones(len(contexts), int)
    got = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert (got if got is None else got.tolist()) == want
    if want is None:
        assert not pads_fewer_pages(PAGE_BUCKETS, computed, query_lens, 3, 4)
        return
    assert pads_fewer_pages(PAGE_BUCKETS, computed, query_lens, np.array(want), 4)
    for i in np.flatnonzero(want):  # one block less for any request: as wide as flat
        starts = np.array(want)
        starts[i] -= 1
        assert not pads_fewer_pages(PAGE_BUCKETS, computed, query_lens, starts, 4)


# Block: 4 tokens of 512 bytes (SHAPE); a query's merge: 8 heads x 65 x 12 / 16 = 390
# bytes. A group pays a call of its own past 32 KiB saved, less its merge.
COSTED = CascadeCostModel(
    launch_overhead_bytes=32 << 10, merge_cost_factor=1 / 16, reads_padded_pages=True
)


def _planned(m, reqs, computed, query_lens, page_buckets, model=COSTED, **options):
    """(level names, groups as _groups gives them, the plan) of CascadePlanner(SHAPE,
    model, page_buckets, **options) on the batch, the plan checked."""
    ids = [r.request_id for r in reqs]
    planner = CascadePlanner(SHAPE, cost_model=model, page_buckets=page_buckets, **options)
    plan = planner.plan(ids, computed, query_lens, m)
    plan.check()
    return [lv.name for lv in plan.levels], _groups(plan, reqs), plan


def _starts_by_request(plan) -> dict[int, int]:
    """Each request's (by batch index) first block of its own pass."""
    return dict(zip(plan.order.tolist(), plan.suffix_start_blocks.tolist(), strict=True))


def _system_prompts(header: list[int]) -> tuple[KVCacheManager, list, np.ndarray, np.ndarray]:
    """(manager, requests, computed, query lens): a0, a1 decode under a 96-token system
    prompt (after `header`); "chunk" holds its first 92 tokens (23 pages), has computed
    48 and prefills 44 (flat pads its pages to 32; its suffix pass needs a group ending
    at block 7 or later); b0, b1 decode under a system prompt of their own."""
    m = KVCacheManager(256, 4, max_model_len=128)
    system_a = header + list(range(400, 496 - len(header)))
    system_b = header + list(range(500, 556 - len(header)))
    reqs = [_decoding(m, f"a{i}", system_a + [i, 50 + i]) for i in range(2)]
    reqs.append(_prefilled(m, "chunk", system_a[:92]))
    reqs += [_decoding(m, f"b{i}", system_b + [i, 50 + i]) for i in range(2)]
    query_lens = np.ones(len(reqs), int)
    query_lens[2] = 44
    computed = np.array([r.num_tokens for r in reqs]) - query_lens
    computed[2] = 48
    return m, reqs, computed, query_lens


def test_a_group_under_one_paying_a_call_holds_the_request_whose_pages_need_it():
    # By bytes a0, a1 over 24 blocks (48 KiB saved) and b0, b1 over 14: the three
    # under system A end where chunk has computed, block 12, and their merge of 46
    # queries leaves them short of a call of their own. They are the one group that
    # holds chunk, whose suffix pass (23 pages from block 0) pads as wide as flat's.
    m, reqs, computed, query_lens = _system_prompts([])
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:3]) == 22 and _shared(m, ids[3:]) == 14 and _shared(m, ids) == 0
    for page_buckets, want in (
        (None, [(ids[:2], 0, 24), (ids[3:], 0, 14)]),
        (PAGE_BUCKETS, [(ids[:3], 0, 12), (ids[3:], 0, 14)]),
    ):
        planner = CascadePlanner(SHAPE, cost_model=COSTED, page_buckets=page_buckets)
        plan = planner.plan(ids, computed, query_lens, m)
        plan.check()
        assert [lv.name for lv in plan.levels] == ["groups"]
        assert _groups(plan, reqs) == want


def test_one_group_holds_every_request_whose_pages_need_one_where_one_is_allowed():
    # x0..x2 share 18 blocks, y0, y1 16, all five the 8 of PROMPT; "solo" shares
    # nothing. By bytes x0..x2 (2 x 18 saved) and y0, y1 (16) outweigh all five over 8
    # (4 x 8), and with one group allowed x0..x2 alone do. But each of the five needs a
    # group (up to 20 pages: flat pads to 32): with one group, only all five hold them.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = [_decoding(m, f"x{i}", PROMPT + list(range(200, 240)) + [i] * 6) for i in range(3)]
    reqs += [_decoding(m, f"y{i}", PROMPT + list(range(300, 332)) + [i] * 6) for i in range(2)]
    reqs.append(_decoding(m, "solo", list(range(600, 612))))
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:5]), _shared(m, ids[:3]), _shared(m, ids[3:5])) == (8, 18, 16)
    both = [(ids[:3], 0, 18), (ids[3:5], 0, 16)]
    for max_groups, page_buckets, want in (
        (1, None, both[:1]),
        (1, PAGE_BUCKETS, [(ids[:5], 0, 8)]),
        (2, PAGE_BUCKETS, both),
    ):
        planner = CascadePlanner(
            SHAPE, cost_model=PADDED, max_groups=max_groups, page_buckets=page_buckets
        )
        assert _groups(_plan(planner, m, reqs), reqs) == want


def _entry(weight, members, end):
    """A kept_groups entry: (weight, first member, (blocks saved, members, end, queries))."""
    members = np.array(members)
    return weight, int(members[0]), (0, members, end, len(members))


def _held(entries):
    return [(w, g[1].tolist(), g[2]) for w, _, g in entries]


def test_outermost_holding_keeps_the_largest_paying_group_ending_at_each_need():
    # Request 2 needs a group ending at block 5 or later. [2, 3] (to 8) lies inside
    # [0..3] (to exactly 5): the larger is kept alone. [4, 5] holds no such request.
    need = np.array([0, 0, 5, 0, 0, 0])
    inner, outer = _entry(20.0, [2, 3], 8), _entry(10.0, [0, 1, 2, 3], 5)
    weighed = [inner, outer, _entry(5.0, [4, 5], 3)]
    assert _held(_outermost_holding(weighed, need, 0, 2)) == [(10.0, [0, 1, 2, 3], 5)]


def test_outermost_holding_skips_groups_that_pay_nothing_or_end_short_of_a_need():
    # [0..5] pays nothing; [0..3] ends at 4, short of request 2's need of 5.
    need = np.array([0, 0, 5, 0, 0, 0])
    weighed = [
        _entry(20.0, [2, 3], 8), _entry(10.0, [0, 1, 2, 3], 4), _entry(0.0, list(range(6)), 6)
    ]  # fmt: skip
    assert _held(_outermost_holding(weighed, need, 0, 2)) == [(20.0, [2, 3], 8)]


def test_outermost_holding_is_empty_where_the_groups_needed_outnumber_max_groups():
    need = np.array([5, 0, 0, 5, 0])
    weighed = [_entry(10.0, [0, 1], 6), _entry(8.0, [3, 4], 6)]
    want = [(10.0, [0, 1], 6), (8.0, [3, 4], 6)]
    assert _held(_outermost_holding(weighed, need, 0, 2)) == want
    assert _outermost_holding(weighed, need, 0, 1) == []
