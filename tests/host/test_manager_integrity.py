"""KVCacheManager.check_integrity names each break of its request bookkeeping."""

from __future__ import annotations

import pytest

from jaxkv import IntegrityError
from jaxkv.kv_cache_block import KVCacheBlock
from tests.host._util import make_request, two_request_manager


def _other_owner(m):
    m._owner["B"] = make_request("C", range(3))


def _stale_owner(m):
    m._owner["gone"] = make_request("gone", range(3))


def _stale_count(m):
    m._num_cached["gone"] = 0


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_other_owner, "'B': its blocks' owner is request 'C'"),
        (_stale_owner, "2 requests hold blocks, 3 have an owner, 2 have a cached-block count"),
        (lambda m: m._num_cached.__setitem__("A", 4), "'A': num_cached=4"),
        (_stale_count, "2 have an owner, 3 have a cached-block count"),
    ],
    ids=[
        "other-owner",
        "stale-owner",
        "num-cached",
        "stale-count",
    ],
)
def test_each_break_of_the_bookkeeping_is_named(corrupt, message):
    m = two_request_manager()
    corrupt(m)
    with pytest.raises(IntegrityError, match=message):
        m.check_integrity()


def _lost_owner(m):
    del m._owner["B"]


def _two_bad_counts(m):
    m._num_cached.update(A=4, B=-1)


def _swap_cached_hashes(m):
    # Two cached blocks trade hashes, the cache map following: the pool's own laws hold,
    # but a hit on A's first block would now return its second block's KV.
    first, second = m._blocks["A"][:2]
    first.block_hash, second.block_hash = second.block_hash, first.block_hash
    cached = m.pool.cached_block_hash_to_block
    cached[first.block_hash], cached[second.block_hash] = first, second


def _count_moved_to_another_id(m):
    # As many counts as requests, but A's is kept under an id that holds no blocks.
    m._num_cached["gone"] = m._num_cached.pop("A")


def _hash_on_a_partial_block(m):
    last = m._blocks["A"][-1]  # A's third block holds 2 of its 4 tokens
    last.block_hash = bytes(16)
    m.pool.cached_block_hash_to_block[last.block_hash] = last


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            _lost_owner,
            "'B': its blocks have no owner; 2 requests hold blocks, 1 have an owner, 2 have a "
            "cached-block count",
        ),
        (lambda m: m._num_cached.__setitem__("B", -1), "'B': num_cached=-1"),
        (_two_bad_counts, "'A': num_cached=4; 'B': num_cached=-1"),
        (
            _swap_cached_hashes,
            "'A': block 1 at 0 carries another hash than the request's; 'A': block 2 at 1 "
            "carries another hash than the request's; 'B': block 1 at 0 carries another hash "
            "than the request's; 'B': block 2 at 1 carries another hash than the request's",
        ),
        (_hash_on_a_partial_block, "'A': block 3 at 2 carries another hash than the request's"),
        (_count_moved_to_another_id, "'A': num_cached=None"),
    ],
    ids=[
        "lost-owner",
        "negative-num-cached",
        "two-requests",
        "swapped-hashes",
        "hashed-partial-block",
        "count-under-another-id",
    ],
)
def test_the_message_names_every_break_and_only_those(corrupt, message):
    m = two_request_manager()
    corrupt(m)
    with pytest.raises(IntegrityError) as e:
        m.check_integrity()
    assert str(e.value) == message


def _shared_block(m):
    return m._blocks["A"][0]  # held by A and B, cached


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda m: setattr(_shared_block(m), "ref_cnt", 3), "ref_cnt=3, cached) has 2 holders"),
        (lambda m: m._blocks["B"].pop(), "ref_cnt=1, uncached) has 0 holders"),
        (lambda m: m._blocks["B"].append(m._blocks["B"][-1]), "ref_cnt=1, uncached) has 2 holders"),
        (
            lambda m: m.pool.cached_block_hash_to_block.pop(_shared_block(m).block_hash),
            "ref_cnt=2, cached) carries a hash the cache map does not give it",
        ),
    ],
    ids=["ref-count", "held-list-lost-a-block", "held-list-twice", "cache-map"],
)
def test_pool_breaks_are_checked_against_the_blocks_requests_hold(corrupt, message):
    # The pool's own laws, and each ref count against the held lists (counted with repeats).
    m = two_request_manager()
    corrupt(m)
    with pytest.raises(IntegrityError) as e:
        m.check_integrity()
    assert str(e.value).startswith("KVCacheBlock(") and str(e.value).endswith(message)


def _foreign_copy(m):
    # B's last block replaced by another object of the same id and count: counted by id,
    # the pool's laws hold, but freeing B would release the copy, not the pool's block.
    own = m._blocks["B"][-1]
    copy = KVCacheBlock(own.block_id)
    copy.ref_cnt = own.ref_cnt
    m._blocks["B"][-1] = copy


def test_a_held_block_must_be_the_pools_own_object():
    m = two_request_manager()
    _foreign_copy(m)
    with pytest.raises(IntegrityError, match="'B': block 4 at 2 is not the pool's block 4"):
        m.check_integrity()


def test_free_leaves_no_owner_behind():
    m = two_request_manager()
    m.free("A")
    m.check_integrity()
    assert list(m._owner) == ["B"] == list(m._blocks)
