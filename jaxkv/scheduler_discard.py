"""Handing back a step's batch when the step failed before any of its KV was written.

Plain Python, no JAX. The body of Scheduler.discard (whose docstring states the
guarantees): it reads and changes the scheduler's queues, transfers and decode carry, so
the scheduler is its only caller. Also what a request aborted before its step leaves for
a discard (keep_unwritten_of): its blocks are freed, so the discard could not reach them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxkv.request import RequestStatus
from jaxkv.scheduler_admission import requeue_admitted
from jaxkv.scheduler_output import SchedulerOutput
from jaxkv.unwritten_blocks import cached_unwritten

if TYPE_CHECKING:
    from jaxkv.request import Request
    from jaxkv.scheduler import Scheduler

__all__ = ["discard_batch", "keep_unwritten_if_unapplied", "keep_unwritten_of"]


def keep_unwritten_of(scheduler: Scheduler, request: Request, num_written: int) -> None:
    """Records the prefix-cache entries of `request`'s blocks past its first `num_written`
    tokens (those its unapplied step is to write), before an abort frees them: a discard
    of that step takes them out of the cache (discard_batch), its update keeps them (the
    step wrote their KV, also for the requests that hit them in that step). The blocks
    are those uncache_unwritten would take out (unwritten_blocks.cached_unwritten)."""
    blocks = cached_unwritten(scheduler.manager, request.request_id, num_written)
    scheduler._unwritten_of_aborted += [
        (b, b.block_hash) for b in blocks if b.block_hash is not None
    ]


def keep_unwritten_if_unapplied(scheduler: Scheduler, request: Request) -> None:
    """keep_unwritten_of for a request aborted between schedule() and
    update_from_output() or discard(), with the tokens its unapplied step had computed
    before it; nothing otherwise."""
    out = scheduler._unapplied
    if out is None:
        return
    for i, scheduled in enumerate(out.requests):
        if scheduled is request:
            keep_unwritten_of(scheduler, request, int(out.num_computed_tokens[i]))
            return


def discard_batch(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """scheduler.discard(output) once `output` is checked to be the unapplied one."""
    scheduler._unapplied = None
    scheduler._decode_carry = None
    scheduler._finished_ids[:0] = output.finished_request_ids  # the next output reports them
    scheduler._transfers.cancel_new_loads()
    # Blocks of requests aborted since schedule(), if still cached under the same hash.
    kept, scheduler._unwritten_of_aborted = scheduler._unwritten_of_aborted, []
    scheduler.manager.pool.uncache_blocks([b for b, h in kept if b.block_hash == h])
    computed = output.num_computed_tokens.tolist()
    for request, num_written in zip(output.requests, computed, strict=True):
        if request.status is RequestStatus.RUNNING:
            scheduler.manager.uncache_unwritten(request, num_written)
    admitted = [
        r
        for r in output.requests[scheduler._num_running_scheduled :]
        if r.status is RequestStatus.RUNNING
    ]
    if not admitted:
        return
    gone = set(map(id, admitted))
    scheduler.running = [r for r in scheduler.running if id(r) not in gone]
    for request in reversed(admitted):  # the last admitted is evicted first
        scheduler.manager.free(request)
        request.num_computed_tokens = 0
        request.status = request.waiting_status
    requeue_admitted(scheduler, admitted)
