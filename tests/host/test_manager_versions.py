"""The manager's answers about its rows: holds_row's bools, and the row and sharing
versions, which a cache hit or a free changes and fresh blocks do not."""

from __future__ import annotations

from jaxkv import KVCacheManager
from tests.host._util import decode, make_request, prefill


def test_holds_row_answers_true_or_false():
    m = KVCacheManager(12, 4, max_model_len=32)
    a = make_request("a", range(9))
    assert m.holds_row("a") is False
    prefill(m, a)
    assert m.holds_row("a") is True and m.holds_row("b") is False
    m.free(a)
    assert m.holds_row("a") is False


def test_versions_move_on_a_cache_hit_and_a_free_only():
    m = KVCacheManager(16, 4, max_model_len=64)
    a, b = make_request("a", range(9)), make_request("b", range(9))
    prefill(m, a)
    rows, shared = m.row_version, m.sharing_version
    for token in (20, 21, 22, 23):  # fill a's last block, then take a fresh one
        decode(m, a, token)
    assert len(m.block_ids(a)) == 4
    assert (m.row_version, m.sharing_version) == (rows, shared)
    prefill(m, b)  # hits a's two full blocks
    assert m.block_ids(b)[:2] == m.block_ids(a)[:2]
    assert m.row_version == rows and m.sharing_version != shared
    hit = m.sharing_version
    m.free(a)
    assert m.row_version != rows and m.sharing_version not in (shared, hit)
