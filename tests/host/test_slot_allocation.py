"""The scheduler's unchecked admission path (jaxkv.slot_allocation) against the public calls.

block_size 4; a fresh pool of N blocks has free queue [1 .. N-1].
"""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager
from jaxkv.slot_allocation import allocate_admitted, find_cache_hit
from tests.host._util import make_request, prefill


def _manager(num_blocks: int = 12) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, max_model_len=64)


def _state(m: KVCacheManager) -> tuple:
    return (
        {r: m.block_ids(r) for r in m.request_ids},
        m.pool.free_block_queue.block_ids(),
        sorted((b.block_id, h) for h, b in m.pool.cached_block_hash_to_block.items()),
        m.block_table.tolist(),
        m.prefix_ids.tolist(),
        m.sharing_version,
    )


def _public(m: KVCacheManager, request, n: int) -> None:
    ids, num = m.get_computed_blocks(request, count=False)
    m.allocate_slots(request, n, num_new_computed_tokens=num, new_computed_blocks=ids)


def test_admitted_allocation_equals_the_public_calls():
    ms = [_manager(), _manager()]
    for m in ms:
        prefill(m, make_request("a", range(14)))
    fresh = [make_request("b", [*range(12), 100, 101, 102]) for _ in ms]
    hit = find_cache_hit(ms[0], fresh[0])
    assert hit.block_ids == [1, 2, 3] and hit.num_tokens == 12
    assert allocate_admitted(ms[0], fresh[0], 3, hit)
    _public(ms[1], fresh[1], 3)
    assert _state(ms[0]) == _state(ms[1])
    for m in ms:
        m.check_integrity()


def test_a_hit_evicted_since_the_lookup_is_refused_with_nothing_changed():
    m = _manager(num_blocks=6)  # blocks 1..5
    a = make_request("a", range(9))  # blocks 1, 2 full and cached, 3 partial
    prefill(m, a)
    m.free(a)  # free queue: 3, 2, 1 (tail first)
    b = make_request("b", [*range(8), 50])
    hit = find_cache_hit(m, b)
    assert hit.block_ids == [1, 2]
    other = make_request("c", [7] * 13)
    prefill(m, other)  # takes 3, 2, 1, 4: evicts the hit's blocks
    before = _state(m)
    with pytest.raises(ValueError, match="stale cache hit"):
        allocate_admitted(m, b, 1, hit)
    assert _state(m) == before
    m.check_integrity()


def test_a_request_holding_blocks_gets_only_the_blocks_it_lacks():
    ms = [_manager(), _manager()]
    held = [make_request("a", range(10)) for _ in ms]
    for m, r in zip(ms, held, strict=True):
        m.allocate_slots(r, 0, num_lookahead_tokens=4)  # one block, nothing computed
    hit = find_cache_hit(ms[0], held[0])
    assert hit.num_tokens == 0
    assert allocate_admitted(ms[0], held[0], 10, hit)
    _public(ms[1], held[1], 10)
    assert _state(ms[0]) == _state(ms[1]) and len(ms[0].block_ids("a")) == 3
    ms[0].check_integrity()


@pytest.mark.parametrize(
    ("num_computed", "num_new", "match"),
    [(4, 1, "exceeds"), (0, 65, "> max_model_len")],
)
def test_admission_refuses_what_allocate_slots_refuses(num_computed, num_new, match):
    m = _manager()
    r = make_request("a", range(8))
    r.num_computed_tokens = num_computed  # holds no block: its computed tokens have no KV
    hit = find_cache_hit(m, r)
    before = _state(m)
    with pytest.raises(ValueError, match=match):
        allocate_admitted(m, r, num_new, hit)
    assert _state(m) == before
    m.check_integrity()


def test_without_prefix_caching_a_lookup_hashes_nothing():
    m = KVCacheManager(12, 4, max_model_len=64, enable_prefix_caching=False)
    r = make_request("a", range(10))
    r.update_block_hashes(8)  # hashed for another block size: no cache here to query
    assert m.get_computed_blocks(r) == ([], 0)
    assert find_cache_hit(m, r).num_tokens == 0 and len(r.block_hashes) == 1


@pytest.mark.parametrize("forget", ["uncache", "reset"])
def test_a_hit_whose_blocks_lost_their_hash_since_the_lookup_is_refused(forget):
    m = _manager()
    a = make_request("a", range(9))  # blocks 1, 2 full and cached
    prefill(m, a)
    if forget == "reset":
        m.free(a)
    b = make_request("b", [*range(8), 50])
    hit = find_cache_hit(m, b)
    assert hit.block_ids == [1, 2]
    if forget == "uncache":
        m.uncache_unwritten(a, 0)  # a's KV was never written
    else:
        assert m.reset_prefix_cache()
    before = _state(m)
    with pytest.raises(ValueError, match="stale cache hit"):
        allocate_admitted(m, b, 1, hit)
    assert _state(m) == before
    m.check_integrity()


def test_a_block_table_row_fits_a_max_model_len_that_is_no_multiple_of_the_block():
    m = KVCacheManager(16, 4, max_model_len=10)  # 3 blocks: the last one partly used
    r = make_request("a", list(range(10)))
    ids = m.allocate_slots(r, 10)
    assert m.max_blocks_per_seq == 3 and ids is not None and len(ids) == 3
    assert m.block_table[m.rows_of(["a"])[0]].tolist() == ids
    m.check_integrity()


def test_cache_hits_another_request_holds_take_no_free_block():
    m = KVCacheManager(5, 4, max_model_len=64)  # 4 usable blocks
    a = make_request("a", list(range(9)))  # 3 blocks, the first 2 full and cached
    assert m.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    b = make_request("b", [*range(8), 42])
    ids, n = m.get_computed_blocks(b)
    assert (len(ids), n, m.num_free_blocks) == (2, 8, 1)  # both hits held by a
    new = m.allocate_slots(b, 1, num_new_computed_tokens=n, new_computed_blocks=ids)
    assert new is not None and len(new) == 1 and m.num_free_blocks == 0
    m.check_integrity()
