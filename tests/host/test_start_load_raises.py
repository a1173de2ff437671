"""A copier whose start_load raises: the load fails to start, and HostOffloadConnector
drops the store entries it was to read, so the request recomputes them on a later step
instead of retrying the same failing load at every schedule(). The exception still
propagates out of the schedule() that started the load. An interrupt (no Exception)
says nothing of the load: the store is kept and the next admission tries it again. A
MemoryError gathering the stored blocks fails the load's start as the copier's does."""

from __future__ import annotations

import types

import pytest

from jaxkv import Request, RequestStatus, SamplingParams, host_offload_connector
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import (
    FakeCopier,
    add,
    make_scheduler,
    run_until_idle,
    step,
    token_of,
)

BS = 4
PROMPT = list(range(1, 15))  # 14 tokens: 3 full blocks stored, then claimed


class _StartLoadRaises(FakeCopier):
    """A copier whose start_load raises `error` (a copy program that fails to build) while
    it is set, every time: a retry would fail the same way."""

    error: BaseException | None = None

    def start_load(self, block_ids, blocks):
        if self.error is not None:
            raise self.error
        return super().start_load(block_ids, blocks)


def _stored_then_evicted_from_device(copier):
    """A scheduler whose connector stores PROMPT's 3 full blocks, its device prefix cache
    empty again: PROMPT's next admission is claimed 12 tokens."""
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=16, block_size=BS, connector=connector)
    add(sched, "a", PROMPT, max_tokens=1)
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache() and len(connector.stored_hashes()) == 3
    return sched, connector


def test_a_start_load_that_raises_drops_its_blocks_and_the_request_recomputes_them():
    # The store kept the blocks, so every later schedule() claimed them again, called
    # start_load again and raised again: "b" waited for good, the engine stuck behind it.
    copier = _StartLoadRaises(16, BS)
    sched, connector = _stored_then_evicted_from_device(copier)
    copier.error = RuntimeError("the load's copy program failed to build")
    b = add(sched, "b", PROMPT, max_tokens=2)
    with pytest.raises(RuntimeError, match="failed to build"):
        sched.schedule()
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert "b" not in sched.manager.request_ids and sched.manager.num_free_blocks == 15
    sched.manager.check_integrity()
    assert connector.stored_hashes() == [] and not connector.has_pending()
    assert connector.on_admission(Request("probe", PROMPT, SamplingParams()), 0) == 0
    assert connector.stats.num_failed_loads == 1 and connector.stats.num_loads == 0
    # The copier still fails every load; "b" computes its prompt (step() checks its KV).
    out, _ = step(sched, copier)
    assert out.request_ids == ["b"] and out.num_scheduled_tokens.tolist() == [len(PROMPT)]
    run_until_idle(sched, copier)
    assert b.output_token_ids[0] == token_of(Request("x", PROMPT, SamplingParams()))
    assert b.status == RequestStatus.FINISHED_LENGTH and sched.requests == {}
    assert sched.manager.num_free_blocks == 15 and not connector.has_pending()
    sched.manager.check_integrity()
    assert connector.stats.num_failed_loads == 1 and len(copier.loaded_block_ids) == 0
    assert len(connector.stored_hashes()) == 3  # stored again as "b" finished


def test_only_the_blocks_the_failed_load_was_to_read_are_dropped():
    # "b" hits PROMPT's first block in the device cache: its load was to read the other two.
    copier = _StartLoadRaises(16, BS)
    sched, connector = _stored_then_evicted_from_device(copier)
    first = connector.stored_hashes()[-1]  # the head: refreshed last, evicted last
    add(sched, "r", PROMPT[:5], max_tokens=1)
    run_until_idle(sched, copier)  # "r" loads PROMPT's first block: device-cached now
    copier.error = RuntimeError("the load's copy program failed to build")
    b = add(sched, "b", PROMPT, max_tokens=1)
    with pytest.raises(RuntimeError, match="failed to build"):
        sched.schedule()
    assert connector.stored_hashes() == [first] and b.num_computed_tokens == 0
    assert "b" not in sched.manager.request_ids and not connector.has_pending()
    sched.manager.check_integrity()
    assert run_until_idle(sched, copier) == {"b": "length"}
    assert sched.manager.num_free_blocks == 15 and len(copier.loaded_block_ids) == 1


def test_an_interrupted_start_load_keeps_the_store_and_the_next_admission_loads():
    copier = _StartLoadRaises(16, BS)
    sched, connector = _stored_then_evicted_from_device(copier)
    stored = connector.stored_hashes()
    copier.error = KeyboardInterrupt("during the load's compile")
    b = add(sched, "b", PROMPT, max_tokens=1)
    with pytest.raises(KeyboardInterrupt):
        sched.schedule()
    assert connector.stored_hashes() == stored and connector.stats.num_failed_loads == 0
    assert "b" not in sched.manager.request_ids and sched.manager.num_free_blocks == 15
    sched.manager.check_integrity()
    copier.error = None
    sched.schedule()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert run_until_idle(sched, copier) == {"b": "length"}
    assert connector.stats.num_loads == 1 and sched.manager.num_free_blocks == 15


def test_a_start_load_out_of_host_memory_for_its_blocks_fails_to_start_the_same_way(
    monkeypatch,
):
    # Gathering the stored blocks into one array ran before the try: its MemoryError
    # kept them stored, so each later admission claimed them and could raise again.
    copier = FakeCopier(16, BS)
    sched, connector = _stored_then_evicted_from_device(copier)

    def out_of_memory(arrays):
        raise MemoryError

    monkeypatch.setattr(host_offload_connector, "np", types.SimpleNamespace(stack=out_of_memory))
    add(sched, "b", PROMPT, max_tokens=1)
    with pytest.raises(MemoryError):
        sched.schedule()
    monkeypatch.undo()
    assert connector.stored_hashes() == [] and connector.stats.num_failed_loads == 1
    assert "b" not in sched.manager.request_ids and sched.manager.num_free_blocks == 15
    sched.manager.check_integrity()
    assert run_until_idle(sched, copier) == {"b": "length"}
    assert len(copier.loaded_block_ids) == 0 and sched.manager.num_free_blocks == 15


class _StartLoadAnswers(FakeCopier):
    """A copier whose start_load returns `answer` instead of its Future while `wrong`."""

    wrong = False
    answer: object = None

    def start_load(self, block_ids, blocks):
        future = super().start_load(block_ids, blocks)
        return self.answer if self.wrong else future


@pytest.mark.parametrize("answer", [None, object()])
def test_a_start_load_answer_that_is_no_future_is_a_load_that_failed_to_start(answer):
    # It was kept as the load's Future: every later poll() raised AttributeError for
    # good, "b" waited holding its blocks and the engine never stepped again.
    copier = _StartLoadAnswers(16, BS)
    sched, connector = _stored_then_evicted_from_device(copier)
    copier.wrong, copier.answer = True, answer
    b = add(sched, "b", PROMPT, max_tokens=2)
    with pytest.raises(ValueError, match="_StartLoadAnswers.start_load\\(\\) returned .*Future"):
        sched.schedule()
    assert b.status == RequestStatus.WAITING and "b" not in sched.manager.request_ids
    assert connector.stored_hashes() == [] and not connector.has_pending()
    assert connector.stats.num_failed_loads == 1 and sched.manager.num_free_blocks == 15
    sched.manager.check_integrity()
    assert run_until_idle(sched, copier) == {"b": "length"}  # recomputed, polls work
    assert sched.manager.num_free_blocks == 15 and not connector.has_pending()
    assert b.output_token_ids[0] == token_of(Request("x", PROMPT, SamplingParams()))
