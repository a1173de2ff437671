"""Groups nested in a group that pays: some members of a group share more blocks than
all of them (a longer prompt under a short header), and the level keeps whichever
disjoint groups save most, not the first group that pays. The expected groups come from
the block ids each request holds and the counts given.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request, cascade_groups
from jaxkv.cascade import (
    DEFAULT_COST_MODELS,
    AttentionShape,
    CascadeCostModel,
    CascadePlanner,
)
from jaxkv.cascade_together import level_weight
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_level_choice import header_and_two_prompts
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, _decoding, _plan, _prefilled


def _planned(planner, m, reqs, computed_blocks=None):
    """(sorted members, start, end) of each group of the plan's groups level."""
    if computed_blocks is None:
        plan = _plan(planner, m, reqs)
    else:
        query_lens = np.ones(len(reqs), int)
        computed = np.array([r.num_tokens for r in reqs]) - query_lens
        computed[: len(computed_blocks)] = np.array(computed_blocks) * 4
        plan = planner.plan([r.request_id for r in reqs], computed, query_lens, m)
        plan.check()
    assert [lv.name for lv in plan.levels] == ["groups"]
    return sorted((sorted(members), start, end) for members, start, end in _groups(plan, reqs))


def _header_then_prompts(m, prompts: dict[str, int]) -> list:
    """Under a 5-block header (blocks of 4), requests named by `prompts` share
    prompts[name] more blocks with the others of its first letter, then hold 2 of their
    own; a pair c0, c1 shares 10 other blocks (so the batch shares nothing)."""
    header = list(range(100, 120))
    reqs = []
    for i, (name, more) in enumerate(prompts.items()):
        prompt = [1000 * (ord(name[0]) - 96) + t for t in range(4 * more)]
        reqs.append(_decoding(m, name, header + prompt + [i, 50 + i]))
    reqs += [_decoding(m, f"c{i}", list(range(5000, 5040)) + [i, 60 + i]) for i in range(2)]
    return reqs


def test_a_group_that_pays_does_not_hide_members_sharing_a_longer_prompt():
    # a0 and b0..b3 share the 5-block header, b0..b3 50 blocks more. The five over 5
    # blocks save 4 x 5 block reads and pay; the four over 55 save 3 x 55, and were
    # never looked at once the five paid.
    m = KVCacheManager(1024, 4, max_model_len=512)
    reqs = _header_then_prompts(m, {"a0": 2, **{f"b{i}": 50 for i in range(4)}})
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:5]), _shared(m, ids[1:5]), _shared(m, ids)) == (5, 55, 0)
    got = _planned(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    assert got == [(ids[1:5], 0, 55), (["c0", "c1"], 0, 10)]


def test_subsets_that_save_more_only_together_replace_the_group_they_nest_in():
    # a0, b0, b1, d0, d1 share the header (4 x 5 = 20 block reads saved); b0, b1 and
    # d0, d1 share 5 blocks more (1 x 10 each, 20 together: a tie keeps the one group)
    # or 6 more (22 together).
    for more, want in ((5, [(["a0", "b0", "b1", "d0", "d1"], 0, 5)]),
                       (6, [(["b0", "b1"], 0, 11), (["d0", "d1"], 0, 11)])):  # fmt: skip
        m = KVCacheManager(1024, 4, max_model_len=512)
        reqs = _header_then_prompts(m, {"a0": 2, "b0": more, "b1": more, "d0": more, "d1": more})
        got = _planned(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
        assert got == sorted([*want, (["c0", "c1"], 0, 10)])


def test_nested_groups_are_weighed_by_bytes_saved_less_their_merge():
    # a0, b0, b1 over the 5-block header save 2 x 5 x 4 tokens x 512 bytes (20480) and
    # merge 3 query tokens (3 x 6240); b0, b1 over 8 blocks save 16384 and merge 2. Both
    # pay a call (it costs nothing), the three save more blocks (10 against 8), but the
    # pair saves more net of its merge (3904 bytes against 1760).
    m = KVCacheManager(1024, 4, max_model_len=512)
    reqs = _header_then_prompts(m, {"a0": 2, "b0": 3, "b1": 3})
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=1)
    got = _planned(CascadePlanner(SHAPE, cost_model=model), m, reqs)
    assert got == [(["b0", "b1"], 0, 8), (["c0", "c1"], 0, 10)]


@pytest.mark.parametrize("max_groups", [1, 8])
def test_a_group_past_a_members_cut_is_split_where_its_members_diverge(max_groups):
    # b0..b4 share 15 blocks (the header and 10 more), b0 having computed 1 of them:
    # b0..b4 over 1 block save 4, b1..b4 over 15 save 45; b1, b2 share 20 blocks more
    # (35 in all: 35 saved), b3, b4 15 more (30 in all: 30 saved), 65 together.
    m = KVCacheManager(1024, 4, max_model_len=512)
    header = list(range(100, 160))
    tails = {"b0": [], "b1": [7] * 80, "b2": [7] * 80, "b3": [8] * 60, "b4": [8] * 60}
    reqs = [
        _decoding(m, n, header + tail + [i, 50 + i]) for i, (n, tail) in enumerate(tails.items())
    ]
    reqs += [_decoding(m, f"c{i}", list(range(5000, 5040)) + [i, 60 + i]) for i in range(2)]
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:5]), _shared(m, ids[1:3]), _shared(m, ids[3:5])) == (15, 35, 30)
    got = _planned(CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=max_groups), m, reqs, [1])
    if max_groups == 1:  # the one group saving most
        assert got == [(["b1", "b2", "b3", "b4"], 0, 15)]
    else:
        assert got == [(["b1", "b2"], 0, 35), (["b3", "b4"], 0, 30), (["c0", "c1"], 0, 10)]


