"""allocate_slots_batch's caching of the blocks a step fills equals cache_full_blocks.

The same random workload runs twice: once as it is, once with every filled block cached
through slot_allocation.cache_full_blocks request by request. Each step must leave the
same prefix cache (hash -> block), the same block hashes and cached counts per request,
and the same outputs: under cache salts, adapter ids, shared prompts (equal hashes: the
second block is left uncached), cache events and preemptions.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from jaxkv import KVCacheManager, Request, SamplingParams, batch_allocation
from jaxkv.config import SchedulerConfig
from jaxkv.scheduler import Scheduler
from jaxkv.slot_allocation import cache_full_blocks


def _per_request(manager, filling):
    for request, num_tokens in filling:
        cache_full_blocks(manager, request, num_tokens)


def _run(seed: int, *, events: bool, num_blocks: int) -> list:
    """Snapshots of one random workload, step by step."""
    rng = np.random.default_rng(seed)
    manager = KVCacheManager(
        num_blocks, 4, max_model_len=40, enable_prefix_caching=True, enable_kv_cache_events=events
    )
    config = SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=6, max_model_len=40)
    sched = Scheduler(config, manager)
    system = rng.integers(0, 20, 9).tolist()
    snapshots = []
    for i in range(70):
        if rng.random() < 0.3:
            prompt = (
                system[: rng.integers(0, 10)] + rng.integers(0, 20, rng.integers(1, 5)).tolist()
            )
            request = Request(
                f"r{i}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 20))),
                cache_salt=[None, "a"][int(rng.integers(2))],
                adapter_id=[None, "lora"][int(rng.integers(2))],
            )  # fmt: skip
            sched.add_request(request)
        out = sched.schedule()
        tokens = rng.integers(0, 3, out.num_requests)  # few distinct: equal blocks recur
        outputs = sched.update_from_output(out, tokens)
        snapshots.append(
            (
                outputs,
                {h: b.block_id for h, b in manager.pool.cached_block_hash_to_block.items()},
                sorted(
                    (r.request_id, tuple(r.block_hashes), manager._num_cached.get(r.request_id))
                    for r in sched.requests.values()
                ),
                manager.take_events() if events else None,
            )
        )
    return snapshots


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), events=st.booleans(), num_blocks=st.sampled_from([12, 64]))
def test_batch_caching_equals_cache_full_blocks(seed, events, num_blocks):
    fast = _run(seed, events=events, num_blocks=num_blocks)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch_allocation, "_cache_filled_blocks", _per_request)
        slow = _run(seed, events=events, num_blocks=num_blocks)
    assert fast == slow


def test_batch_caching_hashes_decode_blocks_itself(monkeypatch):
    """The comparison above covers blocks that the batch path hashed, not only fallbacks."""
    hashed = []
    original = batch_allocation.extend_block_hashes

    def counting(*args, **kwargs):
        hashed.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(batch_allocation, "extend_block_hashes", counting)
    _run(1, events=False, num_blocks=64)
    assert len(hashed) > 20


def test_a_decode_block_equal_to_one_already_cached_stays_uncached():
    # Two requests with one prompt, allocated without cache hits: each holds its own
    # blocks. When a decode step fills their second blocks with equal tokens, the first
    # takes the hash; the second is a duplicate and must stay uncached, as
    # cache_full_blocks leaves it (caching it too left the first block carrying a hash
    # the cache map no longer gave it).
    manager = KVCacheManager(16, 4, max_model_len=40)
    a, b = (Request(r, [1, 2, 3, 4, 5], SamplingParams(max_tokens=8)) for r in "ab")
    for request in (a, b):
        assert manager.allocate_slots(request, 5) is not None
        request.num_computed_tokens = 5
        request.append_output_token_ids([6, 7, 8])
    assert manager.allocate_slots_batch([a, b], [3, 3])
    blocks_a, blocks_b = (manager._blocks[r.request_id] for r in (a, b))
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
    assert [blk.block_hash for blk in blocks_a] == a.block_hashes
    assert [blk.block_hash for blk in blocks_b] == [None, None]
    cached = manager.pool.cached_block_hash_to_block
    assert [cached[h] for h in a.block_hashes] == blocks_a
    manager.check_integrity()


def test_a_decode_block_whose_tokens_cannot_be_hashed_is_refused_as_allocate_slots_refuses_it():
    # A token list mutated past int64 (all_token_ids says not to mutate it): the block it
    # fills cannot be hashed, and both paths raise the hash's own error, caching nothing.
    for allocate in (
        lambda m, r: m.allocate_slots(r, 1),
        lambda m, r: m.allocate_slots_batch([r], [1]),
    ):
        manager = KVCacheManager(16, 4, max_model_len=40)
        request = Request("r", range(7))
        assert manager.allocate_slots(request, 7) is not None
        request.num_computed_tokens = 7
        request.all_token_ids.append(2**64)  # fills block 1
        hashes, cached = list(request.block_hashes), dict(manager.pool.cached_block_hash_to_block)
        with pytest.raises(ValueError, match="token_ids must be ints .* that fit in int64"):
            allocate(manager, request)
        assert request.block_hashes == hashes and len(hashes) == 1
        assert manager.pool.cached_block_hash_to_block == cached and manager._num_cached["r"] == 1
        manager.check_integrity()
