"""Scheduler.discard frees what the failed step admitted in LRU order (last admitted
first), and leaves the waiting queue as it was before that step."""

from __future__ import annotations

from jaxkv import RequestStatus
from tests.host._sched_util import (
    FakeCopier,
    OracleLoadConnector,
    add,
    make_scheduler,
    run_until_idle,
    step,
)


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


def test_a_discarded_step_that_preempted_leaves_the_waiting_queue_as_it_was():
    # It admitted nothing: the queue, the preempted c ahead of L (still loading), stays.
    # The previous step's admission order (L passed over, then b and c) is not this one's.
    connector = OracleLoadConnector(FakeCopier(6, 4), {"L": 4})
    connector.hold = True  # L's load stays in flight
    sched = make_scheduler(num_blocks=6, block_size=4, connector=connector)
    add(sched, "L", range(1, 6), max_tokens=1)
    add(sched, "b", range(10, 14), max_tokens=8)
    add(sched, "c", range(20, 24), max_tokens=8)
    out, _ = step(sched)  # L's load takes 2 blocks, b and c one each: 1 left
    assert out.request_ids == ["b", "c"]
    out = sched.schedule()  # b and c each need a fresh block: c is preempted
    assert out.request_ids == ["b"] and out.preempted_request_ids == ("c",)
    sched.discard(out)
    assert [r.request_id for r in sched.waiting] == ["c", "L"]
    connector.hold = False
    assert run_until_idle(sched) == {"L": "length", "b": "length", "c": "length"}