def test_groups_nested_in_one_that_pays_are_examined_after_the_other_candidates():
    # max_groups=2 examines 8 candidates. 24 requests share 2 blocks (paying), in sixes
    # sharing 12, in trios sharing 30; a pair shares 100 (the most block reads saved by
    # one group). Examined by size, the 24, the four sixes and three trios spent the
    # search before the pair.
    m = KVCacheManager(2048, 4, max_model_len=512)
    header = list(range(100, 108))
    reqs = [
        _decoding(
            m,
            f"a{i}",
            header
            + [1000 * (i // 6) + t for t in range(40)]
            + [100_000 + 1000 * (i // 3) + t for t in range(72)]
            + [i, 50],
        )  # fmt: skip
        for i in range(24)
    ]
    reqs += [_decoding(m, f"c{i}", list(range(5000, 5400)) + [i, 60 + i]) for i in range(2)]
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:24]), _shared(m, ids[:6]), _shared(m, ids[:3])) == (2, 12, 30)
    assert _shared(m, ids[24:]) == 100
    got = _planned(CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=2), m, reqs)
    assert (["c0", "c1"], 0, 100) in got


def test_a_group_paying_only_its_merge_over_groups_that_pay_a_call_is_not_weighed(monkeypatch):
    # a0..a2 and b0..b2 share a 2-block header, then a prompt each (10 blocks more). The
    # six over the header pay their merge but not the 25000-byte call; each trio pays
    # it. The header group weighs no more than a call, less than either trio: the level
    # keeps the trios without weighing candidates (kept_groups) at every step.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = header_and_two_prompts(m)
    model = CascadeCostModel(launch_overhead_bytes=25000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert not planner.pays(6, 8, 6) and planner.pays(3, 48, 3)
    monkeypatch.setattr(cascade_groups, "kept_groups", None)  # calling it fails
    got = _planned(planner, m, reqs)
    assert got == [(["a0", "a1", "a2"], 0, 12), (["b0", "b1", "b2"], 0, 12)]


def test_groups_nested_in_a_group_leave_its_other_members_a_group_of_their_own():
    # A chat-template header (28 blocks of 16) over 64 decoding requests, 16 of them
    # under a 128-block system prompt after it, and one request without the header (no
    # global level). pallas_tpu model, 32 query heads of 128 over 8 KV heads, bf16: the
    # 64 over the header save 107.2 MiB less their merge, the 16 over 156 blocks 145.5;
    # the level kept the 16 alone (137.5 MiB less its call), though the other 48 still
    # share the header: beside them over 28 blocks (80.0 MiB more) it saves 217.5.
    shape = AttentionShape(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_itemsize=2)
    model = DEFAULT_COST_MODELS["pallas_tpu"]
    m = KVCacheManager(1024, 16, max_model_len=4096)
    header, prompt = list(range(10_000, 10_448)), list(range(20_000, 22_048))
    reqs = [_decoding(m, f"h{i:02}", header + [i] * 5 + [50 + i]) for i in range(48)]
    reqs += [_decoding(m, f"p{i:02}", header + prompt + [i] * 5 + [60 + i]) for i in range(16)]
    reqs.append(_decoding(m, "x", list(range(30_000, 30_640))))
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:64]), _shared(m, ids[48:64]), _shared(m, ids)) == (28, 156, 0)
    got = _planned(CascadePlanner(shape, cost_model=model), m, reqs)
    assert got == [(ids[:48], 0, 28), (ids[48:64], 0, 156)]
    mib = [
        level_weight(model, shape, groups, 0, 16, np.ones(len(reqs), int)) / 2**20
        for groups in ([(np.arange(48, 64), 156)], [(np.arange(48), 28), (np.arange(48, 64), 156)])
    ]
    assert [round(w, 1) for w in mib] == [137.5, 217.5]


