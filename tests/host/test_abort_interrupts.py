"""Scheduler.abort cut by a Ctrl-C: the interrupt waits until the request is released."""

from __future__ import annotations

import signal

import pytest

from jaxkv import RequestStatus
from tests.host._sched_util import add, make_scheduler, step


@pytest.mark.parametrize("running", [True, False], ids=["running", "waiting"])
def test_a_ctrl_c_during_abort_is_raised_once_the_request_is_released(running):
    # Raised after abort took the request out of its queue but before it released it, the
    # interrupt orphaned it: its blocks held and its id in use for good, and a second
    # abort raised ValueError (list.remove) instead of finishing the job.
    sched = make_scheduler(block_size=4)
    request = add(sched, "a", range(1, 10), max_tokens=5)
    if running:
        step(sched)  # holds blocks now
    assert request.status is (RequestStatus.RUNNING if running else RequestStatus.WAITING)
    release = sched._transfers.abort

    def interrupted(request):
        signal.raise_signal(signal.SIGINT)  # raised at this call's return, unheld
        release(request)

    sched._transfers.abort = interrupted
    with pytest.raises(KeyboardInterrupt):
        sched.abort("a")
    del sched._transfers.abort
    assert request.status == RequestStatus.FINISHED_ABORTED and "a" not in sched.requests
    assert not sched.abort("a") and not sched.has_unfinished_requests()
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1
    sched.manager.check_integrity()
