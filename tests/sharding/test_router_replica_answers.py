"""PrefixAwareRouter over a replica whose add_request answers wrong: another id than the
one asked for (ValueError naming the replica, the method and the answer), or an error
after it queued the request. Either way the id is aborted there, the router unchanged."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter, Route
from tests.sharding._router_util import BLOCK, FakeReplica


class _Answers(FakeReplica):
    """A FakeReplica whose add_request returns `queued(request_id)`."""

    def __init__(self, index: int, queued) -> None:
        super().__init__(index)
        self.queued = queued

    def add_request(self, prompt_token_ids, sampling_params=None, *, request_id, cache_salt=None):
        super().add_request(prompt_token_ids, sampling_params, request_id=request_id)
        return self.queued(request_id)


@pytest.mark.parametrize("answer", [None, "other", b"dp-0"])
def test_an_add_request_returning_another_id_is_refused_with_the_request_aborted(answer):
    # The router ignored the answer: a replica that queued under another id ran a request
    # whose outputs the router could not place, the id it recorded held for good.
    router = PrefixAwareRouter([_Answers(0, lambda rid: answer)], block_size=BLOCK)
    with pytest.raises(
        ValueError,
        match=rf"replicas\[0\] \(_Answers\)\.add_request\(request_id='dp-0'\) returned "
        rf"{answer!r}; expected that id",
    ):
        router.add_request([1] * 2 * BLOCK, SamplingParams(max_tokens=2))
    assert router.replicas[0].running == {} and not router.has_unfinished_requests()
    assert router.num_outstanding == (0,) and router.route([1] * 2 * BLOCK) == Route(0, 0)
    router.replicas[0].queued = lambda rid: rid
    assert router.add_request([1] * 2 * BLOCK) == "dp-0"  # the id it would have had


def test_a_request_queued_by_an_add_request_that_raised_is_aborted_there():
    # A remote replica's reply lost after it queued: the request ran there, unknown to the
    # router, its outputs passed on under an id the router would hand out again.
    def lost(request_id):
        raise ConnectionError("reply lost")

    router = PrefixAwareRouter([_Answers(0, lost)], block_size=BLOCK)
    with pytest.raises(ConnectionError, match="reply lost"):
        router.add_request([1] * BLOCK)
    assert router.replicas[0].running == {} and not router.has_unfinished_requests()


def test_an_abort_that_also_fails_is_noted_on_the_replicas_error():
    class Unreachable(_Answers):
        def abort(self, request_id):
            raise ConnectionError("replica gone")

    router = PrefixAwareRouter([Unreachable(0, lambda rid: None)], block_size=BLOCK)
    with pytest.raises(ValueError, match="returned None") as raised:
        router.add_request([1] * BLOCK)
    assert "replica gone" in "".join(raised.value.__notes__)
    assert router.num_outstanding == (0,)
