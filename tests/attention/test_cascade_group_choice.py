"""Which groups the planner keeps, against block counts read from KVCacheManager.block_ids.

Each case is built so that one rule of the group search decides the plan: what a group
saves ((members - 1) x its own shared blocks), what a group adds past the global level,
where a candidate that does not pay is split, and which queries the level's one call
merges. The expected groups come from the block ids each request holds, never from the
planner's prefix ids.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlanner
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, _decoding, _plan, _prefilled


def _shared(m: KVCacheManager, ids: list[str]) -> int:
    """Leading block columns in which every request of `ids` holds the same block id."""
    tables = [m.block_ids(rid) for rid in ids]
    k = 0
    while all(k < len(t) for t in tables) and len({t[k] for t in tables}) == 1:
        k += 1
    return k


def _groups(plan, reqs) -> list[tuple[list[str], int, int]]:
    """(member ids, first block, end block) of each group of the plan's last level."""
    level = plan.levels[-1]
    return [
        (
            [reqs[int(plan.order[i])].request_id for i in range(s, e)],
            int(level.block_starts[g]),
            int(level.block_ends[g]),
        )
        for g, (s, e) in enumerate(zip(level.group_starts, level.group_ends, strict=True))
    ]


def test_the_kept_group_is_the_one_whose_other_members_read_fewest_blocks():
    # With max_groups=1 the level keeps the group that saves most block reads: a group
    # of n requests sharing b blocks saves (n - 1) x b. Two requests over 7 blocks save
    # 7, four over 3 blocks save 9 (counting n x b would keep the pair: 14 > 12).
    m = KVCacheManager(256, 4, max_model_len=64)
    pair = [_decoding(m, f"a{i}", list(range(100, 128)) + [i, 50 + i]) for i in range(2)]
    four = [_decoding(m, f"b{i}", list(range(200, 212)) + [i, 60 + i]) for i in range(4)]
    reqs = pair + four
    saves = {}
    for name, members in (("pair", pair), ("four", four)):
        ids = [r.request_id for r in members]
        saves[name] = (len(ids) - 1) * _shared(m, ids)
    assert saves == {"pair": 7, "four": 9}
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=1), m, reqs)
    ((members, start, end),) = _groups(plan, reqs)
    assert sorted(members) == ["b0", "b1", "b2", "b3"]
    assert (start, end) == (0, _shared(m, members)) == (0, 3)


def _two_groups_under_one_prompt(group_tokens: int):
    """Six decoding requests (blocks of 4) under one 32-token prompt; requests of even and
    of odd index then share `group_tokens` more tokens, and each ends in 3 of its own."""
    m = KVCacheManager(256, 4, max_model_len=128)
    system = list(range(100, 132))
    reqs = [
        _decoding(m, f"r{i}", system + [900 + i % 2] * group_tokens + [i, 50 + i, 60 + i])
        for i in range(6)
    ]
    return m, reqs, [r.request_id for r in reqs]


def test_a_group_is_judged_by_the_blocks_it_adds_past_the_global_level():
    # Six requests share 8 blocks (the global level pays); two groups of three share one
    # more block each. Saving 2 x 4 tokens x 512 bytes per group does not pay for the
    # level's call (20000 bytes) even together; counting the global 8 blocks again would
    # make each group look as if it saved 2 x 36 tokens and plan a groups level.
    m, reqs, ids = _two_groups_under_one_prompt(group_tokens=4)
    assert _shared(m, ids) == 8
    assert _shared(m, ids[0::2]) == _shared(m, ids[1::2]) == 9
    model = CascadeCostModel(launch_overhead_bytes=20000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert planner.pays(6, 32, 6) and not planner.pays(3, 4, 3)
    plan = _plan(planner, m, reqs)
    assert [lv.name for lv in plan.levels] == ["global"]
    assert plan.suffix_start_blocks.tolist() == [8] * 6


def test_a_group_under_the_global_level_is_weighed_against_the_suffix_it_shortens():
    # Six requests share 8 blocks (32 tokens); two groups of three share 4 more blocks
    # each; contexts of 52 tokens. The global level saves 5 x 32 of 6 x 52 tokens (0.51).
    # A group saves 2 x 16 tokens of the 3 x 20 its members' suffix pass reads past the
    # global level (0.53), which a min_saved_fraction of 0.4 plans; weighed against the
    # whole contexts (3 x 52 tokens, 0.21), as if the global level read nothing once,
    # it was refused and the groups' 4 blocks were read three times each.
    m, reqs, ids = _two_groups_under_one_prompt(group_tokens=16)
    assert _shared(m, ids) == 8 and {r.num_tokens for r in reqs} == {52}
    assert _shared(m, ids[0::2]) == _shared(m, ids[1::2]) == 12
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, min_saved_fraction=0.4)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert planner.pays(6, 32, 6, 6 * 52) and planner.pays(3, 16, 3, 3 * 20)
    assert not planner.pays(3, 16, 3, 3 * 52)
    plan = _plan(planner, m, reqs)
    assert [lv.name for lv in plan.levels] == ["global", "groups"]
    groups = _groups(plan, reqs)
    assert sorted(sorted(members) for members, _, _ in groups) == [ids[0::2], ids[1::2]]
    assert {(start, end) for _, start, end in groups} == {(8, 12)}


