"""Inputs the manager cannot honour are refused up front, with nothing changed.

Each case here used to fail only after blocks were taken (an exception from hashing,
from a float count, from hashes of another block size), or to be accepted and poison the
prefix cache (fresh blocks cached as computed), or to be read as something else (one
str as a list of one-letter ids, True as block 1). Also a random walk whose cache events,
replayed, must give the cache's exact contents after every step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    Request,
    UnknownRequestError,
)
from tests.host._util import make_request, prefill, snapshot


def _busy() -> KVCacheManager:
    m = KVCacheManager(12, 4, max_model_len=32, enable_kv_cache_events=True)
    prefill(m, make_request("a", range(9)))
    prefill(m, make_request("b", [*range(4), 50, 51]))
    m.take_events()
    return m


def _state(m: KVCacheManager) -> tuple:
    """Everything observable: pool, table, holders, stats, pending events."""
    events = m.take_events()
    m.pool._events.extend(events)  # put them back: reading must not consume them
    return snapshot(m), m.prefix_cache_stats, events, m.request_ids


def _refused(m: KVCacheManager, call, match: str, exc=ValueError) -> None:
    before = _state(m)
    with pytest.raises(exc, match=match):
        call()
    m.check_integrity()
    assert _state(m) == before


# ------------------------------------------------------------------ requests


@pytest.mark.parametrize("token", [2**63, np.uint64(2**64 - 1)])
def test_token_ids_past_int64_are_refused(token):
    # Hashes encode tokens as int64: such a token used to fail inside allocate_slots,
    # after its blocks were taken.
    with pytest.raises(ValueError, match="prompt_token_ids of 'r' must be <= 9223372036854775807"):
        Request("r", [1, token])
    req = Request("r", [1, 2])
    for bad in (token, [3, token]):
        with pytest.raises(ValueError, match="token_ids of 'r' must be <="):
            req.append_output_token_ids(bad)
    assert list(req.all_token_ids) == [1, 2]
    assert Request("r", [2**63 - 1]).update_block_hashes(1)  # the largest one hashes


@pytest.mark.parametrize("key", ["cache_salt", "adapter_id"])
def test_salt_and_adapter_must_be_str(key):
    for bad in (5, b"x", ("x",)):
        with pytest.raises(ValueError, match=f"{key}=.* of 'r' must be None or a str"):
            Request("r", [1], **{key: bad})


def test_one_str_is_not_a_list_of_ids():
    m = KVCacheManager(12, 4, max_model_len=32)
    for rid in "ab":
        prefill(m, make_request(rid, range(9)))
    assert m.num_common_prefix_blocks(["a", "b"]) == 2
    for call in (m.num_common_prefix_blocks, m.rows_of, m.num_blocks_of):
        _refused(m, lambda call=call: call("ab"), "must be a sequence of request ids")


# ------------------------------------------------------------- event replay


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
