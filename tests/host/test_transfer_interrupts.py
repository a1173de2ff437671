"""An interrupt while finished requests are handed to the connector strands none of them."""

from __future__ import annotations

import signal

import pytest

from jaxkv import KVCacheManager, RequestStatus
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.kv_transfer import KVConnector, TransferEvents
from jaxkv.scheduler_transfers import TransferTracker
from tests.host._sched_util import FakeCopier, add, make_scheduler, run_until_idle, step
from tests.host._util import make_request, prefill

BS = 4


def _offloading(connector_type: type[HostOffloadConnector], copier: FakeCopier):
    """A connector of `connector_type` holding 64 of `copier`'s blocks, bound to it, and
    a 32-block scheduler that drives it."""
    connector = connector_type(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    return connector, make_scheduler(num_blocks=32, block_size=BS, connector=connector)


class _SaveInterrupted(FakeCopier):
    """A copier whose next start_save raises KeyboardInterrupt itself (a real Ctrl-C
    there is held until the update is done: the save may have started)."""

    interrupt_next = False

    def start_save(self, block_ids):
        if self.interrupt_next:
            self.interrupt_next = False
            raise KeyboardInterrupt("during the save's compile")
        return super().start_save(block_ids)


def test_an_interrupt_in_on_finish_frees_that_request_and_still_finishes_the_others():
    copier = _SaveInterrupted(32, BS)
    connector, sched = _offloading(HostOffloadConnector, copier)
    a = add(sched, "a", range(1, 10), max_tokens=1)
    b = add(sched, "b", range(20, 29), max_tokens=1)
    copier.interrupt_next = True
    with pytest.raises(KeyboardInterrupt):
        step(sched, copier)  # their prompts and one token each: both finish
    # a's save never started: its blocks are free. b, after it, is saved as usual.
    assert "a" not in sched.requests and a.status == RequestStatus.FINISHED_LENGTH
    assert list(sched.transferring) == ["b"] and b.status == RequestStatus.FINISHED_TRANSFERRING
    assert sched.running == [] and sched.stats.num_generated_tokens == 2
    sched.manager.check_integrity()
    run_until_idle(sched, copier)
    assert sched.requests == {} and sched.manager.num_free_blocks == 31
    assert connector.stats.num_saves == 1 and b.status == RequestStatus.FINISHED_LENGTH
    add(sched, "a", range(1, 10), max_tokens=1)  # its id is free again
    assert run_until_idle(sched, copier) == {"a": "length"}
    assert sched.manager.num_free_blocks == 31


class _First(BaseException):
    pass


class _Second(BaseException):
    pass


class _InterruptingConnector(KVConnector):
    """Each on_finish raises the next of `interrupts`."""

    def __init__(self, interrupts):
        self.interrupts = list(interrupts)

    def on_finish(self, request, block_ids):
        raise self.interrupts.pop(0)


def test_finish_all_releases_everyone_and_then_raises_the_first_interrupt():
    # With one interrupt per request, the first is the one the caller sees (the later
    # ones happened while finishing the rest); each request is released all the same.
    m = KVCacheManager(16, 4, max_model_len=64)
    reqs = [make_request(r, range(6)) for r in "abc"]
    for r in reqs:
        prefill(m, r)
    released = []

    def release(request):
        m.free(request)
        released.append(request.request_id)

    connector = _InterruptingConnector([_First(), KeyboardInterrupt(), _Second()])
    with pytest.raises(_First):
        TransferTracker(connector, m, release).finish_all(reqs)
    assert released == ["a", "b", "c"] and m.num_free_blocks == 15
    m.check_integrity()


class _InterruptedAfterPoll(HostOffloadConnector):
    """A Ctrl-C arrives while its poll() runs, after it collected the copies that ended
    (Python raises it at the next bytecode that looks for signals)."""

    interrupt_next = False

    def poll(self):
        events = super().poll()
        if self.interrupt_next and events:
            self.interrupt_next = False
            signal.raise_signal(signal.SIGINT)
        return events


def test_an_interrupt_while_copies_are_polled_loses_no_report():
    # Raised inside poll(), after the connector had dropped the copies it reported: their
    # blocks stayed held for good (drain_transfers and close timed out forever).
    copier = FakeCopier(32, BS, auto_complete=False)
    connector, sched = _offloading(_InterruptedAfterPoll, copier)
    add(sched, "a", range(1, 10), max_tokens=1)
    step(sched, copier)  # finishes: its save is in flight
    assert list(sched.transferring) == ["a"]
    copier.complete()
    connector.interrupt_next = True
    with pytest.raises(KeyboardInterrupt):
        sched.schedule()
    assert sched.transferring == {} and sched.manager.num_free_blocks == 31
    assert connector.stats.num_saves == 1 and not sched.has_pending_transfers()
    sched.manager.check_integrity()


class _InterruptedOnceSaving(HostOffloadConnector):
    """A Ctrl-C arrives while its on_finish runs, after it started and recorded the save
    (Python raises it at the next bytecode that looks for signals)."""

    interrupt_next = False

    def on_finish(self, request, block_ids):
        held = super().on_finish(request, block_ids)
        if self.interrupt_next and held:
            self.interrupt_next = False
            signal.raise_signal(signal.SIGINT)
        return held


def test_an_interrupt_once_a_save_has_started_holds_its_blocks_until_it_lands():
    # Raised inside on_finish, after the connector had started the save: the request was
    # released, its blocks freed (and reused) while the save still read them, and the
    # save's report made the next schedule() raise ValueError.
    copier = FakeCopier(32, BS, auto_complete=False)
    connector, sched = _offloading(_InterruptedOnceSaving, copier)
    a = add(sched, "a", range(1, 10), max_tokens=1)
    connector.interrupt_next = True
    with pytest.raises(KeyboardInterrupt):
        step(sched, copier)  # finishes: the Ctrl-C comes as its save starts
    assert list(sched.transferring) == ["a"] and a.status == RequestStatus.FINISHED_TRANSFERRING
    assert sched.manager.num_free_blocks == 31 - 3
    sched.manager.check_integrity()
    copier.complete()
    assert run_until_idle(sched, copier) == {}  # the save lands, reported once
    assert sched.requests == {} and sched.manager.num_free_blocks == 31
    assert connector.stats.num_saves == 1 and a.status == RequestStatus.FINISHED_LENGTH


class _SavedAtAnInterruptedPoll(KVConnector):
    """Holds each finished request for a save; its poll() reports a's save landed as a
    Ctrl-C arrives."""

    def on_finish(self, request, block_ids):
        return True

    def poll(self):
        signal.raise_signal(signal.SIGINT)
        return TransferEvents(saved=("a",))


def test_the_tracker_itself_holds_an_interrupt_in_poll_until_the_report_is_applied():
    # Its own guarantee, whoever calls apply_events(): raised inside poll(), the report
    # was lost and a's blocks stayed held for good.
    m = KVCacheManager(16, 4, max_model_len=64)
    a = make_request("a", range(6))
    prefill(m, a)
    a.status = RequestStatus.FINISHED_LENGTH
    released = []
    tracker = TransferTracker(_SavedAtAnInterruptedPoll(), m, released.append)
    tracker.finish(a)
    assert tracker.transferring == {"a": a} and a.status == RequestStatus.FINISHED_TRANSFERRING
    with pytest.raises(KeyboardInterrupt):
        tracker.apply_events()
    assert tracker.transferring == {} and released == [a]
    assert a.status == RequestStatus.FINISHED_LENGTH
