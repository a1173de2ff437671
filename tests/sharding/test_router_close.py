"""PrefixAwareRouter.close: requests aborted, closable replicas closed, use refused."""

from __future__ import annotations

import math
import time

import pytest

from jaxkv import SamplingParams
from jaxkv.closable import Closable, checked_timeout, try_each
from jaxkv.router import PrefixAwareRouter
from tests.sharding._router_util import BLOCK, FakeReplica, OffloadingReplica


class ClosableReplica(FakeReplica):
    """Records its close calls; the first `timeouts` of them raise TimeoutError."""

    def __init__(self, index: int, timeouts: int = 0) -> None:
        super().__init__(index)
        self.timeouts = timeouts
        self.close_calls: list[float] = []  # the timeout_s of each call

    def close(self, timeout_s: float = 60.0) -> None:
        self.close_calls.append(timeout_s)
        if self.timeouts:
            self.timeouts -= 1
            raise TimeoutError("copies still pending")
        self.running.clear()


def test_close_aborts_every_request_closes_replicas_that_can_and_refuses_use():
    replicas = [ClosableReplica(0), FakeReplica(1)]  # the second has no close()
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    for tokens in ([1] * BLOCK, [2] * BLOCK, [3] * BLOCK):
        router.add_request(tokens, SamplingParams(max_tokens=5))
    assert sorted(router.num_outstanding) == [1, 2]

    router.close(timeout_s=30.0)

    assert router.closed and router.num_outstanding == (0, 0)
    assert not router.has_unfinished_requests()
    assert not any(r.running for r in replicas)  # aborted on the replica, not just forgotten
    assert len(replicas[0].close_calls) == 1 and 0 < replicas[0].close_calls[0] <= 30.0
    calls = {
        "add_request": lambda: router.add_request([4] * BLOCK),
        "step": router.step,
        "generate": lambda: router.generate([[4] * BLOCK], progress=False),
        "generate of no prompts": lambda: router.generate([], progress=False),
        # Closed comes first: not "sampling_params: 0 for 1 prompts", as for an Engine.
        "generate of refused params": lambda: router.generate([[4] * BLOCK], [], progress=False),
        "drain_transfers": router.drain_transfers,
        "queue_checkpoint": router.queue_checkpoint,  # it returned a rewind
    }
    for call in calls.values():
        with pytest.raises(RuntimeError, match="the PrefixAwareRouter is closed"):
            call()
    assert not any(r.prompts.get("dp-3") for r in replicas)  # nothing reached a replica
    # Not refused: a caller's cleanup may abort its ids after close; all were aborted.
    assert router.abort(["dp-0", "dp-2"]) is False
    router.close()  # again: nothing to do
    router.close(timeout_s=-1.0)  # nothing, not even reading the timeout
    assert len(replicas[0].close_calls) == 1


