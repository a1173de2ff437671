"""PrefixAwareRouter when a replica's step raises: counts stay right, and the outputs
gathered from the replicas before it are returned by the next step."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter
from tests.sharding._router_util import BLOCK, FakeReplica, OffloadingReplica


class FailingReplica(FakeReplica):
    """Its first `failures` steps raise; later ones step as FakeReplica does."""

    def __init__(self, index: int, failures: int = 1) -> None:
        super().__init__(index)
        self.failures = failures

    def step(self):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("device lost")
        return super().step()


def test_a_replica_whose_step_raises_loses_no_output_and_keeps_counts_right():
    replicas = [FakeReplica(0), FailingReplica(1, failures=2)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    done = router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    stuck = router.add_request([2] * BLOCK, SamplingParams(max_tokens=1))
    assert (router.replica_of(done), router.replica_of(stuck)) == (0, 1)
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
    # Replica 0's finished output, gathered before the failure, is kept across failures;
    # its request is the router's (counted, its id taken) until that output is returned.
    assert router.num_outstanding == (1, 1) and router.replica_of(done) == 0
    assert router.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
    assert not router.abort(done)  # finished: its output is still to come
    outputs = router.step()
    assert [(o.request_id, o.finished) for o in outputs] == [(done, True), (stuck, True)]
    assert router.num_outstanding == (0, 0) and not router.has_unfinished_requests()


class _LosesItsRequestThenFails(FakeReplica):
    """Its first step drops what it runs and raises; later steps are a FakeReplica's."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.raised = False

    def step(self):
        if not self.raised:
            self.raised = True
            self.running.clear()
            raise RuntimeError("device lost")
        return super().step()


def test_outputs_kept_from_a_failed_step_count_as_unfinished_work():
    router = PrefixAwareRouter([FakeReplica(0), _LosesItsRequestThenFails(1)], block_size=BLOCK)
    done = router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError):
        router.step()
    assert not any(r.has_unfinished_requests() for r in router.replicas)
    assert router.has_unfinished_requests()  # the kept output is still to be delivered
    assert [(o.request_id, o.finished) for o in router.step()] == [(done, True)]
    assert not router.has_unfinished_requests()


def _after_a_failed_step(request_id: str, *, max_tokens: int) -> PrefixAwareRouter:
    """A router whose step raised once: replica 0 ran `request_id` (its output kept),
    replica 1 failed with request "y" (3 tokens) still to run."""
    router = PrefixAwareRouter([FakeReplica(0), FailingReplica(1)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=max_tokens), request_id=request_id)
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=3), request_id="y")
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
    return router


def test_an_aborted_requests_kept_output_never_reaches_a_later_request_of_its_id():
    # A failed step() keeps x's first token for the next step; x is aborted and its id
    # reused: the old token used to be delivered as the new x's first.
    router = _after_a_failed_step("x", max_tokens=3)
    assert router.abort("x")
    router.add_request([7] * 9, SamplingParams(max_tokens=1), request_id="x")
    outputs = router.step()
    assert [(o.request_id, o.finished) for o in outputs if o.request_id == "x"] == [("x", True)]
    assert [o.new_token_ids for o in outputs if o.request_id == "x"] == [(9,)]


