"""HostOffloadConnector logs each save or load whose copy failed (its Future raised, on
the copy thread, or the store had no memory for a landed block), naming the request and
the exception, besides counting it."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import numpy as np
import pytest

from jaxkv import Request, SamplingParams
from jaxkv.host_block_store import HostBlockStore
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import (
    FakeCopier,
    add,
    make_scheduler,
    run_until_idle,
    store_link_faults,
)

BS = 4


@pytest.mark.filterwarnings("error")
def test_a_failed_save_and_a_failed_load_are_logged_with_their_exceptions(caplog):
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    first = Request("first", list(range(1, 10)), SamplingParams())
    first.num_computed_tokens = 8
    copier.fail_saves = True
    with caplog.at_level(logging.WARNING, logger="jaxkv.host_offload_connector"):
        assert connector.on_finish(first, [1, 2])
        assert connector.poll().failed_saves == ("first",)
        copier.fail_saves = False
        assert connector.on_finish(first, [1, 2]) and connector.poll().saved == ("first",)
        again = Request("again", list(range(1, 10)), SamplingParams())
        assert connector.on_admission(again, 0) == 8
        copier.fail_loads = True
        connector.start_load(again, [3, 4])
        assert connector.poll().failed_loads == ("again",)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "save of 'first'" in messages[0] and "injected save failure" in messages[0]
    assert "load of 'again'" in messages[1] and "injected load failure" in messages[1]
    stats = connector.stats
    assert (stats.num_failed_saves, stats.num_saves, stats.num_failed_loads) == (1, 1, 1)


def _poll(connector):
    try:
        return connector.poll()
    except BaseException as e:  # noqa: BLE001 - an interrupt here would end the test run
        pytest.fail(f"poll() raised {e!r}")


def _pending_save(request_id: str):
    """(copier, connector, request, future): a connector bound to a copier that completes
    nothing by itself, with the save of a request's two full blocks started."""
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    request = Request(request_id, list(range(1, 10)), SamplingParams())
    request.num_computed_tokens = 8
    assert connector.on_finish(request, [1, 2])
    ((future, _),) = copier.pending
    return copier, connector, request, future


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)], ids=type)
def test_a_copy_that_ended_with_a_base_exception_fails_like_any_other(error, caplog):
    # A Future stores a BaseException its copy thread raised. poll() used to raise it
    # after dropping the transfer, so the request never learnt its save or load ended.
    copier, connector, first, future = _pending_save("first")
    future.set_exception(error)
    with caplog.at_level(logging.WARNING, logger="jaxkv.host_offload_connector"):
        assert _poll(connector).failed_saves == ("first",)
    assert not connector.has_pending() and connector.stored_hashes() == []
    copier.pending.clear()
    assert connector.on_finish(first, [1, 2])  # saved this time: the store is usable
    copier.complete()
    assert connector.poll().saved == ("first",)
    again = Request("again", list(range(1, 10)), SamplingParams())
    assert connector.on_admission(again, 0) == 8
    connector.start_load(again, [3, 4])
    ((future, _),) = copier.pending
    future.set_exception(error)
    with caplog.at_level(logging.WARNING, logger="jaxkv.host_offload_connector"):
        assert _poll(connector).failed_loads == ("again",)
    assert not connector.has_pending()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all(repr(error) in m for m in messages), messages
    stats = connector.stats
    assert (stats.num_failed_saves, stats.num_saves, stats.num_failed_loads) == (1, 1, 1)


def _one_failed_save_then_one_saved(copier, wrong: str, caplog) -> None:
    """Serves "a", whose save must fail with one warning naming `wrong` and leave nothing
    held, stored or pending; then, once `copier` is healed (its `ragged` / `land` unset),
    serves "b", whose save must land."""
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=16, block_size=BS, connector=connector)
    add(sched, "a", range(1, 10), max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="jaxkv.host_offload_connector"):
        run_until_idle(sched)
    assert sched.requests == {} and sched.manager.num_free_blocks == 15
    assert not connector.has_pending() and connector.stored_hashes() == []
    assert connector.stats.num_failed_saves == 1 and connector.stats.num_saves == 0
    ((message,),) = [[r.getMessage() for r in caplog.records]]
    assert "save of 'a' failed" in message and wrong in message, message
    copier.ragged, copier.land = False, None
    add(sched, "b", range(1, 10), max_tokens=1)
    run_until_idle(sched)
    assert len(connector.stored_hashes()) == 2  # the failed save left none "being saved"