def test_a_candidate_that_does_not_pay_is_split_at_the_first_column_it_differs():
    # Nine requests share a one-block header that does not pay. Past it, three share a
    # long prompt (9 blocks in all) and six share one block only (2 in all): that group
    # differs from the header group first at column 1 and diverges at column 2, so a
    # split anywhere past column 1 loses it.
    m = KVCacheManager(512, 4, max_model_len=128)
    header = [1, 2, 3, 4]
    long_reqs = [
        _decoding(m, f"a{i}", header + list(range(100, 132)) + [i, 50 + i]) for i in range(3)
    ]
    short_reqs = [
        _decoding(m, f"b{i}", header + [7, 7, 7, 7] + [10 * i + j for j in range(8)] + [i])
        for i in range(6)
    ]
    reqs = long_reqs + short_reqs
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 1
    assert _shared(m, ids[:3]) == 9 and _shared(m, ids[3:]) == 2
    # 512 bytes per token: the header saves 8 x 4 x 512 = 16384, the six 5 x 8 x 512 = 20480.
    model = CascadeCostModel(launch_overhead_bytes=20000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert not planner.pays(9, 4, 9) and planner.pays(6, 8, 6) and planner.pays(3, 36, 3)
    plan = _plan(planner, m, reqs)
    got = sorted((sorted(members), start, end) for members, start, end in _groups(plan, reqs))
    assert got == [(ids[:3], 0, 9), (ids[3:], 0, 2)]
    assert [lv.name for lv in plan.levels] == ["groups"]


def test_groups_that_pay_together_are_charged_only_their_own_queries():
    # Two pairs of decoding requests share 8 blocks each; a fifth request, sharing
    # nothing, prefills 40 tokens. Each pair saves 32 x 512 = 16384 bytes and costs its
    # 2 query tokens' merge (2 x 6240); together 32768 bytes pay one call (6000 bytes) and
    # the merge of their 4 query tokens (24960), not of the batch's 44 tokens.
    m = KVCacheManager(512, 4, max_model_len=128)
    pairs = [
        _decoding(m, f"p{p}r{i}", list(range(100 * (p + 1), 100 * (p + 1) + 32)) + [i, 50 + i])
        for p in range(2)
        for i in range(2)
    ]
    loner = _prefilled(m, "loner", list(range(700, 748)))
    reqs = [*pairs, loner]
    query_lens = np.array([1, 1, 1, 1, 40])
    model = CascadeCostModel(launch_overhead_bytes=6000, merge_cost_factor=1)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert not planner.pays(2, 32, 2)  # no pair pays a call of its own
    plan = _plan(planner, m, reqs, query_lens)
    got = sorted((sorted(members), start, end) for members, start, end in _groups(plan, reqs))
    expected = [(["p0r0", "p0r1"], 0, 8), (["p1r0", "p1r1"], 0, 8)]
    assert got == expected
    assert all(_shared(m, members) >= end for members, _, end in got)


@pytest.mark.parametrize(("page_buckets", "cascade"), [((2, 16), False), ((4, 16), True)])
def test_a_groups_level_counts_the_partial_last_page_of_the_longest_suffix(page_buckets, cascade):
    # Groups over 8 and 6 blocks of 4. The longest context, 38 tokens, pads flat
    # attention to 10 -> 16 pages. The longest suffix past its group is 33 - 24 = 9
    # tokens: 3 pages (the third partial), padded to 16 with buckets (2, 16), so cascade
    # reads no fewer pages there; with (4, 16) it pads to 4 and pays.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = [_decoding(m, f"a{i}", list(range(100, 132)) + [i] * 5) for i in range(3)]
    reqs += [_decoding(m, f"b{i}", list(range(200, 224)) + [i] * 8) for i in range(3)]
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:3]) >= 8 and _shared(m, ids[3:]) >= 6
    contexts = [r.num_tokens for r in reqs]
    assert max(contexts) == 38 and max(contexts[3:]) - 6 * 4 == 9
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, reads_padded_pages=True)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model, page_buckets=page_buckets), m, reqs)
    assert plan.uses_cascade == cascade


