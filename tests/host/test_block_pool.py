"""Block pool: the free queue's order and O(1) removal, and that check_integrity catches damage."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxkv import IntegrityError
from jaxkv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from jaxkv.hashing import hash_block_tokens, root_hash


def test_free_queue_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks[1:])
    assert queue.block_ids() == [1, 2, 3, 4, 5]
    queue.remove(blocks[3])
    assert queue.block_ids() == [1, 2, 4, 5] and queue.num_free_blocks == 4
    assert [b.block_id for b in queue.popleft_n(2)] == [1, 2]
    queue.append(blocks[2])
    queue.append(blocks[3])
    assert queue.block_ids() == [4, 5, 2, 3]
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[5])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    with pytest.raises(ValueError, match="exceeds num_free_blocks=4"):
        queue.popleft_n(5)
    for n in (-1, -2, 1.0, True, "1"):  # a negative n raised the free count
        with pytest.raises(ValueError, match=r"popleft_n: n=.* must be an int >= 0"):
            queue.popleft_n(n)
    assert queue.block_ids() == [4, 5, 2, 3] and queue.num_free_blocks == 4
    assert [queue.popleft().block_id for _ in range(4)] == [4, 5, 2, 3]
    with pytest.raises(ValueError, match="no free block"):
        queue.popleft()
    assert queue.num_free_blocks == 0 and queue.block_ids() == []
    queue.append(blocks[5])  # a popped block is out of the queue: it may go back
    assert queue.block_ids() == [5]


def test_pool_never_hands_out_the_null_block():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.check_integrity({1: 1, 2: 1, 3: 1})


def test_pool_settings_are_checked_by_name():
    # A numpy int is a block count (it used to be refused as "must be an int"); a flag
    # given as a str used to switch caching or events by its truthiness.
    pool = BlockPool(np.int64(4))
    assert pool.num_blocks == 4 and type(pool.num_blocks) is int
    for kwargs, match in [
        (dict(num_blocks=1), "num_blocks=1 must be an int in"),
        (dict(num_blocks=4.0), "num_blocks=4.0 must be an int in"),
        (dict(num_blocks=True), "num_blocks=True must be an int in"),
        (dict(num_blocks=4, enable_caching="no"), "enable_caching='no' must be a bool"),
        (dict(num_blocks=4, enable_events=1), "enable_events=1 must be a bool"),
    ]:
        with pytest.raises(ValueError, match=match):
            BlockPool(**kwargs)


def _pool_with_cached_block() -> BlockPool:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    h = root_hash(0)
    pool.cache_full_blocks(
        blocks[:1], [h], parent_block_hash=None, token_ids=[1, 2], block_size=2, adapter_id=None
    )
    pool.check_integrity({1: 1, 2: 1})
    return pool


def test_integrity_catches_wrong_ref_count():
    pool = _pool_with_cached_block()
    pool.blocks[2].ref_cnt = 2
    with pytest.raises(IntegrityError, match="KVCacheBlock\\(2, ref_cnt=2.*has 1 holders"):
        pool.check_integrity({1: 1, 2: 1})


def test_integrity_catches_held_block_in_queue():
    pool = _pool_with_cached_block()
    pool.blocks[4].ref_cnt = 1  # in the queue yet counted as held
    with pytest.raises(IntegrityError, match="disagrees with ref_cnt"):
        pool.check_integrity()


def test_integrity_catches_stale_cache_map():
    pool = _pool_with_cached_block()
    pool.blocks[1].block_hash = None
    with pytest.raises(IntegrityError, match="stale hash"):
        pool.check_integrity()


def test_integrity_catches_a_block_carrying_another_blocks_cached_hash():
    """A block whose hash the cache map gives to another block is reported."""
    pool = _pool_with_cached_block()
    pool.blocks[2].block_hash = pool.blocks[1].block_hash
    with pytest.raises(IntegrityError, match="KVCacheBlock\\(2.*a hash the cache map does not"):
        pool.check_integrity()


def test_integrity_catches_a_negative_ref_count():
    """A block out of the queue with ref_cnt -1 is reported, though it is not counted free."""
    pool = _pool_with_cached_block()
    pool.blocks[2].ref_cnt = -1
    with pytest.raises(IntegrityError, match="negative ref_cnt"):
        pool.check_integrity()


def test_integrity_catches_leaked_block():
    pool = _pool_with_cached_block()
    pool.free_blocks([pool.blocks[2]])
    pool.free_block_queue.remove(pool.blocks[2])  # neither free nor held
    with pytest.raises(IntegrityError, match="free=False disagrees"):
        pool.check_integrity()


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda pool: setattr(pool.null_block, "ref_cnt", 1), "null block ref_cnt=1"),
        (lambda pool: setattr(pool.null_block, "block_hash", root_hash(9)), "null block carries"),
        (lambda pool: pool.free_block_queue.append(pool.null_block), "null block is in the free"),
    ],
)
def test_integrity_catches_a_null_block_that_is_held_cached_or_free(corrupt, match):
    """The null block is never handed out: a holder, a hash or a place in the free queue
    is reported (the per-block checks start at block 1, so only these checks see it)."""
    pool = _pool_with_cached_block()
    corrupt(pool)
    with pytest.raises(IntegrityError, match=match):
        pool.check_integrity({1: 1, 2: 1})


def test_integrity_catches_a_free_count_that_disagrees_with_the_queue():
    """num_free_blocks is a counter kept beside the links: a drift (every admission and
    allocation trusts it) is reported even when the links themselves are intact."""
    pool = _pool_with_cached_block()
    pool.free_block_queue.num_free_blocks += 1
    with pytest.raises(IntegrityError, match="free queue holds 2 blocks, counter says 3"):
        pool.check_integrity({1: 1, 2: 1})


def test_integrity_error_is_an_assertion_error():
    assert issubclass(IntegrityError, AssertionError)


def _pool_state(pool: BlockPool) -> tuple:
    return (
        pool.free_block_queue.block_ids(),
        [b.ref_cnt for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
    )


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: p.touch([p.blocks[3], p.null_block]), "blocks: .*null block"),
        (lambda p: p.touch([p.blocks[3], KVCacheBlock(3)]), "blocks: .*not of this pool"),
        (lambda p: p.touch([KVCacheBlock(5)]), "blocks: .*not of this pool"),  # id past the pool
        (lambda p: p.free_blocks([p.blocks[2], p.blocks[3]]), "ordered_blocks: .*3.*0 holders"),
        (lambda p: p.free_blocks([p.blocks[2], p.blocks[2]]), "freed 2 times.*1 holders"),
        (lambda p: p.free_blocks([p.blocks[0]]), "ordered_blocks: .*null block"),
        (
            lambda p: p.cache_full_blocks(
                p.blocks[1:3],
                [root_hash(7)],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                adapter_id=None,
            ),
            "2 blocks need as many block_hashes \\(got 1\\)",
        ),
        (
            lambda p: p.cache_full_blocks(
                p.blocks[1:3],
                [root_hash(7), root_hash(8)],
                parent_block_hash=None,
                token_ids=[1, 2, 3],
                block_size=2,
                adapter_id=None,
            ),
            "block_size=2 token_ids \\(got 3\\)",
        ),
        (
            lambda p: p.cache_full_blocks(
                p.blocks[2:4],
                [root_hash(7), root_hash(8)],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                adapter_id=None,
            ),
            "blocks \\[3\\] are free",  # a free block's KV is nobody's: never a hit
        ),
        *[
            (
                lambda p, bad=bad: p.cache_full_blocks(
                    p.blocks[1:3],
                    [root_hash(7), bad],  # None used to be cached as a key
                    parent_block_hash=None,
                    token_ids=[1, 2, 3, 4],
                    block_size=2,
                    adapter_id=None,
                ),
                re.escape(f"block hash {bad!r} is no BlockHash"),
            )
            for bad in (None, [], b"x", bytes(17))  # a hash is 16 bytes
        ],
        (
            lambda p: p.cache_full_blocks(
                p.blocks[2:3],
                [root_hash(7)],
                parent_block_hash="root",  # reached the BlockStored event as it was
                token_ids=[1, 2],
                block_size=2,
                adapter_id=None,
            ),
            "parent_block_hash='root' is no BlockHash",
        ),
        (
            lambda p: p.cache_full_blocks(
                p.blocks[2:3],
                [root_hash(7)],
                parent_block_hash=None,
                token_ids=[1, 2],
                block_size=2,
                adapter_id=5,
            ),
            "adapter_id=5 must be None or a str",
        ),
        (
            lambda p: p.cache_full_blocks(
                [BlockPool(5).get_new_blocks(1)[0]],  # held, but by another pool
                [root_hash(7)],
                parent_block_hash=None,
                token_ids=[1, 2],
                block_size=2,
                adapter_id=None,
            ),
            "blocks: .*not of this pool",
        ),
        # It used to uncache block 1, then fail on "junk" with no epoch bump or event.
        (lambda p: p.uncache_blocks([p.blocks[1], "junk"]), "blocks: 'junk' is the null block"),
        (lambda p: p.touch(p.blocks[3]), "blocks=KVCacheBlock.* must be an iterable"),
        (lambda p: p.uncache_blocks(None), "blocks=None must be an iterable of blocks"),
        (lambda p: p.free_blocks(2), "ordered_blocks=2 must be an iterable of blocks"),
        (lambda p: p.get_new_blocks(-1), "get_new_blocks: n=-1 must be an int >= 0"),
        (lambda p: p.get_new_blocks(True), "get_new_blocks: n=True must be an int >= 0"),
        (lambda p: p.get_new_blocks(3), "n=3 exceeds num_free_blocks=2"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, match):
    pool = _pool_with_cached_block()  # blocks 1 (cached) and 2 held, 3 and 4 free
    before = _pool_state(pool)
    with pytest.raises(ValueError, match=match):
        call(pool)
    assert _pool_state(pool) == before
    pool.check_integrity({1: 1, 2: 1})


@pytest.mark.parametrize("block_size", [2.0, 0, None])
def test_cache_full_blocks_refuses_a_block_size_that_is_no_int_before_caching(block_size):
    # 2.0 passed the length check (2.0 == 2) and cached the block, then slicing the event's
    # tokens raised TypeError: the block stayed cached with no BlockStored to report it.
    pool = BlockPool(4, enable_events=True)
    blocks = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="cache_full_blocks: block_size=.* must be an int >= 1"):
        pool.cache_full_blocks(
            blocks, [root_hash(7)], parent_block_hash=None, token_ids=[1, 2],
            block_size=block_size, adapter_id=None,
        )  # fmt: skip
    assert blocks[0].block_hash is None and not pool.cached_block_hash_to_block
    assert pool.take_events() == []
    pool.cache_full_blocks(
        blocks, [root_hash(7)], parent_block_hash=None, token_ids=[1, 2],
        block_size=np.int64(2), adapter_id=None,
    )  # fmt: skip
    assert [e.block_size for e in pool.take_events()] == [2]


def test_touch_takes_blocks_from_a_generator():
    pool = _pool_with_cached_block()  # the check used to consume it: nothing was touched
    pool.touch(b for b in pool.blocks[3:4])
    assert pool.blocks[3].ref_cnt == 1 and 3 not in pool.free_block_queue.block_ids()
    pool.check_integrity({1: 1, 2: 1, 3: 1})


def test_freeing_a_block_once_per_holder_is_fine():
    pool = _pool_with_cached_block()
    pool.touch([pool.blocks[2]])
    pool.free_blocks([pool.blocks[2], pool.blocks[2]])
    assert pool.free_block_queue.block_ids() == [3, 4, 2]
    pool.check_integrity({1: 1})


def test_events_split_stored_runs_around_a_block_already_cached():
    # The middle block's hash is cached on another block: the two stored blocks are two
    # runs, the second with the skipped block's hash as its parent.
    pool = BlockPool(8, enable_events=True)
    a, b, c, other = pool.get_new_blocks(4)
    hashes = [bytes([i]) * 16 for i in range(3)]
    kw = dict(block_size=1, adapter_id=None)
    pool.cache_full_blocks([other], hashes[1:2], parent_block_hash=hashes[0], token_ids=[2], **kw)
    pool.take_events()
    pool.cache_full_blocks([a, b, c], hashes, parent_block_hash=None, token_ids=[1, 2, 3], **kw)
    events = pool.take_events()
    assert [e.block_hashes for e in events] == [(hashes[0],), (hashes[2],)]
    assert events[0].token_ids == (1,)  # not the skipped block's token too
    assert events[1].parent_block_hash == hashes[1] and events[1].token_ids == (3,)


@pytest.mark.parametrize("events", [False, True])
def test_a_cached_block_keeps_its_hash_when_cached_again(events):
    pool = BlockPool(4, enable_events=events)
    (a,) = pool.get_new_blocks(1)
    h1, h2 = b"\1" * 16, b"\2" * 16
    kw = dict(parent_block_hash=None, token_ids=[1], block_size=1, adapter_id=None)
    pool.cache_full_blocks([a], [h1], **kw)
    pool.cache_full_blocks([a], [h2], **kw)
    assert a.block_hash == h1 and pool.get_cached_block(h2) is None
    assert [e.block_hashes for e in pool.take_events()] == ([(h1,)] if events else [])
    pool.check_integrity({a.block_id: 1})


def test_a_pool_without_caching_caches_no_block_and_reports_no_event():
    pool = BlockPool(4, enable_caching=False, enable_events=True)
    blocks = pool.get_new_blocks(2)
    h0 = hash_block_tokens(root_hash(), [0, 1, 2, 3])
    h1 = hash_block_tokens(h0, [4, 5, 6, 7])
    pool.cache_full_blocks(
        blocks, [h0, h1], parent_block_hash=None, token_ids=range(8), block_size=4,
        adapter_id=None,
    )  # fmt: skip
    assert [b.block_hash for b in blocks] == [None, None]
    assert pool.cached_block_hash_to_block == {} and pool.take_events() == []
    pool.check_integrity()


def test_a_broken_backward_link_of_the_free_queue_is_reported():
    pool = BlockPool(5)
    _, b, c = list(pool.free_block_queue)[:3]
    b.prev_free = c  # the forward links and the tail are intact
    with pytest.raises(IntegrityError, match="broken free-queue link"):
        pool.check_integrity()


def test_a_broken_tail_link_of_the_free_queue_is_reported():
    """The tail sentinel's backward link is checked too, not only the free blocks' links."""
    pool = BlockPool(5)
    pool.free_block_queue._tail.prev_free = pool.blocks[3]  # the last free block is 4
    with pytest.raises(IntegrityError, match="broken free-queue tail link"):
        pool.check_integrity()


@pytest.mark.parametrize("bad_id", [0, 5, 99])  # the null block, then past the pool
def test_holders_of_ids_that_are_no_pool_block_are_reported(bad_id):
    pool = BlockPool(5)
    with pytest.raises(IntegrityError, match="invalid block ids"):
        pool.check_integrity({bad_id: 1})


def test_taking_zero_blocks_changes_nothing():
    """n=0 is a valid count: get_new_blocks(0) and popleft_n(0) return [] and change nothing."""
    pool = _pool_with_cached_block()
    before = _pool_state(pool)
    assert pool.get_new_blocks(0) == [] and pool.free_block_queue.popleft_n(0) == []
    assert _pool_state(pool) == before
    pool.check_integrity({1: 1, 2: 1})


def test_popleft_takes_the_head_and_refuses_an_empty_queue():
    """popleft returns the head block unlinked; on an empty queue it raises its own error."""
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks[1:])
    assert queue.popleft() is blocks[1] and blocks[1].next_free is None
    assert queue.popleft() is blocks[2] and queue.num_free_blocks == 0
    with pytest.raises(ValueError, match="no free block to pop"):
        queue.popleft()
    assert queue.block_ids() == [] and queue.num_free_blocks == 0
