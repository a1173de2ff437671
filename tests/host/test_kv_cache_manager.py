"""Scenario tests of the KV cache manager with exact block ids and free-queue order.

All scenarios use block_size 4; a fresh pool of N blocks has free queue [1 .. N-1]
(block 0 is the null block and never handed out).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager, Request
from tests.host._util import decode, make_request, prefill, ref_counts


def _manager(num_blocks: int = 10, **kwargs) -> KVCacheManager:
    kwargs.setdefault("max_model_len", 64)
    return KVCacheManager(num_blocks, 4, **kwargs)


def _queue(m: KVCacheManager) -> list[int]:
    return m.pool.free_block_queue.block_ids()


def test_fresh_pool():
    m = _manager()
    assert _queue(m) == list(range(1, 10))
    assert m.num_free_blocks == 9 and m.usage == 0.0
    # 9 blocks but the null block: fewer than max_model_len's 16, the most a row can hold.
    assert m.block_table.shape[1] == m.max_blocks_per_seq == 9
    assert m.block_table.dtype == np.int32 and m.prefix_ids.dtype == np.int64
    m.check_integrity()


def test_rows_are_as_wide_as_the_pool_when_max_model_len_needs_more_blocks():
    # Rows used to be ceil(max_model_len / block_size) wide whatever the pool: here 2**31
    # columns, a 384 GiB table for 8 blocks (MemoryError, or the host's memory used up).
    m = KVCacheManager(8, 1, max_model_len=2**31 - 1)
    assert m.block_table.shape == (16, 7) and m.prefix_ids.shape == (16, 7)
    assert m.max_blocks_per_seq == 7
    r = make_request("a", range(5))
    assert m.allocate_slots(r, 7) == list(range(1, 8))  # every block a row can hold
    assert m.block_table[m.rows_of(["a"])[0]].tolist() == list(range(1, 8))
    assert m.allocate_slots(r, 8) is None  # an eighth block: the pool has none
    m.check_integrity()


def test_two_prompts_share_three_full_blocks():
    m = _manager()
    a = make_request("a", range(14))  # 3 full blocks + 2 tokens
    assert prefill(m, a) == [1, 2, 3, 4]
    b = make_request("b", [*range(12), 100, 101, 102])
    assert m.get_computed_blocks(b) == ([1, 2, 3], 12)
    assert prefill(m, b) == [5]
    assert m.block_ids("a") == [1, 2, 3, 4] and m.block_ids("b") == [1, 2, 3, 5]
    assert ref_counts(m)[:7] == [0, 2, 2, 2, 1, 1, 0]
    assert _queue(m) == [6, 7, 8, 9]
    rows = m.rows_of(["a", "b"])
    assert m.block_table[rows, :5].tolist() == [[1, 2, 3, 4, 0], [1, 2, 3, 5, 0]]
    assert m.num_blocks_of(["a", "b"]).tolist() == [4, 4]
    assert m.num_common_prefix_blocks(["a", "b"]) == 3
    stats = m.prefix_cache_stats  # a, b looked up twice (once above, once in prefill)
    assert (stats.requests, stats.queries, stats.hits) == (3, 14 + 15 + 15, 12 + 12)
    m.check_integrity()


def test_hit_never_covers_the_last_prompt_token():
    m = _manager()
    prefill(m, make_request("a", range(8)))
    assert m.get_computed_blocks(make_request("b", range(8))) == ([1], 4)
    assert m.get_computed_blocks(make_request("c", range(9))) == ([1, 2], 8)


def test_decode_growth_caches_the_last_block_only_when_full():
    m = _manager()
    a = make_request("a", range(6))
    assert prefill(m, a) == [1, 2]
    blocks = m.pool.blocks
    assert blocks[1].block_hash == a.block_hashes[0] and blocks[2].block_hash is None
    assert decode(m, a, 50) == []  # 7 tokens
    assert blocks[2].block_hash is None
    assert decode(m, a, 51) == []  # 8 tokens: block 2 is full
    assert blocks[2].block_hash == a.block_hashes[1]
    assert decode(m, a, 52) == [3]  # 9 tokens need a third block
    assert blocks[3].block_hash is None and m.block_ids("a") == [1, 2, 3]
    assert _queue(m) == list(range(4, 10))
    m.check_integrity()


def test_lookahead_slots_are_allocated_but_not_cached():
    m = _manager()
    a = make_request("a", range(4))
    assert m.allocate_slots(a, 4, num_lookahead_tokens=5) == [1, 2, 3]
    assert m.pool.blocks[1].block_hash is not None
    assert m.pool.blocks[2].block_hash is None
    m.check_integrity()


def test_eviction_order_after_freeing_several_requests():
    m = _manager()
    a, b, c = (make_request("a", range(8)), make_request("b", range(100, 112)),
               make_request("c", range(200, 204)))  # fmt: skip
    assert (prefill(m, a), prefill(m, b), prefill(m, c)) == ([1, 2], [3, 4, 5], [6])
    m.free(b)  # tail first
    assert _queue(m) == [7, 8, 9, 5, 4, 3]
    m.free(a)
    assert _queue(m) == [7, 8, 9, 5, 4, 3, 2, 1]
    m.free(c)
    assert _queue(m) == [7, 8, 9, 5, 4, 3, 2, 1, 6]
    d = make_request("d", range(300, 316))
    assert prefill(m, d) == [7, 8, 9, 5]  # least recently freed first
    assert _queue(m) == [4, 3, 2, 1, 6]
    m.check_integrity()


def test_reused_block_loses_its_old_hash():
    m = _manager(enable_kv_cache_events=True)
    b = make_request("b", range(100, 112))
    assert prefill(m, b) == [1, 2, 3]
    old_hash = m.pool.blocks[3].block_hash
    assert old_hash == b.block_hashes[2]
    m.free(b)
    m.take_events()
    assert _queue(m) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    filler = make_request("f", range(500, 528))  # 7 blocks: takes 4..9 and then 3
    assert prefill(m, filler) == [4, 5, 6, 7, 8, 9, 3]
    assert m.pool.blocks[3].block_hash != old_hash
    assert old_hash not in m.pool.cached_block_hash_to_block
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((old_hash,))]
    clone = make_request("b2", [*range(100, 112), 7])
    assert m.get_computed_blocks(clone) == ([1, 2], 8)  # blocks 1, 2 are still cached
    m.check_integrity()


def test_cache_hit_on_blocks_that_are_free_in_the_queue():
    m = _manager()
    a = make_request("a", range(9))
    assert prefill(m, a) == [1, 2, 3]
    m.free(a)
    assert _queue(m) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    b = make_request("b", [*range(8), 40, 41])
    assert m.get_computed_blocks(b) == ([1, 2], 8)
    assert prefill(m, b) == [4]
    assert _queue(m) == [5, 6, 7, 8, 9, 3]  # 1 and 2 left the middle of the queue
    assert ref_counts(m)[1:5] == [1, 1, 0, 1]
    assert m.block_ids("b") == [1, 2, 4]
    m.check_integrity()


def test_cache_hits_at_the_head_of_the_free_queue_are_not_handed_out_as_fresh_blocks():
    # The hits leave the free queue before fresh blocks are taken: taken the other way
    # round, the head of the queue (a hit) would be handed out as a fresh block too.
    m = _manager(num_blocks=4)
    x = make_request("x", range(8))  # two full blocks, both cached
    assert prefill(m, x) == [1, 2]
    z = make_request("z", [90, 91, 92])
    assert prefill(m, z) == [3]
    m.free(x)
    m.free(z)
    assert _queue(m) == [2, 1, 3]  # a hit is the head of the queue
    b = make_request("b", [*range(8), 40])
    assert m.get_computed_blocks(b) == ([1, 2], 8)
    assert prefill(m, b) == [3]
    assert m.block_ids("b") == [1, 2, 3] and _queue(m) == []
    assert ref_counts(m)[1:] == [1, 1, 1]
    m.check_integrity()


def test_not_enough_blocks_returns_none_and_changes_nothing():
    m = _manager(num_blocks=6)
    a = make_request("a", range(12))
    assert prefill(m, a) == [1, 2, 3]
    b = make_request("b", [*range(8), *range(50, 62)])  # 20 tokens: 2 hits + 3 new
    hit_ids, num_hit = m.get_computed_blocks(b)
    assert (hit_ids, num_hit) == ([1, 2], 8)
    before = (ref_counts(m), _queue(m), m.block_table.copy(), m.prefix_ids.copy())
    assert m.allocate_slots(b, 12, num_new_computed_tokens=8, new_computed_blocks=hit_ids) is None
    assert ref_counts(m) == before[0] and _queue(m) == before[1]
    assert (m.block_table == before[2]).all() and (m.prefix_ids == before[3]).all()
    assert "b" not in m.request_ids
    m.check_integrity()


def test_hits_on_free_blocks_count_against_free_space():
    m = _manager(num_blocks=6)
    a = make_request("a", range(12))
    prefill(m, a)
    m.free(a)
    assert _queue(m) == [4, 5, 3, 2, 1]
    too_big = make_request("b", [*range(8), *range(50, 66)])  # 24 tokens: 2 hits + 4 new
    hit_ids, num_hit = m.get_computed_blocks(too_big)
    assert hit_ids == [1, 2]
    assert (
        m.allocate_slots(too_big, 16, num_new_computed_tokens=8, new_computed_blocks=hit_ids)
        is None
    )
    assert _queue(m) == [4, 5, 3, 2, 1] and ref_counts(m) == [0] * 6
    fits = make_request("c", [*range(8), *range(50, 62)])  # 2 hits + 3 new == 5 free
    assert prefill(m, fits) == [4, 5, 3]
    assert m.block_ids("c") == [1, 2, 4, 5, 3] and m.num_free_blocks == 0
    m.check_integrity()


def test_cache_salt_and_adapter_isolate_caches():
    m = _manager(num_blocks=20)
    prefill(m, make_request("a", range(9)))
    assert m.get_computed_blocks(make_request("x", range(9)))[1] == 8
    assert m.get_computed_blocks(make_request("s", range(9), cache_salt="k"))[1] == 0
    assert m.get_computed_blocks(make_request("l", range(9), adapter_id="lora"))[1] == 0
    prefill(m, make_request("s1", range(9), cache_salt="k"))
    assert m.get_computed_blocks(make_request("s2", range(9), cache_salt="k"))[1] == 8
    assert m.get_computed_blocks(make_request("s3", range(9), cache_salt="other"))[1] == 0
    m.check_integrity()


def test_prefix_caching_disabled():
    m = _manager(enable_prefix_caching=False)
    a, b = make_request("a", range(9)), make_request("b", range(9))
    assert prefill(m, a) == [1, 2, 3]
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.prefix_cache_stats.requests == 0  # no cache, no lookup counted
    assert prefill(m, b) == [4, 5, 6]
    assert all(blk.block_hash is None for blk in m.pool.blocks)
    assert m.num_common_prefix_blocks(["a", "b"]) == 0
    with pytest.raises(ValueError, match="prefix caching is disabled"):
        m.allocate_slots(make_request("c", range(9)), 1, new_computed_blocks=[1])
    m.check_integrity()


def test_reset_prefix_cache_refused_while_in_use():
    m = _manager(enable_kv_cache_events=True)
    a = make_request("a", range(9))
    prefill(m, a)
    assert m.reset_prefix_cache() is False
    assert len(m.pool.cached_block_hash_to_block) == 2
    m.free(a)
    one = make_request("one", range(4))  # holds a single block: still in use
    prefill(m, one)
    assert m.usage > 0 and m.reset_prefix_cache() is False
    m.free(one)
    m.take_events()
    assert m.reset_prefix_cache() is True
    assert m.pool.cached_block_hash_to_block == {}
    assert all(blk.block_hash is None for blk in m.pool.blocks)
    assert m.take_events() == [AllBlocksCleared()]
    assert m.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    m.check_integrity()


def test_events_report_stored_blocks():
    m = _manager(enable_kv_cache_events=True)
    a = make_request("a", range(10), adapter_id="x")
    prefill(m, a)
    (event,) = m.take_events()
    assert event == BlockStored(tuple(a.block_hashes[:2]), None, tuple(range(8)), 4, "x")
    decode(m, a, 10)
    decode(m, a, 11)  # 12 tokens: third block full
    (event,) = m.take_events()
    assert event.block_hashes == (a.block_hashes[2],)
    assert event.parent_block_hash == a.block_hashes[1]
    assert event.token_ids == (8, 9, 10, 11)
    assert m.take_events() == []


def test_events_report_only_blocks_stored():
    # b fills four blocks without a cache lookup; its first duplicates a block that a
    # already caches, so only the other three are stored, with b's first hash as parent.
    m = KVCacheManager(16, 2, max_model_len=32, enable_kv_cache_events=True)
    a = make_request("a", [1, 2, 3])
    prefill(m, a)
    m.take_events()
    b = make_request("b", [1, 2, 9, 9, 5, 6, 8, 8, 0])
    m.allocate_slots(b, b.num_tokens)
    hashes = b.update_block_hashes(2)
    (event,) = m.take_events()
    assert event == BlockStored(tuple(hashes[1:4]), hashes[0], (9, 9, 5, 6, 8, 8), 2, None)
    assert m.pool.cached_block_hash_to_block[hashes[0]].block_id == m.block_ids("a")[0]
    b2 = make_request("b2", b.all_token_ids)
    m.allocate_slots(b2, b2.num_tokens)
    assert m.take_events() == []  # every block duplicates one of b's or a's
    m.check_integrity()


def test_events_off_by_default():
    m = _manager()
    prefill(m, make_request("a", range(9)))
    assert m.take_events() == []


def test_prefix_cache_stats_reset():
    m = _manager()
    prefill(m, make_request("a", range(9)))
    prefill(m, make_request("b", range(9)))
    stats = m.reset_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    assert m.prefix_cache_stats.requests == 0 and m.prefix_cache_stats.hit_rate == 0.0


def test_chunked_prefill_caches_blocks_as_chunks_fill_them():
    m = _manager()
    a = make_request("a", range(10))
    assert m.allocate_slots(a, 5) == [1, 2]
    a.num_computed_tokens = 5
    assert m.pool.blocks[1].block_hash is not None and m.pool.blocks[2].block_hash is None
    assert m.allocate_slots(a, 5) == [3]
    a.num_computed_tokens = 10
    assert m.pool.blocks[2].block_hash == a.block_hashes[1]
    assert m.pool.blocks[3].block_hash is None
    m.check_integrity()


def test_duplicate_full_block_stays_uncached():
    m = _manager()
    a, b = make_request("a", range(5)), make_request("b", range(5))
    assert m.allocate_slots(a, 5) == [1, 2]
    assert m.allocate_slots(b, 5) == [3, 4]  # computed concurrently, no lookup
    assert m.pool.blocks[1].block_hash == a.block_hashes[0]
    assert m.pool.blocks[3].block_hash is None
    m.free(a)
    m.free(b)
    m.check_integrity()


def test_rows_are_reused_and_grow_by_doubling():
    m = _manager(num_blocks=100)
    reqs = [make_request(f"r{i}", range(i * 10, i * 10 + 4)) for i in range(20)]
    for r in reqs:
        prefill(m, r)
    assert m.block_table.shape[0] == 32
    assert m.rows_of([r.request_id for r in reqs]).tolist() == list(range(20))
    m.free(reqs[3])
    assert not m.block_table[3].any()
    new = make_request("new", range(1000, 1004))
    prefill(m, new)
    assert m.rows_of(["new"]).tolist() == [3]
    assert m.block_table[3, 0] == m.block_ids("new")[0]
    m.check_integrity()


def test_free_accepts_a_request_id():
    m = _manager()
    prefill(m, Request("a", range(5)))
    m.free("a")
    assert m.num_free_blocks == 9
    m.check_integrity()
