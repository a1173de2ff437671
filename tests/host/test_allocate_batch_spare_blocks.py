"""allocate_slots_batch with a request that already holds more blocks than it needs."""

from __future__ import annotations

from jaxkv import KVCacheManager
from tests.host._util import make_request, prefill, snapshot


def _with_spare_blocks():
    """A manager where `a` holds three spare blocks (lookahead) and `b` holds one."""
    m = KVCacheManager(10, 4, max_model_len=64)  # 9 usable blocks, 4 left free
    a, b = make_request("a", range(4)), make_request("b", range(100, 104))
    assert m.allocate_slots(a, 4, num_lookahead_tokens=12) is not None  # 4 blocks
    a.num_computed_tokens = 4
    assert prefill(m, b) is not None  # 1 block
    return m, a, b


def test_spare_blocks_of_one_request_do_not_shrink_what_another_is_given():
    """A request whose held blocks already cover its tokens needs none, and its spare
    blocks are never counted against what the other requests of the batch need: each
    of them gets every block its tokens need, exactly as allocate_slots gives one by one."""
    batched, a1, b1 = _with_spare_blocks()
    single, a2, b2 = _with_spare_blocks()
    free_before = batched.num_free_blocks
    assert batched.allocate_slots_batch([a1, b1], [1, 8])
    assert single.allocate_slots(a2, 1) == []
    assert len(single.allocate_slots(b2, 8)) == 2
    batched.check_integrity()
    assert len(batched.block_ids("b")) == 3
    assert len(batched.block_ids("a")) == 4
    assert batched.num_free_blocks == free_before - 2
    state_a, state_b = snapshot(batched), snapshot(single)
    del state_a["prefix_ids"], state_b["prefix_ids"]  # opaque ids, numbered in call order
    assert state_a == state_b


def test_spare_blocks_do_not_make_a_batch_that_cannot_fit_look_as_if_it_fits():
    """With fewer free blocks than the other requests need, the batch is refused and
    nothing changes, however many spare blocks one request holds."""
    m, a, b = _with_spare_blocks()
    hog = make_request("hog", range(200, 200 + 4 * (m.num_free_blocks - 1)))
    assert prefill(m, hog) is not None  # leaves one free block
    assert m.num_free_blocks == 1
    before = snapshot(m)
    assert not m.allocate_slots_batch([a, b], [1, 8])  # b needs 2
    assert snapshot(m) == before