def test_close_drops_the_outputs_a_failed_step_kept():
    # A finished request's output kept by a failed step() is not work a closed router
    # still has: close drops it, as documented.
    router = PrefixAwareRouter([FakeReplica(0), _LosesItsRequestThenFails(1)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError):
        router.step()
    assert router.has_unfinished_requests()
    router.close()
    assert router.closed and not router.has_unfinished_requests()
    # A finished request whose kept output close dropped is released with it.
    router = _after_a_failed_step("x", max_tokens=1)
    router.close()
    assert router.num_outstanding == (0, 0)
    with pytest.raises(KeyError):
        router.replica_of("x")


def test_a_finished_requests_kept_output_never_reaches_a_later_request_of_its_id():
    # x finished in a step() that raised; its id used to be free at once, so a new x
    # (or generate's next default id) got the old x's finishing output as its own.
    router = _after_a_failed_step("dp-0", max_tokens=1)
    with pytest.raises(ValueError, match="'dp-0' is already running"):
        router.add_request([7] * 9, SamplingParams(max_tokens=1), request_id="dp-0")
    out = router.generate([[5] * 7], SamplingParams(max_tokens=3), progress=False)
    assert [(o.request_id, len(o.output_token_ids)) for o in out] == [("dp-1", 3)]
    assert router.num_outstanding == (0, 0) and not router.has_unfinished_requests()


class _FinishesThenRaises(FakeReplica):
    """Its first step finishes what it runs and raises, the finishing outputs lost (as an
    Engine whose connector is interrupted while it takes the finished requests)."""

    def step(self):
        if not hasattr(self, "raised"):
            self.raised = True
            super().step()
            raise KeyboardInterrupt
        return super().step()


def test_a_request_finished_in_a_step_that_raised_is_released_when_its_replica_is_idle():
    # It stayed counted (skewing the routing) and its id held until aborted.
    router = PrefixAwareRouter([_FinishesThenRaises(0), FakeReplica(1)], block_size=BLOCK)
    rid = router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    with pytest.raises(KeyboardInterrupt):
        router.step()
    assert not router.replicas[0].has_unfinished_requests() and router.num_outstanding == (0, 0)
    with pytest.raises(KeyError):
        router.replica_of(rid)
    assert not router.abort(rid) and not router.has_unfinished_requests()
    assert router.add_request([2] * BLOCK, request_id=rid) == rid  # its id is free
    assert router.replica_of(rid) == 0  # the least loaded again


class _CopiesThenFinishesAndRaises(OffloadingReplica):
    """Once `armed`, its next step finishes what it runs, then raises."""

    armed = False

    def step(self):
        outputs = super().step()
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return outputs


def test_a_request_finished_in_a_drain_step_that_raised_is_released_when_its_replica_is_idle():
    # drain_transfers steps a replica with copies in flight, running its requests too. A
    # step of it that raised after finishing them left them counted (skewing the routing)
    # and their ids held, though step() releases them in that case.
    router = PrefixAwareRouter([_CopiesThenFinishesAndRaises(0, copy_steps=3)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    assert [o.finished for o in router.step()] == [True] and router.has_pending_transfers()
    rid = router.add_request([2] * BLOCK, SamplingParams(max_tokens=1))
    router.replicas[0].armed = True
    with pytest.raises(KeyboardInterrupt):
        router.drain_transfers()
    assert not router.replicas[0].has_unfinished_requests() and router.num_outstanding == (0,)
    with pytest.raises(KeyError):
        router.replica_of(rid)
    router.drain_transfers()
    assert router.add_request([3] * BLOCK, request_id=rid) == rid  # its id is free


class _FinishesOneThenRaises(FakeReplica):
    """Its first step finishes its first request and raises, the others still running."""

    def step(self):
        if not hasattr(self, "raised"):
            self.raised = True
            del self.running[next(iter(self.running))]
            raise RuntimeError("device lost")
        return super().step()


def test_a_replica_still_running_requests_after_its_step_raised_keeps_them_counted():
    # Which of them ended is not known without asking each: abort releases those.
    router = PrefixAwareRouter([_FinishesOneThenRaises(0)], block_size=BLOCK)
    first = router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
    assert router.num_outstanding == (2,)
    assert not router.abort(first) and router.num_outstanding == (1,)
    assert [o.finished for o in router.step()] == [True] and router.num_outstanding == (0,)


def test_a_replica_whose_idle_answer_raises_after_its_step_did_releases_nothing():
    class Broken(_FinishesThenRaises):
        def has_unfinished_requests(self):
            if getattr(self, "raised", False):
                raise OSError("connection lost")
            return super().has_unfinished_requests()

    router = PrefixAwareRouter([Broken(0)], block_size=BLOCK)
    rid = router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    with pytest.raises(KeyboardInterrupt) as raised:
        router.step()
    assert "OSError('connection lost')" in "".join(raised.value.__notes__)
    assert router.num_outstanding == (1,) and router.replica_of(rid) == 0
    router.replicas[0].has_unfinished_requests = lambda: False
    router.close()
    assert router.num_outstanding == (0,)


class _Interrupted(FakeReplica):
    """Its first step raises KeyboardInterrupt before stepping anything."""

    def step(self):
        if not hasattr(self, "raised"):
            self.raised = True
            raise KeyboardInterrupt
        return super().step()


def test_an_interrupt_in_a_later_replicas_step_loses_no_earlier_replicas_output():
    # Ctrl-C lands inside whichever replica steps: the outputs of the replicas stepped
    # before it are kept, or their finished requests stay counted and their ids held.
    router = PrefixAwareRouter([FakeReplica(0), _Interrupted(1)], block_size=BLOCK)
    done = router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=1))
    with pytest.raises(KeyboardInterrupt):
        router.step()
    assert router.has_unfinished_requests()
    outputs = router.step()
    assert [(o.request_id, o.finished) for o in outputs][0] == (done, True)
    assert router.num_outstanding == (0, 0) and not router.has_unfinished_requests()


def test_an_interrupt_before_the_first_replica_s_turn_is_raised_as_it_came():
    # It was an UnboundLocalError: the failure path read the index of a replica never reached.
    class InterruptedFirst:
        def __iter__(self):
            raise KeyboardInterrupt

    router = PrefixAwareRouter([FakeReplica(0)], block_size=BLOCK)
    rid = router.add_request([1] * BLOCK, SamplingParams(max_tokens=1))
    router._indices = InterruptedFirst()
    with pytest.raises(KeyboardInterrupt):
        router.step()
    router._indices = range(1)
    assert router.num_outstanding == (1,) and [o.request_id for o in router.step()] == [rid]
