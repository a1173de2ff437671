"""Admission: which waiting requests join the running batch in a step, with how many tokens.

Plain Python, no JAX. The body of Scheduler.schedule's admission phase: it reads and
changes the scheduler's queues and transfer tracker, so the scheduler is its only caller.

Order: requests whose KV loads landed come first, in landing order. They hold blocks
for all their tokens, need no new block, and only running requests free what they hold,
so a queue head that cannot get its blocks (or that keeps preempting itself once
running) must not keep them waiting with their blocks idle. Then waiting requests are
admitted in queue order until one cannot get its blocks, the token budget is spent or
max_num_seqs requests run. A request the connector can supply KV for starts a load
instead (status WAITING_FOR_REMOTE_KV, 0 tokens this step) and keeps its queue place.
Also the checks a request passes before it may queue at all (check_new_request).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxkv.allocation_args import checked_request_id
from jaxkv.request import Request, RequestStatus
from jaxkv.scheduler_output import StepBatch
from jaxkv.slot_allocation import allocate_admitted, count_lookup, find_cache_hit

if TYPE_CHECKING:
    from jaxkv.scheduler import Scheduler

__all__ = ["admit_waiting", "check_fits", "check_new_request"]

# _allocate_for_admission: a load in flight for another request brings this one's next
# block; it waits (keeping its queue place) and then hits the block in the prefix cache.
_AWAITING_LOAD = -1


def check_new_request(scheduler: Scheduler, request: Request) -> None:
    """Raises ValueError unless Scheduler.add_request may queue `request` (see there)."""
    rid = checked_request_id(request)
    manager = scheduler.manager
    if rid in scheduler.requests:
        raise ValueError(f"request id {rid!r} is already in use")
    if manager.holds_row(rid):  # allocated on the manager directly: admission would fail
        raise ValueError(
            f"request id {rid!r} holds a row in the manager (allocated there): free it first"
        )
    if (
        request.status != RequestStatus.WAITING
        or request.num_computed_tokens
        or request.output_token_ids
    ):
        raise ValueError(f"{request!r} must be new (WAITING, nothing computed, no output)")
    if request.queued:  # two schedulers would both advance it, each its own way
        raise ValueError(f"{request!r} was already queued by a scheduler: build a new Request")
    if request.sampling_params.n != 1:
        raise ValueError(
            f"request {rid!r}: sampling_params.n={request.sampling_params.n} must be 1; "
            "each sample is a request of its own (Engine.add_request fans them out)"
        )
    check_fits(scheduler, request, rid)


def check_fits(scheduler: Scheduler, request: Request, rid: str) -> None:
    """Raises ValueError naming `rid` (a sample's parent request, for Engine.add_request
    under n > 1) unless the scheduler can serve `request`: a tokenizer for its stop
    strings or streamed text, its block hashes' config, room for output, a pool that
    holds its KV. Its id and newness are check_new_request's."""
    manager, max_model_len = scheduler.manager, scheduler.config.max_model_len
    params = request.sampling_params
    if scheduler.detokenizer is None and (params.stop or params.stream_text):
        field = f"stop={params.stop!r}" if params.stop else "stream_text=True"
        raise ValueError(
            f"request {rid!r}: sampling_params.{field} needs a tokenizer to read the "
            "output text: Engine(..., tokenizer=...)"
        )
    # Read by the prefix cache and, with prefix caching off too, by a KV connector.
    request.check_hash_config(manager.block_size, manager.hash_seed)
    if request.num_tokens >= max_model_len:
        raise ValueError(
            f"request {rid!r}: {request.num_tokens} prompt tokens leave no "
            f"room for output within {max_model_len=}"
        )
    # A request the whole pool cannot hold would preempt itself and wait forever. Its KV
    # peaks one token short of prompt plus max_tokens: the last token is never fed back.
    max_new = max_model_len if request.max_tokens is None else request.max_tokens
    max_kv = min(request.num_tokens + max_new, max_model_len) - 1
    num_blocks = -(-max_kv // manager.block_size)
    if num_blocks >= manager.pool.num_blocks:
        raise ValueError(
            f"request {rid!r}: up to {max_kv} tokens of KV (prompt plus max_tokens less "
            f"the last token, at most max_model_len - 1) need {num_blocks} blocks of "
            f"{manager.block_size}; the pool has {manager.pool.num_blocks - 1}"
        )


def admit_waiting(scheduler: Scheduler, budget: int, batch: StepBatch) -> int:
    """Admits landed loads, then waiting requests in order; returns the budget left.

    If the connector raises while a request is admitted, the waiting queue is left whole
    (in its order) before the error propagates.
    """
    budget = _admit_landed(scheduler, budget, batch)
    waiting, running = scheduler.waiting, scheduler.running
    max_num_seqs = scheduler.config.max_num_seqs
    skipped: list[Request] = []
    taken = scheduler._admission_order = []  # off the queue's head, in its order
    while waiting and budget > 0 and len(running) < max_num_seqs:
        request = waiting[0]
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            skipped.append(waiting.popleft())
            taken.append(request)
            continue
        try:
            n = _allocate_for_admission(scheduler, request, budget)
        except BaseException:  # a connector's error: the waiting queue stays whole
            waiting.extendleft(reversed(skipped))
            raise
        if n is None:
            break
        taken.append(waiting.popleft())
        if n == _AWAITING_LOAD or request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            skipped.append(request)
            continue
        _start_running(scheduler, request, n, batch)
        budget -= n
    waiting.extendleft(reversed(skipped))
    return budget


def requeue_admitted(scheduler: Scheduler, admitted: list[Request]) -> None:
    """Puts the requests a discarded step admitted back in the waiting queue: those
    admitted as their loads landed at its head, then each other where it stood among the
    requests that step's admit_waiting passed over (which lie at the head, in order)."""
    waiting, taken = scheduler.waiting, scheduler._admission_order
    taken_ids = set(map(id, taken))
    back = set(map(id, admitted))
    while waiting and id(waiting[0]) in taken_ids:  # passed over (some may be aborted since)
        back.add(id(waiting.popleft()))
    landed = [r for r in admitted if id(r) not in taken_ids]
    waiting.extendleft(reversed(landed + [r for r in taken if id(r) in back]))


def _admit_landed(scheduler: Scheduler, budget: int, batch: StepBatch) -> int:
    """Admits waiting requests whose loads landed, in landing order (out of queue order)."""
    for request in scheduler._transfers.landed():
        if budget <= 0 or len(scheduler.running) >= scheduler.config.max_num_seqs:
            break
        n = _allocate_for_admission(scheduler, request, budget)
        if n is None:
            continue
        scheduler.waiting.remove(request)
        _start_running(scheduler, request, n, batch)
        budget -= n
    return budget


def _start_running(scheduler: Scheduler, request: Request, n: int, batch: StepBatch) -> None:
    """Moves an admitted waiting request to running with `n` tokens this step."""
    scheduler._transfers.forget_landed(request.request_id)
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    batch.add(request, n)


def _allocate_for_admission(scheduler: Scheduler, request: Request, budget: int) -> int | None:
    """Allocates a waiting request's blocks; returns its tokens this step, or None.

    A request that already holds blocks (its KV load landed) continues from its
    computed tokens; a fresh one looks up the device prefix cache and then the
    connector, and if the connector claims more it starts the load instead (status
    WAITING_FOR_REMOTE_KV, 0 tokens this step). A fresh one whose next block a load in
    flight for another request brings gets _AWAITING_LOAD: one load serves both.
    """
    m = scheduler.manager
    chunked = scheduler.config.enable_chunked_prefill
    budget = min(budget, scheduler.config.max_tokens_per_request)
    if request.num_computed_tokens:  # a load landed: blocks held, continue after them
        n = _chunk(request.num_tokens - request.num_computed_tokens, budget, chunked)
        if n is None or m.allocate_slots(request, n) is None:
            return None
        return n
    # check_new_request checked the request when it queued: the manager's unchecked
    # lookup and allocation serve it (allocate_admitted re-checks a stale cache hit).
    # Counted only once acted on: a request waiting for room is looked up every step.
    hit = find_cache_hit(m, request)
    num_hit = hit.num_tokens
    hashes, next_block = request.block_hashes, num_hit // m.block_size
    # Worth the wait only for a block a cache hit may cover (never the last token's).
    num_hittable = min(len(hashes), (request.num_tokens - 1) // m.block_size)
    # One computing its prompt logprobs reads no cached KV, the connector's neither.
    reads_cache = not request.skips_prefix_cache_reads
    if (
        reads_cache
        and next_block < num_hittable
        and scheduler._transfers.is_loading(hashes[next_block])
    ):
        return _AWAITING_LOAD
    num_external = scheduler._transfers.claim(request, num_hit) if reads_cache else 0
    if num_external:  # the request waits for the load: 0 tokens this step
        started = scheduler._transfers.start_load(request, hit.block_ids, num_hit, num_external)
        if started:
            count_lookup(m, request, num_hit)
        return 0 if started else None
    n = _chunk(request.num_tokens - num_hit, budget, chunked)
    if n is None or not allocate_admitted(m, request, n, hit):
        return None
    count_lookup(m, request, num_hit)
    request.num_computed_tokens = num_hit
    return n


def _chunk(remaining: int, budget: int, chunked_prefill: bool) -> int | None:
    """Tokens of `remaining` to run now: all if they fit, else the budget (chunked
    prefill) or None (the request waits for a step with room for its whole prompt)."""
    if remaining <= budget:
        return remaining
    return budget if chunked_prefill else None
