"""Groups from block 0 on a backend whose work follows each pass's padded page width
(xla), where the groups kept first leave a request whose own pages need a group in none:
groups kept under a candidate give way to its rest, so that the requests around them
are held too (more runs under a header than max_groups allows, or one request alone
beside a pair sharing a little more), but never a group whose members need more blocks
than that rest's. The expected plans come from the block ids each request holds.
"""

from __future__ import annotations

from jaxkv import KVCacheManager
from jaxkv.buckets import least_suffix_starts
from jaxkv.cascade import CascadePlanner
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_padded_groups import COSTED, PAGE_BUCKETS
from tests.attention.test_cascade_padded_needs import _batch
from tests.attention.test_cascade_planner import SHAPE

HEADER = list(range(100, 116))  # 4 blocks of 4


def _planned(m, reqs, computed, query_lens, **options):
    """(level names, groups as _groups gives them or [] for a flat plan, the plan) of
    CascadePlanner(SHAPE, COSTED, PAGE_BUCKETS, **options) on the batch, checked."""
    planner = CascadePlanner(SHAPE, cost_model=COSTED, page_buckets=PAGE_BUCKETS, **options)
    plan = planner.plan([r.request_id for r in reqs], computed, query_lens, m)
    plan.check()
    return [lv.name for lv in plan.levels], _groups(plan, reqs) if plan.levels else [], plan


