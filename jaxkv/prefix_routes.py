"""The router's memory of where prompt prefixes went: block hashes -> replica index.

A prompt's prefix is keyed by the chained hashes of its first full blocks (jaxkv.hashing,
the keys the replicas' prefix caches use), so two prompts share a key exactly when they
share those blocks' tokens, salt included. The table is bounded: past
`max_tracked_prefixes` keys the least recently used are dropped.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Container, Sequence
from typing import NamedTuple

import numpy as np

from jaxkv.field_checks import int_fields
from jaxkv.hashing import BlockHash, check_hash_key, extend_block_hashes
from jaxkv.prompt_checks import checked_prompt_ids
from jaxkv.request import MAX_TOKEN_ID

__all__ = ["PrefixRoutes", "Route", "routable_prompt_ids"]


class Route(NamedTuple):
    """Where a prompt goes and why."""

    replica: int  # index into the router's replicas
    matched_blocks: int  # leading full blocks whose prefix was routed to `replica` before


def routable_prompt_ids(prompt_token_ids: Sequence[int] | np.ndarray) -> list[int]:
    """The prompt as Python ints; ValueError (before anything is hashed) unless ids a
    block hash can encode. The replica refuses what else it must (an empty prompt, ids
    outside its vocabulary)."""
    return checked_prompt_ids(prompt_token_ids, limit=MAX_TOKEN_ID + 1, allow_empty=True)


class PrefixRoutes:
    """Remembered prefix routes; plain Python, not thread-safe. Raises ValueError naming
    a size that is not an int >= 1, or a hash_seed outside int64."""

    def __init__(
        self, block_size: int, max_prefix_blocks: int, max_tracked_prefixes: int, hash_seed: int
    ) -> None:
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.max_tracked_prefixes = max_tracked_prefixes
        self.hash_seed = hash_seed
        int_fields(self, "block_size", "max_prefix_blocks", "max_tracked_prefixes", minimum=1)
        int_fields(self, "hash_seed", minimum=-(2**63), maximum=2**63 - 1)
        self._replica_of: collections.OrderedDict[BlockHash, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._replica_of)

    def hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """The keys of the prompt's first full blocks (at most max_prefix_blocks), for a
        prompt the router has checked (ints, no bools). Raises ValueError unless
        `cache_salt` is None or a str a hash can encode."""
        check_hash_key("cache_salt", cache_salt)
        head = list(prompt_token_ids[: self.max_prefix_blocks * self.block_size])
        return extend_block_hashes(
            [], head, self.block_size, seed=self.hash_seed, cache_salt=cache_salt,
            tokens_checked=True,  # routable_prompt_ids refused bools
        )  # fmt: skip

    def longest(
        self, hashes: list[BlockHash], replicas: Container[int] | None = None
    ) -> tuple[int, int] | None:
        """(replica, matched blocks) of the longest remembered prefix of `hashes`, among
        those routed to one of `replicas` (the open ones) if given, or None. Changes
        nothing (the order of use included)."""
        for i in range(len(hashes) - 1, -1, -1):
            replica = self._replica_of.get(hashes[i])
            if replica is not None and (replicas is None or replica in replicas):
                return replica, i + 1
        return None

    def remember(self, hashes: list[BlockHash], replica: int) -> None:
        """Routes every prefix in `hashes` to `replica`, as the most recently used."""
        # Longest first: a prompt's shorter prefixes, which more prompts share, become the
        # most recently used and are dropped last.
        table = self._replica_of
        for h in reversed(hashes):
            table[h] = replica
            table.move_to_end(h)
        while len(table) > self.max_tracked_prefixes:
            table.popitem(last=False)

    def forget_replica(self, replica: int) -> None:
        """Drops every prefix routed to `replica` (its prefix cache was emptied)."""
        table = self._replica_of
        for h in [h for h, r in table.items() if r == replica]:
            del table[h]

    def keys(self) -> set[BlockHash]:
        """The remembered prefix keys, as a set of their own."""
        return set(self._replica_of)

    def copy(self) -> PrefixRoutes:
        """A table of its own with the same routes, in the same order of use."""
        other = copy.copy(self)
        other._replica_of = self._replica_of.copy()
        return other

    def restore(self, saved: PrefixRoutes) -> None:
        """Takes the routes of `saved` (a copy()), in their order of use. A copy of them:
        `saved` stays as it is, for a later restore (a queue checkpoint rewound twice)."""
        self._replica_of = saved._replica_of.copy()
