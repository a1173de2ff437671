"""Block pool and free queue at their edges: the smallest and largest pools, the
defaults, the cached-block lookup, cache_block's answer, how stored runs are reported
(with a plain int block size), the invalid ids check_integrity names, and a queue built
empty."""

from __future__ import annotations

import re

import numpy as np
import pytest

import jaxkv.block_pool as block_pool_module
from jaxkv.block_pool import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeKVCacheBlockQueue,
    IntegrityError,
    KVCacheBlock,
)
from jaxkv.hashing import root_hash


def test_two_blocks_are_the_smallest_pool_one_block_to_hand_out():
    pool = BlockPool(2)
    assert pool.num_blocks == 2 and pool.num_free_blocks == 1
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]
    assert pool.usage == 1.0
    pool.check_integrity({1: 1})


def test_the_largest_pool_has_max_int32_blocks(monkeypatch):
    # Block ids are int32 in block tables: MAX_INT32 blocks is the limit, itself allowed.
    monkeypatch.setattr(block_pool_module, "MAX_INT32", 5)
    assert BlockPool(5).num_blocks == 5
    with pytest.raises(ValueError, match=r"num_blocks=6 must be an int in \[2, 5\]"):
        BlockPool(6)


def test_a_pool_reports_no_events_unless_asked():
    pool = BlockPool(3)
    assert pool.enable_caching is True and pool.enable_events is False
    (block,) = pool.get_new_blocks(1)
    h = root_hash(3)
    pool.cache_full_blocks(
        [block], [h], parent_block_hash=None, token_ids=[1], block_size=1, adapter_id=None
    )
    pool.free_blocks([block])
    pool.get_new_blocks(2)  # evicts the cached block
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []


def test_get_cached_block_gives_the_block_that_carries_a_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h0, h1 = root_hash(1), root_hash(2)
    pool.cache_full_blocks(
        [a, b], [h0, h1], parent_block_hash=None, token_ids=[1, 2], block_size=1,
        adapter_id=None,
    )  # fmt: skip
    assert pool.get_cached_block(h0) is a and pool.get_cached_block(h1) is b
    pool.free_blocks([b, a])
    assert pool.get_cached_block(h1) is b  # a free block keeps its hash until handed out
    assert pool.get_new_blocks(2) == [pool.blocks[3], b]
    assert pool.get_cached_block(h1) is None and pool.get_cached_block(h0) is a


def test_a_stored_event_reports_a_numpy_block_size_as_an_int():
    pool = BlockPool(4, enable_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(
        blocks, [root_hash(1), root_hash(2)], parent_block_hash=None, token_ids=[1, 2, 3, 4],
        block_size=np.int64(2), adapter_id=None,
    )  # fmt: skip
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored) and type(event.block_size) is int
    assert event.block_size == 2 and event.token_ids == (1, 2, 3, 4)
    assert not isinstance(event, BlockRemoved)


def test_a_stored_run_after_a_skipped_block_grows_as_the_first_run_does():
    # b's hash is cached on another block: a is one run, c and d a second of two blocks.
    pool = BlockPool(8, enable_events=True)
    a, b, c, d, other = pool.get_new_blocks(5)
    hashes = [bytes([i]) * 16 for i in range(4)]
    kw = dict(block_size=1, adapter_id=None)
    pool.cache_full_blocks([other], hashes[1:2], parent_block_hash=hashes[0], token_ids=[2], **kw)
    pool.take_events()
    pool.cache_full_blocks(
        [a, b, c, d], hashes, parent_block_hash=None, token_ids=[1, 2, 3, 4], **kw
    )
    events = pool.take_events()
    assert [e.block_hashes for e in events] == [(hashes[0],), (hashes[2], hashes[3])]
    assert [e.parent_block_hash for e in events] == [None, hashes[1]]
    assert [e.token_ids for e in events] == [(1,), (3, 4)]


def test_cache_block_answers_true_or_false():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = root_hash(5)
    assert pool.cache_block(a, h) is True
    assert pool.cache_block(b, h) is False and b.block_hash is None  # one block per hash
    assert pool.cache_block(a, root_hash(6)) is False and a.block_hash == h
    pool.check_integrity({a.block_id: 1, b.block_id: 1})


def test_holders_of_many_invalid_ids_are_reported_by_the_eight_smallest():
    pool = BlockPool(3)
    holders = {i: 1 for i in range(20, 9, -1)} | {0: 1}
    message = "holders reference invalid block ids [0, 10, 11, 12, 13, 14, 15, 16]"
    with pytest.raises(IntegrityError, match=re.escape(message) + "$"):
        pool.check_integrity(holders)


def test_a_free_queue_built_empty_is_empty_and_takes_blocks():
    queue = FreeKVCacheBlockQueue([])
    assert queue.block_ids() == [] and list(queue) == [] and queue.num_free_blocks == 0
    with pytest.raises(ValueError, match="no free block to pop"):
        queue.popleft()
    assert queue.popleft_n(0) == []
    block = KVCacheBlock(1)
    queue.append(block)
    assert queue.block_ids() == [1] and queue.popleft() is block
