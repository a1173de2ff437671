"""build_attention_metadata against a plain-loop reference that reads the manager's block ids.

The reference walks each scheduled request token by token and block by block, reading
block ids from KVCacheManager.block_ids (never the host block table the builder slices),
so it shares no paging logic with the builder. Mixed prefill/decode and decode-only
batches, flat and cascade plans; a shuffled block table must be caught by the same check.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import KVCacheManager, batch
from jaxkv.batch import AttentionMetadata, build_attention_metadata
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlan, CascadePlanner
from tests.attention import workload
from tests.attention.test_cascade_planner import _decoding
from tests.attention.test_paged_attention import buckets_for

SHAPE = AttentionShape(4, 2, 16, kv_itemsize=4)
ALWAYS = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0)


def _reference(step: workload.Step, plan: CascadePlan, md: AttentionMetadata) -> dict:
    """The main pass's arrays, padded to md's shapes, built one token and block at a time."""
    bs = step.manager.block_size
    num_tokens, num_seqs = md.max_num_tokens, md.max_num_seqs
    width = md.page_indices.shape[1]
    ref = dict(
        positions=np.zeros(num_tokens, np.int64),
        slot_mapping=np.zeros(num_tokens, np.int64),
        logits_indices=np.zeros(num_seqs, np.int64),
        cu_q_lens=np.zeros(num_seqs + 1, np.int64),
        kv_lens=np.zeros(num_seqs, np.int64),
        page_indices=np.zeros((num_seqs, width), np.int64),
    )
    t = 0
    for i, s in enumerate(plan.order.tolist()):
        blocks = step.manager.block_ids(step.request_ids[s])
        computed, n = int(step.num_computed_tokens[s]), int(step.query_lens[s])
        first = int(plan.suffix_start_blocks[i])
        for pos in range(computed, computed + n):
            ref["positions"][t] = pos
            ref["slot_mapping"][t] = blocks[pos // bs] * bs + pos % bs
            t += 1
        ref["logits_indices"][i] = t - 1
        ref["cu_q_lens"][i + 1] = t
        ref["kv_lens"][i] = computed + n - first * bs
        for j, block in enumerate(blocks[first : first + width]):
            ref["page_indices"][i, j] = block
    ref["cu_q_lens"][len(plan.order) + 1 :] = t
    return ref


def _build(step: workload.Step, plan: CascadePlan, block_table: np.ndarray) -> AttentionMetadata:
    return build_attention_metadata(
        block_table=block_table,
        plan=plan,
        query_lens=step.query_lens[plan.order],
        num_computed_tokens=step.num_computed_tokens[plan.order],
        block_size=step.manager.block_size,
        buckets=buckets_for(step.manager.block_size),
    )


def _mismatches(step: workload.Step, plan: CascadePlan, md: AttentionMetadata) -> list[str]:
    ref = _reference(step, plan, md)
    bad = [k for k, v in ref.items() if not np.array_equal(getattr(md, k), v)]
    if int(md.num_seqs[0]) != len(plan.order):
        bad.append("num_seqs")
    return bad


def _decode_only(step: workload.Step) -> workload.Step:
    """The same requests each computing only their last scheduled token."""
    last = step.num_computed_tokens + step.query_lens - 1
    return workload.Step(step.manager, step.request_ids, last, np.ones_like(step.query_lens))


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("decode_only", [False, True])
@pytest.mark.parametrize("cascade", [False, True])
def test_metadata_equals_the_reference(seed, decode_only, cascade):
    step = workload.random_step(
        seed, block_size=(4, 8)[seed % 2], common_root_blocks=2 * (seed % 3 == 0)
    )
    if decode_only:
        step = _decode_only(step)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS, enable_cascade=cascade)
    m = step.manager
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, m)
    md = _build(step, plan, m.block_table)
    assert _mismatches(step, plan, md) == []


def test_a_shuffled_block_table_is_caught():
    step = _decode_only(workload.random_step(3, block_size=4))
    m = step.manager
    planner = CascadePlanner(SHAPE, enable_cascade=False)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, m)
    table = m.block_table.copy()
    # The first and last block of the longest row swapped: every token still lies in a
    # held block (the builder's own check passes), but in the wrong one.
    held = m.num_blocks_of(step.request_ids)
    row = int(m.rows_of(step.request_ids)[np.argmax(held)])
    last = int(held.max()) - 1
    assert last >= 1
    table[row, [0, last]] = table[row, [last, 0]]
    # The builder refuses a planner's plan with a table other than its manager's; as a
    # hand-made plan it builds, and the reference check must find the wrong blocks.
    with pytest.raises(ValueError, match="the plan's rows differ from its manager's"):
        _build(step, plan, table)
    hand_made = dataclasses.replace(plan, made_for=None)
    assert {"slot_mapping", "page_indices"} <= set(
        _mismatches(step, plan, _build(step, hand_made, table))
    )


def test_an_empty_query_or_reused_levels_of_another_plan_are_refused():
    step = workload.random_step(1, block_size=4, common_root_blocks=2)
    m = step.manager
    plan = CascadePlanner(SHAPE, cost_model=ALWAYS).plan(
        step.request_ids, step.num_computed_tokens, step.query_lens, m
    )
    assert plan.levels
    md = _build(step, plan, m.block_table)
    args = dict(
        block_table=m.block_table,
        plan=plan,
        num_computed_tokens=step.num_computed_tokens[plan.order],
        block_size=m.block_size,
        buckets=buckets_for(m.block_size),
    )
    query_lens = step.query_lens[plan.order].copy()
    query_lens[-1] = 0  # a request with nothing scheduled would sample its neighbour's logits
    with pytest.raises(ValueError, match="query_lens"):
        build_attention_metadata(query_lens=query_lens, **args)
    with pytest.raises(ValueError, match="levels"):
        build_attention_metadata(
            query_lens=step.query_lens[plan.order], levels=md.levels[:-1], **args
        )


def test_a_decode_batch_one_past_the_shared_token_offsets_equals_the_reference(monkeypatch):
    """The decode path's shared 0..n offsets grow when a batch needs one more than they
    hold (R requests need R + 1 cumulative query offsets)."""
    step = _decode_only(workload.random_step(0, block_size=4))
    num_requests = len(step.request_ids)
    assert num_requests >= 2
    held = np.arange(num_requests, dtype=np.int32)
    held.flags.writeable = False
    monkeypatch.setattr(batch, "_IOTA", held)
    m = step.manager
    plan = CascadePlanner(SHAPE, enable_cascade=False).plan(
        step.request_ids, step.num_computed_tokens, step.query_lens, m
    )
    assert _mismatches(step, plan, _build(step, plan, m.block_table)) == []


def test_a_cascade_request_holding_its_whole_row_keeps_its_last_main_pass_page():
    """Main-pass pages of a batch whose suffix passes start at different columns include
    the last column of the block table (a request at max_model_len)."""
    m = KVCacheManager(32, 4, max_model_len=16)
    shared = list(range(100, 108))
    _decoding(m, "full", shared + list(range(7)))  # 16 tokens: every column of its row
    _decoding(m, "short", shared + [50])
    _decoding(m, "alone", list(range(200, 205)))
    ids = ["full", "short", "alone"]
    computed = np.array([15, 9, 5])
    plan = CascadePlanner(SHAPE, cost_model=ALWAYS).plan(ids, computed, np.ones(3, int), m)
    assert sorted(plan.suffix_start_blocks.tolist()) == [0, 2, 2]
    md = build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=np.ones(3, int),
        num_computed_tokens=computed[plan.order], block_size=4, buckets=buckets_for(4),
    )  # fmt: skip
    i = plan.order.tolist().index(0)
    assert md.page_indices[i, :2].tolist() == m.block_ids("full")[2:4]
