"""A cascade level past its buckets is refused with a ValueError naming the level and what
overflowed (its sequences or its pages), not a bare "n=... exceeds the largest bucket"."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade_plan import CascadePlan, make_level
from tests.attention.test_cascade_planner import _decoding

SHARED = list(range(100, 120))  # 5 blocks of 4


def _build(m, ids, level, suffix_start, buckets):
    rows = m.rows_of(ids)
    n = len(ids)
    plan = CascadePlan(np.arange(n, dtype=np.int32), rows, suffix_start, (level,), 0)
    computed = np.array([m.num_blocks_of([i])[0] * 4 - 3 for i in ids])  # one decode token
    return build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=np.ones(n, np.int32),
        num_computed_tokens=computed, block_size=4, buckets=buckets,
    )  # fmt: skip


def test_a_level_with_more_sequences_than_its_buckets_is_refused_by_name():
    # max_cascade_groups=1: a level holds at most 2 sequences (a group and a gap).
    m = KVCacheManager(64, 4, max_model_len=64)
    ids = [f"r{i}" for i in range(3)]
    for i, rid in enumerate(ids):
        _decoding(m, rid, [10 * i + j for j in range(8)])
    rows = m.rows_of(ids)
    one_each = make_level("groups", [0, 1, 2], [1, 2, 3], [0] * 3, [1] * 3, rows.tolist())
    suffix = np.ones(3, np.int32)
    buckets = BucketConfig(8, 4, 16, max_cascade_groups=1)
    fits = BucketConfig(8, 4, 16, max_cascade_groups=2)  # 4 sequences: the three fit
    assert int(_build(m, ids, one_each, suffix, fits).levels[0].num_seqs[0]) == 3
    with pytest.raises(ValueError, match="sequences of cascade level 'groups'=3 exceeds"):
        _build(m, ids, one_each, suffix, buckets)


def test_a_level_over_more_pages_than_its_buckets_is_refused_by_name():
    # Page buckets (4,): the main pass reads one or two blocks past the shared five.
    m = KVCacheManager(64, 4, max_model_len=64)
    ids = ["a", "b"]
    for i, rid in enumerate(ids):
        _decoding(m, rid, SHARED + [i, i])
    rows = m.rows_of(ids)
    level = make_level("global", [0], [2], [0], [5], [int(rows[0])])
    suffix = np.full(2, 5, np.int32)
    buckets = BucketConfig(max_num_tokens=8, max_num_seqs=4, max_pages_per_seq=4)
    wide = BucketConfig(8, 4, 8)
    assert _build(m, ids, level, suffix, wide).levels[0].page_indices.shape == (1, 8)
    with pytest.raises(ValueError, match="pages of cascade level 'global'=5 exceeds"):
        _build(m, ids, level, suffix, buckets)
