"""PrefixAwareRouter.reset_prefix_cache: every replica's prefix cache is emptied, and the
routes to a replica are forgotten exactly when its cache was; a refusing replica keeps
both. Over fake replicas (tests/sharding/test_router.py's), without engines or jax."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxkv.prefix_routes import PrefixRoutes
from jaxkv.router import PrefixAwareRouter, Route
from tests.sharding._router_util import BLOCK, FakeReplica


class ResettingReplica(FakeReplica):
    """Refuses to reset while it holds a request, as Engine.reset_prefix_cache does."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.resets = 0

    def reset_prefix_cache(self) -> bool:
        if self.running:
            return False
        self.resets += 1
        return True


def _prompt(first: int) -> list[int]:
    return list(range(first, first + 2 * BLOCK))


def _routed_router() -> tuple[PrefixAwareRouter, list[ResettingReplica], list[list[int]]]:
    """Two replicas, each given one two-block prompt and stepped until it finished."""
    replicas = [ResettingReplica(0), ResettingReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    prompts = [_prompt(0), _prompt(100)]
    assert [router.replica_of(router.add_request(p)) for p in prompts] == [0, 1]
    while router.has_unfinished_requests():
        router.step()
    assert [router.route(p) for p in prompts] == [Route(0, 2), Route(1, 2)]
    return router, replicas, prompts


def test_a_reset_empties_every_replica_and_forgets_every_route():
    router, replicas, prompts = _routed_router()
    assert router.reset_prefix_cache() is True
    assert [r.resets for r in replicas] == [1, 1]
    assert [router.route(p).matched_blocks for p in prompts] == [0, 0]
    # Routes are learnt again from the next requests.
    router.add_request(prompts[1])
    assert router.route(prompts[1] + [7]).matched_blocks == 2


class _QueueingReplica(ResettingReplica):
    """Resets while its requests are only queued (hold no blocks), as an Engine does."""

    def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True


def test_a_reset_keeps_the_routes_of_requests_still_queued_on_the_replica():
    # Their prefixes fill the emptied cache again once they run; the reset used to forget
    # their routes, so requests sharing them went to the least loaded replica instead.
    replicas = [_QueueingReplica(0), _QueueingReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK, max_imbalance=None)
    done = router.add_request(_prompt(0))
    while router.has_unfinished_requests():
        router.step()
    queued = router.add_request(_prompt(100))  # to replica 0: both are idle
    router.add_request(_prompt(200))
    assert (router.replica_of(queued), router.replica_of("dp-2")) == (0, 1)
    assert router.reset_prefix_cache() is True and [r.resets for r in replicas] == [1, 1]
    assert router.route(_prompt(0)).matched_blocks == 0  # finished: its route is gone
    assert router.route(_prompt(100)) == Route(0, 2)
    assert router.route(_prompt(200)) == Route(1, 2)
    router.abort([queued, "dp-2"])
    assert done == "dp-0" and router.reset_prefix_cache() is True
    assert router.route(_prompt(100)).matched_blocks == 0


def test_a_refusing_replica_keeps_its_routes_and_the_others_are_reset():
    router, replicas, prompts = _routed_router()
    router.add_request(prompts[1] + [5])  # replica 1 holds a request: it refuses
    assert router.replica_of("dp-2") == 1
    assert router.reset_prefix_cache() is False
    assert [r.resets for r in replicas] == [1, 0]
    assert router.route(prompts[0]).matched_blocks == 0
    assert router.route(prompts[1]) == Route(1, 2)
    assert router.num_outstanding == (0, 1)  # no request is touched


def test_a_refusing_replica_keeps_a_route_that_a_reset_replicas_queued_request_shares():
    # Replica 0 queues a request over a prefix that then moved to replica 1 (max_imbalance
    # 0). Replica 0's reset put the routes of its queued request back, that prefix's too:
    # replica 1, which refused and still holds it in its cache, lost its route to it.
    replicas = [_QueueingReplica(0), ResettingReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK, max_imbalance=0)
    shared = _prompt(0)
    first = router.add_request(shared + _prompt(100)[:BLOCK])
    moved = router.add_request(shared + _prompt(200)[:BLOCK])
    assert (router.replica_of(first), router.replica_of(moved)) == (0, 1)
    assert router.route(shared) == Route(1, 2)
    assert router.reset_prefix_cache() is False and [r.resets for r in replicas] == [1, 0]
    assert router.route(shared) == Route(1, 2)
    assert router.route(shared + _prompt(100)[:BLOCK]) == Route(0, 3)  # its own block


def test_a_reset_of_both_replicas_that_queue_a_prefix_keeps_its_route_where_it_was():
    # Replica 0 put its queued requests' routes back first, then replica 1 did, taking
    # the shared prefix last routed to replica 0 (which holds it queued, too) from it.
    replicas = [_QueueingReplica(0), _QueueingReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK, max_imbalance=0)
    shared = _prompt(0)
    ids = [router.add_request(p) for p in (_prompt(300), shared + [1], shared + [2])]
    moved = router.add_request(shared + [3])  # replica 1 is busier: the prefix moves
    assert [router.replica_of(i) for i in [*ids, moved]] == [0, 1, 1, 0]
    router.max_imbalance = None  # routes as remembered, whatever the load
    assert router.route(shared) == Route(0, 2)
    assert router.reset_prefix_cache() is True and [r.resets for r in replicas] == [1, 1]
    assert router.route(shared) == Route(0, 2)
    assert router.route(_prompt(300)) == Route(0, 2)


def test_putting_back_queued_routes_never_drops_a_refusing_replicas_route():
    # One key per prompt, two tracked. Replica 0 queues A and C (A's route already dropped
    # as least recently used); replica 1 holds B and refuses to reset. Putting back A and
    # C past the bound used to drop B, the route of a replica that kept its cache.
    replicas = [_QueueingReplica(0), ResettingReplica(1)]
    router = PrefixAwareRouter(
        replicas, block_size=BLOCK, max_prefix_blocks=1, max_tracked_prefixes=2,
        max_imbalance=None,
    )  # fmt: skip
    a, b, c = _prompt(0), _prompt(100), _prompt(200)
    assert [router.replica_of(router.add_request(p)) for p in (a, b, c)] == [0, 1, 0]
    assert router.route(a).matched_blocks == 0  # dropped: the table holds two keys
    assert router.reset_prefix_cache() is False and [r.resets for r in replicas] == [1, 0]
    assert router.route(b) == Route(1, 1)
    assert router.route(c) == Route(0, 1)  # the room left goes to the latest queued


def test_a_replica_without_the_method_keeps_its_routes():
    replicas = [ResettingReplica(0), FakeReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    for first in (0, 100):
        router.add_request(_prompt(first))
    while router.has_unfinished_requests():
        router.step()
    assert router.reset_prefix_cache() is False
    assert router.route(_prompt(0)).matched_blocks == 0
    assert router.route(_prompt(100)) == Route(1, 2)


def test_a_closed_router_refuses_to_reset():
    router, replicas, _ = _routed_router()
    router.close()
    with pytest.raises(RuntimeError):
        router.reset_prefix_cache()
    assert [r.resets for r in replicas] == [0, 0]


def test_forget_replica_drops_only_its_routes_and_keeps_the_order_of_use():
    routes = PrefixRoutes(BLOCK, max_prefix_blocks=4, max_tracked_prefixes=4, hash_seed=0)
    a, b, c = (routes.hashes(_prompt(first), None) for first in (0, 100, 200))
    routes.remember(a, 0)
    routes.remember(b, 1)
    routes.remember(c, 2)  # over capacity: a's two routes, the least recently used, go
    routes.remember(a[:1], 0)
    assert len(routes) == 4 and routes.longest(b) == (1, 1)  # b's longer route went
    routes.forget_replica(0)
    assert len(routes) == 3
    assert routes.longest(a) is None
    assert routes.longest(b) == (1, 1) and routes.longest(c) == (2, 2)
    routes.remember(a, 3)  # over capacity again: b's route, now the oldest, goes first
    assert routes.longest(b) is None
    assert routes.longest(a) == (3, 2) and routes.longest(c) == (2, 2)


def test_the_sizes_routes_are_keyed_by_are_read_only_and_checked_by_the_table():
    """Assigning router.block_size (say) would leave the routes hashed with the old one."""
    router = PrefixAwareRouter([ResettingReplica(0)], block_size=BLOCK, hash_seed=7)
    for name in ("block_size", "max_prefix_blocks", "max_tracked_prefixes", "hash_seed"):
        with pytest.raises(AttributeError):
            setattr(router, name, 3)
    sizes = (router.block_size, router.max_prefix_blocks, router.max_tracked_prefixes)
    assert sizes == (BLOCK, 8, 1 << 16) and router.hash_seed == 7
    for bad in ({"block_size": 0}, {"max_tracked_prefixes": 0}, {"hash_seed": 2**63}):
        kwargs = dict(block_size=BLOCK, max_prefix_blocks=1, max_tracked_prefixes=1, hash_seed=0)
        with pytest.raises(ValueError, match=f"{list(bad)[0]}="):
            PrefixRoutes(**(kwargs | bad))


class AnsweringReplica(ResettingReplica):
    """Resets, then answers `answer` (a third-party replica's non-bool)."""

    def __init__(self, index: int, answer: object) -> None:
        super().__init__(index)
        self.answer = answer

    def reset_prefix_cache(self):
        super().reset_prefix_cache()
        return self.answer


@pytest.mark.parametrize("answer", [None, "yes", 1, [True]])
def test_a_reset_answer_that_is_no_bool_is_refused_after_every_replica_was_asked(answer):
    """It was read by its truth: None and 0 counted as a refusal, "yes" or a list as an
    emptied cache, with no word of the broken replica."""
    replicas = [AnsweringReplica(0, answer), ResettingReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    prompts = [_prompt(0), _prompt(100)]
    assert [router.replica_of(router.add_request(p)) for p in prompts] == [0, 1]
    while router.has_unfinished_requests():
        router.step()
    with pytest.raises(
        ValueError,
        match=rf"reset_prefix_cache\(\) of replicas\[0\] \(AnsweringReplica\) returned "
        rf"{re.escape(repr(answer))}; expected a bool",
    ):
        router.reset_prefix_cache()
    assert [r.resets for r in replicas] == [1, 1]  # replica 1 was asked all the same
    assert router.route(prompts[0]) == Route(0, 2)  # unknown: kept
    assert router.route(prompts[1]).matched_blocks == 0


def test_a_numpy_bool_reset_answer_is_a_bool():
    replicas = [AnsweringReplica(0, np.bool_(True))]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    assert router.reset_prefix_cache() is True


@pytest.mark.parametrize("attribute", [True, "reset", None])
def test_a_reset_prefix_cache_that_is_no_method_is_named_before_any_replica_is_reset(attribute):
    # A bool or a str there raised a bare TypeError ("'bool' object is not callable")
    # naming no replica, after the replicas before it had been reset. None is no method.
    router, replicas, prompts = _routed_router()
    replicas[1].reset_prefix_cache = attribute
    if attribute is None:
        assert router.reset_prefix_cache() is False
        assert router.route(prompts[1]) == Route(1, 2)
        return
    with pytest.raises(
        ValueError,
        match=rf"replicas\[1\] \(ResettingReplica\)\.reset_prefix_cache is "
        rf"{re.escape(repr(attribute))}; expected a method",
    ):
        router.reset_prefix_cache()
    assert [r.resets for r in replicas] == [0, 0]
    assert [router.route(p) for p in prompts] == [Route(0, 2), Route(1, 2)]


def test_a_queue_checkpoint_rewind_leaves_the_routes_a_later_reset_forgot_forgotten():
    # The rewind put back the whole table as at the checkpoint: the routes the reset had
    # dropped came back, to replicas whose caches no longer held those prefixes.
    router, _, prompts = _routed_router()
    rewind = router.queue_checkpoint()
    assert router.reset_prefix_cache() is True
    added = router.add_request(_prompt(300))
    assert router.abort(added) and router.route(_prompt(300)).matched_blocks == 2
    rewind()
    assert [router.route(p).matched_blocks for p in [*prompts, _prompt(300)]] == [0, 0, 0]
    assert router.add_request(prompts[1]) == "dp-2"  # the id it gave back
    assert router.abort("dp-2") and router.route(prompts[1]).matched_blocks == 2
    rewind()  # again: the reset is still in force, the route added since undone
    assert [router.route(p).matched_blocks for p in prompts] == [0, 0]


def test_a_reset_between_two_rewinds_of_one_checkpoint_stays_in_force():
    router, _, prompts = _routed_router()
    rewind = router.queue_checkpoint()
    rewind()
    assert router.reset_prefix_cache() is True
    rewind()
    assert [router.route(p).matched_blocks for p in prompts] == [0, 0]


def test_a_rewind_keeps_what_a_later_reset_kept_and_undoes_only_the_requests_queued_since():
    # A reset keeps the routes of the requests a replica still queues: those queued before
    # the checkpoint stay after the rewind, those of requests queued since go.
    replicas = [_QueueingReplica(0), _QueueingReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK, max_imbalance=None)
    held = router.add_request(_prompt(0))  # to replica 0
    router.add_request(_prompt(100), request_id="f")  # to replica 1
    rewind = router.queue_checkpoint()
    since = router.add_request(_prompt(200))  # to replica 0: both hold one
    assert router.abort("f") and router.reset_prefix_cache() is True
    assert [router.route(_prompt(p)).matched_blocks for p in (0, 100, 200)] == [2, 0, 2]
    assert router.abort(since)
    rewind()
    assert router.route(_prompt(0)) == Route(0, 2) and router.replica_of(held) == 0
    assert [router.route(_prompt(p)).matched_blocks for p in (100, 200)] == [0, 0]


def test_the_routes_kept_for_a_rewind_go_with_it():
    # Each live rewind's copy is reset with the table: generate's, dropped once it
    # returns or raises, must not pile up for every later reset to walk.
    router, _, prompts = _routed_router()
    router.generate([prompts[0]], progress=False)
    with pytest.raises(ValueError):
        router.generate([prompts[1], []], progress=False)
    rewind = router.queue_checkpoint()
    assert len(router._saved_routes) == 1
    del rewind
    assert len(router._saved_routes) == 0 and router.reset_prefix_cache() is True


def test_the_routes_put_back_keep_a_shared_first_block_as_the_most_recently_used():
    """Two queued requests share their first block. Put back as remember() would leave
    them, that shared key is the most recently used, so it is the one a bound of one key
    keeps: a longer prefix, which fewer prompts share, goes first."""
    router = PrefixAwareRouter([_QueueingReplica(0)], block_size=BLOCK, max_tracked_prefixes=1)
    shared = _prompt(0)[:BLOCK]
    for tail in (100, 200):
        router.add_request(shared + _prompt(tail)[:BLOCK])
    assert router.route(shared + _prompt(200)[:BLOCK]) == Route(0, 1)
    assert router.reset_prefix_cache() is True
    assert router.route(shared + _prompt(200)[:BLOCK]) == Route(0, 1)
    assert router.route(shared + _prompt(300)[:BLOCK]) == Route(0, 1)
