"""Cascade level metadata against a plain-loop reference that reads the manager's block ids.

LevelMetadata's layout: one sequence per group of the level, holding every query token
of the group's members (in batch order) and the group's shared blocks; one empty
sequence (kv_len 0, no pages) for each run of tokens before or between groups; tokens
after the last group belong to no sequence. The reference builds that layout walking
the batch token by token and the shared columns block by block, reading block ids from
KVCacheManager.block_ids of every member (never the host block table nor the level's
leader row), so it shares no paging logic with jaxkv.batch.

Compared: num_seqs, the valid rows of cu_q_lens and kv_lens, and every entry of
page_indices (padded page-table entries hold the null block 0, a documented
guarantee); max_q_len and the padded sizes only as bounds drawn from the buckets.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv.batch import AttentionMetadata, LevelMetadata
from jaxkv.buckets import BucketConfig, padded_size
from jaxkv.cascade import CascadeLevel, CascadePlan, CascadePlanner
from jaxkv.level_metadata import table_slice
from tests.attention import workload
from tests.attention.test_metadata_reference import ALWAYS, SHAPE, _build, _decode_only, _mismatches
from tests.attention.test_paged_attention import buckets_for

_NO_SEQUENCE = object()  # the label before the first batch position: no sequence yet


def _shared_blocks(step: workload.Step, plan: CascadePlan, level: CascadeLevel, g: int) -> list:
    """Block ids of group g's shared columns, one block at a time; every member must hold
    the same ones (else the plan itself is wrong)."""
    members = [
        step.request_ids[int(plan.order[i])]
        for i in range(int(level.group_starts[g]), int(level.group_ends[g]))
    ]
    blocks = []
    for col in range(int(level.block_starts[g]), int(level.block_ends[g])):
        block = step.manager.block_ids(members[0])[col]
        for rid in members[1:]:
            assert step.manager.block_ids(rid)[col] == block, (rid, col)
        blocks.append(block)
    return blocks


def level_reference(step: workload.Step, plan: CascadePlan, level: CascadeLevel) -> dict:
    """Per valid sequence of the level: its query tokens, kv_len and pages (lists)."""
    bs = step.manager.block_size
    group_of = {}
    for g in range(level.num_groups):
        for i in range(int(level.group_starts[g]), int(level.group_ends[g])):
            group_of[i] = g
    last = int(level.group_ends.max())
    q_lens, kv_lens, pages = [], [], []
    label = _NO_SEQUENCE
    for i, s in enumerate(plan.order.tolist()[:last]):
        g = group_of.get(i)  # None: a position between groups
        if g != label:  # a new sequence: the next group, or a gap
            label = g
            q_lens.append(0)
            kv_lens.append(0)
            pages.append([])
            if g is not None:
                for block in _shared_blocks(step, plan, level, g):
                    pages[-1].append(block)
                    kv_lens[-1] += bs
        for _ in range(int(step.query_lens[s])):
            q_lens[-1] += 1
    return dict(q_lens=q_lens, kv_lens=kv_lens, pages=pages)


def level_mismatches(
    step: workload.Step, plan: CascadePlan, level: CascadeLevel, md: LevelMetadata,
    buckets: BucketConfig,
) -> list[str]:  # fmt: skip
    """Names of md's fields that disagree with the reference (or break a bucket bound)."""
    ref = level_reference(step, plan, level)
    n = len(ref["q_lens"])
    bad = []
    if md.num_seqs.tolist() != [n]:
        return ["num_seqs"]
    rows, width = md.page_indices.shape
    if md.cu_q_lens.shape != (rows + 1,) or md.kv_lens.shape != (rows,) or rows < n:
        return ["shapes"]
    if rows not in buckets.level_seq_buckets or width not in buckets.page_buckets:
        bad.append("shapes")
    cu = np.concatenate([[0], np.cumsum(ref["q_lens"])])
    if not np.array_equal(md.cu_q_lens[: n + 1], cu):
        bad.append("cu_q_lens")
    if not np.array_equal(md.kv_lens[:n], ref["kv_lens"]):
        bad.append("kv_lens")
    want_pages = np.zeros((rows, max(width, *map(len, ref["pages"]))), np.int64)
    for k, blocks in enumerate(ref["pages"]):
        want_pages[k, : len(blocks)] = blocks
    if want_pages.shape[1] > width or not np.array_equal(md.page_indices, want_pages):
        bad.append("page_indices")
    if md.max_q_len < max(ref["q_lens"]) or md.max_q_len not in buckets.q_len_buckets:
        bad.append("max_q_len")
    return bad


def all_level_mismatches(
    step: workload.Step, plan: CascadePlan, md: AttentionMetadata
) -> list[tuple[int, str]]:
    buckets = buckets_for(step.manager.block_size)
    assert md.num_levels == plan.num_levels
    return [
        (k, name)
        for k, (level, level_md) in enumerate(zip(plan.levels, md.levels, strict=True))
        for name in level_mismatches(step, plan, level, level_md, buckets)
    ]


