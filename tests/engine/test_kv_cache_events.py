"""CacheConfig.enable_kv_cache_events: an engine's prefix-cache events, for a router.

A consumer that applies the events in order (BlockStored adds hashes, BlockRemoved drops
them, AllBlocksCleared empties its table) holds exactly the hashes the engine's prefix
cache holds, through evictions under a tight pool and a reset; each stored block's
tokens are the tokens of the prompt it came from.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import AllBlocksCleared, BlockRemoved, BlockStored, CacheConfig, SamplingParams
from jaxkv.engine import Engine
from jaxkv.hashing import extend_block_hashes
from tests.engine._util import (
    BLOCK_SIZE,
    TIGHT_BLOCKS,
    VOCAB,
    assert_all_blocks_free,
    engine_config,
    tiny_model,
)


def _engine(*, events: bool) -> Engine:
    config = engine_config(num_blocks=TIGHT_BLOCKS)
    cache = dataclasses.replace(config.cache, enable_kv_cache_events=events)
    return Engine(tiny_model(), None, dataclasses.replace(config, cache=cache))


class EventMirror:
    """A router's view of one engine's prefix cache, built from its events alone."""

    def __init__(self) -> None:
        self.table: dict = {}  # cached hash -> its parent's hash (None at a prompt's start)
        self.parents: dict = {}  # every hash ever stored -> its parent's hash
        self.tokens: dict = {}  # every hash ever stored -> its block's tokens
        self.num_removed = 0

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                assert event.block_size == BLOCK_SIZE
                tokens = np.array(event.token_ids).reshape(len(event.block_hashes), BLOCK_SIZE)
                parent = event.parent_block_hash  # of the first; each next one's: the one before
                for block_hash, block_tokens in zip(event.block_hashes, tokens, strict=True):
                    assert block_hash not in self.table, "stored twice, not removed between"
                    self.table[block_hash] = self.parents[block_hash] = parent
                    self.tokens[block_hash] = tuple(block_tokens.tolist())
                    parent = block_hash
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    del self.table[block_hash]  # KeyError: removed what was never stored
                    self.num_removed += 1
            else:
                assert isinstance(event, AllBlocksCleared)
                self.table.clear()


def test_events_mirror_the_prefix_cache_through_evictions_and_a_reset():
    rng = np.random.default_rng(7)
    mirror = EventMirror()
    prompts_seen = []
    with _engine(events=True) as engine:
        cached = engine.manager.pool.cached_block_hash_to_block
        for _ in range(4):  # rounds of shared-prefix prompts: hits, then evictions
            prefix = rng.integers(0, VOCAB, 9).tolist()
            prompts = [prefix + rng.integers(0, VOCAB, int(n)).tolist() for n in (3, 6, 10)]
            prompts_seen += prompts
            engine.generate(prompts, SamplingParams(max_tokens=4), progress=False)
            mirror.apply(engine.manager.take_events())
            assert set(mirror.table) == set(cached)
        assert mirror.num_removed > 0, "the tight pool evicted nothing: the test lost its point"
        assert_all_blocks_free(engine)
        assert engine.manager.reset_prefix_cache()
        events = engine.manager.take_events()
        assert isinstance(events[-1], AllBlocksCleared)
        mirror.apply(events)
        assert mirror.table == {} and not cached
        engine.manager.check_integrity()
    # A block stored at a prompt's start holds its first tokens, under the hash a router
    # elsewhere computes for them.
    first_blocks = {tuple(p[:BLOCK_SIZE]): p for p in prompts_seen}
    roots = [h for h, parent in mirror.parents.items() if parent is None]
    assert roots
    for root in roots:
        prompt = first_blocks[mirror.tokens[root]]
        assert extend_block_hashes([], prompt, BLOCK_SIZE, seed=0)[0] == root


def test_off_by_default_no_event_is_kept():
    assert CacheConfig().enable_kv_cache_events is False
    with _engine(events=False) as engine:
        engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], SamplingParams(max_tokens=2), progress=False)
        assert engine.manager.pool.cached_block_hash_to_block  # blocks were cached
        assert engine.manager.take_events() == []


@pytest.mark.parametrize("value", ["true", 1, None])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(value):
    with pytest.raises(ValueError, match="enable_kv_cache_events="):
        CacheConfig(enable_kv_cache_events=value)
