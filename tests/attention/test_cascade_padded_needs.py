"""Groups that hold the requests whose own pages need one, on a backend whose work follows
each pass's padded page width (xla), where the groups a plan weighs first leave such a
request in none: a lighter group kept beside them is kept in their place within
max_groups, a group ending short of a member's need is no such holder, a run past the
search's cap on runs is searched where it holds such a request, and a global level whose
suffix passes pad as wide as flat's, alone or with the groups past it, gives way to
groups from block 0 that pay alone.
The expected plans come from the block ids each request holds.
"""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheManager
from jaxkv.buckets import least_suffix_starts, pads_fewer_pages
from jaxkv.cascade_together import level_weight
from tests.attention.test_cascade_group_choice import _shared
from tests.attention.test_cascade_padded_groups import (
    COSTED,
    PAGE_BUCKETS,
    _planned,
    _starts_by_request,
)
from tests.attention.test_cascade_planner import SHAPE, _decoding, _prefilled

HEADER = list(range(100, 112))  # 3 blocks of 4


def _batch(m, spec):
    """(requests, computed, query lens) of (id, tokens, prefilled query or 0 to decode)."""
    reqs, computed, query_lens = [], [], []
    for rid, tokens, chunk in spec:
        if chunk:
            reqs.append(_prefilled(m, rid, tokens))
            computed.append(len(tokens) - chunk)
            query_lens.append(chunk)
        else:
            reqs.append(_decoding(m, rid, tokens))
            computed.append(len(tokens))
            query_lens.append(1)
    return reqs, np.array(computed), np.array(query_lens)


def _three_runs(m, header, *, with_header=True):
    """(requests, computed, query lens): l0, l1 under a 19-block prompt, b0..b2 under an
    11-block one, c0..c2 under a 10-block one (c1 prefills 26 tokens), each prompt
    opening with the 4-block `header`, or with blocks of its own in its place."""
    heads = [header] * 3 if with_header else [list(range(k, k + 16)) for k in (260, 328, 424)]
    system_l = heads[0] + list(range(200, 260))
    system_b = heads[1] + list(range(300, 328))
    system_c = heads[2] + list(range(400, 424))
    return _batch(m, [
        ("l0", system_l + [1, 2, 3, 4, 5], 0),
        ("l1", system_l + [6, 7, 8], 0),
        ("b0", system_b + list(range(10, 18)), 0),
        ("b1", system_b + [20, 21, 22], 0),
        ("b2", system_b + list(range(30, 39)), 0),
        ("c0", system_c + [40, 41, 42, 43, 44], 0),
        ("c1", system_c + list(range(50, 72)), 26),
        ("c2", system_c + [80, 81, 82, 83, 84], 0),
    ])  # fmt: skip


def test_the_lighter_group_is_kept_where_only_it_holds_the_requests_that_need_one():
    # a0..a2 share a 14-block prompt, b0..b2 a 13-block one, all under the header. With
    # one group allowed, b's (no prefill) weighs more than a's (17 queries to merge);
    # but a0 and a1 reach 17 pages (flat pads to 32), so their suffix passes need a
    # group: only a's lets the others pad to 16.
    m = KVCacheManager(256, 4, max_model_len=128)
    system_a = HEADER + list(range(200, 244))
    system_b = HEADER + list(range(300, 340))
    reqs, computed, query_lens = _batch(m, [
        ("a0", system_a + list(range(500, 508)), 0),
        ("a1", system_a + list(range(510, 520)), 10),
        ("a2", system_a + list(range(520, 527)), 7),
        ("b0", system_b + [1, 2, 3], 0),
        ("b1", system_b + [4, 5, 6, 7, 8, 9, 10], 0),
        ("b2", system_b + [11, 12, 13, 14], 0),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:3]) == 14 and _shared(m, ids[3:]) == 13
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [1, 1, 0, 0, 0, 0]
    names, groups, _ = _planned(m, reqs, computed, query_lens, None, max_groups=1)
    assert (names, groups) == (["groups"], [(ids[3:], 0, 13)])
    names, groups, _ = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, max_groups=1)
    assert (names, groups) == (["groups"], [(ids[:3], 0, 14)])


