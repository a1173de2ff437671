"""A cache hit is a prefix: it stops at the first block whose hash is not cached, even
when a later block's hash still is (block_size 4, exact block ids)."""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager
from tests.host._util import make_request, prefill


def test_a_hit_stops_at_an_evicted_block_though_a_later_block_is_still_cached():
    # x computes the first block again while a holds it cached, so x's copy stays
    # uncached (a duplicate) and only x's second block enters the cache. Once a's block
    # is evicted, the cache holds the second block's hash but not the first one's.
    m = KVCacheManager(8, 4, max_model_len=64)
    a = make_request("a", [*range(4), 100])
    assert prefill(m, a) == [1, 2]
    x = make_request("x", [*range(8), 200])
    assert m.allocate_slots(x, 9) == [3, 4, 5]  # no lookup: computed from scratch
    x.num_computed_tokens = 9
    m.free(a)
    c = make_request("c", range(300, 316))
    assert prefill(m, c) == [6, 7, 2, 1]  # evicts a's cached first block
    probe = make_request("probe", [*range(8), 400])
    hashes = probe.update_block_hashes(4)
    cached = m.pool.cached_block_hash_to_block
    assert hashes[0] not in cached and cached[hashes[1]].block_id == 4
    assert m.get_computed_blocks(probe) == ([], 0)
    m.check_integrity()


def test_a_hit_goes_stale_on_any_change_of_the_manager_and_is_then_refused():
    # get_computed_blocks' result was said to hold until the next allocate_slots or
    # free; uncache_unwritten and reset_prefix_cache take its blocks' hashes as well.
    for change in ("uncache_unwritten", "reset_prefix_cache"):
        m = KVCacheManager(8, 2, max_model_len=32)
        a = make_request("a", [1, 2, 3, 4, 5])
        assert m.allocate_slots(a, 5) == [1, 2, 3]
        a.num_computed_tokens = 5
        b = make_request("b", [1, 2, 3, 4, 5, 6])
        if change == "reset_prefix_cache":
            m.free(a)
        ids, n = m.get_computed_blocks(b)
        assert (ids, n) == ([1, 2], 4)
        if change == "uncache_unwritten":
            m.uncache_unwritten(a, 0)  # a's step failed: its blocks hold no KV
        else:
            assert m.reset_prefix_cache()
        free = m.num_free_blocks
        with pytest.raises(ValueError, match="stale cache hit"):
            m.allocate_slots(b, 6 - n, num_new_computed_tokens=n, new_computed_blocks=ids)
        assert m.num_free_blocks == free and not m.holds_row("b")
        m.check_integrity()
