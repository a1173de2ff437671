"""A request allocated no tokens holds an empty row; a call on a request that holds no
row names it with UnknownRequestError."""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager, UnknownRequestError
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
