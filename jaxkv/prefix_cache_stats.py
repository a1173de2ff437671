"""Prefix-cache counters of a KVCacheManager: lookups, tokens looked up, tokens found."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefixCacheStats"]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters since the last reset, in tokens (requests counts lookups)."""

    requests: int = 0  # number of get_computed_blocks calls
    queries: int = 0  # tokens looked up (each request's num_tokens)
    hits: int = 0  # tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
