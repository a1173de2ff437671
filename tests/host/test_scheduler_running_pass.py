"""An interrupt inside schedule()'s pass over running requests hands the batch back."""

from __future__ import annotations

import pytest

from jaxkv import RequestStatus
from tests.host._sched_util import add, make_scheduler, step


def test_an_interrupt_in_the_running_pass_leaves_the_running_requests_running(monkeypatch):
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    a = add(sched, "a", range(1, 8), max_tokens=4)
    b = add(sched, "b", range(11, 18), max_tokens=4)
    step(sched)  # a's prompt, b's first token: b is mid-prefill, so no decode carry
    held = {r.request_id: sched.manager.block_ids(r.request_id) for r in (a, b)}

    def interrupted(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(sched.manager, "allocate_slots_batch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            sched.schedule()
    # That call admitted neither: neither is freed nor requeued.
    assert sched.running == [a, b] and not sched.waiting
    assert a.status == b.status == RequestStatus.RUNNING
    assert {r.request_id: sched.manager.block_ids(r.request_id) for r in (a, b)} == held
    sched.manager.check_integrity()
    out, _ = step(sched)
    assert out.request_ids == ["a", "b"] and out.num_computed_tokens.tolist() == [7, 1]
