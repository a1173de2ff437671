"""Scheduler.discard frees what the failed step admitted in LRU order: last admitted first."""

from __future__ import annotations

from jaxkv import RequestStatus
from tests.host._sched_util import add, make_scheduler


def test_discard_frees_the_last_admitted_request_first():
    """The blocks of the request admitted last are evicted first, each request's tail
    block before its head, as if the admissions were undone in reverse order."""
    sched = make_scheduler(num_blocks=16, block_size=4)
    a = add(sched, "a", range(1, 9), max_tokens=4)
    b = add(sched, "b", range(101, 109), max_tokens=4)
    out = sched.schedule()
    assert out.request_ids == ["a", "b"]
    a_ids = sched.manager.block_ids("a")
    b_ids = sched.manager.block_ids("b")
    sched.discard(out)
    assert a.status == b.status == RequestStatus.WAITING
    queue = sched.manager.pool.free_block_queue.block_ids()
    assert queue[-4:] == b_ids[::-1] + a_ids[::-1]
