"""Seeded prefix-tree batches through the differential planners, with caps of 8 and 32.

Each batch is built through the real manager under prompt trees up to four segments
deep: a request takes a random path down a tree, then a few tokens of its own. So
groups nest several levels deep, and beside a kept nested group sits the rest of a
larger candidate's members; a third of the batches put 24-32 requests under one header
block over 8-10 system prompts, so that more than 8 groups save most. Some requests
decode one token; the others prefill a chunk of any length after their cache hit (a
long prefill query, a member that has computed fewer blocks than the others of its
group), some of them after a hit on a holder's blocks that no other scheduled request
holds, or having computed fewer of the blocks they hold alike with others (loading or
computing them). 0-3 requests more hold blocks without being scheduled (the
correctness trap in DESIGN.md). workload.random_step's batches (one level of prompts
under an optional root) never reach such trees.

Every plan of the six planners of test_serving_differential, and of two more with room
for 32 groups, must pass serving_sim.check_plan, hold no more groups than the planner's
max_groups (none without groups), have a groups level that saves more than its call and
merges cost (by the cost model's own formulas), and be planned again alike (from the
planner's memo); those where every level pays (caps of 8 and 32) must pass
serving_sim.check_complete, those with a merge cost (default cap and 32)
serving_sim.check_left_out. The planners are fresh for each batch.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from tests.attention import serving_sim as sim
from tests.attention.test_serving_differential import (
    ALWAYS,
    HEAD_DIM,
    MERGING,
    NUM_Q_HEADS,
    SHAPE,
    TOGETHER,
    _plan_fields,
)
from tests.attention.workload import _admit

PAGES = (4, 8, 16, 64, 256, 1024)
MERGE_PER_QUERY = MERGING.cost_bytes(1, NUM_Q_HEADS, HEAD_DIM)
NUM_SEEDS = 300

# (planner, check_complete, check_left_out)
PLANNERS = [
    (dict(cost_model=ALWAYS, max_groups=2, page_buckets=PAGES), False, False),
    (dict(cost_model=ALWAYS, max_groups=8), True, False),
    (dict(backend="xla", page_buckets=PAGES), False, False),
    (dict(cost_model=ALWAYS, enable_groups=False), False, False),
    (dict(cost_model=TOGETHER), False, False),
    (dict(cost_model=MERGING), False, True),
    (dict(cost_model=ALWAYS, max_groups=32), True, False),
    (dict(cost_model=MERGING, max_groups=32), False, True),
]


def _tree(
    rng: np.random.Generator, bs: int, depth: int, base: int, wide: bool = False
) -> tuple[list, list]:
    """(segment tokens, child trees) of a tree `depth` levels under its root segment: 1-4
    blocks (sometimes part of one more) over 0-3 children a node, or for a `wide` tree a
    root of one block (a header) over 8-10 children; every segment draws its tokens from
    a range of its own."""
    blocks = 1 if wide else int(rng.integers(1, 5))
    size = blocks * bs + (int(rng.integers(bs)) if rng.random() < 0.2 else 0)
    segment = rng.integers(base, base + 1000, size).tolist()
    num_kids = int(rng.integers(*((8, 11) if wide else (0, 4)))) if depth else 0
    return segment, [_tree(rng, bs, depth - 1, base + 7000 * (i + 1)) for i in range(num_kids)]


def _path(rng: np.random.Generator, node: tuple[list, list]) -> list:
    """The tokens of a random path from `node` down (stopping early a quarter of the
    time at each node with children)."""
    segment, kids = node
    if kids and rng.random() < 0.75:
        return segment + _path(rng, kids[int(rng.integers(len(kids)))])
    return list(segment)


def tree_batch(seed: int) -> tuple[KVCacheManager, types.SimpleNamespace]:
    """(manager, scheduled batch as the planners and the oracles read it) of `seed`:
    2-32 scheduled requests and 0-3 unscheduled holders under one or two trees 2-4
    segments deep, blocks of 1, 2 or 4 tokens."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 2, 4]))
    manager = KVCacheManager(1024, bs, max_model_len=1024)  # at most 177 used (seeds < 4000)
    # Many children under a root and more requests, mostly decoding: over 8 groups.
    wide = rng.random() < 0.3
    decoding = 0.9 if wide else 0.6  # the share of scheduled requests decoding
    roots = [
        _tree(rng, bs, int(rng.integers(1, 4)), 10_000 * (r + 1), wide)
        for r in range(1 if wide else int(rng.integers(1, 3)))
    ]
    ids, computed, query = [], [], []
    num_scheduled = int(rng.integers(24 if wide else 2, 33))
    num_holders = int(rng.integers(0, 4))
    total = num_scheduled + num_holders
    holders = set(rng.choice(total, num_holders, replace=False).tolist())
    held = []  # the prompts of the holders so far
    for i in range(total):
        segment, kids = root = roots[int(rng.integers(len(roots)))]
        if wide:  # the header, then one of the system prompts under it
            prefix = segment + _path(rng, kids[int(rng.integers(len(kids)))])
        else:
            prefix = _path(rng, root) if rng.random() < 0.9 else []
        own = int(rng.integers(1, 2 * bs + 1))
        if i in holders:  # a finished request: its output too
            own += int(rng.integers(0, 4 * bs))
        rehit = i not in holders and held and rng.random() < 0.2
        if rehit:  # a holder's prompt again: a hit on blocks no scheduled request holds
            prefix, own = held[int(rng.integers(len(held)))], int(rng.integers(1, 8 * bs + 1))
        request = Request(f"r{i}", prefix + rng.integers(100_000, 200_000, own).tolist())
        if i in holders or (not rehit and rng.random() < decoding):
            # Fully computed: a holder, or a scheduled request decoding one token.
            _admit(manager, request)
            request.num_computed_tokens = request.num_tokens
            if i in holders:
                held.append(list(request.all_token_ids))
                continue
            request.append_output_token_ids([int(rng.integers(0, 1000))])
            assert manager.allocate_slots(request, 1) is not None
            ids.append(request.request_id)
            computed.append(request.num_tokens - 1)
            query.append(1)
        else:  # a prefill chunk of any length after its cache hit
            _, hit = manager.get_computed_blocks(request)
            chunk = int(rng.integers(1, request.num_tokens - hit + 1))
            _admit(manager, request, chunk)
            # Sometimes it has computed fewer of the blocks it holds alike with others
            # (loading or computing them): it cuts their groups short.
            done = int(rng.integers(hit)) if hit and rng.random() < 0.2 else hit
            ids.append(request.request_id)
            computed.append(done)
            query.append(hit - done + chunk)
    out = types.SimpleNamespace(
        request_ids=ids,
        num_computed_tokens=np.array(computed),
        num_scheduled_tokens=np.array(query),
        num_requests=len(ids),
    )
    return manager, out


