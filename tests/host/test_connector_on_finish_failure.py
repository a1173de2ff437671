"""A KV connector whose on_finish raises: a save that failed to start, logged, never a
leak. The failure is logged, not warned: a warnings filter that turns warnings into
errors (as these tests set) would otherwise raise before the blocks were freed. A
HostOffloadConnector whose copier's start_save raises changes nothing before it does."""

from __future__ import annotations

import logging
import re

import pytest

from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.kv_transfer import KVConnector, TransferEvents
from tests.host._sched_util import (
    FakeCopier,
    add,
    computed_request,
    make_scheduler,
    run_until_idle,
    step,
)


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


class _StartSaveRaises(FakeCopier):
    """A copier whose start_save raises while `refuse` (its copy program failed to build)."""

    refuse = False

    def start_save(self, block_ids):
        if self.refuse:
            raise RuntimeError("the save's copy program failed to build")
        return super().start_save(block_ids)


def test_a_start_save_that_raises_leaves_the_offload_connector_unchanged():
    # on_finish used to refresh the stored blocks of the request's prompt before
    # start_save: one that raised had still moved them to most recently used.
    copier = _StartSaveRaises(16, 4)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=4, hash_seed=0)
    for rid, first, ids in (("a", 1, [1, 2]), ("b", 20, [3, 4])):
        assert connector.on_finish(computed_request(rid, list(range(first, first + 8))), ids)
        assert connector.poll().saved == (rid,)
    stored = connector.stored_hashes()  # a's two blocks, then b's
    longer = computed_request("c", list(range(1, 13)))  # a's prompt and one block more
    copier.refuse = True
    with pytest.raises(RuntimeError, match="failed to build"):
        connector.on_finish(longer, [5, 6, 7])
    assert connector.stored_hashes() == stored and not connector.has_pending()
    assert (connector.stats.num_saves, connector.stats.num_failed_saves) == (2, 0)
    copier.refuse = False
    assert connector.on_finish(longer, [5, 6, 7])  # its third block is not "being saved"
    assert copier.saved_block_ids[-1] == [7]
    assert connector.stored_hashes() == [*stored[2:], *stored[:2]]  # a's refreshed now
    assert connector.poll().saved == ("c",)
    assert connector.stored_hashes()[:2] == stored[2:] and len(connector.stored_hashes()) == 5


@pytest.mark.filterwarnings("error")
def test_a_start_save_that_raises_every_time_ends_each_request_and_serving_goes_on(caplog):
    # Unlike a load, a save that fails to start leaves nothing to retry: each finishing
    # request is freed unsaved, and the next one is served as usual.
    copier = _StartSaveRaises(16, 4)
    copier.refuse = True
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=4, hash_seed=0)
    sched = make_scheduler(block_size=4, num_blocks=16, connector=connector)
    with caplog.at_level(logging.WARNING, logger="jaxkv.scheduler_transfers"):
        for rid in "ab":
            request = add(sched, rid, range(1, 10), max_tokens=3)
            assert run_until_idle(sched, copier) == {rid: "length"}
            assert len(request.output_token_ids) == 3 and sched.requests == {}
            assert sched.manager.num_free_blocks == 15 and not connector.has_pending()
            sched.manager.check_integrity()
    assert re.search("on_finish\\('a'\\) raised.*on_finish\\('b'\\) raised", caplog.text, re.S)
    assert connector.stored_hashes() == [] and connector.stats.num_failed_saves == 0
    copier.refuse = False  # the copier recovers: the next request is saved
    add(sched, "c", range(1, 10), max_tokens=3)
    run_until_idle(sched, copier)
    assert len(connector.stored_hashes()) == 2 and sched.manager.num_free_blocks == 15


class _StartSaveAnswers(FakeCopier):
    """A copier whose start_save returns `answer` instead of its Future while it is set."""

    answer: object = None
    unset = object()

    def start_save(self, block_ids):
        future = super().start_save(block_ids)
        return future if self.answer is self.unset else self.answer


@pytest.mark.parametrize("answer", [None, "a future", 0])
@pytest.mark.filterwarnings("error")
def test_a_start_save_answer_that_is_no_future_fails_that_save_and_later_polls_work(answer, caplog):
    # It was kept as the save's Future: every later poll() raised AttributeError on
    # answer.done() for good, the request's blocks held, the other copies unreported.
    # (None was read as "nothing started": the request's blocks were freed, unlogged.)
    copier = _StartSaveAnswers(16, 4)
    copier.answer = answer
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=4, hash_seed=0)
    with pytest.raises(ValueError, match="_StartSaveAnswers.start_save\\(\\) returned .*Future"):
        connector.on_finish(computed_request("a", list(range(1, 9))), [1, 2])
    assert not connector.has_pending() and connector.stored_hashes() == []
    assert connector.poll() == TransferEvents()
    sched = make_scheduler(block_size=4, num_blocks=16, connector=connector)
    with caplog.at_level(logging.WARNING, logger="jaxkv.scheduler_transfers"):
        add(sched, "b", range(1, 10), max_tokens=1)
        assert run_until_idle(sched, copier) == {"b": "length"}
    assert re.search("on_finish\\('b'\\) raised ValueError.*start_save", caplog.text)
    assert sched.requests == {} and sched.manager.num_free_blocks == 15
    copier.answer = copier.unset  # the same prompt is saved once the copier answers a Future
    add(sched, "c", range(1, 10), max_tokens=1)
    assert run_until_idle(sched, copier) == {"c": "length"}
    assert len(connector.stored_hashes()) == 2 and not connector.has_pending()
