"""Padding never changes results: every padded metadata entry poisoned, outputs unchanged.

The builder fills padding with harmless values (the null block, zero lengths, repeated
offsets). Here every entry attention must not read is replaced by an adversarial one:
page-table entries past each row's pages (and every entry of rows past num_seqs or of a
cascade level's gaps) point at other requests' blocks, lengths and offsets past num_seqs
are garbage, and every KV slot no valid query may see, padded query rows included, holds
NaN. Valid rows must still equal the dense oracle over each request's whole context.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import paged_attention
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlanner
from jaxkv.step_inputs import coarsen_metadata
from tests.attention import workload

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 1, 16, 4, 128
SM_SCALE = HEAD_DIM**-0.5
MAX_TOKENS, MAX_GROUPS = 128, 2
BUCKETS = BucketConfig(
    max_num_tokens=MAX_TOKENS, max_num_seqs=8, max_pages_per_seq=16, max_cascade_groups=MAX_GROUPS,
    min_num_tokens=MAX_TOKENS, min_num_seqs=8, min_pages_per_seq=16,
)  # fmt: skip
SHAPE = AttentionShape(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, kv_itemsize=4)
ALWAYS = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0)


def _poison_rows(cu_q_lens, kv_lens, page_indices, num_seqs, rng):
    """Copies of one pass's arrays with every entry past the valid ones made adversarial:
    pages past ceil(kv_len / block_size) of each row, and all of rows past num_seqs, hold
    random real block ids; rows past num_seqs get the longest length and unsorted offsets."""
    n = int(num_seqs[0])
    cu, kv, pages = (np.array(a, np.int32) for a in (cu_q_lens, kv_lens, page_indices))
    used = -(-kv // BLOCK_SIZE)
    used[n:] = 0
    pad = np.arange(pages.shape[1])[None, :] >= used[:, None]
    pages[pad] = rng.integers(1, NUM_BLOCKS, int(pad.sum()))
    kv[n:] = pages.shape[1] * BLOCK_SIZE
    cu[n + 1 :] = np.resize([MAX_TOKENS, 0], len(cu) - n - 1)
    return cu, kv, pages


def poison_metadata(md, rng):
    cu, kv, pages = _poison_rows(md.cu_q_lens, md.kv_lens, md.page_indices, md.num_seqs, rng)
    levels = []
    for lv in md.levels:
        lcu, lkv, lpages = _poison_rows(lv.cu_q_lens, lv.kv_lens, lv.page_indices, lv.num_seqs, rng)
        levels.append(dataclasses.replace(lv, cu_q_lens=lcu, kv_lens=lkv, page_indices=lpages))
    return dataclasses.replace(
        md, cu_q_lens=cu, kv_lens=kv, page_indices=pages, levels=tuple(levels)
    )


def poisoned_kv(step: workload.Step, rng) -> np.ndarray:
    """f32[NUM_BLOCKS, BLOCK_SIZE, 2 * Hkv, D]: NaN in every slot outside the context of
    the scheduled requests (unused and null blocks, tails of last blocks, holders' own)."""
    visible = np.zeros((NUM_BLOCKS, BLOCK_SIZE), bool)
    for rid, computed, q_len in zip(
        step.request_ids, step.num_computed_tokens, step.query_lens, strict=True
    ):
        context = np.arange(int(computed + q_len))
        blocks = np.asarray(step.manager.block_ids(rid))
        visible[blocks[context // BLOCK_SIZE], context % BLOCK_SIZE] = True
    kv = rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, 2 * NUM_KV_HEADS, HEAD_DIM))
    kv[~visible] = np.nan
    return kv.astype(np.float32)


def _planned(seed: int, planner: CascadePlanner):
    step = workload.random_step(
        seed, block_size=BLOCK_SIZE, max_requests=6, max_prompt_blocks=4,
        num_blocks=NUM_BLOCKS, max_model_len=64, common_root_blocks=2 * (seed % 3 == 0),
    )  # fmt: skip
    m = step.manager
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, m)
    md = step.metadata(plan, BUCKETS)
    # One program per level structure: every static bound at its largest.
    md = coarsen_metadata(md, (MAX_TOKENS,), BUCKETS.level_seq_buckets[-1])
    return step, plan, md


def _attend(q, kv, md) -> np.ndarray:
    return np.asarray(paged_attention(jnp.asarray(q), jnp.asarray(kv), md, sm_scale=SM_SCALE))


@pytest.mark.parametrize(
    "planner",
    [
        CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=MAX_GROUPS),
        CascadePlanner(SHAPE, enable_cascade=False),
    ],
    ids=["cascade", "flat"],
)
def test_poisoned_padding_leaves_valid_rows_equal_to_the_oracle(planner):
    structures = set()
    for seed in range(12):
        step, plan, md = _planned(seed, planner)
        total = int(step.query_lens.sum())
        if total > MAX_TOKENS:
            continue
        structures.add(tuple(lv.name for lv in plan.levels))
        rng = np.random.default_rng(seed)
        kv = poisoned_kv(step, rng)
        q = rng.standard_normal((MAX_TOKENS, NUM_Q_HEADS, HEAD_DIM)).astype(np.float32)
        q[total:] = np.nan
        want = workload.dense_oracle(step, plan.order, q, kv, SM_SCALE)
        clean = _attend(q, kv, md)[:total]
        poisoned = _attend(q, kv, poison_metadata(md, rng))[:total]
        np.testing.assert_allclose(clean, want, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(poisoned, clean, atol=1e-6, rtol=1e-6)
    if planner.enable_cascade:
        assert {("global", "groups"), ("groups",)} <= structures, structures
    else:
        assert structures == {()}


def test_poisoning_a_valid_entry_is_seen():
    # The same comparison catches a poison that reaches one valid page-table entry.
    step, plan, md = _planned(0, CascadePlanner(SHAPE, enable_cascade=False))
    total = int(step.query_lens.sum())
    rng = np.random.default_rng(0)
    kv = poisoned_kv(step, rng)
    q = rng.standard_normal((MAX_TOKENS, NUM_Q_HEADS, HEAD_DIM)).astype(np.float32)
    clean = _attend(q, kv, md)[:total]
    bad = poison_metadata(md, rng)
    pages = bad.page_indices.copy()
    pages[0, 0] = next(b for b in range(1, NUM_BLOCKS) if b != pages[0, 0])
    bad = dataclasses.replace(bad, page_indices=pages)
    got = _attend(q, kv, bad)[:total]
    assert not np.allclose(got, clean, atol=1e-6, rtol=1e-6, equal_nan=False)
