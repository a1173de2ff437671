"""A Ctrl-C at any line of PrefixAwareRouter.add_request or abort: the request is queued
on its replica and counted by the router, or neither; aborted there and released by the
router, or neither; the run goes on to no outstanding sequence. In the replica's own
add_request or step it still stops the call at once."""

from __future__ import annotations

import pathlib
import signal

import pytest

from jaxkv import SamplingParams
from tests.host._line_interrupts import PACKAGE, LineInterrupts
from tests.sharding._router_util import BLOCK, FakeReplica, make_router

PROMPT = [1] * BLOCK + [2, 3]
# jaxkv's modules but closable.py, whose finally resets the running method's name with no
# call before it (Python handles a signal at a call, never there; a tracer's line can).
FILES = {p.name for p in pathlib.Path(PACKAGE).glob("*.py")} - {"closable.py"}


def test_a_ctrl_c_at_any_line_of_add_request_routes_the_request_whole_or_not_at_all():
    # Cut after the replica had queued it, the router did not hold the request (its
    # outputs dropped, its id unabortable), or counted it without holding it: the replica
    # kept an outstanding sequence for good, and routed later requests away from it.
    at = 0
    while True:
        at += 1
        router, replicas = make_router(2)
        router.add_request([5] * BLOCK, request_id="first")
        lines = LineInterrupts(at, FILES)
        try:
            with lines:
                router.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="x")
        except KeyboardInterrupt:
            pass
        routed = "x" in router._replica_of
        on_replicas = [r.index for r in replicas if "x" in r.running]
        assert on_replicas == ([router.replica_of("x")] if routed else []), lines.fired
        assert sum(router.num_outstanding) == 1 + routed, lines.fired
        while router.has_unfinished_requests():
            router.step()
        assert router.num_outstanding == (0, 0), lines.fired
        if lines.fired is None:
            break
    assert at > 30  # add_request's code was tried throughout


class _Interrupted(FakeReplica):
    """Its add_request receives a Ctrl-C once it has queued the request."""

    def add_request(self, *args, **kwargs):
        queued = super().add_request(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        self.ran_on = True  # a held Ctrl-C let it finish
        return queued


def test_a_ctrl_c_in_a_replicas_add_request_stops_it_and_aborts_the_request_there():
    replica = _Interrupted(0)
    router, _ = make_router(1)
    router = type(router)([replica], block_size=BLOCK)
    with pytest.raises(KeyboardInterrupt):
        router.add_request(PROMPT, request_id="x")
    assert not hasattr(replica, "ran_on") and "x" not in replica.running
    assert router.num_outstanding == (0,) and not router.has_unfinished_requests()


class _InterruptedStep(FakeReplica):
    """Its step receives a Ctrl-C before it returns its outputs."""

    def step(self):
        outputs = super().step()
        signal.raise_signal(signal.SIGINT)
        self.ran_on = True  # a held Ctrl-C let it finish
        return outputs


def test_a_ctrl_c_in_a_replicas_step_stops_it_at_once():
    replica = _InterruptedStep(0)
    router = type(make_router(1)[0])([replica], block_size=BLOCK)
    router.add_request(PROMPT, request_id="x")
    with pytest.raises(KeyboardInterrupt):
        router.step()
    assert not hasattr(replica, "ran_on")


def test_a_ctrl_c_at_any_line_of_abort_releases_each_request_it_aborted():
    # Cut after the replica had aborted a request, the router still counted it: with its
    # replica idle the run ended, the request held and its sequence outstanding for good.
    at = 0
    while True:
        at += 1
        router, replicas = make_router(2)
        for rid, token in (("x", 1), ("y", 5)):
            router.add_request([token] * BLOCK + [2], SamplingParams(max_tokens=3), request_id=rid)
        router.step()
        lines = LineInterrupts(at, FILES)
        try:
            with lines:
                router.abort(["x", "y"])
        except KeyboardInterrupt:
            pass
        for rid in ("x", "y"):
            held = rid in router._replica_of
            assert held == any(rid in r.running for r in replicas), (rid, lines.fired)
        while router.has_unfinished_requests():
            router.step()
        assert router.num_outstanding == (0, 0) and not router._replica_of, lines.fired
        if lines.fired is None:
            break
    assert at > 30  # abort's code was tried throughout


@pytest.mark.parametrize("steps_before", [0, 1, 2])
def test_a_ctrl_c_at_any_line_of_step_leaves_no_finished_request_counted(steps_before):
    # Cut in the release of the step's finished requests, the router kept counting them:
    # their replica idle, the run ended with them held and outstanding for good.
    at = 0
    while True:
        at += 1
        router, _ = make_router(2)
        for rid, token, max_tokens in (("x", 1, 2), ("y", 5, 1), ("z", 1, 3)):
            params = SamplingParams(max_tokens=max_tokens)
            router.add_request([token] * BLOCK + [2], params, request_id=rid)
        for _ in range(steps_before):
            router.step()
        # UserCode.call's flag is set until its finally: a Ctrl-C there is the replica's
        # step raising, whose requests stay counted until abort() (PrefixAwareRouter.step).
        lines = LineInterrupts(at, FILES - {"held_interrupts.py"})
        try:
            with lines:
                router.step()
        except KeyboardInterrupt:
            pass
        while router.has_unfinished_requests():
            router.step()
        assert router.num_outstanding == (0, 0) and not router._replica_of, lines.fired
        if lines.fired is None:
            break
    assert at > 30  # step's code was tried throughout
