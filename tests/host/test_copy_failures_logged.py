"""HostOffloadConnector logs each save or load whose copy failed (its Future raised, on
the copy thread), naming the request and the exception, besides counting it."""

from __future__ import annotations

import logging

import pytest

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier

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


@pytest.mark.parametrize("error", [KeyboardInterrupt(), SystemExit(3)], ids=type)
def test_a_copy_that_ended_with_a_base_exception_fails_like_any_other(error, caplog):
    # A Future stores a BaseException its copy thread raised. poll() used to raise it
    # after dropping the transfer, so the request never learnt its save or load ended.
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    first = Request("first", list(range(1, 10)), SamplingParams())
    first.num_computed_tokens = 8
    assert connector.on_finish(first, [1, 2])
    ((future, _),) = copier.pending
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