def test_groups_from_block_0_replace_a_global_level_whose_suffix_passes_pad_as_wide_as_flat():
    # All seven share a 6-block header, which pays a global level; l0 and l1 share 22
    # blocks and reach 24 pages (flat pads to 32), so their suffix passes need a group
    # ending at block 8 or later. Past the header no group pays the call. The groups
    # from block 0 held the whole batch to block 6, which ends short of that need; l0
    # and l1 over 22 blocks pay alone.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 124))
    system_l = header + list(range(200, 264))
    system_c = header + list(range(300, 324))
    reqs, computed, query_lens = _batch(m, [
        ("l0", system_l + [1, 2, 3, 4, 5], 0),
        ("l1", system_l + [6, 7, 8, 9, 10, 11, 12], 0),
        ("c0", system_c + [13, 14], 0),
        ("c1", system_c + [15, 16, 17, 18, 19], 0),
        ("c2", system_c + [20, 21, 22], 0),
        ("p0", header + list(range(400, 425)), 25),
        ("p1", header + list(range(430, 439)), 9),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 6 and _shared(m, ids[:2]) == 22 and _shared(m, ids[2:5]) == 12
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [8, 8, 0, 0, 0, 0, 0]
    names, groups, _ = _planned(m, reqs, computed, query_lens, None, max_groups=1)
    assert names == ["global"]
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, max_groups=1)
    assert (names, groups) == (["groups"], [(ids[:2], 0, 22)])
    assert plan.suffix_start_blocks.tolist() == [22, 22, 0, 0, 0, 0, 0]


def test_a_run_past_the_cap_on_runs_is_searched_where_it_holds_a_request_that_needs_a_group():
    # Past a 4-block header three runs: b0..b2 and c0..c2 (three each) and l0, l1 (two),
    # who share 19 blocks and reach 20 and 21 pages (flat pads to 32), so their suffix
    # passes need a group. With one group allowed the search looks at the two largest
    # runs only; l0 and l1's must be searched too.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs, computed, query_lens = _three_runs(m, list(range(100, 116)))
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 4 and _shared(m, ids[:2]) == 19
    assert _shared(m, ids[2:5]) == 11 and _shared(m, ids[5:]) == 10
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [5, 4, 0, 0, 0, 0, 0, 0]
    names, groups, _ = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, max_groups=1)
    assert (names, groups) == (["groups"], [(ids[:2], 0, 19)])


