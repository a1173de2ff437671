"""Seeded batches on a backend whose work follows each pass's padded page width (xla),
drawn so that suffix passes often pad as wide as flat attention's: prompts of 2-17
blocks past a header, decodes and prefill chunks (some after fewer computed tokens
than they hold), holders outside the batch.

Every plan, with 1, 2 and 8 groups allowed, must pass serving_sim.check_plan, keep at
most that many groups in a level and pad its suffix passes to fewer pages than flat's;
and none may be flat where a plan of a global level alone, or of one group from block 0
of any requests holding the same blocks, pads fewer and pays (by the cost model's own
weights). The seeds reach the planner's retries that hold the requests whose pages need
a group.
"""

from __future__ import annotations

import itertools
import types

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request, cascade_padded
from jaxkv.buckets import pads_fewer_pages
from jaxkv.cascade import CascadePlanner
from jaxkv.cascade_together import global_weight, level_weight
from tests.attention import serving_sim as sim
from tests.attention.test_cascade_padded_groups import COSTED, PAGE_BUCKETS
from tests.attention.test_cascade_planner import SHAPE
from tests.attention.workload import allocate_after_hit

BS = 4
NUM_SEEDS = 200


def _batch(seed: int) -> tuple[KVCacheManager, list[str], np.ndarray, np.ndarray]:
    """(manager, ids, computed, query lens) of 3-8 requests under 1-3 prompts."""
    rng = np.random.default_rng(seed)
    m = KVCacheManager(512, BS, max_model_len=128)
    token = itertools.count(1000)

    def fresh(n: int) -> list[int]:
        return [next(token) for _ in range(n)]

    header = fresh(int(rng.integers(2, 11)) * BS + int(rng.integers(0, 2)) * int(rng.integers(BS)))
    prompts = [
        header + fresh(int(rng.integers(2, 18)) * BS + int(rng.integers(BS)))
        for _ in range(int(rng.integers(1, 4)))
    ]
    ids, computed, query_lens = [], [], []
    for i in range(int(rng.integers(3, 9))):
        prompt = prompts[int(rng.integers(len(prompts)))]
        request = Request(f"r{i}", (prompt + fresh(int(rng.integers(1, 12))))[:120])
        hit = allocate_after_hit(m, request)
        if rng.random() < 0.65:  # decode
            c = request.num_tokens - 1
        else:  # a prefill chunk after its hit, or after fewer tokens than it holds
            c = hit if rng.random() < 0.6 else int(rng.integers(0, hit + 1)) // BS * BS
        ids.append(request.request_id)
        computed.append(c)
        query_lens.append(request.num_tokens - c)
        if rng.random() < 0.2:  # a holder outside the batch
            allocate_after_hit(m, Request(f"h{i}", prompt + fresh(1)))
    return m, ids, np.array(computed), np.array(query_lens)


def _pays_somewhere(m, ids, computed, query_lens) -> bool:
    """Whether a global level alone, or one group from block 0 of two or more requests
    holding the same blocks, pads fewer pages than flat and pays (from block ids)."""
    blocks = [m.block_ids(r) for r in ids]
    common = sim.brute_common_prefix(m, ids)
    k0 = min(common, int(computed.min()) // BS)
    if k0 and pads_fewer_pages(PAGE_BUCKETS, computed, query_lens, k0, BS):
        if global_weight(COSTED, SHAPE, len(ids), k0 * BS, int(query_lens.sum())) > 0:
            return True
    for end in range(1, max(map(len, blocks)) + 1):
        for prefix in {tuple(b[:end]) for b in blocks if len(b) >= end}:
            run = [
                i for i, b in enumerate(blocks)
                if tuple(b[:end]) == prefix and computed[i] // BS >= end
            ]  # fmt: skip
            for size in range(2, len(run) + 1):
                for members in itertools.combinations(run, size):
                    starts = np.zeros(len(ids), np.int64)
                    starts[list(members)] = end
                    group = [(np.array(members), end)]
                    if (
                        pads_fewer_pages(PAGE_BUCKETS, computed, query_lens, starts, BS)
                        and level_weight(COSTED, SHAPE, group, 0, BS, query_lens) > 0
                    ):
                        return True
    return False


@pytest.fixture
def retries(monkeypatch):
    """Counts of the plans the retries holding requests that need a group return."""
    found = {"from block 0": 0, "past the base": 0}
    holding = cascade_padded.PaddedPlans._plan_holding
    padding = cascade_padded.PaddedPlans._groups_padding_fewer

    def plan_holding(self, *args):
        plan = holding(self, *args)
        found["from block 0"] += plan is not None
        return plan

    def groups_padding_fewer(self, manager, rows, computed, query_lens, base, end, out):
        groups = padding(self, manager, rows, computed, query_lens, base, end, out)
        found["past the base"] += bool(base and groups[0])
        return groups

    monkeypatch.setattr(cascade_padded.PaddedPlans, "_plan_holding", plan_holding)
    monkeypatch.setattr(cascade_padded.PaddedPlans, "_groups_padding_fewer", groups_padding_fewer)
    return found


def test_padded_plans_are_exact_pad_fewer_pages_and_are_flat_only_where_nothing_simple_pays(
    retries,
):
    flat_where_paying = []
    cascades = 0
    for seed in range(NUM_SEEDS):
        m, ids, computed, query_lens = _batch(seed)
        out = types.SimpleNamespace(request_ids=ids, num_computed_tokens=computed)
        pays = None
        for max_groups in (1, 2, 8):
            planner = CascadePlanner(
                SHAPE, cost_model=COSTED, page_buckets=PAGE_BUCKETS, max_groups=max_groups
            )
            plan = planner.plan(ids, computed, query_lens, m)
            sim.check_plan(m, out, plan)
            assert all(level.num_groups <= max_groups for level in plan.levels), seed
            if plan.levels:
                cascades += 1
                starts = np.empty(len(ids), np.int64)
                starts[plan.order] = plan.suffix_start_blocks
                assert pads_fewer_pages(PAGE_BUCKETS, computed, query_lens, starts, BS), seed
                continue
            if pays is None:
                pays = _pays_somewhere(m, ids, computed, query_lens)
            if pays:
                flat_where_paying.append((seed, max_groups))
    assert flat_where_paying == []
    assert cascades > NUM_SEEDS  # the seeds plan cascade often, and reach the retries:
    assert retries["from block 0"] >= 3 and retries["past the base"] >= 1, retries
