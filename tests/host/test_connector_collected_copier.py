"""HostOffloadConnector whose copier was collected without unbind (its engine dropped
without close()): the copies it had in flight are forgotten as failed, at once."""

from __future__ import annotations

import gc
import threading

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.kv_transfer import TransferEvents
from tests.host._sched_util import FakeCopier, add, make_scheduler, step

BS = 4


def _one_request(request_id: str, num_tokens: int) -> Request:
    request = Request(request_id, list(range(1, num_tokens + 1)), SamplingParams())
    request.num_computed_tokens = num_tokens
    return request


def _save_in_flight():
    """(connector, copier): a finished request's save through `copier` never lands."""
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = HostOffloadConnector(1 << 20)
    connector.bind(copier, block_size=BS, hash_seed=0)
    assert connector.on_finish(_one_request("a", 8), [1, 2])
    return connector, copier


def _load_in_flight():
    """(connector, copier): a's two blocks stored, and b's load of them never lands."""
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(1 << 20)
    connector.bind(copier, block_size=BS, hash_seed=0)
    assert connector.on_finish(_one_request("a", 8), [1, 2])
    connector.poll()
    copier.auto_complete = False
    b = Request("b", list(range(1, 10)), SamplingParams())
    assert connector.on_admission(b, 0) == 2 * BS
    connector.start_load(b, [5, 6])
    return connector, copier


def test_a_save_in_flight_through_a_collected_copier_is_failed_at_once():
    # It stayed pending, and uncounted, until another engine was bound: a caller waiting
    # for has_pending() to turn False waited for good.
    connector, copier = _save_in_flight()
    assert connector.has_pending()
    del copier
    gc.collect()
    assert not connector.has_pending()
    assert connector.stats.num_failed_saves == 1 and connector.hash_layout is None
    assert connector.poll() == TransferEvents()


def test_a_load_in_flight_through_a_collected_copier_is_failed_at_once():
    connector, copier = _load_in_flight()
    assert connector.has_pending()
    del copier
    gc.collect()
    stats = connector.stats  # the lost load failed; the landed save did not
    assert (stats.num_failed_loads, stats.num_loads, stats.num_failed_saves) == (1, 0, 0)
    assert not connector.has_pending() and connector.poll() == TransferEvents()


def test_a_copier_collected_on_another_thread_is_unbound_on_the_callers():
    # The copy thread may be the one that collects the copier: nothing of the connector
    # changes there, so a poll() on the engine's thread never sees its dicts change.
    connector, copier = _save_in_flight()
    del copier
    collector = threading.Thread(target=gc.collect)
    collector.start()
    collector.join()
    assert connector._saves  # still there: forgotten by the next call on this thread
    assert not connector.has_pending() and connector.stats.num_failed_saves == 1


def test_poll_reports_nothing_for_copies_that_landed_after_their_copier_was_collected():
    # No scheduler is left to free their blocks: reporting them to another engine's
    # scheduler would name requests it never had.
    connector, copier = _save_in_flight()
    ((future, work),) = copier.pending
    del copier
    gc.collect()
    FakeCopier._run(future, work)
    assert connector.poll() == TransferEvents() and connector.stored_hashes() == []


def test_a_copier_collected_without_unbind_frees_the_connector_and_its_copies():
    copier = FakeCopier(32, BS)
    connector = HostOffloadConnector(1 << 20, copy_delay_steps=3)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    add(sched, "a", list(range(1, 10)), max_tokens=1)
    step(sched, copier)  # a save is in flight when its engine goes away
    assert connector.has_pending()
    del copier, sched
    gc.collect()
    connector.bind(FakeCopier(32, BS), block_size=BS, hash_seed=0)
    assert not connector.has_pending()  # no one is left to be told they landed


def test_a_copier_collected_with_a_load_in_flight_leaves_nothing_pending():
    connector, copier = _load_in_flight()
    assert connector.has_pending()
    del copier
    gc.collect()
    connector.bind(FakeCopier(16, BS), block_size=BS, hash_seed=0)
    assert not connector.has_pending() and connector.poll() == TransferEvents()
    assert len(connector.stored_hashes()) == 2  # same layout: the store is kept
    stats = connector.stats  # the lost load failed, once; the landed save did not
    assert (stats.num_failed_loads, stats.num_loads, stats.num_failed_saves) == (1, 0, 0)


def test_blocks_whose_save_was_forgotten_with_its_copier_can_be_saved_again():
    connector, copier = _save_in_flight()  # never lands
    del copier
    gc.collect()
    other = FakeCopier(16, BS)
    connector.bind(other, block_size=BS, hash_seed=0)
    assert connector.on_finish(_one_request("b", 8), [3, 4])  # no longer "being saved"
    assert other.saved_block_ids == [[3, 4]]
