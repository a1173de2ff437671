"""Batches at, and one past, each bucket edge get the padded sizes the buckets promise.

Token, sequence and page counts exactly at a bucket keep that bucket, one more moves to
the next; max_num_seqs requests and a context of exactly max_model_len fit the largest
buckets; anything beyond is refused with a ValueError naming what overflowed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig, padded_size, pow2_buckets
from jaxkv.cascade import AttentionShape, CascadePlanner
from jaxkv.config import EngineConfig

BLOCK_SIZE, MAX_MODEL_LEN, MAX_SEQS, MAX_TOKENS = 4, 64, 8, 32
# tokens (8, 16, 32), seqs (4, 8), pages (4, 8, 16), query bounds (1, 8, 16, 32)
BUCKETS = BucketConfig(
    max_num_tokens=MAX_TOKENS, max_num_seqs=MAX_SEQS, max_pages_per_seq=MAX_MODEL_LEN // BLOCK_SIZE
)
FLAT = CascadePlanner(AttentionShape(4, 2, 16, kv_itemsize=4), enable_cascade=False)


def _metadata(contexts: list[int], query_lens: list[int]):
    """Metadata of requests holding `contexts` tokens whose last `query_lens` are scheduled,
    and the block ids each request holds, in batch order."""
    manager = KVCacheManager(160, BLOCK_SIZE, max_model_len=MAX_MODEL_LEN)
    ids = []
    for i, n in enumerate(contexts):
        request = Request(f"r{i}", list(range(1000 * i, 1000 * i + n)))
        assert manager.allocate_slots(request, n) is not None
        ids.append(request.request_id)
    computed = np.subtract(contexts, query_lens)
    query = np.asarray(query_lens)
    plan = FLAT.plan(ids, computed, query, manager)
    md = build_attention_metadata(
        block_table=manager.block_table, plan=plan, query_lens=query[plan.order],
        num_computed_tokens=computed[plan.order], block_size=BLOCK_SIZE, buckets=BUCKETS,
    )  # fmt: skip
    return md, [manager.block_ids(ids[i]) for i in plan.order.tolist()]


@pytest.mark.parametrize(
    "contexts, query_lens, want",  # want: (tokens, seqs, pages, max_q_len)
    [
        ([16] * 4, [1] * 4, (8, 4, 4, 1)),  # decode; 4 seqs and 4 pages exactly
        ([16] * 4 + [17], [1] * 5, (8, 8, 8, 1)),  # one seq and one key past
        ([16] * 4, [2] * 4, (8, 4, 4, 8)),  # 8 tokens exactly
        ([17, 16], [5, 4], (16, 4, 8, 8)),  # 9 tokens; 17 keys take 5 pages
        ([MAX_MODEL_LEN], [MAX_TOKENS], (32, 4, 16, 32)),  # the last chunk of a full request
        ([MAX_MODEL_LEN] * MAX_SEQS, [1] * MAX_SEQS, (8, 8, 16, 1)),  # full batch, full length
        ([MAX_MODEL_LEN] * MAX_SEQS, [4] * MAX_SEQS, (32, 8, 16, 8)),  # and the full budget
    ],
)
def test_sizes_at_and_just_past_each_bucket(contexts, query_lens, want):
    md, blocks = _metadata(contexts, query_lens)
    got = (md.max_num_tokens, md.max_num_seqs, md.page_indices.shape[1], md.max_q_len)
    assert got == want
    total, n = sum(query_lens), len(contexts)
    assert int(md.num_seqs[0]) == n and md.cu_q_lens[n:].tolist() == [total] * (
        md.max_num_seqs - n + 1
    )
    assert sorted(md.kv_lens[:n].tolist()) == sorted(contexts) and not md.kv_lens[n:].any()
    # Every page a request holds, also where they fill the padded width exactly; then the
    # null block.
    width = md.page_indices.shape[1]
    want = [b + [0] * (width - len(b)) for b in blocks] + [[0] * width] * (md.max_num_seqs - n)
    assert md.page_indices.tolist() == want


@pytest.mark.parametrize(
    "contexts, query_lens, match",
    [
        ([MAX_MODEL_LEN, 2], [MAX_TOKENS, 1], r"query_lens.sum\(\)=33"),
        ([2] * (MAX_SEQS + 1), [1] * (MAX_SEQS + 1), r"len\(query_lens\)=9"),
    ],
)
def test_a_batch_past_the_largest_bucket_is_refused_by_name(contexts, query_lens, match):
    with pytest.raises(ValueError, match=match):
        _metadata(contexts, query_lens)


@pytest.mark.parametrize(
    "field, value", [("min_num_tokens", 0), ("min_num_seqs", -2), ("max_num_tokens", 64.5),
                     ("max_pages_per_seq", True), ("max_cascade_groups", 0)],
)  # fmt: skip
def test_a_bad_bucket_config_is_refused_on_construction_by_name(field, value):
    sizes = dict(max_num_tokens=64, max_num_seqs=8, max_pages_per_seq=16) | {field: value}
    with pytest.raises(ValueError, match=f"{field}={value!r} must be an int >= 1"):
        BucketConfig(**sizes)


@pytest.mark.parametrize("q_len_buckets", [(1, 16.5, 512), (1, 512.0), "12", (True, 512)])
def test_q_len_buckets_must_be_ints(q_len_buckets):
    with pytest.raises(ValueError, match="q_len_buckets"):
        EngineConfig(q_len_buckets=q_len_buckets)
    assert EngineConfig(q_len_buckets=np.array([1, 512])).q_len_buckets == (1, 512)


def test_max_programs_is_the_product_of_the_bucket_counts():
    # tokens 3 x seqs 2 x pages 3 x query bounds 4 = 72 main-pass shapes; a level has
    # 4 sequence counts (1, 2, 4, 8: each of its groups and gaps holds a request, so it
    # has at most max_num_seqs=8 sequences, not 16 for 8 groups and a gap before each) x
    # 3 pages x 4 query bounds = 48 shapes.
    assert BUCKETS.max_programs(cascade=False) == 72
    assert BUCKETS.max_programs() == 72 * (1 + 48) ** 2
    assert BUCKETS.max_programs((1, 32), pad_levels=True) == 36 * (1 + 6) ** 2
    # The defaults bound a run by 1120 * 161**2 (about 3e7) shapes, each with and without
    # logprobs; the bucket options bring it down to one shape per level structure.
    assert EngineConfig().max_step_programs == 2 * 1120 * 161**2
    one_size = EngineConfig(
        min_num_tokens_bucket=512, min_num_seqs_bucket=64, min_pages_bucket=32,
        q_len_buckets=(512,), pad_cascade_levels=True,
    )  # fmt: skip
    assert one_size.max_step_programs == 2 * 4
    assert dataclasses.replace(one_size, enable_cascade=False).max_step_programs == 2 * 1


def test_pow2_buckets_double_from_the_minimum_and_end_at_the_maximum():
    assert pow2_buckets(3, 13) == (3, 6, 12, 13)
    assert pow2_buckets(4, 16) == (4, 8, 16)
    assert pow2_buckets(5, 5) == (5,)
    for minimum, maximum in ((0, 8), (-1, 8), (9, 8)):
        with pytest.raises(ValueError, match="minimum"):
            pow2_buckets(minimum, maximum)


def test_each_axis_draws_its_buckets_from_its_own_minimum():
    b = BucketConfig(
        max_num_tokens=100, max_num_seqs=20, max_pages_per_seq=40,
        min_num_tokens=16, min_num_seqs=2, min_pages_per_seq=8,
    )  # fmt: skip
    assert b.token_buckets == (16, 32, 64, 100)
    assert b.seq_buckets == (2, 4, 8, 16, 20)
    assert b.page_buckets == (8, 16, 32, 40)
    assert b.q_len_buckets == (1, 16, 32, 64, 100)
    # A minimum above its maximum gives that axis the one size maximum.
    high = BucketConfig(
        max_num_tokens=16, max_num_seqs=4, max_pages_per_seq=8,
        min_num_tokens=64, min_num_seqs=8, min_pages_per_seq=32,
    )  # fmt: skip
    assert (high.token_buckets, high.seq_buckets, high.page_buckets) == ((16,), (4,), (8,))


def test_more_sequences_than_tokens_is_refused_by_name():
    with pytest.raises(ValueError, match="max_num_seqs=9"):
        BucketConfig(max_num_tokens=8, max_num_seqs=9, max_pages_per_seq=4)
    assert BucketConfig(max_num_tokens=8, max_num_seqs=8, max_pages_per_seq=4).seq_buckets == (4, 8)


def test_bucket_functions():
    assert pow2_buckets(8, 100) == (8, 16, 32, 64, 100)
    assert pow2_buckets(4, 4) == (4,)
    assert padded_size((8, 16, 32), 1) == 8
    assert padded_size((8, 16, 32), 16) == 16
    assert padded_size((8, 16, 32), 17) == 32
    with pytest.raises(ValueError, match="exceeds"):
        padded_size((8, 16, 32), 33)
    with pytest.raises(ValueError, match="max_num_seqs"):
        BucketConfig(max_num_tokens=4, max_num_seqs=8, max_pages_per_seq=4)


@pytest.mark.timeout(10)  # unchecked, such a minimum doubles for good (0 * 2 == 0)
def test_pow2_buckets_refuses_a_minimum_below_one_or_above_the_maximum():
    for minimum, maximum in ((0, 4), (-1, 4), (8, 4)):
        with pytest.raises(ValueError, match="need 1 <="):
            pow2_buckets(minimum, maximum)


def test_a_size_past_the_buckets_is_refused_naming_it_and_the_largest_bucket():
    with pytest.raises(ValueError, match=r"^pages=33 exceeds the largest bucket 32$"):
        padded_size((8, 16, 32), 33, name="pages")