def test_a_global_level_compares_pages_with_the_longest_context():
    # Two requests share 2 blocks of 4; contexts of 14 and 33 tokens. Flat attention pads
    # the longer one's 9 pages to 16, the global level's suffix pass 7 pages to 8: cascade
    # pays. Counting the shorter context (4 pages, suffix 2, both padded to 4) would not.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 108))
    reqs = [_decoding(m, "short", header + [1] * 5), _decoding(m, "long", header + [2] * 24)]
    assert _shared(m, ["short", "long"]) == 2
    assert [r.num_tokens for r in reqs] == [14, 33]
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, reads_padded_pages=True)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model, page_buckets=(4, 8, 16)), m, reqs)
    assert [(lv.name, lv.block_ends.tolist()) for lv in plan.levels] == [("global", [2])]


def test_a_larger_group_saving_less_does_not_hide_a_smaller_one_saving_more():
    # max_groups=1: three requests share one block (saving 2), two share 8 (saving 8).
    # The search must weigh both candidates, not only the largest run of requests.
    m = KVCacheManager(256, 4, max_model_len=64)
    three = [_decoding(m, f"c{i}", [1, 2, 3, 4] + [10 * i + j for j in range(8)]) for i in range(3)]
    two = [_decoding(m, f"d{i}", list(range(100, 132)) + [i, 50 + i]) for i in range(2)]
    reqs = three + two
    ids = [r.request_id for r in reqs]
    assert (2 * _shared(m, ids[:3]), _shared(m, ids[3:])) == (2, 8)
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=1), m, reqs)
    ((members, start, end),) = _groups(plan, reqs)
    assert (sorted(members), start, end) == (["d0", "d1"], 0, 8)


def test_split_candidates_larger_than_those_waiting_are_examined_first():
    # max_groups=1 examines 4 candidates. A (8 requests, 1 shared block) and B (2, 1
    # block) pay nothing; A splits into A1 (6, 2 blocks: still not enough) and A2 (2), and
    # A1 into two trios sharing 10 blocks, which pay. Visiting the larger split candidates
    # first reaches a trio on the third look; taking candidates in the order they were
    # found spends the four looks on A, B, A1 and A2, none of which pays: no cascade.
    m = KVCacheManager(256, 4, max_model_len=64)
    a0, b0 = [1000, 1001, 1002, 1003], [2000, 2001, 2002, 2003]
    a1 = [1100 + i for i in range(4)]  # A1's second block
    reqs = [
        _decoding(m, f"a{i}", a0 + a1 + [3000 + 100 * (i // 3) + j for j in range(32)] + [i])
        for i in range(6)
    ]  # trios a0..a2 and a3..a5: 10 shared blocks each
    reqs += [_decoding(m, f"a{i}", a0 + [1200] * 4 + [i]) for i in (6, 7)]
    reqs += [_decoding(m, f"b{i}", b0 + [i, 60 + i]) for i in range(2)]
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:8]) == 1 and _shared(m, ids[:6]) == 2
    assert _shared(m, ids[:3]) == _shared(m, ids[3:6]) == 10
    assert _shared(m, ids[6:8]) == 2 and _shared(m, ids[8:]) == 1
    model = CascadeCostModel(launch_overhead_bytes=30000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model, max_groups=1)
    assert not planner.pays(8, 4, 8) and not planner.pays(6, 8, 6) and planner.pays(3, 40, 3)
    plan = _plan(planner, m, reqs)
    assert [lv.name for lv in plan.levels] == ["groups"]
    ((members, start, end),) = _groups(plan, reqs)
    assert (sorted(members), start, end) == (["a0", "a1", "a2"], 0, 10)


@pytest.mark.parametrize(
    ("launch_overhead_bytes", "max_groups", "num_groups"),
    [(7807, 2, 2), (7808, 2, 0), (6000, 1, 0)],
)
def test_groups_paying_together_must_save_more_than_the_call_of_the_groups_kept(
    launch_overhead_bytes, max_groups, num_groups
):
    # Two pairs each save 16384 bytes and merge 2 query tokens (12480 bytes): together
    # 32768 bytes against the call and 24960 bytes of merge, which must cost less (a
    # tie plans flat). With max_groups=1 only one pair is kept, and its 16384 bytes
    # saved do not pay the call and its own merge alone.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = [
        _decoding(m, f"p{p}r{i}", list(range(100 * (p + 1), 100 * (p + 1) + 32)) + [i, 50 + i])
        for p in range(2)
        for i in range(2)
    ]
    model = CascadeCostModel(launch_overhead_bytes=launch_overhead_bytes, merge_cost_factor=1)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model, max_groups=max_groups), m, reqs)
    assert plan.num_levels == (num_groups > 0)
    assert sum(lv.num_groups for lv in plan.levels) == num_groups


