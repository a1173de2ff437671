"""A replica closed directly (engine.close() on one of router.replicas): the router routes
no new request to it, releases the requests it still held there at its next step, and
refuses a request only when every replica is closed."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter, Route
from tests.sharding._router_util import BLOCK, FakeReplica


class ClosingReplica(FakeReplica):
    """Has Engine's `closed`; once closed it refuses add_request and step, as Engine does.
    Its close keeps `running` when `keeps` (a replica that still says it has requests)."""

    def __init__(self, index: int, keeps: bool = False) -> None:
        super().__init__(index)
        self.closed, self.keeps = False, keeps

    def close(self, timeout_s: float = 60.0) -> None:
        self.closed = True
        if not self.keeps:
            self.running.clear()

    def add_request(self, prompt_token_ids, sampling_params=None, *, request_id, cache_salt=None):
        if self.closed:
            raise RuntimeError("the replica is closed")
        return super().add_request(
            prompt_token_ids, sampling_params, request_id=request_id, cache_salt=cache_salt
        )

    def step(self):
        if self.closed:
            raise RuntimeError("the replica is closed")
        return super().step()


def _router(n: int = 2, **kwargs) -> tuple[PrefixAwareRouter, list[ClosingReplica]]:
    replicas = [ClosingReplica(i, **kwargs) for i in range(n)]
    return PrefixAwareRouter(replicas, block_size=BLOCK), replicas


@pytest.mark.parametrize("keeps", [False, True])
def test_new_requests_go_only_to_open_replicas(keeps):
    router, replicas = _router(keeps=keeps)
    hot = router.add_request([1] * BLOCK, SamplingParams(max_tokens=5))
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=5))
    assert router.num_outstanding == (1, 1) and router.replica_of(hot) == 0
    replicas[0].close()
    # Replica 0 holds the hot prefix and ties for least loaded: both used to win.
    assert router.route([1] * BLOCK + [3]) == Route(1, 0)
    assert router.route([4] * BLOCK) == Route(1, 0)
    moved = router.add_request([1] * BLOCK + [3], SamplingParams(max_tokens=5))
    fresh = router.add_request([4] * BLOCK, SamplingParams(max_tokens=5))
    assert router.replica_of(moved) == router.replica_of(fresh) == 1
    assert router.route([1] * BLOCK) == Route(1, 1)  # the prefix moved with it


@pytest.mark.parametrize("keeps", [False, True])
def test_requests_held_on_a_closed_replica_are_released_at_the_next_step(keeps):
    router, replicas = _router(keeps=keeps)
    lost = router.add_request([1] * BLOCK, SamplingParams(max_tokens=3))
    kept = router.add_request([2] * BLOCK, SamplingParams(max_tokens=3))
    assert router.num_outstanding == (1, 1)
    replicas[0].close()
    assert router.has_unfinished_requests()  # a step still has to release it
    outputs = router.step()  # the closed replica's step is not called: it would raise
    assert {o.request_id for o in outputs} == {kept}
    assert router.num_outstanding == (0, 1)
    with pytest.raises(KeyError):
        router.replica_of(lost)
    assert router.abort(lost) is False
    router.add_request([5] * BLOCK, request_id=lost)  # its id is free again
    while router.has_unfinished_requests():
        router.step()
    assert router.num_outstanding == (0, 0)
    assert not router.has_pending_transfers()
    router.drain_transfers()


def test_generate_runs_on_the_open_replicas():
    router, replicas = _router(3)
    replicas[1].close()
    outputs = router.generate([[i] * BLOCK for i in range(1, 6)], progress=False)
    assert [o.finish_reason for o in outputs] == ["length"] * 5
    assert not replicas[1].prompts


def test_every_replica_closed_refuses_a_request_changing_nothing():
    router, replicas = _router()
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=5))
    for replica in replicas:
        replica.close()
    for call in (
        lambda: router.add_request([1] * BLOCK),
        lambda: router.add_request([2] * BLOCK, request_id="x"),
        lambda: router.route([1] * BLOCK),
        lambda: router.generate([[1] * BLOCK], progress=False),
    ):
        with pytest.raises(RuntimeError, match=r"every replica .*is closed"):
            call()
    assert router.num_outstanding == (1, 0) and not router.closed
    assert [r.prompts for r in replicas] == [{"dp-0": [1] * BLOCK}, {}]
    # Bad input is still named as such.
    with pytest.raises(ValueError, match="request_id=7"):
        router.add_request([1] * BLOCK, request_id=7)
    router.step()  # releases dp-0
    assert router.num_outstanding == (0, 0) and not router.has_unfinished_requests()
    replicas[1].closed = False  # open again (a proxy reconnected): served, ids as before
    assert router.add_request([1] * BLOCK) == "dp-1" and router.replica_of("dp-1") == 1
    router.close()
    assert router.closed


def test_a_closed_attribute_that_is_no_bool_is_named():
    router, replicas = _router()
    replicas[1].closed = "yes"
    with pytest.raises(ValueError, match=r"replicas\[1\] \(ClosingReplica\)\.closed is 'yes'"):
        router.add_request([1] * BLOCK)
    assert router.num_outstanding == (0, 0) and not any(r.prompts for r in replicas)
    replicas[1].closed = None  # None counts as no such attribute: open
    rid = router.add_request([1] * BLOCK)
    replicas[1].closed = "yes"
    for call in (router.step, router.has_unfinished_requests, lambda: router.abort(rid)):
        with pytest.raises(ValueError, match=r"replicas\[1\] \(ClosingReplica\)\.closed"):
            call()
    with pytest.raises(ValueError, match=r"replicas\[1\] \(ClosingReplica\)\.closed"):
        router.close()  # before it aborts anything
    assert router.replica_of(rid) == 0 and replicas[0].running and not router.closed


def test_replicas_without_a_closed_attribute_are_always_open():
    router = PrefixAwareRouter([FakeReplica(0), FakeReplica(1)], block_size=BLOCK)
    ids = [router.add_request([i] * BLOCK) for i in range(1, 4)]
    assert [router.replica_of(r) for r in ids] == [0, 1, 0]


def test_abort_after_close_asks_no_replica():
    # Cleanup code aborts its ids after close: the router holds none, so no replica is
    # asked; a replica's `closed` gone bad after close made that cleanup raise.
    router, replicas = _router()
    rid = router.add_request([1] * BLOCK)
    router.close()
    replicas[1].closed = "yes"
    assert router.abort(rid) is False and router.abort([rid, "other"]) is False
    with pytest.raises(ValueError, match="request_ids"):
        router.abort(7)  # still refused by name