def test_a_group_sharing_a_few_blocks_more_is_tried_beside_the_rest_of_its_group():
    # a0..a3, b0, b1 share the 5-block header (5 x 5 block reads saved); b0, b1 share 8
    # more (1 x 13). The pair can save no more than the six (13 < 25), but beside the
    # four over the header (3 x 5) it saves 28: the search must split the six.
    m = KVCacheManager(1024, 4, max_model_len=512)
    reqs = _header_then_prompts(m, {"a0": 0, "a1": 0, "a2": 0, "a3": 0, "b0": 8, "b1": 8})
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:6]), _shared(m, ids[4:6]), _shared(m, ids[:4])) == (5, 13, 5)
    got = _planned(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    assert got == [(ids[:4], 0, 5), (["b0", "b1"], 0, 13), (["c0", "c1"], 0, 10)]


def test_a_group_paying_only_its_merge_leaves_its_other_members_a_group():
    # As above, and d0..d2 under the header only, x under none (no global level), with
    # a 40000-byte call: each trio pays it (2 x 48 x 512 bytes), the nine over the header
    # only their merge (8 x 8 x 512). The nine weigh less than either trio, but d0..d2
    # still share the header: beside the trios they save 2 x 8 x 512 more.
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = header_and_two_prompts(m)
    reqs += [_decoding(m, f"d{i}", list(range(100, 108)) + [i, 60 + i]) for i in range(3)]
    reqs.append(_decoding(m, "x", list(range(500, 510))))
    model = CascadeCostModel(launch_overhead_bytes=40000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert not planner.pays(9, 8, 9) and planner.pays(3, 48, 3)
    got = _planned(planner, m, reqs)
    assert got == [
        (["a0", "a1", "a2"], 0, 12),
        (["b0", "b1", "b2"], 0, 12),
        (["d0", "d1", "d2"], 0, 2),
    ]


def _whole_table_pair(m: KVCacheManager, rid: str, tokens: list[int]) -> list[str]:
    """rid, prefilled over a whole table row, and rid + "'" holding its very blocks: a
    cache hit over every token, handed to allocate_slots as such (get_computed_blocks
    leaves a request's last token to compute)."""
    first = _prefilled(m, rid, tokens)
    twin = Request(rid + "'", list(tokens))
    hit = m.block_ids(rid)
    got = m.allocate_slots(twin, 0, num_new_computed_tokens=len(tokens), new_computed_blocks=hit)
    assert got == []  # no fresh block
    return [first.request_id, twin.request_id]


@pytest.mark.parametrize(("launch_overhead_bytes", "planned"), [(16000, True), (16385, False)])
def test_groups_over_a_whole_table_row_are_searched_no_further(launch_overhead_bytes, planned):
    # Two pairs each hold alike all 4 columns of their rows (4 blocks of 4 tokens, 8192
    # bytes saved a pair): neither pays a call, both their merges (none, no queries); the
    # level runs where the two together save more than its call, and no search splits a
    # pair past the table's last column.
    m = KVCacheManager(64, 4, max_model_len=16)
    ids = _whole_table_pair(m, "a", list(range(100, 116)))
    ids += _whole_table_pair(m, "b", list(range(200, 216)))
    assert m.max_blocks_per_seq == 4 and _shared(m, ids[:2]) == _shared(m, ids[2:]) == 4
    model = CascadeCostModel(launch_overhead_bytes=launch_overhead_bytes, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    plan = planner.plan(ids, np.full(4, 16), np.zeros(4, np.int32), m)
    plan.check()
    if planned:
        assert [lv.name for lv in plan.levels] == ["groups"]
        got = [(level.block_starts.tolist(), level.block_ends.tolist()) for level in plan.levels]
        assert got == [([0, 0], [4, 4])] and plan.suffix_start_blocks.tolist() == [4] * 4
    else:
        assert not plan.levels


def test_members_beside_the_nested_groups_whose_rest_does_not_pay_read_on_their_own():
    # a0, d0, b0 and b1 share the 5-block header, b0 and b1 10 blocks more. With merges
    # of 6240 bytes a query and no call cost, the four over the header save 3 x 10240
    # for 4 x 6240 (5760), the pair b over 15 blocks 30720 for 2 x 6240 (18240); a0 and
    # d0 beside it would save 10240 for 2 x 6240: no group of theirs pays, and they read
    # the header in their own pass.
    m = KVCacheManager(1024, 4, max_model_len=512)
    reqs = _header_then_prompts(m, {"a0": 2, "d0": 2, "b0": 10, "b1": 10})
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:4]), _shared(m, ids[2:4]), _shared(m, ids[:2])) == (5, 15, 5)
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=1)
    got = _planned(CascadePlanner(SHAPE, cost_model=model), m, reqs)
    assert got == [(["b0", "b1"], 0, 15), (["c0", "c1"], 0, 10)]


