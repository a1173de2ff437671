"""Which groups a level keeps when more of them pay than max_groups: the heaviest
disjoint set cut to max_groups, or the candidates taken heaviest first where those
weigh more; and among groups that weigh the same, those of the earliest requests.
The expected groups come from the block ids each request holds."""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, _decoding, _plan, _prefilled


class _AlwaysPays:
    """A cost model with only pays(): groups weigh the bytes they save."""

    def pays(self, **_) -> bool:
        return True


def _header_pairs_and_a_short_pair(m: KVCacheManager) -> list:
    """x0..x3 share a 6-block header, x0, x1 and x2, x3 5 blocks more in pairs; z0, z1
    share 2 blocks. Each request ends in 2 tokens of its own (blocks of 4)."""
    header = list(range(100, 124))
    reqs = [
        _decoding(m, f"x{i}", header + [1000 + 100 * (i // 2) + t for t in range(20)] + [i, 50])
        for i in range(4)
    ]
    return reqs + [_decoding(m, f"z{i}", list(range(5000, 5008)) + [i, 60]) for i in range(2)]


@pytest.mark.parametrize("model", [ALWAYS, _AlwaysPays()])
@pytest.mark.parametrize(
    ("max_groups", "want"),
    [
        # the pairs x (2 x 11 blocks saved) and z (2) weigh most, cut to one (11); the
        # four x over the header, taken first (3 x 6 = 18), weigh more
        (1, [(["x0", "x1", "x2", "x3"], 6)]),
        # cut to two, the pairs x (22) weigh more than the four x and z (20)
        (2, [(["x0", "x1"], 11), (["x2", "x3"], 11)]),
    ],
)
def test_past_max_groups_the_heavier_of_the_cut_set_and_the_heaviest_first_is_kept(
    model, max_groups, want
):
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = _header_pairs_and_a_short_pair(m)
    ids = [r.request_id for r in reqs]
    assert (_shared(m, ids[:4]), _shared(m, ids[:2]), _shared(m, ids[2:4])) == (6, 11, 11)
    assert _shared(m, ids[4:]) == 2 and _shared(m, ids) == 0
    plan = _plan(CascadePlanner(SHAPE, cost_model=model, max_groups=max_groups), m, reqs)
    assert [(members, end) for members, _, end in _groups(plan, reqs)] == want


def test_of_groups_that_weigh_the_same_those_of_the_earliest_requests_are_kept():
    # Nine pairs over 3 blocks each; pair k holds batch positions k and 17 - k. Eight are
    # kept: the pair whose first request comes last (positions 8 and 9) is dropped.
    m = KVCacheManager(512, 4, max_model_len=64)
    pair_of = [i if i < 9 else 17 - i for i in range(18)]
    reqs = [
        _decoding(m, f"r{i}", list(range(1000 * (k + 1), 1000 * (k + 1) + 12)) + [i])
        for i, k in enumerate(pair_of)
    ]
    assert _shared(m, ["r0", "r17"]) == 3 and _shared(m, [r.request_id for r in reqs]) == 0
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=8), m, reqs)
    got = [(members, end) for members, _, end in _groups(plan, reqs)]
    assert got == [([f"r{k}", f"r{17 - k}"], 3) for k in range(8)]


def _three_pairs(holder_first: bool) -> tuple[KVCacheManager, list]:
    """Pairs under 2-, 2- and 6-block prompts (a, b, c), allocated in that order, the c
    pair scheduled first; with `holder_first`, a finished request holding c's prompt was
    allocated before them all."""
    m = KVCacheManager(256, 4, max_model_len=64)
    prompts = {"a": list(range(100, 108)), "b": list(range(200, 208)), "c": list(range(300, 324))}
    if holder_first:
        _prefilled(m, "held", prompts["c"] + [99])
    reqs = {
        f"{p}{i}": _decoding(m, f"{p}{i}", prompts[p] + [i, 50]) for p in "abc" for i in range(2)
    }
    return m, [reqs[rid] for rid in ("c0", "c1", "a0", "a1", "b0", "b1")]


def test_which_runs_the_search_examines_does_not_depend_on_holders_outside_the_batch():
    # With max_groups=1 the search splits the batch into at most two runs. Of three
    # equal runs it keeps those of the earliest requests, the c pair first, whatever
    # order the blocks were first held in: a finished request that held c's prompt
    # before the others were allocated gave c's blocks the smallest prefix ids, and
    # ordering runs by those ids planned c with the holder and a without it.
    plans = []
    for holder_first in (False, True):
        m, reqs = _three_pairs(holder_first)
        assert _shared(m, ["c0", "c1"]) == 6 and _shared(m, ["a0", "a1"]) == 2
        plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=1), m, reqs)
        plans.append(_groups(plan, reqs))
    assert plans[0] == plans[1] == [(["c0", "c1"], 0, 6)]


@pytest.mark.parametrize("max_groups", [1, 2])
def test_a_small_max_groups_still_searches_past_a_staircase_of_candidates_that_do_not_pay(
    max_groups,
):
    # s0..s7 each leave the others one block later (s_i shares i + 1 blocks with them)
    # and read 240 tokens of their own; g0..g3 share 40 blocks. Each run from a stair
    # down saves too small a fraction of its members' contexts; only g0..g3 pay, the
    # ninth candidate of the search, past 4 x max_groups.
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, min_saved_fraction=0.45)
    m = KVCacheManager(1024, 4, max_model_len=512)
    stairs = list(range(100, 132))  # 8 blocks of 4
    shared = stairs + list(range(200, 328))  # 40 blocks
    reqs = [
        _decoding(m, f"s{i}", stairs[: 4 * (i + 1)] + [1000 * (i + 1) + t for t in range(240)])
        for i in range(8)
    ]
    reqs += [_decoding(m, f"g{i}", shared + [i]) for i in range(4)]
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 1 and _shared(m, ids[7:]) == 8 and _shared(m, ids[8:]) == 40
    plan = _plan(CascadePlanner(SHAPE, cost_model=model, max_groups=max_groups), m, reqs)
    assert _groups(plan, reqs) == [(ids[8:], 0, 40)]
