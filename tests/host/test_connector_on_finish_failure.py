"""A KV connector whose on_finish raises: a save that failed to start, logged, never a
leak. The failure is logged, not warned: a warnings filter that turns warnings into
errors (as these tests set) would otherwise raise before the blocks were freed."""

from __future__ import annotations

import logging
import re

import pytest

from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.kv_transfer import KVConnector
from tests.host._sched_util import add, make_scheduler, step


class _OnFinishRaises(KVConnector):
    def on_finish(self, request, block_ids):
        raise RuntimeError("device copy failed to start")


@pytest.mark.filterwarnings("error")
def test_an_on_finish_that_raises_is_a_failed_save_and_every_finished_request_is_freed(caplog):
    sched = make_scheduler(block_size=4, num_blocks=16, connector=_OnFinishRaises())
    for rid in "ab":
        add(sched, rid, range(1, 6), max_tokens=1)
    out = sched.schedule()
    with caplog.at_level(logging.WARNING, logger="jaxkv.scheduler_transfers"):
        outputs = sched.update_from_output(out, [9, 9])
    assert re.search(
        "on_finish\\('a'\\) raised RuntimeError.*on_finish\\('b'\\)", caplog.text, re.S
    )
    assert [(o.request_id, o.finished) for o in outputs] == [("a", True), ("b", True)]
    assert not sched.has_unfinished_requests() and not sched.has_pending_transfers()
    assert sched.requests == {} and sched.manager.num_free_blocks == 15
    add(sched, "a", range(1, 6), max_tokens=1)  # its id is free again


@pytest.mark.filterwarnings("error")
def test_an_unbound_offload_connector_frees_the_blocks_it_cannot_save(caplog):
    sched = make_scheduler(connector=HostOffloadConnector(1024))
    add(sched, "a", range(1, 10), max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="jaxkv.scheduler_transfers"):
        step(sched)
    assert re.search("used unbound.*freed without saving", caplog.text)
    assert sched.requests == {} and sched.manager.num_free_blocks == 63