def test_two_members_beside_groups_paying_a_call_keep_the_group_of_the_one_over_them():
    # a0, d0 and b0..b2 share the 5-block header, b0..b2 10 blocks more. With a call of
    # 50000 bytes and no merge cost, the five over the header save 4 x 10240 (no call of
    # their own, but a group of a level that runs anyway), the three b over 15 blocks
    # 2 x 30720 (a call of their own). Beside the three, a0 and d0 still share the
    # header and save 10240 in that level: both groups are kept, and the pair c too.
    m = KVCacheManager(1024, 4, max_model_len=512)
    reqs = _header_then_prompts(m, {"a0": 2, "d0": 2, "b0": 10, "b1": 10, "b2": 10})
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:5]), _shared(m, ids[2:5]), _shared(m, ids[:2])) == (5, 15, 5)
    model = CascadeCostModel(launch_overhead_bytes=50000, merge_cost_factor=0)
    got = _planned(CascadePlanner(SHAPE, cost_model=model), m, reqs)
    assert got == [(["a0", "d0"], 0, 5), (["b0", "b1", "b2"], 0, 15), (["c0", "c1"], 0, 10)]


def test_the_largest_groups_nested_in_ones_that_pay_are_examined_first():
    # Under two 2-block headers, five requests each: three share 10 blocks more, two 10
    # other blocks. With max_groups=1, 4 candidates are examined: the two headers' groups
    # (both pay), then two of the four nested in them, the largest first: the three over
    # 12 blocks (saving 2 x 12) under the first header is kept, not a pair (1 x 12).
    m = KVCacheManager(1024, 4, max_model_len=128)
    reqs = []
    for h in range(2):
        header = list(range(100 + 10 * h, 108 + 10 * h))
        for i, sub in enumerate([0, 0, 0, 1, 1]):
            prompt = [1000 + 100 * (2 * h + sub) + t for t in range(40)]
            reqs.append(_decoding(m, f"{'xy'[h]}{i}", header + prompt + [i, 50 + h]))
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:5]), _shared(m, ids[:3]), _shared(m, ids[3:5])) == (2, 12, 12)
    assert _shared(m, ids) == 0
    got = _planned(CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=1), m, reqs)
    assert got == [(["x0", "x1", "x2"], 0, 12)]


