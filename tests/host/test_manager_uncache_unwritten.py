"""KVCacheManager.uncache_unwritten: the cached blocks past the tokens a failed step left
written leave the prefix cache, and a retry that writes them caches them again.

All scenarios use block_size 4; a fresh pool of N blocks has free queue [1 .. N-1].
"""

from __future__ import annotations

from types import SimpleNamespace

from jaxkv import BlockRemoved, KVCacheManager
from jaxkv.scheduler_discard import keep_unwritten_of
from jaxkv.unwritten_blocks import cached_unwritten
from tests.host._util import make_request, prefill


def _manager(num_blocks: int = 10, **kwargs) -> KVCacheManager:
    kwargs.setdefault("max_model_len", 64)
    return KVCacheManager(num_blocks, 4, **kwargs)


def test_uncache_unwritten_takes_the_unwritten_blocks_out_and_a_refill_caches_them_again():
    # a's step was to compute tokens 4..12 (blocks 2 and 3 full) but failed: only its
    # first block, a cache hit on b's, holds KV.
    m = _manager(enable_kv_cache_events=True)
    b = make_request("b", [*range(4), 99])
    prefill(m, b)
    a = make_request("a", [*range(12), 7])
    hit_ids, num_hit = m.get_computed_blocks(a)
    assert (hit_ids, num_hit) == (m.block_ids("b")[:1], 4)
    m.allocate_slots(a, 9, num_new_computed_tokens=4, new_computed_blocks=hit_ids)
    first, second, third, _ = m.block_ids("a")
    m.take_events()
    m.uncache_unwritten(a, 4)
    assert [m.pool.blocks[i].block_hash for i in (second, third)] == [None, None]
    assert m.pool.blocks[first].block_hash == a.block_hashes[0]  # written by b: kept
    assert m.take_events() == [BlockRemoved(tuple(a.block_hashes[1:3]))]
    probe = make_request("p", a.all_token_ids)
    assert m.get_computed_blocks(probe) == ([first], 4)
    m.check_integrity()
    # The retried step computes the same tokens into the same blocks, which cache again.
    a.num_computed_tokens = 4
    assert m.allocate_slots(a, 9) == []
    assert [m.pool.blocks[i].block_hash for i in (second, third)] == a.block_hashes[1:3]
    assert m.get_computed_blocks(probe) == ([first, second, third], 12)
    m.uncache_unwritten(a, 100)  # nothing past 100 tokens: no change
    assert m.get_computed_blocks(probe) == ([first, second, third], 12)
    m.check_integrity()


def test_a_cache_hit_after_an_uncache_caches_the_blocks_before_it_again():
    # r's block 1 left the cache (a failed step); the retry wrote it (computed 8) and r
    # then takes block 2 as a hit. Block 1 must not be counted as already cached along
    # with the hit: the same call caches it.
    m = _manager(num_blocks=16)
    r = make_request("r", range(1, 14))
    m.allocate_slots(r, 8)  # caches its blocks 0 and 1
    donor = make_request("d", range(1, 14))
    m.allocate_slots(donor, 13)  # no lookup: caches only block 2 (0 and 1 are r's)
    m.free("d")
    m.uncache_unwritten(r, 4)
    hashes = r.block_hashes
    assert hashes[1] not in m.pool.cached_block_hash_to_block
    r.num_computed_tokens = 8
    hit = m.pool.cached_block_hash_to_block[hashes[2]]
    m.allocate_slots(r, 1, num_new_computed_tokens=4, new_computed_blocks=[hit.block_id])
    assert m.pool.cached_block_hash_to_block[hashes[1]].block_id == m.block_ids("r")[1]
    m.check_integrity()


def test_uncache_unwritten_takes_out_a_block_its_written_tokens_only_partly_fill():
    # KV in place for 6 of a's 9 tokens: block 1 (tokens 4..7) lacks 6 and 7, so it
    # leaves the cache; block 0 stays.
    m = _manager()
    a = make_request("a", range(9))
    prefill(m, a)
    m.uncache_unwritten(a, 6)
    assert m.get_computed_blocks(make_request("p", range(9))) == (m.block_ids("a")[:1], 4)
    m.check_integrity()


def test_an_aborts_record_of_unwritten_blocks_leaves_out_a_block_another_request_cached():
    # b's block 2 was taken out of the cache and c's retry cached it again (as in
    # test_uncache_unwritten_leaves_a_later_block_another_request_cached_again): the
    # record an abort keeps for a discard took it too, as it lay past b's written tokens,
    # so the discard took c's entry out, which c would never enter again.
    m = _manager(num_blocks=32)
    b = make_request("b", range(1, 14))
    m.allocate_slots(b, 13)
    b.num_computed_tokens = 13
    c = make_request("c", [*range(1, 13), 99, 98])
    m.allocate_slots(c, 2, num_new_computed_tokens=12, new_computed_blocks=m.block_ids("b")[:3])
    m.uncache_unwritten(b, 8)
    m.uncache_unwritten(c, 8)
    c.num_computed_tokens = 8
    m.allocate_slots(c, 6)  # caches block 2 again, as c's
    m.uncache_unwritten(b, 4)
    shared = m.pool.blocks[m.block_ids("b")[2]]
    assert shared.block_hash == c.block_hashes[2]
    sched = SimpleNamespace(manager=m, _unwritten_of_aborted=[])
    keep_unwritten_of(sched, b, 4)
    assert sched._unwritten_of_aborted == []
    assert cached_unwritten(m, "b", 4) == []
    m.check_integrity()


def test_a_shorter_allocation_after_a_rewind_keeps_the_cached_count_for_uncache_unwritten():
    # A caller that rewinds num_computed_tokens to recompute a request's prompt, then
    # allocates fewer tokens than its blocks hold, leaves those blocks cached; a failed
    # step then takes every one past the written tokens out, not only those the shorter
    # allocation reached.
    m = _manager()
    a = make_request("a", list(range(12)))
    m.allocate_slots(a, 12)
    blocks = m.block_ids("a")
    assert all(m.pool.blocks[i].block_hash is not None for i in blocks)
    a.num_computed_tokens = 0
    assert m.allocate_slots(a, 4) == []
    m.uncache_unwritten(a, 0)
    assert [m.pool.blocks[i].block_hash for i in blocks] == [None, None, None]
    m.check_integrity()