@pytest.mark.parametrize("max_groups", [8, 2])
def test_groups_paying_together_are_not_hidden_by_the_candidate_they_split_from(max_groups):
    # Eight requests share a 10-block header, then pairs of them 20 blocks more; two
    # others share 60 blocks. At 512 bytes a token nothing pays the 200000-byte call
    # alone: the eight over the header save 143360 bytes, each pair over 30 blocks
    # 61440, the other two 122880. The four pairs with the two save 368640 together,
    # more than the eight with the two (266240), which were kept because the eight
    # outweigh any one pair. Cut to max_groups=2, two pairs and the two (184320) do not
    # pay; the eight and the two do.
    m = KVCacheManager(1024, 4, max_model_len=256)
    header = list(range(100, 140))
    reqs = [
        _decoding(m, f"p{p}r{i}", header + [1000 * (p + 1) + t for t in range(80)] + [i, 50 + i])
        for p in range(4)
        for i in range(2)
    ]
    reqs += [_decoding(m, f"b{i}", list(range(6000, 6240)) + [i, 60 + i]) for i in range(2)]
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids[:8]) == 10 and _shared(m, ids[8:]) == 60 and _shared(m, ids) == 0
    assert all(_shared(m, ids[2 * p : 2 * p + 2]) == 30 for p in range(4))
    model = CascadeCostModel(launch_overhead_bytes=200000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model, max_groups=max_groups)
    assert not any(planner.pays(n, tokens, n) for n, tokens in ((8, 40), (2, 120), (2, 240)))
    plan = _plan(planner, m, reqs)
    got = sorted((sorted(members), start, end) for members, start, end in _groups(plan, reqs))
    if max_groups == 8:
        pairs = [(ids[2 * p : 2 * p + 2], 0, 30) for p in range(4)]
        assert got == [(["b0", "b1"], 0, 60), *pairs]
    else:
        assert got == [(["b0", "b1"], 0, 60), (ids[:8], 0, 10)]


