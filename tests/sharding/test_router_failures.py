"""PrefixAwareRouter when a replica's step raises: counts stay right, and the outputs
gathered from the replicas before it are returned by the next step."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter
from tests.sharding.test_router import BLOCK, FakeReplica


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
    assert router.num_outstanding == (0, 1)
    with pytest.raises(KeyError):
        router.replica_of(done)
    # Replica 0's finished output, gathered before the failure, is kept across failures.
    assert router.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
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


def test_an_aborted_requests_kept_output_never_reaches_a_later_request_of_its_id():
    # A failed step() keeps x's first token for the next step; x is aborted and its id
    # reused: the old token used to be delivered as the new x's first.
    router = PrefixAwareRouter([FakeReplica(0), FailingReplica(1)], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=3), request_id="x")
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=3), request_id="y")
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
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