def test_runs_past_max_groups_fold_into_the_rest_of_their_header():
    # Under the header three runs of two: a (9 blocks), b (10; b1 computed 9 of them and
    # prefills 12 tokens) and c (13). c's contexts reach 15 and 16 pages (flat pads to
    # 16), and every request's suffix pass needs a group ending at block 3 or later to
    # pad to 8. With two groups allowed, c's and the four of a and b over the header
    # hold them all; any two runs leave two requests in none.
    m = KVCacheManager(256, 4, max_model_len=128)
    system_a = HEADER + list(range(200, 220))
    system_b = HEADER + list(range(300, 324))
    system_c = HEADER + list(range(400, 436))
    reqs, computed, query_lens = _batch(m, [
        ("a0", system_a + list(range(10, 18)), 0),
        ("a1", system_a + [20, 21, 22, 23, 24], 0),
        ("b0", system_b + [30, 31, 32], 0),
        ("b1", system_b + list(range(40, 48)), 12),
        ("c0", system_c + list(range(50, 57)), 0),
        ("c1", system_c + list(range(60, 69)), 0),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 4 and _shared(m, ids[:2]) == 9
    assert _shared(m, ids[2:4]) == 10 and _shared(m, ids[4:]) == 13
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [4, 3, 3, 4, 7, 8]
    names, groups, _ = _planned(m, reqs, computed, query_lens, max_groups=8)
    assert (names, groups) == (
        ["groups"], [(ids[:2], 0, 9), (ids[2:4], 0, 9), (ids[4:], 0, 13)]
    )  # fmt: skip
    names, groups, plan = _planned(m, reqs, computed, query_lens, max_groups=2)
    assert (names, groups) == (["groups"], [(ids[:4], 0, 4), (ids[4:], 0, 13)])
    assert plan.suffix_start_blocks.tolist() == [4, 4, 4, 4, 13, 13]


def test_a_pair_folds_into_the_rest_beside_a_request_that_needs_a_group():
    # Under the header: "long" alone (20 pages, flat pads to 32), the pair x0, x1 sharing
    # 3 blocks more (x1 has computed 5 blocks and prefills 13 tokens), and y0, y1 sharing
    # 16 (19 and 20 pages). long, y0 and y1 need a group ending at block 4 or later to
    # pad to 16; "fresh" has computed nothing (so no global level). The five over the
    # header alone do not pay the level's call; y's group beside x's leaves long in
    # none. y's beside long with x0, x1 over the header holds all three and pays.
    m = KVCacheManager(256, 4, max_model_len=128)
    system_x = HEADER + list(range(200, 212))
    system_y = HEADER + list(range(300, 348))
    reqs, computed, query_lens = _batch(m, [
        ("fresh", HEADER + list(range(400, 420)), 36),
        ("long", HEADER + list(range(500, 560)), 0),
        ("x0", system_x + list(range(10, 20)), 0),
        ("x1", system_x + [20, 21, 22, 23, 24], 13),
        ("y0", system_y + list(range(30, 40)), 0),
        ("y1", system_y + list(range(40, 53)), 0),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert computed.tolist() == [0, 76, 38, 20, 74, 77]
    assert _shared(m, ids) == 4 and _shared(m, ids[2:4]) == 7 and _shared(m, ids[4:]) == 16
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [0, 4, 0, 0, 3, 4]
    names, groups, plan = _planned(m, reqs, computed, query_lens)
    assert (names, groups) == (["groups"], [(ids[1:4], 0, 4), (ids[4:], 0, 16)])
    assert plan.suffix_start_blocks.tolist() == [4, 4, 4, 16, 16, 0]


def test_a_pair_folds_into_the_rest_of_a_header_whose_group_ends_short_of_a_need():
    # Under a 3-block header: "solo" alone (43 tokens computed, 11 pages), s0, s1 sharing
    # 7 blocks, and l0..l3 sharing 10 (l2 computed 6 and prefills 18). Flat pads to 16;
    # to pad to 8 every request needs a group, l1 one ending at block 5 or later, so the
    # seven over the header is no group. l0..l3 over 6 blocks, and the header's rest:
    # solo beside s0, s1 rather than s0, s1 over 7 blocks (which leaves solo in none).
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 112))
    system_l = header + list(range(200, 228))
    system_s = header + list(range(300, 316))
    reqs, computed, query_lens = _batch(m, [
        ("l0", system_l + list(range(10, 15)), 0),
        ("l1", system_l + list(range(20, 30)), 0),
        ("s0", system_s + list(range(30, 35)), 0),
        ("solo", header + list(range(400, 431)), 0),
        ("l2", system_l + [40, 41], 18),
        ("l3", system_l + [50, 51], 2),
        ("s1", system_s + list(range(60, 66)), 0),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert computed.tolist() == [45, 50, 33, 43, 24, 40, 34]
    assert _shared(m, ids) == 3 and _shared(m, [ids[2], ids[6]]) == 7
    assert _shared(m, [ids[0], ids[1], ids[4], ids[5]]) == 10
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [4, 5, 1, 3, 3, 3, 1]
    names, groups, plan = _planned(m, reqs, computed, query_lens)
    want = [([ids[0], ids[1], ids[4], ids[5]], 0, 6), ([ids[2], ids[3], ids[6]], 0, 3)]
    assert (names, groups) == (["groups"], want)
    assert plan.suffix_start_blocks.tolist() == [6, 6, 6, 6, 3, 3, 3]


def test_a_group_short_of_its_own_need_is_not_folded_into_a_shorter_rest():
    # Under the header: x0..x4 share 10 blocks more (x2 has computed 2 blocks and
    # prefills 54 tokens), y0, y1 share 17 more (y0 reaches 24 pages, flat pads to 32),
    # and "own" (4 blocks computed, prefilling 58) shares only the header. y0 and y1 need
    # a group ending at block 8 or later, "own" one at block 3. x's group beside y's
    # leaves "own" in none; folding x's into the header's rest beside "own" holds it, but
    # y's group needs 8 blocks: it is no group to fold into a rest over 4.
    m = KVCacheManager(256, 4, max_model_len=128)
    system_x = HEADER + list(range(200, 240))
    system_y = HEADER + list(range(300, 368))
    reqs, computed, query_lens = _batch(m, [
        ("x0", system_x + list(range(10, 22)), 0),
        ("x1", system_x + [22, 23, 24], 0),
        ("x2", system_x + list(range(30, 36)), 54),
        ("x3", system_x + list(range(40, 48)), 0),
        ("y0", system_y + list(range(50, 58)), 0),
        ("y1", system_y + list(range(60, 68)), 8),
        ("own", HEADER + list(range(400, 458)), 58),
        ("x4", system_x + list(range(70, 81)), 0),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert computed.tolist() == [68, 59, 8, 64, 92, 84, 16, 67]
    assert _shared(m, ids) == 4 and _shared(m, ids[4:6]) == 21
    assert _shared(m, [ids[i] for i in (0, 1, 2, 3, 7)]) == 14
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [2, 0, 0, 1, 8, 7, 3, 1]
    names, groups, plan = _planned(m, reqs, computed, query_lens, max_groups=2)
    header_group = [ids[i] for i in (0, 1, 3, 6, 7)]
    assert (names, groups) == (["groups"], [(header_group, 0, 4), (ids[4:6], 0, 21)])
    assert plan.suffix_start_blocks.tolist() == [4, 4, 4, 4, 4, 21, 21, 0]


def test_the_rest_a_fold_makes_holds_its_members_for_the_candidates_around_it():
    # Under a 7-block header: x0..x2 share 6 blocks more, y0..y3 share 13 more, of which
    # y0 and y1 have computed 6 and 7 blocks (prefilling 59 and 57 tokens); y2 and y3
    # reach 23 pages (flat pads to 32). y0, y1, y2 and y3 need a group ending at block
    # 5, 6, 7 and 7 or later. x's group over 13 beside y2, y3's over 20 leaves y0 and y1
    # in none; folding x's group into the rest over 6 blocks, beside y0 and y1, holds
    # them all. The rest a fold keeps counts its members as held for the candidates
    # weighed after it.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 128))
    system_x = header + list(range(200, 224))
    system_y = header + list(range(300, 352))
    reqs, computed, query_lens = _batch(m, [
        ("x0", system_x + [10, 11, 12, 13, 14], 0),
        ("y0", system_y + [20, 21, 22], 59),
        ("y1", system_y + list(range(30, 35)), 57),
        ("x1", system_x + list(range(40, 46)), 6),
        ("y2", system_y + list(range(50, 59)), 9),
        ("x2", system_x + list(range(60, 70)), 0),
        ("y3", system_y + list(range(70, 80)), 0),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert computed.tolist() == [57, 24, 28, 52, 80, 62, 90]
    assert _shared(m, ids) == 7 and _shared(m, [ids[0], ids[3], ids[5]]) == 13
    assert _shared(m, [ids[1], ids[2], ids[4], ids[6]]) == 20
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [0, 5, 6, 0, 7, 0, 7]
    names, groups, plan = _planned(m, reqs, computed, query_lens, max_groups=2)
    want = [([ids[i] for i in (0, 1, 2, 3, 5)], 0, 6), ([ids[4], ids[6]], 0, 20)]
    assert (names, groups) == (["groups"], want)
    assert plan.suffix_start_blocks.tolist() == [6, 6, 6, 6, 6, 20, 20]


def test_a_candidate_weighing_as_much_as_its_fold_is_kept_whole():
    # Under a 3-block header: s0..s4 share 10 blocks and s0..s3 16, of which s2 has
    # computed 9 (prefilling 38 tokens); s4 has computed its 10 (prefilling 4). s0 and
    # s2 need a group ending at block 3 or later, s1 at 2 and s3 at 1. With two groups
    # allowed s0, s1, s3 over 16 blocks and s2, s4 over 9 hold them; with one, the five
    # over 9 blocks: the candidate whole, which weighs at least as much as any fold of
    # the groups inside it into its rest.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 112))
    system_s = header + list(range(200, 228))
    sub_s = system_s + list(range(228, 252))
    reqs, computed, query_lens = _batch(m, [
        ("s0", sub_s + list(range(10, 18)), 0),
        ("s1", sub_s + list(range(20, 26)), 6),
        ("p0", header + list(range(300, 340)), 40),
        ("s2", sub_s + list(range(30, 40)), 38),
        ("p1", header + list(range(400, 435)), 0),
        ("s3", sub_s + [40, 41], 0),
        ("s4", system_s + [50, 51, 52, 53], 4),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert computed.tolist() == [72, 64, 12, 36, 47, 66, 40]
    assert _shared(m, ids) == 3 and _shared(m, [ids[i] for i in (0, 1, 3, 5)]) == 16
    assert _shared(m, [ids[i] for i in (0, 1, 3, 5, 6)]) == 10
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [3, 2, 0, 3, 0, 1, 0]
    names, groups, _ = _planned(m, reqs, computed, query_lens, max_groups=2)
    want = [([ids[0], ids[1], ids[5]], 0, 16), ([ids[3], ids[6]], 0, 9)]
    assert (names, groups) == (["groups"], want)
    names, groups, plan = _planned(m, reqs, computed, query_lens, max_groups=1)
    assert (names, groups) == (["groups"], [([ids[i] for i in (0, 1, 3, 5, 6)], 0, 9)])
    assert plan.suffix_start_blocks.tolist() == [9, 9, 9, 9, 9, 0, 0]


def test_a_fold_weighing_as_much_as_its_candidate_keeps_the_deeper_groups():
    # Under an 8-block header: a0..a2 share 2 blocks more (a0 has computed nothing, a1
    # 9 blocks), b0..b2 share 8 more (b2 has computed 5 blocks and prefills 52 tokens),
    # c0, c1 share 3 more. b0, b1 and b2 need a group ending at block 2, 3 and 2 or
    # later. Over the 8 blocks, b0, b1 and the pairs of a and c weigh as much as
    # b0, b1 apart with a1, a2, c0, c1 folded into the rest; the candidate whole hid b's
    # pair from the candidate over 5 blocks around it (which adds b2), and the plan went
    # flat with two groups allowed. Kept now: b0, b1 over 16 beside the other four and b2
    # over 5.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = list(range(100, 132))
    system_a = header + list(range(200, 208))
    system_b = header + list(range(300, 332))
    system_c = header + list(range(400, 412))
    reqs, computed, query_lens = _batch(m, [
        ("a0", system_a + list(range(10, 15)), 45),
        ("a1", system_a + list(range(20, 33)), 17),
        ("a2", system_a + list(range(40, 46)), 0),
        ("b0", system_b + [50, 51, 52, 53], 0),
        ("b1", system_b + list(range(60, 69)), 9),
        ("b2", system_b + list(range(70, 78)), 52),
        ("c0", system_c + list(range(80, 86)), 0),
        ("c1", system_c + list(range(90, 96)), 0),
    ])  # fmt: skip
    ids = [r.request_id for r in reqs]
    assert computed.tolist() == [0, 36, 46, 68, 64, 20, 50, 50]
    assert _shared(m, ids) == 8 and _shared(m, ids[:3]) == 10 and _shared(m, ids[3:6]) == 16
    assert _shared(m, ids[6:]) == 11
    need = least_suffix_starts(PAGE_BUCKETS, computed, query_lens, 4)
    assert need.tolist() == [0, 0, 0, 2, 3, 2, 0, 0]
    want = [([ids[i] for i in (1, 2, 5, 6, 7)], 0, 5), (ids[3:5], 0, 16)]
    for max_groups in (2, 8):
        names, groups, plan = _planned(m, reqs, computed, query_lens, max_groups=max_groups)
        assert (names, groups) == (["groups"], want)
        assert plan.suffix_start_blocks.tolist() == [5, 5, 5, 5, 5, 16, 16, 0]