def test_a_group_that_pays_only_its_merge_joins_one_that_pays_the_call():
    # A pair over 100 blocks saves 204800 bytes and pays the 20000-byte call; another
    # pair over 8 blocks saves 16384, less than a call but more than its merge (free
    # here): the level runs anyway, so it reads those 8 blocks once too.
    m = KVCacheManager(512, 4, max_model_len=512)
    reqs = [_decoding(m, f"a{i}", list(range(1000, 1400)) + [i, 50 + i]) for i in range(2)]
    reqs += [_decoding(m, f"b{i}", list(range(2000, 2032)) + [i, 60 + i]) for i in range(2)]
    model = CascadeCostModel(launch_overhead_bytes=20000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert planner.pays(2, 400, 2) and not planner.pays(2, 32, 2)
    plan = _plan(planner, m, reqs)
    got = sorted((sorted(members), start, end) for members, start, end in _groups(plan, reqs))
    assert got == [(["a0", "a1"], 0, 100), (["b0", "b1"], 0, 8)]


def test_a_whole_batch_prefix_that_pays_in_tokens_is_one_global_level():
    # The global level's cost verdict counts the shared prefix in tokens. Four decoding
    # requests share 1024 tokens (64 blocks of 16): reading them once saves
    # 3 * 1024 * 4 KiB = 12 MiB, more than a TPU call's 8 MiB. Counted as 64 "tokens"
    # (its blocks) it would save 0.75 MiB and not pay, and the batch would fall through
    # to a one-group "groups" level (or, beside real groups, lose them).
    shape = AttentionShape(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_itemsize=2)
    m = KVCacheManager(4096, 16, max_model_len=2048)
    prompt = list(range(5000, 5000 + 1024))
    reqs = [_decoding(m, f"r{i}", prompt + [9000 + i] * 3) for i in range(4)]
    planner = CascadePlanner(shape, backend="pallas_tpu")
    context = sum(r.num_tokens for r in reqs)
    assert planner.pays(4, 1024, 4, context) and not planner.pays(4, 64, 4, context)
    plan = _plan(planner, m, reqs)
    assert [level.name for level in plan.levels] == ["global"]
    assert (
        plan.levels[0].block_ends.tolist() == [64]
        and _shared(m, [r.request_id for r in reqs]) == 64
    )
    assert plan.suffix_start_blocks.tolist() == [64] * 4


def test_enable_groups_false_plans_no_groups_level():
    def two_prompts(m):
        a = [_decoding(m, f"a{i}", [*range(100, 132), i, 50 + i]) for i in range(3)]
        return a + [_decoding(m, f"b{i}", [*range(200, 224), i, 60 + i]) for i in range(3)]

    for enable_groups, names in ((True, ["groups"]), (False, [])):
        m = KVCacheManager(256, 4, max_model_len=64)
        planner = CascadePlanner(SHAPE, cost_model=ALWAYS, enable_groups=enable_groups)
        assert [lv.name for lv in _plan(planner, m, two_prompts(m)).levels] == names


def test_groups_paying_together_count_each_request_once():
    # r0..r3 share 2 blocks and r0, r1 six more: the pair saves 8 blocks, the four 3 x 2.
    # Neither pays the 21000-byte call alone, nor does the pair beside r2, r3 over the 2
    # blocks (10 x 2048 bytes); summing the pair and the four (14 x 2048) would plan r0,
    # r1 in two groups.
    m = KVCacheManager(256, 4, max_model_len=64)
    header, tail = list(range(100, 108)), list(range(300, 324))
    reqs = [_decoding(m, f"r{i}", header + tail + [i, i + 1]) for i in range(2)]
    reqs += [_decoding(m, f"r{i}", header + [1000 * i + t for t in range(26)]) for i in (2, 3)]
    reqs += [_decoding(m, f"r{i}", [1000 * i + t for t in range(34)]) for i in (4, 5)]
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:4]), _shared(m, ids[:2]), _shared(m, ids)) == (2, 8, 0)
    model = CascadeCostModel(launch_overhead_bytes=21000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert not planner.pays(4, 2 * 4, 4) and not planner.pays(2, 8 * 4, 2)
    assert not _plan(planner, m, reqs).uses_cascade


class _NeverPays:
    """A cost model that records the size of each candidate it is asked about."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def pays(self, *, num_requests: int, **_) -> bool:
        self.asked.append(num_requests)
        return False


def _tree(m: KVCacheManager, base: int, num_groups: int, pairs_per_group: int) -> list:
    """Groups sharing one block, each made of pairs that share two more."""
    reqs = []
    for g in range(num_groups):
        head = [base + 1000 * g + t for t in range(4)]
        for p in range(pairs_per_group):
            pair = [base + 1000 * g + 100 * (p + 1) + t for t in range(8)]
            for i in range(2):
                reqs.append(_decoding(m, f"{base}.{g}.{p}.{i}", head + pair + [i, 9, 9]))
    return reqs


def test_the_group_search_is_bounded_by_max_groups():
    # A split keeps its 2 x max_groups largest runs (here max_groups=1: two of the four
    # pairs); the search examines at most 4 x max(max_groups, 4) candidates in all,
    # here every run kept: both groups and the two pairs of each.
    m = KVCacheManager(512, 4, max_model_len=64)
    four_pairs, two_by_two = _tree(m, 10_000, 4, 1), _tree(m, 20_000, 2, 2)
    model = _NeverPays()
    planner = CascadePlanner(SHAPE, cost_model=model, max_groups=1)
    assert not _plan(planner, m, four_pairs).uses_cascade
    assert model.asked == [2, 2]
    model.asked.clear()
    assert not _plan(planner, m, two_by_two).uses_cascade
    assert model.asked == [4, 4, 2, 2, 2, 2]