class _RaggedSaves(FakeCopier):
    """A copier whose saves, while `ragged`, land as many blocks as asked, each ragged (no
    array holds it)."""

    ragged = True

    def start_save(self, block_ids):
        if not self.ragged:
            return super().start_save(block_ids)
        future: Future = Future()
        future.set_result([[[0.0], [1.0, 2.0]]] * len(block_ids))
        return future


@pytest.mark.filterwarnings("error")
def test_a_save_that_lands_ragged_blocks_fails_and_its_blocks_are_freed(caplog):
    # poll() used to raise in the store's put, the save already dropped: the request
    # stayed FINISHED_TRANSFERRING, holding its blocks for good.
    copier = _RaggedSaves(16, BS)
    _one_failed_save_then_one_saved(copier, "ValueError", caplog)


class _ReshapedSaves(FakeCopier):
    """A copier whose saves land as many blocks as asked, each made `land(blocks)` (another
    shape or dtype than the f32[block_size] blocks of FakeCopier) while `land` is set."""

    land = None

    def start_save(self, block_ids):
        future = super().start_save(block_ids)
        if self.land is None:
            return future
        reshaped: Future = Future()
        reshaped.set_result(self.land(future.result()))
        return reshaped


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize(
    ("declared", "land", "wrong"),
    [
        ({"block_shape": (BS,)}, lambda a: a.reshape(len(a), 2, BS // 2), "shape (2, 2)"),
        ({"dtype": np.dtype(np.float32)}, lambda a: a.view(np.int32), "dtype int32"),
        (
            {"block_shape": (BS,), "dtype": np.float32},
            lambda a: a.astype(np.float64)[:, :, None],
            "shape (4, 1), not the copier's (4,) and dtype float64, not the copier's float32",
        ),
    ],
    ids=["shape", "dtype", "both"],
)
def test_a_save_that_lands_blocks_unlike_the_copiers_fails_and_its_blocks_are_freed(
    declared, land, wrong, caplog
):
    # Such blocks were stored, and a later load that gathered them with blocks of the
    # declared layout failed far from the cause (np.stack, or the copier refusing them).
    copier = _ReshapedSaves(16, BS)
    for name, value in declared.items():
        setattr(copier, name, value)
    copier.land = land
    _one_failed_save_then_one_saved(copier, wrong, caplog)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize(
    ("land", "wrong"),
    [
        (lambda a: a.reshape(len(a), 2, BS // 2), "shape (2, 2), not the stored blocks' (4,)"),
        (lambda a: a.astype(np.float64), "dtype float64, not the stored blocks' float32"),
    ],
    ids=["shape", "dtype"],
)
def test_a_copier_declaring_no_layout_stores_only_blocks_like_those_stored(land, wrong, caplog):
    # FakeCopier declares neither block_shape nor dtype. Blocks of another shape were
    # stored behind those of an earlier save; a prompt covering both then made start_load
    # raise in np.stack at every schedule(), its request waiting for good.
    copier = _ReshapedSaves(16, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(
        num_blocks=16, block_size=BS, connector=connector, enable_prefix_caching=False
    )
    add(sched, "a", range(1, 10), max_tokens=1)
    run_until_idle(sched, copier)
    assert len(connector.stored_hashes()) == 2
    copier.land = land
    prompt = [1, 2, 3, 4, 50, 51, 52, 53, 54]  # a's first block, then a new one
    add(sched, "b", prompt, max_tokens=1)  # loads a's first block, saves its second
    with caplog.at_level(logging.WARNING, logger="jaxkv.host_offload_connector"):
        run_until_idle(sched, copier)
    assert sched.requests == {} and sched.manager.num_free_blocks == 15
    assert not connector.has_pending() and len(connector.stored_hashes()) == 2
    assert connector.stats.num_failed_saves == 1
    ((message,),) = [[r.getMessage() for r in caplog.records]]
    assert "save of 'b' failed" in message and wrong in message, message
    copier.land = None
    add(sched, "c", [*prompt, 55], max_tokens=1)  # finds only a's first block stored
    run_until_idle(sched, copier)
    assert sched.requests == {} and sched.manager.num_free_blocks == 15
    stats = connector.stats
    assert (stats.num_loads, stats.num_loaded_tokens, stats.num_failed_loads) == (2, 2 * BS, 0)
    assert len(connector.stored_hashes()) == 3  # c's second block, like the others


@pytest.mark.filterwarnings("error")
def test_a_save_the_store_has_no_memory_for_fails_and_the_other_landed_copies_are_reported(
    monkeypatch, caplog
):
    # A MemoryError in the store's copy of a landed block escaped poll(), its transfer
    # already dropped: the request held its blocks for good, one of its blocks stayed
    # stored, and b's save, landed in the same poll(), was never reported either.
    copier = FakeCopier(32, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    put, calls = HostBlockStore.put, []

    def short_of_memory(store, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:  # a's second block: its first is stored by then
            raise MemoryError
        put(store, *args, **kwargs)

    monkeypatch.setattr(HostBlockStore, "put", short_of_memory)
    add(sched, "a", range(1, 10), max_tokens=1)
    add(sched, "b", range(20, 29), max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="jaxkv.host_offload_connector"):
        run_until_idle(sched, copier)
    assert len(calls) == 4  # a's two blocks, then b's
    assert sched.requests == {} and sched.manager.num_free_blocks == 31
    assert not connector.has_pending() and connector.stored_hashes() == calls[2:]
    assert store_link_faults(connector) == []
    stats = connector.stats
    assert (stats.num_failed_saves, stats.num_saves) == (1, 1)
    ((message,),) = [[r.getMessage() for r in caplog.records]]
    assert "save of 'a' failed" in message and "MemoryError" in message, message
    add(sched, "again", range(1, 10), max_tokens=1)  # a's blocks are saved this time
    run_until_idle(sched, copier)
    assert len(connector.stored_hashes()) == 4 and connector.stats.num_saves == 2


class _ParentLinksShortOfMemory(dict):
    """The store's parent links, failing to grow at their `fail_at`-th new key."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.new_keys = fail_at, 0

    def __setitem__(self, key, value):
        if key not in self:
            self.new_keys += 1
            if self.new_keys == self.fail_at:
                raise MemoryError
        super().__setitem__(key, value)


@pytest.mark.filterwarnings("error")
def test_a_save_out_of_memory_growing_the_stores_parent_links_fails_cleanly(caplog):
    # put stored the entry before its parent link: out of memory there, the entry stayed
    # with no parent, and the save's rollback (drop) raised KeyError out of poll(), the
    # request's blocks held for good and b's landed save unreported.
    copier = FakeCopier(32, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    connector._store._parent_of = _ParentLinksShortOfMemory(fail_at=2)  # a's second put
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    add(sched, "a", range(1, 10), max_tokens=1)
    add(sched, "b", range(20, 29), max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="jaxkv.host_offload_connector"):
        run_until_idle(sched, copier)
    assert sched.requests == {} and sched.manager.num_free_blocks == 31
    assert not connector.has_pending() and len(connector.stored_hashes()) == 2  # b's
    assert store_link_faults(connector) == []
    stats = connector.stats
    assert (stats.num_failed_saves, stats.num_saves) == (1, 1)
    assert "save of 'a' failed" in caplog.text and "MemoryError" in caplog.text


@pytest.mark.filterwarnings("error")
def test_a_save_that_lands_blocks_larger_than_bytes_per_block_fails_and_its_blocks_are_freed(
    caplog,
):
    # FakeCopier declares no block_shape or dtype, only bytes_per_block (16 bytes): its
    # float64 blocks of 32 bytes were stored into an empty store, which counts host_bytes
    # by bytes_per_block, so it held twice its budget while its stats said otherwise.
    copier = _ReshapedSaves(16, BS)
    copier.land = lambda a: a.astype(np.float64)
    _one_failed_save_then_one_saved(
        copier, "32 bytes each, not the copier's bytes_per_block 16", caplog
    )


def test_a_save_returning_the_wrong_number_of_blocks_is_logged_naming_both_counts(caplog):
    copier, connector, _, future = _pending_save("a")
    copier.pending.clear()
    future.set_result(copier.device[[1]])  # one block for the two asked
    with caplog.at_level(logging.WARNING, logger="jaxkv.host_offload_connector"):
        assert connector.poll().failed_saves == ("a",)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "save of 'a'" in message and "1 blocks copied for 2 asked" in message
