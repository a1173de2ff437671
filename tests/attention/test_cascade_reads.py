"""SearchReads: a group search is reused for other computed tokens only where every read it
made answers alike for them (a verdict by its context limit,
CascadeCostModel.max_context_tokens, tested in test_cascade_cost); and what a planner
keys its reused searches on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxkv.cascade_groups as cascade_groups
from jaxkv import KVCacheManager
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from jaxkv.cascade_reads import SearchReads
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, SYSTEM_A, _decoding

FOUR = np.arange(4)


def _reads(counts, limit: int = 100) -> SearchReads:
    """Reads over `counts` (block size 4) whose verdicts pay for contexts up to `limit`."""
    pays = lambda n, prefix, queries, context, model=None: context <= limit  # noqa: E731
    return SearchReads(np.array(counts), 4, pays, lambda n, prefix, queries, model: limit)


def test_an_eligibility_read_holds_until_a_member_computes_its_block():
    reads = _reads([3, 7, 8, 20])
    assert reads.eligible(FOUR, 1).tolist() == [2, 3]  # computed 8 tokens: block 1 whole
    assert reads.holds(np.array([3, 7, 8, 20]))
    assert reads.holds(np.array([4, 7, 11, 90]))  # grown, no member past the threshold
    assert not reads.holds(np.array([3, 8, 8, 20]))  # member 1 computed block 1
    assert not reads.holds(np.array([3, 7, 7, 20]))  # member 2 no longer has
    assert not reads.holds(np.array([3, 7, 8]))  # another batch


def test_an_end_read_holds_while_the_least_computed_blocks_cap_it_alike():
    reads = _reads([9, 30, 12, 40])
    assert reads.end(FOUR, 5) == 2  # capped by member 0's two whole blocks
    assert reads.holds(np.array([11, 31, 12, 44]))
    assert not reads.holds(np.array([12, 30, 12, 40]))  # now three
    capped = _reads([21, 30, 24, 40])
    assert capped.end(FOUR, 5) == 5  # every member past the shared blocks
    assert capped.holds(np.array([23, 90, 60, 41]))
    assert not capped.holds(np.array([19, 30, 24, 40]))  # member 0 fell under them


def test_a_rising_read_holds_while_its_answer_cannot_have_turned():
    rising = lambda most: most >= 5  # noqa: E731
    short = _reads([3, 9, 12, 2])
    assert not short.rising(FOUR, rising)  # 3 blocks at most
    assert short.holds(np.array([3, 9, 15, 2]))
    assert not short.holds(np.array([3, 9, 20, 2]))  # 5 blocks: True now
    long = _reads([3, 9, 24, 2])
    assert long.rising(FOUR, rising)  # 6 blocks
    assert long.holds(np.array([30, 9, 24, 2]))
    assert not long.holds(np.array([3, 9, 16, 2]))  # 4 blocks: False now


def test_a_verdict_holds_while_its_context_stays_on_the_same_side_of_its_limit():
    paid = _reads([20, 20, 20, 20])
    assert paid.pays(FOUR, 16, 4, 2)  # contexts past column 2: 4 * (20 - 8) + 4 = 52
    assert paid.holds(np.array([30, 30, 30, 30]))  # 92
    assert paid.holds(np.array([32, 32, 32, 32]))  # 100, the limit
    assert not paid.holds(np.array([32, 32, 32, 33]))  # 101: no longer pays
    unpaid = _reads([40, 40, 40, 40])
    assert not unpaid.pays(FOUR, 16, 4, 2)  # 132
    assert unpaid.holds(np.array([50, 40, 40, 40]))
    assert not unpaid.holds(np.array([32, 32, 32, 32]))  # 100: pays now


def test_a_verdict_without_a_context_limit_never_holds():
    pays = lambda n, prefix, queries, context, model=None: True  # noqa: E731
    reads = SearchReads(np.array([8, 8]), 4, pays, lambda n, prefix, queries, model: None)
    assert reads.pays(np.arange(2), 4, 2, 0)
    assert not reads.holds(np.array([8, 8]))


class _OwnPays(CascadeCostModel):
    """A cost model with a pays() of its own: no context limit is known for it."""

    def pays(self, **kwargs) -> bool:
        return super().pays(**kwargs)


class _OwnPaysUnchecked(CascadeCostModel):
    """A cost model with a pays_unchecked() of its own, which the planner asks."""

    def pays_unchecked(self, **kwargs) -> bool:
        return super().pays_unchecked(**kwargs)


class _OwnFraction(CascadeCostModel):
    """A cost model with a min_saved_fraction test of its own."""

    def _short_of_fraction(self, saved, context_tokens, kv_bytes_per_token) -> bool:
        return super()._short_of_fraction(saved, context_tokens, kv_bytes_per_token)


def _batch():
    """Eight decoding requests, pairs of samples of four prompts under SYSTEM_A."""
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A + [i // 2, 50, 51, 52, 53]) for i in range(8)]
    ids = [r.request_id for r in reqs]
    return m, ids, np.array([r.num_tokens - 1 for r in reqs]), np.ones(8, np.int64)


@pytest.fixture
def searches(monkeypatch) -> list:
    """One entry per group search a planner runs (rather than reuses)."""
    calls = []
    search = cascade_groups.GroupSearch._search

    def counted(*args, **kwargs):
        calls.append(1)
        return search(*args, **kwargs)

    monkeypatch.setattr(cascade_groups.GroupSearch, "_search", counted)
    return calls


def test_a_planner_reuses_a_search_only_for_the_same_arguments(searches):
    m, ids, computed, ones = _batch()
    # A call costs one pair's saving: the pairs pay only together, over the global level.
    model = CascadeCostModel(launch_overhead_bytes=3000.0, merge_cost_factor=0.05)
    planner = CascadePlanner(SHAPE, cost_model=model)
    first = planner.plan(ids, computed, ones, m)
    assert [lv.name for lv in first.levels] == ["global", "groups"] and searches
    asked = len(searches)
    assert planner.plan(ids, computed + 1, ones, m).levels[-1].num_groups == 4
    assert len(searches) == asked  # grown contexts: reused
    planner.plan(ids, computed, ones * 2, m)
    assert len(searches) > asked  # other query lengths: searched again
    # The settings a search is reused under are fixed: its page buckets, merge-only model
    # and merge bytes are derived from them once.
    with pytest.raises(AttributeError):
        planner.cost_model = dataclasses.replace(model, merge_cost_factor=0.06)
    with pytest.raises(AttributeError):
        planner.shape = SHAPE
    asked = len(searches)
    planner.max_groups = 2
    planner.plan(ids, computed, ones * 2, m)
    assert len(searches) > asked  # another max_groups: searched again


@pytest.mark.parametrize("kind", [_OwnPays, _OwnPaysUnchecked, _OwnFraction])
def test_a_cost_model_with_its_own_pays_is_searched_every_step(searches, kind):
    m, ids, computed, ones = _batch()
    model = kind(launch_overhead_bytes=3000.0, merge_cost_factor=0.05)
    planner = CascadePlanner(SHAPE, cost_model=model)
    for step in range(3):
        asked = len(searches)
        plan = planner.plan(ids, computed + step, ones, m)
        assert len(searches) > asked  # searched again, not reused
        fresh = CascadePlanner(SHAPE, cost_model=model).plan(ids, computed + step, ones, m)
        assert plan.levels[-1].block_ends.tolist() == fresh.levels[-1].block_ends.tolist()


def test_a_search_is_keyed_on_the_requests_left_out_and_the_pages_needed(searches):
    m, ids, computed, ones = _batch()
    planner, rows = CascadePlanner(SHAPE, cost_model=ALWAYS), m.rows_of(ids)
    groups = planner._groups(m, rows, computed, ones, 0)
    assert [(g.tolist(), end) for g, end in groups] == [(list(range(8)), 8)]
    assert planner._groups(m, rows, computed, ones, 0) == groups and len(searches) == 1
    out = np.arange(8) == 0  # r0 left out: the others group without it
    searched = np.where(out, 0, computed)
    left = planner._groups(m, rows, searched, ones, 0, left_out=out)
    assert len(searches) == 2 and [g.tolist() for g, _ in left] == [list(range(1, 8))]
    searched[1] = 0  # r1 has computed nothing: left out or not, the same counts
    planner._groups(m, rows, searched, ones, 0, left_out=out)
    assert len(searches) == 3
    planner._groups(m, rows, searched, ones, 0, left_out=out | (np.arange(8) == 1))
    assert len(searches) == 4
    need = np.zeros(8, np.int64)  # a search holding the requests whose pages need a group
    planner._groups(m, rows, computed, ones, 0, need=need)
    assert len(searches) == 5
    planner._groups(m, rows, computed, ones, 0, need=need + 1)
    assert len(searches) == 6
