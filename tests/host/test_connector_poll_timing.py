"""HostOffloadConnector.poll: a landed copy is reported on the copy_delay_steps-th poll
after it started, not before and not later; a copy still running is neither waited for
nor reported."""

from __future__ import annotations

import threading

import pytest

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier

BS = 4


def _connector(copier: FakeCopier, copy_delay_steps: int) -> HostOffloadConnector:
    connector = HostOffloadConnector(64 * copier.bytes_per_block, copy_delay_steps=copy_delay_steps)
    connector.bind(copier, block_size=BS, hash_seed=0)
    return connector


def _finished(request_id: str) -> Request:
    request = Request(request_id, list(range(1, 10)), SamplingParams())
    request.num_computed_tokens = 8  # two full blocks
    return request


@pytest.mark.parametrize("copy_delay_steps", [0, 1, 3])
def test_a_landed_copy_is_reported_on_the_delay_th_poll_after_it_started(copy_delay_steps):
    copier = FakeCopier(16, BS)  # copies land at once; held here, as the connector won't
    connector = _connector(copier, copy_delay_steps)
    connector.poll()
    assert connector.on_finish(_finished("a"), [1, 2])
    for _ in range(copy_delay_steps - 1):
        assert connector.poll().saved == ()
    assert connector.poll().saved == ("a",)


def test_poll_neither_waits_for_nor_reports_a_copy_still_running():
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = _connector(copier, 0)
    assert connector.on_finish(_finished("a"), [1, 2])
    polled = []
    # On a thread: a poll that waited for the copy would block this test for good.
    poller = threading.Thread(target=lambda: polled.append(connector.poll()), daemon=True)
    poller.start()
    poller.join(10)
    assert polled and polled[0].saved == () and polled[0].failed_saves == ()
    copier.complete()
    assert connector.poll().saved == ("a",)
