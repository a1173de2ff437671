"""A Ctrl-C at any line of Scheduler.schedule: once the batch is handed back
(discard_unapplied, as the engine's next step does), queues, blocks and the prefix cache
are as before, and the run goes on to the tokens of an uninterrupted one. In the KV
connector (user code) it still stops schedule() at once."""

from __future__ import annotations

import signal

import pytest

from jaxkv import RequestStatus
from jaxkv.kv_transfer import KVConnector
from tests.host._line_interrupts import LineInterrupts, fired_in, raised_at_once
from tests.host._sched_util import FakeCopier, OracleLoadConnector, add, make_scheduler, step

# schedule()'s own code (the manager's calls from it are each tried as a whole); its
# calls into the connector are the lines that name them (and the line after each, where a
# tracer, unlike a signal, runs before the flag is reset).
FILES = {
    "scheduler.py",
    "scheduler_running.py",
    "scheduler_admission.py",
    "scheduler_transfers.py",
}
USER_CALLS = ("on_admission(", "connector.start_load(", "user_code.runs = False")


class _Loads(OracleLoadConnector):
    """Claims only what the device prefix cache does not hold (a load handed back by a
    discard may have cached its block)."""

    def on_admission(self, request, num_computed_tokens):
        return 0 if num_computed_tokens else super().on_admission(request, 0)


def _scheduler(num_blocks):
    copier = FakeCopier(16, 4)
    connector = _Loads(copier, {"l": 4})
    sched = make_scheduler(
        num_blocks=num_blocks, block_size=4, max_num_batched_tokens=12, connector=connector
    )
    shared = list(range(1, 9))
    requests = [
        add(sched, "a", shared + [9], max_tokens=4),
        add(sched, "b", shared + [19, 20], max_tokens=3),  # a's two blocks, once written
        add(sched, "c", range(30, 37), max_tokens=5),
        add(sched, "l", range(40, 46), max_tokens=2),  # its first block loaded
        add(sched, "d", range(50, 55), max_tokens=3),
    ]
    return sched, copier, requests


def _assert_consistent(sched, requests):
    sched.manager.check_integrity()
    running, waiting = set(map(id, sched.running)), set(map(id, sched.waiting))
    assert not running & waiting
    for r in requests:
        if r.is_finished():
            assert r.request_id not in sched.requests and id(r) not in running | waiting, r
        elif r.status is RequestStatus.RUNNING:
            assert id(r) in running and r.num_computed_tokens < r.num_tokens, r
            assert r.request_id in sched.manager.request_ids, r
        else:
            assert id(r) in waiting, r
            loaded = r.status is RequestStatus.WAITING_FOR_REMOTE_KV or r.num_computed_tokens
            assert (r.request_id in sched.manager.request_ids) == bool(loaded), r


TRIED_STEPS = (1, 2)  # d admitted as l's load starts; d preempted as l's load lands


def _run(at, steps=TRIED_STEPS):
    """Runs the requests to the end, a SIGINT at the `at`-th line of the code of the
    schedule() calls of `steps` (to the interrupt's step only, if in the connector, whose
    own records it may cut); returns where it came, the interrupt and each request's
    tokens and status."""
    sched, copier, requests = _scheduler(num_blocks=10)
    lines, schedule = LineInterrupts(at, FILES), sched.schedule

    def traced():
        with lines:
            return schedule()

    for i in range(99):
        if not sched.has_unfinished_requests():
            break
        sched.schedule = traced if i in steps else schedule
        try:
            step(sched, copier)  # each request reads the KV it computed or hit
        except KeyboardInterrupt as interrupt:
            assert lines.fired
            chosen = sched._unapplied is not None
            sched.discard_unapplied()
            _assert_consistent(sched, requests)
            if fired_in(lines.fired, USER_CALLS):  # stopped at once, the batch handed back
                assert raised_at_once(interrupt) and not chosen, lines.fired
            else:  # raised at once only before anything changed, else once chosen
                assert raised_at_once(interrupt) != chosen, lines.fired
            if fired_in(lines.fired, USER_CALLS):
                return lines.fired, None
    _assert_consistent(sched, requests)
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1
    return lines.fired, [(list(r.output_token_ids), r.status) for r in requests]


def test_a_ctrl_c_at_any_line_of_schedule_leaves_queues_blocks_and_cache_whole():
    # Cut halfway, schedule() broke the manager's records (a block half taken off the
    # free queue, an owner without a row), left a request RUNNING outside `running`, a
    # load started but not tracked, or lost the batch (the next schedule() refused to run
    # or cached blocks were never written).
    _, expected = _run(None, ())
    assert {status for _, status in expected} == {RequestStatus.FINISHED_LENGTH}
    at = 0
    while True:
        at += 2  # every other line, for time: a window is one line or more
        fired, got = _run(at)
        if fired is None:
            break
        if got is not None:
            assert got == expected, fired
    assert at > 400  # those calls were tried throughout


def test_a_ctrl_c_in_the_connector_during_schedule_stops_it_at_once():
    class _Signalling(KVConnector):
        ran_on = False

        def on_admission(self, request, num_computed_tokens):
            signal.raise_signal(signal.SIGINT)
            self.ran_on = True  # a held Ctrl-C let the connector finish
            return 0

    connector = _Signalling()
    sched = make_scheduler(block_size=4, connector=connector)
    a = add(sched, "a", range(1, 10), max_tokens=2)
    with pytest.raises(KeyboardInterrupt):
        sched.schedule()
    assert not connector.ran_on and not sched.discard_unapplied()  # handed back already
    assert list(sched.waiting) == [a] and a.status is RequestStatus.WAITING
    assert not sched.running and not sched.manager.request_ids