def test_a_rest_kept_inside_a_nested_group_counts_at_its_weight_one_level_up():
    # Six share a 10-block header; v0, v1, p0, p1 2 blocks more; p0, p1 17 more; z shares
    # nothing. Under v's four (3 x 12 saved) the pair p (29) and the rest v0, v1 (12)
    # weigh more; over the header the six (5 x 10 = 50) weigh less than those two with
    # the rest w0, w1 (29 + 12 + 10 = 51): three groups.
    m = KVCacheManager(1024, 4, max_model_len=128)
    h1, h2, h3 = list(range(100, 140)), list(range(200, 208)), list(range(300, 368))
    tokens = {"w": h1, "v": h1 + h2, "p": h1 + h2 + h3}
    reqs = [_decoding(m, f"{k}{i}", tokens[k] + [i, 50]) for k in "wvp" for i in range(2)]
    reqs.append(_decoding(m, "z", list(range(900, 940)) + [7]))
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:6]), _shared(m, ids[2:6]), _shared(m, ids[4:6])) == (10, 12, 29)
    got = _planned(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    assert got == [(["p0", "p1"], 0, 29), (["v0", "v1"], 0, 12), (["w0", "w1"], 0, 10)]


def test_the_others_under_a_header_form_a_group_where_the_whole_batch_pays_nothing():
    # x0, x1 share 12 blocks (a 2-block header, then a prompt); y0..y2 share the header
    # only, with short contexts. All five over the header save 4 x 8 tokens of their
    # 141: under the min_saved_fraction of 0.3, neither a call nor its merge. The
    # y's alone save 2 x 8 of their 39 tokens (0.41): their own merge, beside the x
    # pair that pays the call. The whole batch used to hide them, as it paid nothing.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 108))
    reqs = [_decoding(m, f"x{i}", header + list(range(200, 240)) + [i, 50]) for i in range(2)]
    reqs += [_decoding(m, f"y{i}", header + [500 + 10 * i + t for t in range(4)]) for i in range(3)]
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids), _shared(m, ids[:2]), _shared(m, ids[2:])) == (2, 12, 2)
    assert [r.num_tokens for r in reqs] == [51, 51, 13, 13, 13]
    model = CascadeCostModel(
        launch_overhead_bytes=20000, merge_cost_factor=0, min_saved_fraction=0.3
    )
    planner = CascadePlanner(SHAPE, cost_model=model)
    merge_only = CascadeCostModel(
        launch_overhead_bytes=0, merge_cost_factor=0, min_saved_fraction=0.3
    )
    assert not planner.pays(5, 8, 5, 141, model=merge_only)
    assert planner.pays(2, 48, 2, 102) and not planner.pays(3, 8, 3, 39)
    assert planner.pays(3, 8, 3, 39, model=merge_only)
    assert _planned(planner, m, reqs) == [(ids[:2], 0, 12), (ids[2:], 0, 2)]
