"""Engine.close against failures that repeat on every try: a KV copy that never lands, a
step that keeps raising while close waits for the copies. Each close must be able to end
closed, the copy thread stopped and the KV caches freed, with the error raised."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import VOCAB, assert_all_blocks_free, make_engine

HOST_BYTES = 1 << 24


def _prompt(seed: int, length: int = 20) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


def _assert_closed_and_freed(engine, caches) -> None:
    assert engine.closed and engine.kv_caches == [] and engine.copier.closed
    assert all(cache.is_deleted() for cache in caches)
    assert not engine.has_pending_transfers()  # those that never landed are lost with it
    # ... and so are their requests: no id stays in use, no block held, none counted
    assert not engine.scheduler.requests and engine.metrics.num_transferring == 0
    assert_all_blocks_free(engine)
    engine.close()  # closed: nothing to do


def _serves(connector) -> None:
    """A new engine binds `connector` (unbound by the closed one) and serves."""
    with make_engine(connector=connector) as successor:
        out = successor.generate([_prompt(9)], SamplingParams(max_tokens=2), progress=False)
        assert len(out[0].output_token_ids) == 2


def test_a_forced_close_ends_closed_past_a_copy_that_never_lands():
    # A save whose copy never returns (a hung device read) kept every close raising
    # TimeoutError, the engine open, its KV caches held: nothing but dropping the engine
    # freed them, and the copy thread's shutdown would have waited on the copy for good.
    connector = HostOffloadConnector(HOST_BYTES)
    engine = make_engine(connector=connector)
    copier, hung = engine.copier, threading.Event()
    copier.start_save = lambda block_ids: copier._executor.submit(hung.wait)
    try:
        engine.generate([_prompt(1)], SamplingParams(max_tokens=2), progress=False)
        caches = engine.kv_caches
        for timeout_s in (0.05, 0):  # with sound copies, a close with more time would land them
            with pytest.raises(TimeoutError, match="still pending"):
                engine.close(timeout_s=timeout_s)
            assert not engine.closed and engine.has_pending_transfers()

        with pytest.raises(TimeoutError, match="still pending") as raised:
            engine.close(timeout_s=0, force=True)

        assert "close went on" in "".join(raised.value.__notes__)
        assert not hung.is_set()  # close did not wait for the hung copy
        # The lost save counts as failed: it neither landed nor vanished from the counts.
        assert connector.stats.num_failed_saves == 1 and connector.stats.num_saves == 0
        _assert_closed_and_freed(engine, caches)
        assert connector.hash_layout is None and not connector.has_pending()
        _serves(connector)
    finally:
        hung.set()
    for thread in list(copier._executor._threads):  # it ends with the copy it ran
        thread.join()


def test_a_forced_close_whose_copies_land_raises_nothing():
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=3)
    engine = make_engine(connector=connector)
    engine.generate([_prompt(2)], SamplingParams(max_tokens=2), progress=False)
    assert engine.has_pending_transfers()
    engine.close(force=True)
    assert engine.closed and connector.stats.num_stored_blocks > 0
    assert_all_blocks_free(engine)


def _fails() -> None:
    raise OSError("device read failed")


def test_copies_that_fail_on_the_copy_thread_every_time_let_close_end_quietly():
    # A failed save ends its transfer like a landed one (its blocks freed, unsaved, a
    # warning logged): close has nothing to raise and nothing is left in flight.
    connector = HostOffloadConnector(HOST_BYTES)
    engine = make_engine(connector=connector)
    copier = engine.copier
    copier.start_save = lambda block_ids: copier._executor.submit(_fails)
    engine.generate([_prompt(10), _prompt(11)], SamplingParams(max_tokens=2), progress=False)
    caches = engine.kv_caches
    engine.close()
    assert connector.stats.num_failed_saves == 2 and connector.stats.num_stored_blocks == 0
    assert_all_blocks_free(engine)
    _assert_closed_and_freed(engine, caches)


class _PollFails(HostOffloadConnector):
    """Its poll raises `error` while set (`once`: the first time only)."""

    error: BaseException | None = None
    once = False

    def poll(self):
        error = self.error
        if error is not None:
            self.error = None if self.once else error
            raise error
        return super().poll()


# A TimeoutError of the connector's own (a socket's: socket.timeout is TimeoutError) is
# no timeout of close's wait: it was taken for one, and left the engine open as well.
POLL_ERRORS = [RuntimeError, TimeoutError]


@pytest.mark.parametrize("error_type", POLL_ERRORS)
def test_a_step_that_keeps_raising_while_close_waits_still_closes_the_engine(error_type):
    # The connector's poll failing at every step made every close raise with the engine
    # left open and its KV caches held, whatever the timeout: it could never be closed.
    connector = _PollFails(HOST_BYTES, copy_delay_steps=5)
    engine = make_engine(connector=connector)
    engine.generate([_prompt(3)], SamplingParams(max_tokens=2), progress=False)
    engine.add_request(_prompt(4), SamplingParams(max_tokens=8), request_id="running")
    caches = engine.kv_caches
    connector.error = error_type("poll broken")

    with pytest.raises(error_type, match="poll broken") as raised:
        engine.close()

    assert "close went on" in "".join(raised.value.__notes__)
    _assert_closed_and_freed(engine, caches)
    assert engine.abort("running") is False  # aborted by the close
    assert connector.hash_layout is None and not connector.has_pending()
    connector.error = None
    _serves(connector)


@pytest.mark.parametrize("error_type", POLL_ERRORS)
def test_a_router_closes_a_replica_whose_step_keeps_raising(error_type):
    # The router's close went on past it, but the replica's own close raised the same way
    # and left it open: the router closed, nothing closed the replica.
    connector = _PollFails(HOST_BYTES, copy_delay_steps=5)
    engine = make_engine(connector=connector)
    router = PrefixAwareRouter([engine], block_size=4)
    router.generate([_prompt(5)], SamplingParams(max_tokens=2), progress=False)
    caches = engine.kv_caches
    connector.error = error_type("poll broken")
    with pytest.raises(error_type, match="poll broken"):
        router.close()
    assert router.closed
    _assert_closed_and_freed(engine, caches)


def test_a_forced_router_close_ends_every_engine_closed_past_a_copy_that_never_lands():
    # Unforced, the router's close raised TimeoutError and left every replica open, the
    # hung one's KV caches held: each had to be closed by hand with close(force=True).
    hung = threading.Event()
    engines = [make_engine(connector=HostOffloadConnector(HOST_BYTES)) for _ in range(2)]
    copier = engines[0].copier
    copier.start_save = lambda block_ids: copier._executor.submit(hung.wait)
    router = PrefixAwareRouter(engines, block_size=4)
    try:
        router.generate([_prompt(12), _prompt(13)], SamplingParams(max_tokens=2), progress=False)
        assert engines[0].has_pending_transfers()
        caches = [engine.kv_caches for engine in engines]
        with pytest.raises(TimeoutError, match="still pending"):
            router.close(timeout_s=0)
        assert not router.closed and not any(engine.closed for engine in engines)

        with pytest.raises(TimeoutError, match="still pending") as raised:
            router.close(timeout_s=0, force=True)

        assert "close went on" in "".join(raised.value.__notes__)
        assert router.closed and not hung.is_set()
        for engine, engine_caches in zip(engines, caches, strict=True):
            _assert_closed_and_freed(engine, engine_caches)
        _serves(engines[0].connector)
    finally:
        hung.set()
    for thread in list(copier._executor._threads):
        thread.join()


def test_an_interrupt_while_close_waits_leaves_the_engine_to_a_second_close():
    # An interrupt is not a failure of the copies: it propagates at once, the engine open
    # and its requests aborted, and the next close lands the copies as if uninterrupted.
    connector = _PollFails(HOST_BYTES, copy_delay_steps=3)
    engine = make_engine(connector=connector)
    engine.generate([_prompt(6)], SamplingParams(max_tokens=2), progress=False)
    engine.add_request(_prompt(7), SamplingParams(max_tokens=8))
    connector.error, connector.once = KeyboardInterrupt(), True
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    assert not engine.closed and not engine.has_unfinished_requests()
    assert engine.has_pending_transfers()
    engine.close()
    assert engine.closed and connector.stats.num_stored_blocks > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("force", ["yes", None, 1])
def test_close_refuses_a_force_that_is_no_bool_before_aborting_anything(force):
    engine = make_engine()
    rid = engine.add_request(_prompt(8, 8), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="force"):
        engine.close(force=force)
    assert not engine.closed and engine.scheduler.requests[rid].status.name == "WAITING"
    engine.close()


def test_a_router_takes_again_the_id_of_a_request_whose_copy_a_forced_close_lost():
    # The closed replica kept the request in its scheduler, its blocks held: ids_in_use
    # held the id for good, and the router refused it, pointing at a drain_transfers
    # that a closed replica can no longer run.
    connector = HostOffloadConnector(HOST_BYTES)
    engine, other = make_engine(connector=connector), make_engine()
    copier, hung = engine.copier, threading.Event()
    copier.start_save = lambda block_ids: copier._executor.submit(hung.wait)
    router = PrefixAwareRouter([engine, other], block_size=4)
    try:
        router.generate([_prompt(12)], SamplingParams(max_tokens=2), progress=False)
        assert engine.has_pending_transfers()
        with pytest.raises(TimeoutError):
            engine.close(timeout_s=0, force=True)
        assert "dp-0" not in engine.ids_in_use
        router.add_request(_prompt(13), SamplingParams(max_tokens=2), request_id="dp-0")
        router.close()
    finally:
        hung.set()


class _EndFails(HostOffloadConnector):
    """Its stats and unbind raise while `broken`."""

    broken = False

    @property
    def stats(self):
        if self.broken:
            raise RuntimeError("stats broken")
        return super().stats

    def unbind(self, copier) -> None:
        if self.broken:
            raise RuntimeError("unbind broken")
        super().unbind(copier)


def test_a_forced_close_goes_on_past_every_failing_step_of_its_end_and_names_them():
    # The end of close (the connector's last counts, its unbind, the lost copies'
    # requests released) is done whole: each failing step is named on the error raised,
    # and the engine ends closed with its KV caches freed.
    connector = _EndFails(HOST_BYTES, copy_delay_steps=5)
    engine = make_engine(connector=connector)
    engine.generate([_prompt(12)], SamplingParams(max_tokens=2), progress=False)
    assert engine.has_pending_transfers()
    caches = engine.kv_caches

    def forget_fails():
        raise RuntimeError("forget broken")

    engine.scheduler.forget_transfers = forget_fails
    connector.broken = True
    with pytest.raises(TimeoutError, match="still pending") as raised:
        engine.close(timeout_s=0, force=True)

    (note,) = raised.value.__notes__
    assert note.startswith("raised by waiting for the KV copies; close went on")
    assert "connector.stats raised RuntimeError('stats broken')" in note
    assert "connector.unbind(copier) raised RuntimeError('unbind broken')" in note
    assert "releasing the requests of the copies lost raised RuntimeError('forget broken')" in note
    assert engine.closed and engine.kv_caches == [] and engine.copier.closed
    assert all(cache.is_deleted() for cache in caches)
    engine.close()  # closed: nothing to do