def _groups_pay(out, plan, model: CascadeCostModel, bs: int) -> bool:
    """Whether the plan's groups level (if any) saves more bytes than its call and its
    merge of the groups' queries cost, by the cost model's saved_bytes and cost_bytes."""
    if not plan.levels or plan.levels[-1].name != "groups":
        return True
    level, saved, queries = plan.levels[-1], 0, 0
    for g in range(level.num_groups):
        members = plan.order[level.group_starts[g] : level.group_ends[g]]
        prefix = int(level.block_ends[g] - level.block_starts[g]) * bs
        saved += model.saved_bytes(len(members), prefix, SHAPE.kv_bytes_per_token)
        queries += int(out.num_scheduled_tokens[members].sum())
    return saved > model.cost_bytes(queries, NUM_Q_HEADS, HEAD_DIM)


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_plans_of_prefix_tree_batches_pass_the_oracles(seed):
    manager, out = tree_batch(seed)
    for k, (options, complete, left_out) in enumerate(PLANNERS):
        planner = CascadePlanner(SHAPE, **options)
        plan = planner.plan(out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens,
                            manager)  # fmt: skip
        sim.check_plan(manager, out, plan)
        cap = planner.max_groups if planner.enable_groups else 0  # no more groups than that
        assert all(lv.num_groups <= cap for lv in plan.levels if lv.name == "groups"), k
        assert _groups_pay(out, plan, planner.cost_model, manager.block_size), k
        if complete:
            sim.check_complete(manager, out, plan, planner.max_groups)
        if left_out:
            sim.check_left_out(manager, out, plan, MERGE_PER_QUERY, SHAPE.kv_bytes_per_token)
        # Asked again, the planner answers from its memo: the same plan.
        again = planner.plan(out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens,
                             manager)  # fmt: skip
        assert _plan_fields(again) == _plan_fields(plan), k