def test_a_replica_close_that_times_out_still_closes_the_router():
    # It left the router open: a replica whose close kept raising kept it open for good.
    replicas = [ClosableReplica(0, timeouts=1), ClosableReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.add_request([1] * BLOCK)
    with pytest.raises(TimeoutError, match="still pending"):
        router.close()
    assert router.closed and router.num_outstanding == (0, 0)
    router.close()  # closed: nothing to do; the replica left open is the caller's
    assert [len(r.close_calls) for r in replicas] == [1, 1]
    router.replicas[0].close()
    assert len(replicas[0].close_calls) == 2


def test_a_replica_close_that_raises_leaves_every_other_replica_closed():
    # close stopped at the first replica whose close raised: the replicas after it kept
    # their device memory (and copy threads) until a retry that might never come.
    replicas = [ClosableReplica(0, timeouts=1), ClosableReplica(1), ClosableReplica(2, timeouts=1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.add_request([1] * BLOCK)
    with pytest.raises(TimeoutError, match="still pending") as raised:
        router.close(timeout_s=30.0)
    (note,) = raised.value.__notes__
    assert note.startswith("raised by replicas[0] (ClosableReplica).close(); close went on")
    assert "replicas[2] (ClosableReplica).close() raised TimeoutError" in note
    assert [len(r.close_calls) for r in replicas] == [1, 1, 1]
    assert all(0 < r.close_calls[0] <= 30.0 for r in replicas)
    assert router.closed and router.num_outstanding == (0, 0, 0)


def test_leaving_a_with_block_closes_the_router():
    replicas = [ClosableReplica(0), ClosableReplica(1)]
    with PrefixAwareRouter(replicas, block_size=BLOCK) as router:
        router.add_request([1] * BLOCK)
    assert router.closed and all(len(r.close_calls) == 1 for r in replicas)


class CopyingReplica(ClosableReplica):
    """Has KV copies in flight while `pending`; each step lands them if `lands`."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.pending, self.lands = True, False

    def has_pending_transfers(self) -> bool:
        return self.pending

    def step(self):
        self.pending = self.pending and not self.lands
        return super().step()


def test_close_closes_no_replica_until_every_copy_has_landed():
    # It used to close replicas one by one: a timeout on the second left the first closed
    # behind a router that stayed open and went on routing requests to it.
    replicas = [ClosableReplica(0), CopyingReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.add_request([1] * BLOCK)
    with pytest.raises(TimeoutError, match="still pending"):
        router.close(timeout_s=0.05)
    assert not router.closed and [r.close_calls for r in replicas] == [[], []]
    rid = router.add_request([2] * BLOCK)  # still serving, on every replica
    assert router.replica_of(rid) in (0, 1)
    replicas[1].lands = True
    router.close()
    assert router.closed and [len(r.close_calls) for r in replicas] == [1, 1]


@pytest.mark.parametrize("timeout_s", ["60", None, float("nan"), -1.0])
def test_close_and_drain_refuse_a_bad_timeout_before_aborting_anything(timeout_s):
    # close("60") used to abort every request before raising TypeError; NaN never timed out.
    replicas = [ClosableReplica(0), ClosableReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    rid = router.add_request([1] * BLOCK)
    for call in (router.close, router.drain_transfers):
        with pytest.raises(ValueError, match="timeout_s"):
            call(timeout_s)
    assert not router.closed and router.replica_of(rid) in (0, 1)
    assert sum(router.num_outstanding) == 1 and not any(r.close_calls for r in replicas)


@pytest.mark.parametrize("request_id", [7, ["a"], b"a", ""])
def test_add_request_refuses_an_id_that_is_not_a_non_empty_str(request_id):
    # A replica that took the id 7 left a request abort(7) refuses, so close() raised
    # ValueError every time; ["a"] raised TypeError (unhashable) instead of ValueError;
    # "" named nothing a log or a sample id ("0_") could tell apart.
    replicas = [ClosableReplica(0), ClosableReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    with pytest.raises(ValueError, match="must be None or a non-empty str"):
        router.add_request([1] * BLOCK, request_id=request_id)
    assert router.num_outstanding == (0, 0) and not any(r.prompts for r in replicas)
    router.close()
    assert router.closed


class SlowClosingReplica(ClosableReplica):
    """Takes `seconds` to close, as an engine landing its last copies does."""

    def __init__(self, index: int, seconds: float) -> None:
        super().__init__(index)
        self.seconds = seconds

    def close(self, timeout_s: float = 60.0) -> None:
        super().close(timeout_s)
        time.sleep(self.seconds)


def test_replicas_close_within_one_timeout_together():
    # Each replica gets what is left of timeout_s, not all of it again.
    replicas = [SlowClosingReplica(0, seconds=0.2), ClosableReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.close(timeout_s=1.0)
    first, second = replicas[0].close_calls[0], replicas[1].close_calls[0]
    assert 0 < first <= 1.0 and second <= first - 0.2, (first, second)


def test_a_zero_and_an_infinite_timeout_are_accepted():
    # ">= 0 (inf: no limit)": 0 closes at once when nothing is in flight.
    for timeout_s in (0, 0.0, math.inf):
        replicas = [ClosableReplica(0), ClosableReplica(1)]
        router = PrefixAwareRouter(replicas, block_size=BLOCK)
        router.add_request([1] * BLOCK)
        router.drain_transfers(timeout_s)
        router.close(timeout_s)
        assert router.closed and all(len(r.close_calls) == 1 for r in replicas)
    assert checked_timeout(0) == 0.0 and checked_timeout(math.inf) == math.inf
    assert checked_timeout(10**400) == math.inf  # past float's range: was OverflowError


def test_a_zero_timeout_collects_copies_that_land_at_the_next_step():
    """drain_transfers and close under timeout_s=0 step each replica with a copy in flight
    once before raising: a copy that the step collects raises nothing."""
    for call in ("drain_transfers", "close"):
        router = PrefixAwareRouter([OffloadingReplica(0, copy_steps=1)], block_size=BLOCK)
        router.generate([[1] * BLOCK], SamplingParams(max_tokens=1), progress=False)
        assert router.has_pending_transfers()
        getattr(router, call)(timeout_s=0)
        assert not router.has_pending_transfers() and router.closed == (call == "close")


class AbortRaisingReplica(ClosableReplica):
    """Its abort raises while `broken`, after acting on it if `acts` (a remote replica
    whose reply was lost) or before."""

    def __init__(self, index: int, *, acts: bool = False) -> None:
        super().__init__(index)
        self.broken, self.acts = True, acts

    def abort(self, request_id: str) -> bool:
        if self.broken:
            if self.acts:
                super().abort(request_id)
            raise RuntimeError(f"replica {self.index} lost")
        return super().abort(request_id)


@pytest.mark.parametrize("acts", [False, True])
def test_an_abort_that_raises_in_close_stops_nothing_else(acts):
    # close stopped at the first abort that raised: the requests after it stayed counted
    # and running on their replicas, and no note said which others would have failed.
    # Then it left the router open, every replica too, as long as that abort raised.
    replicas = [
        AbortRaisingReplica(0, acts=acts),
        ClosableReplica(1),
        AbortRaisingReplica(2, acts=acts),
    ]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    ids = [router.add_request([i + 1] * BLOCK, SamplingParams(max_tokens=5)) for i in range(3)]
    assert [router.replica_of(rid) for rid in ids] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="replica 0 lost") as raised:
        router.close()
    (note,) = raised.value.__notes__
    assert note.startswith("raised by abort('dp-0'); close went on")
    assert "abort('dp-2') raised RuntimeError('replica 2 lost')" in note
    assert router.closed and router.num_outstanding == (0, 0, 0)
    assert not router.has_unfinished_requests() and router.abort(ids) is False
    assert not any(r.running for r in replicas)  # their close ended what abort could not
    assert [len(r.close_calls) for r in replicas] == [1, 1, 1]


def test_an_abort_of_a_list_tries_every_id_when_one_replicas_abort_raises():
    # The first replica abort that raised stopped the list: the ids after it ran on (a
    # generate's cleanup left them queued, their outputs dropped).
    replicas = [AbortRaisingReplica(0), ClosableReplica(1), ClosableReplica(2)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    ids = [router.add_request([i + 1] * BLOCK, SamplingParams(max_tokens=5)) for i in range(3)]
    with pytest.raises(RuntimeError, match="replica 0 lost") as raised:
        router.abort(ids)
    assert raised.value.__notes__ == ["raised by abort('dp-0'); every other call was made"]
    assert router.num_outstanding == (1, 0, 0) and router.replica_of("dp-0") == 0
    assert replicas[1].running == replicas[2].running == {}
    replicas[0].broken = False
    assert router.abort(ids) is True and router.num_outstanding == (0, 0, 0)
    assert router.abort(ids) is False


def test_try_each_makes_every_call_and_names_the_later_failures_in_a_bounded_note():
    made = []

    def call(i):
        made.append(i)
        if i % 2:
            raise ValueError(f"odd {i}")

    with pytest.raises(ValueError, match="odd 1") as raised:
        try_each(call, range(14), "call")
    assert made == list(range(14))
    (note,) = raised.value.__notes__
    assert note.startswith("raised by call(1); every other call was made: call(3) raised")
    assert "call(9) raised ValueError('odd 9'); and 2 more" in note and "call(11)" not in note
    try_each(call, [0, 2], "call")  # none raised: nothing
    with pytest.raises(KeyboardInterrupt):  # an interrupt stops at once
        try_each(lambda i: made.append(i) or (i == 8 and _interrupt()), [7, 8, 9], "x")
    assert made[-2:] == [7, 8]


def _interrupt():
    raise KeyboardInterrupt


class StuckCopier(ClosableReplica):
    """Has a KV copy in flight, and each of its steps raises (a lost device); or, if
    `asked_fails`, its has_pending_transfers raises (a lost connection)."""

    def __init__(self, index: int, asked_fails: bool = False) -> None:
        super().__init__(index)
        self.asked_fails = asked_fails

    def has_pending_transfers(self) -> bool:
        if self.asked_fails:
            raise RuntimeError("device lost")
        return True

    def step(self):
        raise RuntimeError("device lost")


@pytest.mark.parametrize("asked_fails", [False, True])
def test_a_replica_whose_step_keeps_raising_still_lets_the_router_close(asked_fails):
    # close stepped it until its copy landed: every close raised its error, closing
    # nothing, and the router could not be shut down.
    replicas = [CopyingReplica(0), StuckCopier(1, asked_fails), ClosableReplica(2)]
    replicas[0].lands = True
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    ids = [router.add_request([i + 1] * BLOCK, SamplingParams(max_tokens=5)) for i in range(3)]
    assert [router.replica_of(rid) for rid in ids] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="device lost") as raised:
        router.close(timeout_s=30.0)
    what = "has_pending_transfers" if asked_fails else "step"
    assert raised.value.__notes__ == [
        f"raised by replicas[1] (StuckCopier).{what}(); close went on: every replica's "
        "close was tried, the router closed"
    ]
    assert router.closed and router.num_outstanding == (0, 0, 0)
    assert not replicas[0].pending  # the other replicas' copies were still landed
    assert [len(r.close_calls) for r in replicas] == [1, 1, 1]
    assert all(0 < r.close_calls[0] <= 30.0 for r in replicas)
    assert not router.has_unfinished_requests() and router.abort(ids) is False
    router.close()  # closed: nothing to do
    assert [len(r.close_calls) for r in replicas] == [1, 1, 1]


def test_copies_that_time_out_beside_a_failed_replica_close_everything_all_the_same():
    # A timeout alone leaves every replica open for a retry; with a replica failing too,
    # a retry would fail again: close goes on, each close given what is left (nothing).
    replicas = [CopyingReplica(0), StuckCopier(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    with pytest.raises(RuntimeError, match="device lost") as raised:
        router.close(timeout_s=0.01)
    (note,) = raised.value.__notes__
    assert "waiting for the KV copies raised TransfersPendingError" in note
    assert router.closed and [r.close_calls for r in replicas] == [[0.0], [0.0]]


def test_a_closable_that_defines_no_close_fails_loudly_at_the_end_of_its_with_block():
    # Closable leaves close() to each subclass: one that forgot it must not leave a
    # `with` block as if it had closed.
    class NoClose(Closable):
        pass

    with pytest.raises(NotImplementedError):
        with NoClose() as closable:
            assert not closable.closed


class _FailsWhenTold(FakeReplica):
    """Records the ids it is asked to abort; its step raises while `fail`."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.fail = False
        self.aborted: list[str] = []

    def step(self):
        if self.fail:
            raise RuntimeError("device lost")
        return super().step()

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return super().abort(request_id)


def test_close_asks_no_replica_to_abort_a_request_whose_kept_output_finished_it():
    """Replica 0 finished "a" in a step() that replica 1 then failed: a's finishing output
    was kept for the next step(). close() drops it and releases "a" as finished, so
    replica 0, which runs it no more, is not asked to abort it; "b" still runs: aborted."""
    replicas = [_FailsWhenTold(0), _FailsWhenTold(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    router.add_request([1] * BLOCK, SamplingParams(max_tokens=1), request_id="a")
    router.add_request([2] * BLOCK, SamplingParams(max_tokens=5), request_id="b")
    replicas[1].fail = True
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
    router.close()
    assert [r.aborted for r in replicas] == [[], ["b"]]
    assert router.num_outstanding == (0, 0) and not router.has_unfinished_requests()
