"""The router's rule: which replica a prompt goes to (jaxkv.router).

A prompt goes to the replica of its longest remembered prefix (jaxkv.prefix_routes), unless
that replica has more than `max_imbalance` outstanding sequences beyond the least-loaded
one; a prompt with no remembered prefix goes to the least-loaded replica (the first of
them on a tie). Only open replicas count (a prefix routed to a closed one is as if not
remembered). The counts are the router's: it keeps them as it adds, steps and aborts.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

from jaxkv.field_checks import as_int
from jaxkv.hashing import BlockHash
from jaxkv.prefix_routes import PrefixRoutes, Route, routable_prompt_ids


def _routes_size(name: str) -> property:
    return property(lambda router: getattr(router._routes, name), doc=f"The router's {name}.")


class RoutingRule:
    """The remembered routes, the outstanding sequences per replica and the rule over them;
    PrefixAwareRouter's base (its docstring gives the arguments)."""

    # The replicas a request may go to, in order: the router's open ones (it raises
    # RuntimeError when every one is closed).
    _open_replicas: Callable[[], Sequence[int]]

    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        max_prefix_blocks: int,
        max_imbalance: int | None,
        max_tracked_prefixes: int,
        hash_seed: int,
    ) -> None:
        self._routes = PrefixRoutes(block_size, max_prefix_blocks, max_tracked_prefixes, hash_seed)
        self.max_imbalance = max_imbalance
        self._outstanding = [0] * num_replicas  # replica -> unfinished sequences
        # The routes of the live queue checkpoints (_checkpoint_routes), reset with these.
        self._saved_routes: weakref.WeakSet[_SavedRoutes] = weakref.WeakSet()

    # Read-only: the remembered routes are keyed by them.
    block_size = _routes_size("block_size")
    max_prefix_blocks = _routes_size("max_prefix_blocks")
    max_tracked_prefixes = _routes_size("max_tracked_prefixes")
    hash_seed = _routes_size("hash_seed")

    @property
    def max_imbalance(self) -> int | None:
        """See PrefixAwareRouter; settable, checked as its constructor checks it (ValueError naming
        it unless None or an int >= 0, the old value kept)."""
        return self._max_imbalance

    @max_imbalance.setter
    def max_imbalance(self, value: int | None) -> None:
        checked = None if value is None else as_int(value)
        if value is not None and (checked is None or checked < 0):
            raise ValueError(f"max_imbalance={value!r} must be None or an int >= 0")
        self._max_imbalance = checked

    @property
    def num_outstanding(self) -> tuple[int, ...]:
        """Unfinished sequences per replica: each unfinished request counts its samples
        still running (SamplingParams.n of them at first; each takes a batch row)."""
        return tuple(self._outstanding)

    def _caches_emptied(self, emptied: list[int], held: list[tuple[int, list[BlockHash]]]) -> None:
        """Forgets the routes to the replicas in `emptied` (their prefix caches were), but
        those of the requests they still hold (queued there, they fill them again): `held`
        gives each request's replica and prefix keys, oldest first. A route to any other
        replica (one that kept its cache) stays as it was. The routes each live queue
        checkpoint keeps for its rewind are reset alike (_checkpoint_routes)."""
        _forget_emptied(self._routes, emptied, held)
        for saved in list(self._saved_routes):
            saved.caches_emptied(emptied, held)

    def _checkpoint_routes(self, held: Iterable[list[BlockHash]]) -> Callable[[], None]:
        """A function that puts back the routes as they are now, undoing those the
        requests queued since added: `held` gives the prefix keys of the requests held
        now, the others' are those of requests queued since (by identity: each queueing
        has a list of its own). A reset since (_caches_emptied) stays in force: it applies
        to the routes kept for the rewind too, as if no request had been queued since."""
        saved = _SavedRoutes(self._routes, held)
        self._saved_routes.add(saved)  # while the function lives: it holds `saved`
        return lambda: self._routes.restore(saved.routes)

    def route(self, prompt_token_ids: Sequence[int], *, cache_salt: str | None = None) -> Route:
        """The replica a prompt would go to now: an open one (a prefix routed to a closed
        replica counts as not remembered). Changes nothing. Raises ValueError unless the
        prompt is a 1-D sequence of token ids (ints in [0, 2**63)) and the salt None or a
        str; RuntimeError when every replica is closed."""
        return self._route(self._routes.hashes(routable_prompt_ids(prompt_token_ids), cache_salt))

    def _route(self, hashes: list[BlockHash]) -> Route:
        candidates = self._open_replicas()
        least = min(candidates, key=self._outstanding.__getitem__)
        found = self._routes.longest(hashes, candidates)
        if found is None:
            return Route(least, 0)
        replica, matched = found
        over = self._outstanding[replica] - self._outstanding[least]
        if self.max_imbalance is not None and over > self.max_imbalance:
            return Route(least, 0)
        return Route(replica, matched)


def _forget_emptied(
    routes: PrefixRoutes, emptied: list[int], held: list[tuple[int, list[BlockHash]]]
) -> None:
    """RoutingRule._caches_emptied on `routes`. The routes put back take only the room
    the bound leaves beside the kept ones (the latest put back first): putting them back
    one by one past it dropped routes to replicas that kept their caches."""
    for index in set(emptied):
        routes.forget_replica(index)
    kept = routes.keys()  # to the replicas that kept their caches
    again: dict[BlockHash, int] = {}  # in order of use, as remember() would leave them
    for replica, hashes in held:  # oldest first: the latest request's replica wins
        if replica in emptied:
            for h in reversed(hashes):
                if h not in kept:
                    again.pop(h, None)
                    again[h] = replica
    room = routes.max_tracked_prefixes - len(kept)
    for h, replica in list(again.items())[max(len(again) - room, 0) :]:
        routes.remember([h], replica)


class _SavedRoutes:
    """The routes a queue checkpoint's rewind puts back: a copy of the table at the
    checkpoint, reset as the table is, but with the requests held at the checkpoint
    only (those queued since must leave no route behind)."""

    def __init__(self, routes: PrefixRoutes, held: Iterable[list[BlockHash]]) -> None:
        self.routes = routes.copy()
        self._held = {id(hashes): hashes for hashes in held}  # kept: their ids stay theirs

    def caches_emptied(self, emptied: list[int], held: list[tuple[int, list[BlockHash]]]) -> None:
        _forget_emptied(self.routes, emptied, [(r, h) for r, h in held if id(h) in self._held])
