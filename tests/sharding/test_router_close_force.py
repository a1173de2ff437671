"""PrefixAwareRouter.close(force=True): past KV copies that never land the router ends
closed, every replica's close(force=True) tried, as Engine.close(force=True) ends an
engine; a force the router cannot pass on is refused before anything changes."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter
from tests.sharding._router_util import BLOCK, FakeReplica


class ForcibleReplica(FakeReplica):
    """Records the keywords of each close call; a copy stays in flight while `pending`
    (each step lands it if `lands`); its close, unforced, raises TimeoutError while
    `pending`, as Engine.close does."""

    def __init__(self, index: int, pending: bool = False) -> None:
        super().__init__(index)
        self.pending, self.lands = pending, False
        self.close_calls: list[dict] = []
        self.closed = False

    def has_pending_transfers(self) -> bool:
        return self.pending

    def step(self):
        self.pending = self.pending and not self.lands
        return super().step()

    def close(self, timeout_s: float = 60.0, *, force: bool = False) -> None:
        self.close_calls.append({"timeout_s": timeout_s, "force": force})
        self.running.clear()
        if self.pending:
            if not force:
                raise TimeoutError("copies still pending")
            self.closed = True
            raise TimeoutError("copies still pending; lost with the replica")
        self.closed = True


class PlainClosingReplica(FakeReplica):
    """A close with no force keyword (a fake, a proxy of an older engine)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.close_calls: list[dict] = []

    def close(self, timeout_s: float = 60.0) -> None:
        self.close_calls.append({"timeout_s": timeout_s})
        self.running.clear()


class ForwardingReplica(PlainClosingReplica):
    """A proxy whose close forwards whatever keywords it is given."""

    def close(self, *args, **kwargs) -> None:
        self.close_calls.append(kwargs)
        self.running.clear()


def _router(replicas) -> tuple[PrefixAwareRouter, list[str]]:
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    params = SamplingParams(max_tokens=5)
    ids = [router.add_request([i + 1] * BLOCK, params) for i in range(len(replicas))]
    return router, ids


def test_a_forced_close_ends_closed_past_copies_that_never_land():
    # Unforced, copies still in flight at timeout_s (no replica failing) leave the router
    # and every replica open; force=True had no router equivalent: each replica had to be
    # closed by hand with close(force=True).
    replicas = [ForcibleReplica(0), ForcibleReplica(1, pending=True), ForcibleReplica(2)]
    router, ids = _router(replicas)
    with pytest.raises(TimeoutError, match="still pending"):
        router.close(timeout_s=0)
    assert not router.closed and not any(r.close_calls for r in replicas)

    with pytest.raises(TimeoutError, match="still pending") as raised:
        router.close(timeout_s=0, force=True)

    (note,) = raised.value.__notes__
    assert note.startswith("raised by waiting for the KV copies; close went on")
    assert "replicas[1] (ForcibleReplica).close() raised TimeoutError" in note
    assert router.closed and router.num_outstanding == (0, 0, 0)
    assert all(r.closed for r in replicas)
    assert [r.close_calls for r in replicas] == [[{"timeout_s": 0.0, "force": True}]] * 3
    assert not router.has_unfinished_requests() and router.abort(ids) is False
    router.close(force=True)  # closed: nothing to do
    assert all(len(r.close_calls) == 1 for r in replicas)


def test_a_forced_close_whose_copies_land_passes_force_and_raises_nothing():
    replicas = [ForcibleReplica(0, pending=True), ForwardingReplica(1), FakeReplica(2)]
    replicas[0].lands = True
    router, _ = _router(replicas)
    router.close(timeout_s=30.0, force=True)
    assert router.closed and not replicas[0].pending
    assert replicas[0].close_calls[0]["force"] is True
    assert replicas[1].close_calls[0]["force"] is True
    assert all(0 < r.close_calls[0]["timeout_s"] <= 30.0 for r in replicas[:2])


def test_an_unforced_close_passes_no_force_keyword():
    # Unchanged: a replica's close(timeout_s) is called as before, force not named.
    replicas = [ForcibleReplica(0), ForwardingReplica(1), PlainClosingReplica(2)]
    router, _ = _router(replicas)
    router.close(force=False)
    assert [list(r.close_calls[0]) for r in replicas] == [["timeout_s", "force"]] + [
        ["timeout_s"]
    ] * 2
    assert replicas[0].close_calls[0]["force"] is False


def test_a_forced_close_refuses_a_replica_close_without_force_before_aborting_anything():
    # Forcing past it could not be passed on: it might keep its copies, and device memory,
    # behind a router that reported closing by force.
    replicas = [ForcibleReplica(0), PlainClosingReplica(1), ForcibleReplica(2)]
    router, ids = _router(replicas)
    with pytest.raises(ValueError, match=r"replicas\[1\] \(PlainClosingReplica\)\.close"):
        router.close(force=True)
    assert not router.closed and router.num_outstanding == (1, 1, 1)
    assert all(r.running for r in replicas) and not any(r.close_calls for r in replicas)
    assert [router.replica_of(rid) for rid in ids] == [0, 1, 2]
    router.close()  # unforced, it is closed as before
    assert router.closed and len(replicas[1].close_calls) == 1


@pytest.mark.parametrize("force", ["yes", None, 1, 0, np.array([True])])
def test_close_refuses_a_force_that_is_no_bool_before_aborting_anything(force):
    replicas = [ForcibleReplica(0), ForcibleReplica(1, pending=True)]
    router, _ = _router(replicas)
    with pytest.raises(ValueError, match="force"):
        router.close(force=force)
    assert not router.closed and router.num_outstanding == (1, 1)
    assert not any(r.close_calls for r in replicas)


def test_a_numpy_bool_force_is_accepted_and_passed_on_as_a_bool():
    replicas = [ForcibleReplica(0, pending=True), ForcibleReplica(1)]
    router, _ = _router(replicas)
    with pytest.raises(TimeoutError):
        router.close(timeout_s=0, force=np.bool_(True))
    assert router.closed
    assert all(type(r.close_calls[0]["force"]) is bool for r in replicas)


class _UnreadableSignature:
    """A callable whose signature inspect cannot read (as some extension functions')."""

    __signature__ = "unreadable"  # inspect.signature raises TypeError

    def __init__(self, replica: PlainClosingReplica) -> None:
        self.replica = replica

    def __call__(self, *args, **kwargs) -> None:
        self.replica.close_calls.append(kwargs)
        self.replica.running.clear()


def test_a_forced_close_refuses_a_replica_close_whose_signature_cannot_be_read():
    """Whether it takes force cannot be told: refused by name, as one without it is,
    before anything changes (it raised inspect's TypeError)."""
    replicas = [ForcibleReplica(0), PlainClosingReplica(1)]
    replicas[1].close = _UnreadableSignature(replicas[1])
    router, _ = _router(replicas)
    with pytest.raises(ValueError, match=r"replicas\[1\] \(PlainClosingReplica\)\.close takes"):
        router.close(force=True)
    assert not router.closed and router.num_outstanding == (1, 1)
    assert not any(r.close_calls for r in replicas)
    router.close()  # unforced, it is called without force
    assert router.closed and [list(c) for c in replicas[1].close_calls] == [["timeout_s"]]
