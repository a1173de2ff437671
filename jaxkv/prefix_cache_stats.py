"""Prefix-cache counters of a KVCacheManager: lookups, tokens looked up, tokens found."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefixCacheCounter", "PrefixCacheStats"]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters since the last reset, in tokens (requests counts lookups).

    A lookup is counted when made (KVCacheManager.get_computed_blocks) or, for the
    Scheduler, once the request it was made for is admitted: a request that waits for
    blocks is looked up again each step but counted once. An admission that
    Scheduler.discard undoes is counted again when it is redone. A request whose KV the
    connector loads is counted when its load starts (its hits: the device cache's only),
    not again when the landed load admits it; a load that fails, like a discard, makes
    the request's next admission count again, and a request aborted while loading stays
    counted. Only KVCacheManager.reset_prefix_cache_stats() resets them: reading them does
    not, nor does reset_prefix_cache() (vLLM's marks its stats reset).
    """

    requests: int = 0  # lookups counted
    queries: int = 0  # tokens looked up (each request's num_tokens)
    hits: int = 0  # tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCacheCounter:
    """The running PrefixCacheStats of one manager (plain ints; a snapshot on read)."""

    __slots__ = ("requests", "queries", "hits")

    def __init__(self) -> None:
        self.requests = self.queries = self.hits = 0

    @property
    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.requests, self.queries, self.hits)

    def count(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def reset(self) -> PrefixCacheStats:
        """Returns the counters and starts new ones from zero."""
        stats = self.stats
        self.requests = self.queries = self.hits = 0
        return stats
