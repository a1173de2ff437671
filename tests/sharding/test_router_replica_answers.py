"""PrefixAwareRouter over a replica whose other answers are wrong: add_request returning
another id (aborted there, as is the id asked for) or raising after it queued, abort
answering no bool, has_unfinished_requests or has_pending_transfers answering no bool,
an ids_in_use that is no container, a has_pending_transfers, close or queue_checkpoint
that is no method. Each raises ValueError naming the replica, the method and the answer
(abort's, given after the replica acted, is read by its truth, False if it has none, with
a logged warning), the router unchanged."""

from __future__ import annotations

import logging

import numpy as np
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


class _Renames(_Answers):
    """Queues each request under an id of its own, `queued(request_id)`, and returns it
    (a broken replica or proxy); records the ids it is asked to abort."""

    def __init__(self, index: int, queued) -> None:
        super().__init__(index, queued)
        self.aborted: list[str] = []

    def add_request(self, prompt_token_ids, sampling_params=None, *, request_id, cache_salt=None):
        request_id = self.queued(request_id)
        return FakeReplica.add_request(
            self, prompt_token_ids, sampling_params, request_id=request_id
        )

    def abort(self, request_id):
        self.aborted.append(request_id)
        return super().abort(request_id)


def test_an_add_request_that_queued_under_the_id_it_returned_has_that_id_aborted_there():
    # Only the id asked for was aborted: the request ran on under the replica's id, its
    # outputs dropped, has_unfinished_requests True until it ended, unseen by the router.
    replica = _Renames(0, lambda rid: f"proxy-{rid}")
    router = PrefixAwareRouter([replica], block_size=BLOCK)
    with pytest.raises(
        ValueError,
        match=r"replicas\[0\] \(_Renames\)\.add_request\(request_id='dp-0'\) returned "
        r"'proxy-dp-0'; expected that id \(both aborted there, nothing queued\)",
    ):
        router.add_request([1] * 2 * BLOCK, SamplingParams(max_tokens=2))
    assert replica.aborted == ["dp-0", "proxy-dp-0"] and replica.running == {}
    assert not router.has_unfinished_requests() and router.num_outstanding == (0,)
    assert router.route([1] * 2 * BLOCK) == Route(0, 0)
    replica.queued = lambda rid: rid
    assert router.add_request([1] * 2 * BLOCK) == "dp-0"  # the id it would have had


@pytest.mark.parametrize("theirs", ["a", "1_a"])
def test_an_add_request_returning_an_id_the_router_holds_leaves_that_request_running(theirs):
    # The router knows that id as its own request (or a running sample of one): the
    # replica's answer is wrong, and aborting it there would end a request the router
    # still counts.
    replica = _Renames(0, lambda rid: rid)
    router = PrefixAwareRouter([replica], block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(n=2, max_tokens=3), request_id="a")
    replica.add_request = lambda *args, request_id, **kwargs: theirs
    with pytest.raises(
        ValueError,
        match=rf"returned '{theirs}'; expected that id \('b' aborted there, nothing queued; "
        rf"'{theirs}', the router's own, left running\)",
    ):
        router.add_request([2] * BLOCK, request_id="b")
    assert replica.aborted == ["b"] and list(replica.running) == ["a"]
    assert router.replica_of("a") == 0 and router.num_outstanding == (2,)


def test_an_add_request_returning_an_id_the_router_runs_elsewhere_has_it_aborted_there():
    # The router's "a" runs on replica 0: on replica 1 that id is no request of the
    # router's, and the one replica 1 may have queued under it must not run on.
    replicas = [FakeReplica(0), _Renames(1, lambda rid: "a")]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=3), request_id="a")
    with pytest.raises(ValueError, match=r"returned 'a'; expected that id \(both aborted there"):
        router.add_request([2] * BLOCK, request_id="b")
    assert replicas[1].aborted == ["b", "a"] and replicas[1].running == {}
    assert list(replicas[0].running) == ["a"] and router.num_outstanding == (1, 0)


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


@pytest.mark.parametrize(("answer", "read"), [(None, False), ("no", True), (1, True)])
def test_an_abort_answering_no_bool_is_read_by_its_truth_with_a_warning(answer, read, caplog):
    class Aborts(FakeReplica):
        def abort(self, request_id):
            super().abort(request_id)
            return answer

    router = PrefixAwareRouter([Aborts(0)], block_size=BLOCK)
    router.add_request([1] * BLOCK, request_id="x")
    with caplog.at_level(logging.WARNING, logger="jaxkv.replica_checks"):
        assert router.abort("x") is read
    assert f"replicas[0] (Aborts).abort('x') returned {answer!r}, not a bool" in caplog.text
    assert router.num_outstanding == (0,) and router.add_request([2], request_id="x") == "x"


def test_an_abort_answering_what_has_no_truth_value_is_read_as_false_and_named(caplog):
    # bool() of the array raised a ValueError naming no replica after the replica had
    # aborted: the router still held the request, its id and count taken for good.
    class Aborts(FakeReplica):
        def abort(self, request_id):
            super().abort(request_id)
            return np.array([True, True])

    router = PrefixAwareRouter([Aborts(0)], block_size=BLOCK)
    router.add_request([1] * BLOCK, request_id="x")
    with caplog.at_level(logging.WARNING, logger="jaxkv.replica_checks"):
        assert router.abort("x") is False
    assert (
        "replicas[0] (Aborts).abort('x') returned array([ True,  True]), not a bool; read "
        "as False (it has no truth value: ValueError(" in caplog.text
    )
    assert router.num_outstanding == (0,) and not router.has_unfinished_requests()
    assert router.add_request([2], request_id="x") == "x"


