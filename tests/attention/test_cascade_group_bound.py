"""Which groups a level keeps when more of them pay than max_groups: the heaviest
disjoint set cut to max_groups, or the candidates taken heaviest first where those
weigh more; and among groups that weigh the same, those of the earliest requests.
The expected groups come from the block ids each request holds."""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager
from jaxkv.cascade import CascadePlanner
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, _decoding, _plan


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
