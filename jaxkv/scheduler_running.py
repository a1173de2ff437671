"""The running requests' share of a step: each gets its next tokens, oldest first.

Plain Python and numpy, no JAX. The body of Scheduler.schedule's first phase: it reads
and changes the scheduler's `running` queue and decode carry, so the scheduler is its
only caller. Every running request gets up to max_tokens_per_request tokens until the
token budget is spent. Their blocks come from one allocate_slots_batch call, which
changes nothing when the pool cannot fit them all; only then are they allocated one by
one, preempting the most recently admitted request (by recompute, Scheduler._preempt)
until each fits. A request that had to preempt itself ends the phase: no request after
it runs. After any preemption, schedule() admits no waiting request that step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxkv.scheduler_output import DecodeCarry, StepBatch
from jaxkv.slot_allocation import needs_manager

if TYPE_CHECKING:
    from jaxkv.request import Request
    from jaxkv.scheduler import Scheduler

__all__ = ["schedule_decode", "schedule_running"]


def schedule_running(
    scheduler: Scheduler, budget: int, batch: StepBatch, preempted: list[str]
) -> int:
    """Schedules running requests oldest first; returns the budget left.

    After an all-decode step the update's carry stands in for the pass over the
    requests. Their blocks come from one allocate_slots_batch call; only when the
    pool cannot fit them all are they allocated one by one, preempting the latest.
    """
    carry, scheduler._decode_carry = scheduler._decode_carry, None
    if carry is not None and len(scheduler.running) <= budget:
        return scheduler._schedule_decode(carry, budget, batch, preempted)
    # The loop is the per-request cost of every step: needs_manager and
    # StepBatch.add are inlined.
    manager = scheduler.manager
    limit = scheduler.config.max_tokens_per_request
    bs = manager.block_size
    fill_limit = bs if manager.enable_prefix_caching else bs + 1
    add_request = batch.requests.append
    add_tokens = batch.num_tokens.append
    add_computed = batch.num_computed.append
    add_token_id = batch.token_ids.append
    add_token_ids = batch.token_ids.extend
    needing, needing_tokens = [], []
    budget_left = budget
    for request in scheduler.running:
        if budget_left <= 0:
            break
        computed = request.num_computed_tokens
        n = request.num_tokens - computed
        if n > budget_left:
            n = budget_left
        if n > limit:
            n = limit
        offset = computed % bs
        if offset == 0 or offset + n >= fill_limit:
            needing.append(request)
            needing_tokens.append(n)
        add_request(request)
        add_tokens(n)
        add_computed(computed)
        if n == 1:
            add_token_id(request.all_token_ids[computed])
        else:
            add_token_ids(request.all_token_ids[computed : computed + n])
        budget_left -= n
    if not needing or manager.allocate_slots_batch(needing, needing_tokens):
        return budget_left
    # Blocks run out: start over one by one (the batch call changed nothing).
    batch.clear()
    return _schedule_one_by_one(scheduler, budget, batch, preempted)


def schedule_decode(
    scheduler: Scheduler, carry: DecodeCarry, budget: int, batch: StepBatch, preempted: list[str]
) -> int:
    """schedule_running when every running request has one token left (the carry), through
    Scheduler._schedule_decode."""
    needing = carry.needing
    if needing and not scheduler.manager.allocate_slots_batch(needing, [1] * len(needing)):
        return _schedule_one_by_one(scheduler, budget, batch, preempted)
    n = len(scheduler.running)
    computed = np.array(carry.num_computed, np.int32)
    batch.set_running(list(scheduler.running), np.ones(n, np.int32), computed, carry.token_ids)
    return budget - n


def _schedule_one_by_one(
    scheduler: Scheduler, budget: int, batch: StepBatch, preempted: list[str]
) -> int:
    """Schedules running requests one by one, preempting the latest when blocks run out."""
    limit = scheduler.config.max_tokens_per_request
    # Iterating the live list is safe: preemption only pops from its end.
    for request in scheduler.running:
        if budget <= 0:
            break
        n = min(request.num_tokens - request.num_computed_tokens, budget, limit)
        if needs_manager(scheduler.manager, request.num_computed_tokens, n) and not (
            _allocate_or_preempt(scheduler, request, n, preempted)
        ):
            break  # the request itself was preempted: nothing after it can run
        batch.add(request, n)
        budget -= n
    return budget


def _allocate_or_preempt(
    scheduler: Scheduler, request: Request, n: int, preempted: list[str]
) -> bool:
    """Allocates for `request`, preempting the latest running requests until it fits;
    False if `request` itself had to be preempted."""
    while scheduler.manager.allocate_slots(request, n) is None:
        victim = scheduler.running.pop()
        scheduler._preempt(victim)
        preempted.append(victim.request_id)
        if victim is request:
            return False
    return True