def _step(seed: int, root: bool, decode_only: bool) -> workload.Step:
    step = workload.random_step(seed, block_size=(4, 8)[seed % 2], common_root_blocks=2 * root)
    return _decode_only(step) if decode_only else step


def _plan(step: workload.Step) -> CascadePlan:
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    return planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)


@pytest.mark.parametrize("seed", range(20))
def test_level_metadata_equals_the_reference(seed):
    for root in (False, True):
        for decode_only in (False, True):
            step = _step(seed, root, decode_only)
            plan = _plan(step)
            md = _build(step, plan, step.manager.block_table)
            assert all_level_mismatches(step, plan, md) == [], (root, decode_only)


def test_the_random_levels_cover_groups_levels_and_loose_requests():
    plans = [_plan(_step(seed, root, d)) for seed in range(20) for root in (0, 1) for d in (0, 1)]
    assert sum(p.num_levels == 2 for p in plans) >= 5
    assert sum(p.num_levels and p.levels[-1].num_groups >= 3 for p in plans) >= 3
    # A request in no group: its tokens lie past the last sequence of the groups level.
    assert sum(p.num_levels and p.levels[-1].group_ends.max() < len(p.order) for p in plans) >= 5


def with_gaps(plan: CascadePlan) -> CascadePlan:
    """The same plan with requests of no group moved before and between the groups
    (g + 1 of them before group g while they last), the rest after the last group.

    Still a valid CascadePlan: each group keeps its members, blocks and leader and stays
    contiguous, suffix_start_blocks and rows move with their requests, and a global level
    (if any) spans the whole batch either way. The planner never lays a batch out so
    (its groups start at position 0), so this is how the gap path of the builder runs.
    """
    groups = plan.levels[-1]
    assert groups.name == "groups"
    grouped = [
        list(range(s, e)) for s, e in zip(groups.group_starts, groups.group_ends, strict=True)
    ]
    loose = sorted(set(range(len(plan.order))) - {i for m in grouped for i in m})
    units = []
    for g, members in enumerate(grouped):
        units += [[i] for i in loose[: g + 1]]
        del loose[: g + 1]
        units.append(members)
    units += [[i] for i in loose]
    moved = np.concatenate(units).astype(np.int32)  # new position -> old position
    starts = np.cumsum([0] + [len(u) for u in units])
    group_units = [k for k, u in enumerate(units) if u in grouped]
    new_groups = dataclasses.replace(
        groups,
        group_starts=starts[group_units].astype(np.int32),
        group_ends=starts[np.add(group_units, 1)].astype(np.int32),
    )
    return dataclasses.replace(
        plan,
        order=plan.order[moved],
        rows=plan.rows[moved],
        suffix_start_blocks=plan.suffix_start_blocks[moved],
        levels=(*plan.levels[:-1], new_groups),
        keeps_order=False,
    )


def gap_plans(count: int) -> list[tuple[workload.Step, CascadePlan]]:
    """Steps whose plan gets a gap before the first group and between the first two."""
    found = []
    for seed in range(100):
        for root in (False, True):
            step = _step(seed, root, False)
            plan = _plan(step)
            if not plan.levels or plan.levels[-1].name != "groups":
                continue
            level = plan.levels[-1]
            if level.num_groups >= 2 and len(plan.order) - level.group_ends.max() >= 3:
                found.append((step, with_gaps(plan)))
                if len(found) == count:
                    return found
    raise AssertionError("too few seeds with two groups and three loose requests")


def test_gaps_before_and_between_groups_become_empty_sequences():
    for step, plan in gap_plans(4):
        level = plan.levels[-1]
        assert level.group_starts[0] == 1 and level.group_starts[1] - level.group_ends[0] == 2
        md = _build(step, plan, step.manager.block_table)
        assert all_level_mismatches(step, plan, md) == []
        assert _mismatches(step, plan, md) == []  # the main pass, requests moved or not
        ref = level_reference(step, plan, level)
        # gap (one request), group 0, gap (two requests), group 1, ...
        assert ref["kv_lens"][0] == 0 and ref["kv_lens"][2] == 0
        assert ref["q_lens"][0] == step.query_lens[plan.order[0]]
        assert ref["q_lens"][2] == step.query_lens[plan.order[level.group_ends[0] :][:2]].sum()


def test_a_level_with_a_gap_before_every_group_fills_the_largest_sequence_bucket():
    # G groups each after a gap are 2G sequences (a trailing gap is none), so buckets for
    # max_cascade_groups=G end at 2G and such a level fills the last one exactly.
    found = 0
    for step, plan in gap_plans(4):
        level = plan.levels[-1]
        ref = level_reference(step, plan, level)
        num_groups = level.num_groups
        if len(ref["kv_lens"]) != 2 * num_groups:
            continue  # some group has no gap before it
        buckets = dataclasses.replace(
            buckets_for(step.manager.block_size), max_cascade_groups=num_groups
        )
        md = step.metadata(plan, buckets)
        assert md.levels[-1].page_indices.shape[0] == buckets.level_seq_buckets[-1]
        assert buckets.level_seq_buckets[-1] == 2 * num_groups
        assert level_mismatches(step, plan, level, md.levels[-1], buckets) == []
        found += 1
    assert found >= 3