def _nesting(blocks: list[list[int]], members, computed: list[int], column: int) -> int:
    """How deep runs (serving_sim._runs: candidate groups of check_complete) nest among
    `members` past `column`."""
    depth = 0
    for run in sim._runs(blocks, members, computed, column):
        rows = [blocks[i] for i in run]
        shared = column + 1
        while all(len(r) > shared for r in rows) and len({r[shared] for r in rows}) == 1:
            shared += 1
        end = min(shared, *(computed[i] for i in run))
        depth = max(depth, 1 + _nesting(blocks, run, computed, end))
    return depth


def test_the_seeds_reach_deep_trees_many_groups_and_left_out_requests():
    # From block ids and counts alone: what the seeds above are for.
    seen = dict.fromkeys(("global", "4 deep", "over 8 groups", "left out", "probed"), 0)
    for seed in range(NUM_SEEDS):
        manager, out = tree_batch(seed)
        ids, bs = out.request_ids, manager.block_size
        blocks = [manager.block_ids(r) for r in ids]
        computed = [int(n) // bs for n in out.num_computed_tokens]
        k0 = min(sim.brute_common_prefix(manager, ids), min(computed))
        want = []
        for members in sim._runs(blocks, range(len(ids)), computed, k0):
            want += sim._best_groups(manager, ids, blocks, members, computed, k0)[1]
        left = sim.left_out_requests(manager, out, MERGE_PER_QUERY, SHAPE.kv_bytes_per_token)
        merge_blocks = out.num_scheduled_tokens * MERGE_PER_QUERY // (bs * SHAPE.kv_bytes_per_token)
        seen["global"] += k0 > 0
        seen["4 deep"] += _nesting(blocks, range(len(ids)), computed, k0) >= 4
        seen["over 8 groups"] += len(want) > 8
        seen["left out"] += bool(left)
        # left out for sharing fewer blocks with the others than it has computed
        seen["probed"] += any(computed[i] > merge_blocks[i] for i in left)
    assert min(seen.values()) >= 5, seen


def test_check_plan_catches_a_leader_row_or_rows_of_other_requests():
    # A groups level reads its blocks from the leader row, each batch position's own pass
    # from its row: a plan naming another request's row there reads foreign KV.
    manager, out = tree_batch(0)
    plan = CascadePlanner(SHAPE, cost_model=ALWAYS).plan(
        out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens, manager
    )
    sim.check_plan(manager, out, plan)
    level = plan.levels[-1]
    g = int(np.argmax(level.block_ends))  # the group over most blocks
    table, b0, b1 = manager.block_table, int(level.block_starts[g]), int(level.block_ends[g])
    leaders = level.leader_rows.copy()
    leaders[g] = next(r for r in plan.rows if (table[r, b0:b1] != table[leaders[g], b0:b1]).any())
    wrong = dataclasses.replace(level, leader_rows=leaders)
    with pytest.raises(AssertionError):
        sim.check_plan(manager, out, dataclasses.replace(plan, levels=(*plan.levels[:-1], wrong)))
    with pytest.raises(AssertionError):
        sim.check_plan(manager, out, dataclasses.replace(plan, rows=plan.rows[::-1].copy()))