@pytest.mark.parametrize("answer", [None, 0, "yes"])
def test_has_unfinished_requests_answering_no_bool_is_refused(answer):
    # None or 0 left the replica unstepped: generate returned its prompt as "abort" while
    # the request stayed queued there, its id held by the router for good.
    class Unsure(FakeReplica):
        def has_unfinished_requests(self):
            return answer

    router = PrefixAwareRouter([Unsure(0)], block_size=BLOCK)
    with pytest.raises(
        ValueError,
        match=rf"replicas\[0\] \(Unsure\)\.has_unfinished_requests\(\) returned {answer!r}; "
        "expected a bool",
    ):
        router.generate([[1] * BLOCK], progress=False)
    assert router.num_outstanding == (0,) and router.replicas[0].running == {}


def test_has_pending_transfers_answering_no_bool_is_refused():
    class Unsure(FakeReplica):
        def has_pending_transfers(self):
            return None

    router = PrefixAwareRouter([FakeReplica(0), Unsure(1)], block_size=BLOCK)
    with pytest.raises(ValueError, match=r"replicas\[1\] \(Unsure\)\.has_pending_transfers"):
        router.has_pending_transfers()


class _Holds(FakeReplica):
    def __init__(self, index: int, ids_in_use) -> None:
        super().__init__(index)
        self.ids_in_use = ids_in_use


@pytest.mark.parametrize("held", [None, iter(["dp-0"]), print])
def test_an_ids_in_use_that_is_no_container_is_refused(held):
    # None or a method raised TypeError from deep in the id check, naming nothing; an
    # iterator was consumed by the first `in`, the id it held then free.
    router = PrefixAwareRouter([FakeReplica(0), _Holds(1, held)], block_size=BLOCK)
    with pytest.raises(ValueError, match=r"replicas\[1\] \(_Holds\)\.ids_in_use is .*container"):
        router.add_request([1] * BLOCK)
    assert router.num_outstanding == (0, 0)
    router.replicas[1].ids_in_use = {"dp-0"}
    assert router.add_request([1] * BLOCK) == "dp-1"


class _PendingProperty(FakeReplica):
    """A proxy that exposes has_pending_transfers as a property, not a method."""

    has_pending_transfers = False


def test_a_has_pending_transfers_that_is_no_method_is_named():
    # It raised a bare TypeError ("'bool' object is not callable") naming no replica,
    # from has_pending_transfers, step and drain_transfers alike.
    router = PrefixAwareRouter([FakeReplica(0), _PendingProperty(1)], block_size=BLOCK)
    named = r"replicas\[1\] \(_PendingProperty\)\.has_pending_transfers is False; expected a meth"
    for call in (router.has_pending_transfers, router.step, router.drain_transfers):
        with pytest.raises(ValueError, match=named):
            call()


class _Closes(FakeReplica):
    def __init__(self, index: int, close) -> None:
        super().__init__(index)
        self.close = close


def test_a_close_that_is_no_method_is_named_before_close_changes_anything():
    # It raised a bare TypeError after every request was aborted and the replicas before
    # it closed, the router open; every later close raised it again, as bare.
    closed = []
    replicas = [_Closes(0, lambda timeout_s: closed.append(0)), _Closes(1, "closed")]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    rid = router.add_request([1] * BLOCK)
    with pytest.raises(ValueError, match=r"replicas\[1\] \(_Closes\)\.close is 'closed'; expec"):
        router.close()
    assert not router.closed and router.replica_of(rid) == 0 and closed == []
    assert router.num_outstanding == (1, 0) and rid in replicas[0].running
    replicas[1].close = None  # no method: nothing to close there
    router.close()
    assert router.closed and closed == [0] and router.num_outstanding == (0, 0)


def test_a_queue_checkpoint_that_is_no_method_is_named():
    router = PrefixAwareRouter([FakeReplica(0)], block_size=BLOCK)
    router.replicas[0].queue_checkpoint = 3
    with pytest.raises(ValueError, match=r"replicas\[0\] \(FakeReplica\)\.queue_checkpoint is 3"):
        router.queue_checkpoint()
    router.replicas[0].queue_checkpoint = None
    router.queue_checkpoint()()  # none to take: the router's own rewinds


class _Checkpoints(FakeReplica):
    def __init__(self, index: int, rewind) -> None:
        super().__init__(index)
        self.rewind = rewind

    def queue_checkpoint(self):
        return self.rewind


def test_a_queue_checkpoint_answer_that_is_no_function_is_named_when_taken():
    # None was taken as replica 1's rewind: rewinding raised a bare TypeError then,
    # after replica 0's rewind had run, and out of generate's cleanup in place of the
    # error that made generate rewind (it lets only a rewind's RuntimeError pass).
    rewound = []
    replicas = [_Checkpoints(0, lambda: rewound.append(0)), _Checkpoints(1, None)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"replicas\[1\] \(_Checkpoints\)\.queue_checkpoint\(\) "):
        router.queue_checkpoint()
    replicas[1].rewind = lambda: rewound.append(1)
    router.queue_checkpoint()()
    assert rewound == [0, 1]
