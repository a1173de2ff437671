"""A Ctrl-C at any line of queueing a request (Scheduler.add_request, through
ParallelSamples.queue as Engine.add_request calls it): the request is queued whole or
not at all, and every request queued is served to the end."""

from __future__ import annotations

import pytest

from jaxkv import RequestStatus
from jaxkv.parallel_sampling import ParallelSamples
from jaxkv.request import Request, SamplingParams
from tests.host._line_interrupts import LineInterrupts
from tests.host._sched_util import add, make_scheduler, step
from tests.host.test_parallel_samples_queue import FakeSampling


def _queued(sched, request_ids):
    """The request ids that are queued, each checked to be in both queue records."""
    waiting = {r.request_id for r in sched.waiting}
    for rid in request_ids:
        assert (rid in sched.requests) == (rid in waiting), rid
    return [rid for rid in request_ids if rid in waiting]


@pytest.mark.parametrize("n", [1, 2])
def test_a_ctrl_c_at_any_line_of_queueing_a_request_queues_it_whole_or_not_at_all(n):
    # Cut between the scheduler's request map and its waiting queue, the request was in
    # the map only: the queue's cleanup then failed to abort it (ValueError, not in the
    # deque), and its id stayed in use for good with nothing to run it.
    ids = ["x"] if n == 1 else ["0_x", "1_x"]
    at = 0
    while True:
        at += 1
        sched, samples, sampling = make_scheduler(block_size=4), ParallelSamples(), FakeSampling()
        first = add(sched, "a", range(1, 10), max_tokens=2)
        lines = LineInterrupts(at)
        request = Request("x", [1, 2, 3, 4, 5], SamplingParams(n=n, max_tokens=3))
        try:
            with lines:
                samples.queue(sched, sampling, request, 0)
        except KeyboardInterrupt:
            pass
        if lines.fired is None:
            break
        queued = _queued(sched, ids)
        assert queued in ([], ids), (queued, lines.fired[:2])
        assert sorted(sampling.seeds) == queued, lines.fired[:2]
        while sched.has_unfinished_requests():
            step(sched)
        assert first.status is RequestStatus.FINISHED_LENGTH
        assert not sched.requests, lines.fired[:2]
        assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1
        sched.manager.check_integrity()
    assert at > 20  # queueing's code was tried throughout
