"""Prefix-cache events replayed by a listener give the cache's exact contents.

A random walk of lookups, stale hits, prefills, batched decodes, frees and resets: after
every step the stored/removed/cleared events replayed into a set equal the manager's
cache map, and an id list the caller keeps and mutates in place still gets the exact
shared prefix.
"""

from __future__ import annotations

import random

import pytest

from jaxkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    Request,
    UnknownRequestError,
)


def _replay(cache: set, events) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            assert cache.isdisjoint(event.block_hashes)
            cache.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert cache.issuperset(event.block_hashes)
            cache.difference_update(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            cache.clear()


@pytest.mark.parametrize("seed", range(3))
def test_events_replayed_give_the_cache_and_reused_id_lists_stay_exact(seed):
    """Random lookups, stale hits, prefills, batched decodes, frees and resets.

    After every step the replayed events equal the cache map, and num_common_prefix_blocks
    of an id list the caller keeps and mutates in place equals a brute-force compare.
    """
    rng = random.Random(seed)
    m = KVCacheManager(24, 2, max_model_len=24, enable_kv_cache_events=True)
    bases = [[rng.randrange(3) for _ in range(24)] for _ in range(2)]
    live: dict[str, Request] = {}
    pending: list[tuple[Request, list[int], int]] = []  # lookups allocated later
    cache: set = set()
    ids: list[str] = []
    for _ in range(700):
        op = rng.random()
        if op < 0.3:
            rid = f"r{rng.randrange(10)}"
            if rid in live or any(r.request_id == rid for r, _, _ in pending):
                continue
            tokens = bases[rng.randrange(2)][: rng.randint(1, 18)] + [rng.randrange(3)]
            req = Request(rid, tokens, cache_salt=rng.choice([None, "s"]))
            pending.append((req, *m.get_computed_blocks(req)))
        elif op < 0.45 and pending:
            req, hit, n = pending.pop(rng.randrange(len(pending)))
            try:
                new = m.allocate_slots(
                    req, req.num_tokens - n, num_new_computed_tokens=n, new_computed_blocks=hit
                )
            except ValueError as e:
                assert "stale cache hit" in str(e)
                continue
            if new is not None:
                req.num_computed_tokens = req.num_tokens
                live[req.request_id] = req
        elif op < 0.65 and live:
            batch = [r for r in live.values() if r.num_tokens < 24 and rng.random() < 0.6]
            for r in batch:
                r.append_output_token_ids(rng.randrange(3))
            if m.allocate_slots_batch(batch, [1] * len(batch)):
                for r in batch:
                    r.num_computed_tokens += 1
            else:
                for r in batch:
                    r.output_token_ids.pop()
                    r._all_token_ids.pop()
        elif op < 0.8 and live:
            m.free(live.pop(rng.choice(sorted(live))))
        elif op < 0.83:
            assert m.reset_prefix_cache() is (m.num_free_blocks == 23)
        elif live:
            if not ids or rng.random() < 0.3:
                ids = [rng.choice(sorted(live)) for _ in range(rng.randint(1, 4))]
            elif rng.random() < 0.5:
                ids.reverse()  # the same list object, changed in place
            if not set(ids) <= set(live):
                with pytest.raises(UnknownRequestError):
                    m.num_common_prefix_blocks(ids)
                ids = []
            else:
                rows = [m.block_ids(i) for i in ids]
                k = 0
                while all(len(r) > k and r[k] == rows[0][k] for r in rows):
                    k += 1
                assert m.num_common_prefix_blocks(ids) == k
        _replay(cache, m.take_events())
        assert cache == set(m.pool.cached_block_hash_to_block)
        m.check_integrity()
