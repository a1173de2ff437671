"""A request allocated no tokens holds an empty row (or only its cache hit, when the
scheduler admits it); a call on a request that holds no row names it with
UnknownRequestError; which next tokens of a running request need the manager."""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager, UnknownRequestError
from jaxkv.slot_allocation import allocate_admitted, find_cache_hit, needs_manager
from tests.host._util import make_request, prefill


@pytest.mark.parametrize("caching", [True, False])
def test_allocating_no_tokens_to_a_new_request_gives_it_an_empty_row(caching):
    m = KVCacheManager(8, 4, max_model_len=32, enable_prefix_caching=caching)
    a = make_request("a", range(5))
    assert m.allocate_slots(a, 0) == []
    assert m.holds_row("a") and m.block_ids("a") == [] and m.request_ids == ["a"]
    assert m.num_common_prefix_blocks(["a"]) == 0 and m.num_free_blocks == 7
    m.check_integrity()
    assert m.allocate_slots(a, 5) is not None and len(m.block_ids("a")) == 2


def test_uncache_unwritten_names_a_request_that_holds_no_row():
    m = KVCacheManager(8, 4, max_model_len=32)
    a = make_request("a", range(9))
    prefill(m, a)
    m.free(a)
    for request in ("a", "b"):
        with pytest.raises(UnknownRequestError, match=f"request '{request}' holds no blocks"):
            m.uncache_unwritten(request, 0)
    m.check_integrity()


def test_admitting_a_cache_hit_with_no_new_tokens_takes_no_fresh_block():
    m = KVCacheManager(8, 4, max_model_len=32)
    prefill(m, make_request("a", range(9)))
    b = make_request("b", range(9))
    hit = find_cache_hit(m, b)
    assert hit.num_tokens == 8
    free = m.num_free_blocks
    assert allocate_admitted(m, b, 0, hit)
    assert m.block_ids(b) == hit.block_ids and m.num_free_blocks == free
    m.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_needs_manager_for_a_fresh_block_or_a_block_to_cache(caching):
    m = KVCacheManager(8, 4, max_model_len=32, enable_prefix_caching=caching)
    assert needs_manager(m, 4, 1) and needs_manager(m, 5, 4)  # a fresh block
    assert not needs_manager(m, 5, 2)  # inside the last block
    assert needs_manager(m, 5, 3) is caching  # fills the last block: only to cache it