def test_groups_from_block_0_replace_a_global_level_whose_groups_pad_as_wide_as_flat():
    # All eight share a 7-block header, which pays a global level; system A (4 blocks
    # more) holds a0..a3, system B (14 more) b0..b3, of which b3 has computed 8 blocks
    # and prefills 63 tokens. b0 reaches 24 pages (flat pads to 32): b0 and b3 need a
    # group ending at block 8 or later, b1 at 7 and b2 at 6. Past the header the groups
    # that pay leave b3 in none (it has computed 1 block past it), and none holding b3
    # pays there. From block 0 a0..a3 over 11 blocks and b0..b3 over the 8 that b3 has
    # computed hold them all and pay.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 128))
    system_a = header + list(range(200, 216))
    system_b = header + list(range(300, 356))
    reqs, computed, query_lens = _batch(m, [
        ("a0", system_a + list(range(10, 21)), 0),
        ("b0", system_b + list(range(30, 40)), 0),
        ("a1", system_a + [50, 51, 52, 53], 0),
        ("b1", system_b + list(range(60, 68)), 8),
        ("b2", system_b + [70], 0),
        ("a2", system_a + [80, 81], 0),
        ("b3", system_b + list(range(90, 101)), 63),
        ("a3", system_a + [110, 111, 112], 0),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    a, b = [0, 2, 5, 7], [1, 3, 4, 6]
    assert computed.tolist() == [55, 94, 48, 84, 85, 46, 32, 47]
    assert _shared(m, ids) == 7
    assert _shared(m, [ids[i] for i in a]) == 11 and _shared(m, [ids[i] for i in b]) == 21
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [0, 8, 0, 7, 6, 0, 8, 0]
    assert not pads_fewer_pages(PAGE_BUCKETS, computed, query_lens, 7, 4)
    groups = [(np.array(a), 11), (np.array(b), 8)]
    assert level_weight(COSTED, SHAPE, groups, 0, 4, query_lens) > 0
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, max_groups=2)
    assert (names, groups) == (
        ["groups"], [([ids[i] for i in a], 0, 11), ([ids[i] for i in b], 0, 8)]
    )  # fmt: skip
    assert _starts_by_request(plan) == {0: 11, 1: 8, 2: 11, 3: 8, 4: 8, 5: 11, 6: 8, 7: 11}


def test_a_run_past_the_cap_under_a_group_paying_only_its_merge_is_searched_too():
    # Under a 2-block header (which p, prefilling 37 tokens, has computed only) four
    # runs: a0..a3 (a3 leaves a0..a2's 10 blocks at 7), b0..b2 (b1, b2 share 8 blocks),
    # and l0, l1 sharing 18, of which l1 reaches 22 pages (flat pads to 32) and needs a
    # group ending at block 6 or later, l0 at 3. The whole batch over the header pays no
    # call of its own; with one group allowed only its two largest runs are searched
    # under it, and l0, l1's must be searched too: their group is the one that holds
    # every request whose pages need one.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 108))
    system_a = header + list(range(200, 220))
    sub_a = system_a + list(range(220, 232))
    system_b = header + list(range(300, 304))
    sub_b = system_b + list(range(304, 324))
    system_l = header + list(range(400, 464))
    reqs, computed, query_lens = _batch(m, [
        ("a0", sub_a + list(range(10, 15)), 0),
        ("l0", system_l + [20], 0),
        ("l1", system_l + list(range(30, 42)), 0),
        ("b0", system_b + list(range(50, 69)), 0),
        ("a1", sub_a + list(range(70, 75)), 0),
        ("a3", system_a + list(range(80, 87)), 7),
        ("b1", sub_b + list(range(90, 96)), 0),
        ("a2", sub_a + list(range(110, 119)), 0),
        ("b2", sub_b + list(range(120, 135)), 15),
        ("p", header + list(range(140, 177)), 37),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert computed.tolist() == [45, 73, 84, 31, 45, 28, 38, 49, 32, 8]
    assert _shared(m, ids) == 2 and _shared(m, ids[1:3]) == 18
    assert _shared(m, [ids[i] for i in (0, 4, 7)]) == 10 and _shared(m, [ids[6], ids[8]]) == 8
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [0, 3, 6, 0, 0, 0, 0, 0, 0, 0]
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, max_groups=1)
    assert (names, groups) == (["groups"], [(ids[1:3], 0, 18)])
    assert _starts_by_request(plan) == {1: 18, 2: 18} | {i: 0 for i in (0, 3, 4, 5, 6, 7, 8, 9)}


def test_a_run_past_the_cap_at_block_0_is_searched_where_it_holds_a_request_that_needs_one():
    # The three runs above with no header: no block is common to the batch, and the
    # search's first split, at block 0, looks at the two largest runs only, with one
    # group allowed. l0 and l1 (19 blocks; 21 and 20 pages, flat pads to 32) need a
    # group ending at block 5 and 4 or later: their run must be searched too.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs, computed, query_lens = _three_runs(m, list(range(100, 116)), with_header=False)
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 0 and _shared(m, ids[:2]) == 19
    assert _shared(m, ids[2:5]) == 11 and _shared(m, ids[5:]) == 10
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [5, 4, 0, 0, 0, 0, 0, 0]
    names, groups, plan = _planned(m, reqs, computed, query_lens, PAGE_BUCKETS, max_groups=1)
    assert (names, groups) == (["groups"], [(ids[:2], 0, 19)])
    assert plan.suffix_start_blocks.tolist() == [19, 19, 0, 0, 0, 0, 0, 0]
