"""Prefix-cache counters: one lookup per admission, whatever the retries before it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import KVCacheManager, PrefixCacheStats, Request, RequestStatus, SamplingParams
from tests.host._sched_util import (
    FakeCopier,
    OracleLoadConnector,
    add,
    make_scheduler,
    step,
    token_of,
)

BS = 4


def test_a_request_waiting_for_blocks_counts_one_lookup_when_admitted():
    # b shares a's first 4 blocks but waits (the pool holds a alone) for several steps;
    # every wait looked it up and counted it again: the hit rate read 26% for 15% here.
    rng = np.random.default_rng(0)
    a = rng.integers(1, 500, 26).tolist()
    b = a[:16] + rng.integers(1, 500, 20).tolist()
    sched = make_scheduler(num_blocks=12, block_size=BS, max_model_len=64)
    add(sched, "a", a, max_tokens=16)
    admitted: dict[str, tuple[int, int]] = {}  # id -> (tokens, hits) at admission
    waits = 0
    for step_index in range(200):
        if step_index == 1:
            add(sched, "b", b, max_tokens=2)
        out = sched.schedule()
        for r, done in zip(out.requests, out.num_computed_tokens.tolist(), strict=True):
            admitted.setdefault(r.request_id, (r.num_tokens, done))
        waits += "b" in sched.requests and sched.requests["b"].status is RequestStatus.WAITING
        sched.update_from_output(out, [token_of(r) for r in out.requests])
        if not sched.has_unfinished_requests():
            break
    assert waits >= 3 and sched.stats.num_preemptions == 0  # b was refused room, then admitted
    assert admitted["b"] == (len(b), 16)
    stats = sched.manager.prefix_cache_stats
    assert stats.requests == 2
    assert (stats.queries, stats.hits) == (len(a) + len(b), 16)


def test_count_prefix_lookup_counts_what_it_is_given_and_refuses_what_it_cannot_be():
    m = KVCacheManager(16, BS, max_model_len=64)
    req = Request("r", list(range(10)))
    assert m.get_computed_blocks(req, count=False) == ([], 0)
    assert m.prefix_cache_stats.requests == 0
    for bad, match in [(-1, "num_hit_tokens=-1"), (11, "exceeds the 10 tokens"), (1.0, "int")]:
        with pytest.raises(ValueError, match=match):
            m.count_prefix_lookup(req, bad)
    with pytest.raises(ValueError, match="must be a Request"):
        m.count_prefix_lookup("r", 0)
    other = Request("o", list(range(10)))
    other.update_block_hashes(2)  # hashed for another manager's block size
    for call in (m.get_computed_blocks, lambda r: m.count_prefix_lookup(r, 0)):
        with pytest.raises(ValueError, match="computed with \\(block_size, seed\\)=\\(2, 0\\)"):
            call(other)
    assert m.prefix_cache_stats.requests == 0
    m.count_prefix_lookup(req, 8)
    stats = m.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 10, 8)
    m.count_prefix_lookup(req, 10)  # the bound is inclusive: a hit on every token
    assert m.prefix_cache_stats.hits == 18
    off = KVCacheManager(16, BS, max_model_len=64, enable_prefix_caching=False)
    off.count_prefix_lookup(req, 0)  # no cache, nothing to count
    assert off.prefix_cache_stats.requests == 0


def test_without_prefix_caching_a_lookup_ignores_hashes_of_another_block_size():
    """count_prefix_lookup refuses only where get_computed_blocks would: with prefix
    caching off nothing is hashed, so a request hashed for another block size is looked
    up and counted (as nothing) by both, not refused by one."""
    off = KVCacheManager(16, BS, max_model_len=64, enable_prefix_caching=False)
    other = Request("o", list(range(10)))
    other.update_block_hashes(2)
    assert off.get_computed_blocks(other) == ([], 0)
    off.count_prefix_lookup(other, 0)
    assert off.prefix_cache_stats.requests == 0


def test_a_request_that_skips_cache_reads_ignores_hashes_of_another_block_size():
    # With prefix caching on, get_computed_blocks answers ([], 0) for a request asking for
    # prompt logprobs without hashing it, but count_prefix_lookup refused its hashes.
    m = KVCacheManager(16, BS, max_model_len=64)
    other = Request("o", list(range(10)), SamplingParams(prompt_logprobs=0))
    other.update_block_hashes(2)
    assert m.get_computed_blocks(other) == ([], 0)
    m.count_prefix_lookup(other, 0)
    assert m.prefix_cache_stats.requests == 0
    m.check_integrity()


def test_reset_starts_every_counter_from_zero_and_returns_a_frozen_snapshot():
    m = KVCacheManager(16, BS, max_model_len=64)
    req = Request("r", list(range(10)))
    m.count_prefix_lookup(req, 8)
    before = m.reset_prefix_cache_stats()
    assert (before.requests, before.queries, before.hits) == (1, 10, 8)
    m.count_prefix_lookup(req, 4)  # after the reset: this lookup alone, hits included
    stats = m.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 10, 4)
    assert stats.hit_rate == 0.4
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 0  # a snapshot: writing it would change no counter


def test_a_load_that_waits_for_blocks_counts_one_lookup_when_it_starts():
    # 3 usable blocks: a holds 2, so b's load (blocks for all 9 tokens) cannot start
    # until a finishes. Each refused start looked b up again; only the start counts.
    copier = FakeCopier(4, BS)
    connector = OracleLoadConnector(copier, {"b": BS})
    sched = make_scheduler(num_blocks=4, block_size=BS, max_model_len=16, connector=connector)
    add(sched, "a", range(1, 9), max_tokens=3)
    add(sched, "b", range(20, 29), max_tokens=2)
    waits = 0
    for _ in range(50):
        waits += not connector.started
        step(sched, copier)
        if not sched.has_unfinished_requests():
            break
    assert waits >= 3 and connector.started == ["b"]
    stats = sched.manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 8 + 9, 0)


def test_only_reset_prefix_cache_stats_resets_the_counters():
    # As the README's list of differences from vLLM says: reading them does not reset
    # them (vLLM's make_prefix_cache_stats does), nor does reset_prefix_cache (vLLM's
    # marks its stats reset).
    m = KVCacheManager(8, 4, max_model_len=32)
    a = Request("a", list(range(9)))
    m.get_computed_blocks(a)
    counted = PrefixCacheStats(requests=1, queries=9, hits=0)
    assert m.prefix_cache_stats == counted and m.prefix_cache_stats == counted
    assert m.reset_prefix_cache() is True
    assert m.prefix_cache_stats == counted
    assert m.reset_prefix_cache_stats() == counted
    assert m.prefix_cache_stats == PrefixCacheStats()