def _broken(
    kind: str, step: workload.Step, plan: CascadePlan
) -> tuple[int, str, AttentionMetadata]:
    """(level, field the check must name, metadata with one deliberate error)."""
    k = plan.num_levels - 1
    level = plan.levels[k]
    table = step.manager.block_table
    md = _build(step, plan, table)
    lmd = md.levels[k]
    # The builder refuses a hand-made plan whose group does not hold the leader's blocks
    # (test_metadata_argument_checks), so these two edit the level metadata it built.
    first = int(np.flatnonzero(lmd.kv_lens)[0])  # group 0's level sequence
    start, end = int(level.block_starts[0]), int(level.block_ends[0])
    pages = lmd.page_indices.copy()
    if kind == "shuffled block":  # the leader row's first shared block swapped with the next
        row = int(level.leader_rows[0])
        pages[first, 0] = table[row, start + 1]
        if end - start > 1:
            pages[first, 1] = table[row, start]
    if kind == "wrong leader row":  # a row that does not hold the group's blocks
        others = np.setdiff1d(plan.rows, plan.rows[level.group_starts[0] : level.group_ends[0]])
        pages[first, : end - start] = table[others[0], start:end]
    if kind in ("shuffled block", "wrong leader row"):
        lmd = dataclasses.replace(lmd, page_indices=pages)
        return k, "page_indices", dataclasses.replace(md, levels=(*md.levels[:-1], lmd))
    if kind == "kv_len off by one":
        kv_lens = lmd.kv_lens.copy()
        kv_lens[0] += 1
        lmd, field = dataclasses.replace(lmd, kv_lens=kv_lens), "kv_lens"
    else:  # "token in the next sequence": the group's last token moved into the next one
        cu = lmd.cu_q_lens.copy()
        cu[1] -= 1
        lmd, field = dataclasses.replace(lmd, cu_q_lens=cu), "cu_q_lens"
    return k, field, dataclasses.replace(md, levels=(*md.levels[:-1], lmd))


BREAKAGES = [
    "shuffled block",
    "wrong leader row",
    "kv_len off by one",
    "token in the next sequence",
]


@pytest.mark.parametrize("kind", BREAKAGES)
def test_a_broken_level_is_caught(kind):
    # Seed 0 with a root: a global level, then three groups that cover the batch.
    step = _step(0, True, False)
    plan = _plan(step)
    assert plan.num_levels == 2 and plan.levels[-1].num_groups == 3
    level, field, md = _broken(kind, step, plan)
    assert all_level_mismatches(step, plan, md) == [(level, field)]


def test_levels_take_the_smallest_buckets_that_fit():
    # buckets_for has one page bucket; here every axis doubles from 1, so a level's page
    # width and query bound are each the smallest bucket holding its longest group.
    fine = BucketConfig(
        max_num_tokens=512, max_num_seqs=16, max_pages_per_seq=64,
        min_num_tokens=1, min_num_seqs=1, min_pages_per_seq=1,
    )  # fmt: skip
    widths = set()
    for seed in range(12):
        step = _step(seed, seed % 2 == 1, False)
        plan = _plan(step)
        md = step.metadata(plan, fine)
        for level, lmd in zip(plan.levels, md.levels, strict=True):
            assert level_mismatches(step, plan, level, lmd, fine) == []
            ref = level_reference(step, plan, level)
            longest_pages = max(map(len, ref["pages"]))
            assert lmd.page_indices.shape[1] == padded_size(fine.page_buckets, longest_pages)
            assert lmd.max_q_len == padded_size(fine.q_len_buckets, max(ref["q_lens"]))
            pages = sorted({padded_size(fine.page_buckets, len(p)) for p in ref["pages"] if p})
            widths.add(tuple(pages))
    # Some level holds groups of more than one page bucket: the width must follow the longest.
    assert any(len(w) > 1 for w in widths), widths


def test_table_slice_reads_up_to_the_tables_last_column_and_pads_past_it_with_0():
    # A table of 4 rows and 6 columns: a slice from column 3 of row 2, 4 wide, reads
    # columns 3..5 and pads the column past the table; col_ends cut each row's slice.
    table = np.arange(1, 25, dtype=np.int32).reshape(4, 6)
    rows, starts = np.array([2, 0]), np.array([3, 0])
    got = table_slice(table, rows, starts, 4)
    assert got.tolist() == [[16, 17, 18, 0], [1, 2, 3, 4]] and got.dtype == np.int32
    got = table_slice(table, rows, starts, 4, np.array([5, 2]))
    assert got.tolist() == [[16, 17, 0, 0], [1, 2, 0, 0]]
