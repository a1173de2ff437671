"""Continuous batching: which requests run this step, with how many tokens each.

Plain Python, no JAX. Each schedule() call first applies finished KV transfers, then
schedules running requests (oldest first, jaxkv.scheduler_running) and then waiting
ones, under a token budget and a cap on running requests. Prompts are split into chunks
when the budget is short (chunked prefill). When blocks run out, the most recently
admitted running request is preempted by recompute: it gives all its blocks back and
resumes later from scratch (its prefix-cache hits make that cheap). A waiting request
whose KV the connector can supply starts a load instead; once it lands the request needs
no further block, so it is admitted ahead of the queue (jaxkv.scheduler_admission holds
the admission order and why). update_from_output() applies the sampled tokens
(jaxkv.scheduler_update), stops requests, and either frees a finished request's blocks
or lets the KV connector keep them held until an asynchronous save lands. Loads and
saves are tracked by scheduler_transfers.TransferTracker. discard() hands back the batch
of a step that failed before writing any KV (jaxkv.scheduler_discard).

Liveness: add_request refuses a request the whole pool could not hold, and blocks are
held only by running requests (which finish or are preempted), by copies in flight
(which land or fail, see scheduler_transfers) and by landed loads (admitted without a
new block), so every accepted request finishes (tests/host/test_scheduler_liveness.py).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np

from jaxkv.config import SchedulerConfig
from jaxkv.held_interrupts import UserCode, holding_interrupts
from jaxkv.kv_cache_manager import KVCacheManager, UnknownRequestError
from jaxkv.kv_transfer import KVConnector
from jaxkv.outputs import RequestOutput
from jaxkv.request import Request, RequestStatus
from jaxkv.request_id_lists import is_id_text, plain_id
from jaxkv.scheduler_admission import admit_waiting, check_new_request
from jaxkv.scheduler_args import checked_scheduler_args
from jaxkv.scheduler_discard import discard_batch, keep_unwritten_if_unapplied
from jaxkv.scheduler_output import DecodeCarry, SchedulerOutput, SchedulerStats, StepBatch
from jaxkv.scheduler_running import schedule_decode, schedule_running
from jaxkv.scheduler_transfers import TransferTracker
from jaxkv.scheduler_update import apply_sampled_tokens, checked_sampled_tokens

__all__ = ["Scheduler", "SchedulerOutput", "SchedulerStats"]


class Scheduler:
    """Owns the request queues; decides each step's batch; applies its results.

    Queues: `waiting` (FIFO; WAITING, PREEMPTED, WAITING_FOR_REMOTE_KV), `running`
    (admission order), and requests that finished but still hold blocks for a KV
    transfer. A request holds blocks from admission until it is preempted, freed after
    finishing, or its transfer lands.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        manager: KVCacheManager,
        connector: KVConnector | None = None,
    ) -> None:
        connector = checked_scheduler_args(config, manager, connector)
        self.config = config
        self.manager = manager
        self.connector = connector
        self.requests: dict[str, Request] = {}  # every request not yet released
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        # Set while a tokenizer, or the connector's on_admission or start_load, runs: a
        # Ctrl-C held around the scheduler's (and Engine.step's) changes stops those at
        # once (held_interrupts).
        self.user_code = UserCode()
        self._transfers = TransferTracker(self.connector, manager, self._release, self.user_code)
        self._finished_ids: list[str] = []
        self._stats = SchedulerStats()
        self.detokenizer = None  # jaxkv.detokenizer.Detokenizer: set by Engine(tokenizer=)
        # Left by update_from_output when every running request is decoding (one token
        # left) and every one was scheduled: what the next step needs of them, without
        # another pass over the requests. Consumed by the next schedule() (which alone
        # admits and preempts); abort of a running request drops it.
        self._decode_carry: DecodeCarry | None = None
        self._unapplied: SchedulerOutput | None = None  # the latest schedule()'s, until applied
        self._num_running_scheduled = 0  # its leading requests that were running before it
        self._admission_order: list[Request] = []  # taken off `waiting` by its admission
        # (block, hash) cached by requests aborted since that schedule(), for its discard
        self._unwritten_of_aborted: list = []

    # ---------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        """Queues a new request (status WAITING).

        Raises ValueError (nothing queued) on an id in use (here, or holding a row in
        the manager), a request not new (computed or output tokens, queued by a
        scheduler before, or block hashes of another block size or seed), a prompt that
        leaves no room for output, or one that the whole pool could not hold. A Ctrl-C
        leaves it queued whole or not at all.
        """
        check_new_request(self, request)
        with holding_interrupts():  # cut halfway, the request was in `requests` only
            self.requests[request.request_id] = request
            self.waiting.append(request)
            request.queued = True

    def abort(self, request_id: str) -> bool:
        """Finishes a request as FINISHED_ABORTED from any unfinished state.

        Returns False (nothing changed) for an unknown or already finished request, and
        raises ValueError, changing nothing, unless `request_id` is a str encodable as UTF-8
        (a Request or int is no id). A request whose KV is loading keeps its blocks until
        the load lands, then they are freed; every other one frees its blocks now. Between
        schedule() and update_from_output() or discard(), the step still runs the
        request's tokens: the blocks they fill stay in the prefix cache if the step is
        applied (its KV written, for the requests that hit them in that step too) and
        leave it if it is discarded, and its tokens count in `stats` if the step is
        applied. A Ctrl-C while it runs is raised once the request is released (cut
        halfway, it orphaned it, blocks held).
        """
        if not is_id_text(request_id):
            raise ValueError(f"{request_id=} must be a request id (a str encodable as UTF-8)")
        request = self.requests.get(plain_id(request_id))
        if request is None or request.is_finished():
            return False
        with holding_interrupts():  # cut halfway, it orphaned the request and its blocks
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._decode_carry = None
                keep_unwritten_if_unapplied(self, request)
            else:
                self.waiting.remove(request)
            self._transfers.abort(request)
        return True

    def has_unfinished_requests(self) -> bool:
        """True while some request has not finished (running, waiting, loading KV)."""
        return bool(self.running or self.waiting)

    def has_pending_transfers(self) -> bool:
        """True while a finished request still holds blocks for a KV transfer."""
        return bool(self._transfers.transferring)

    def forget_finished(self) -> None:
        """Drops the ids the next schedule() would report as finished (Engine reads none)."""
        self._finished_ids.clear()

    def forget_transfers(self) -> None:
        """Ends every KV copy in flight as failed (Engine.close went on past them)."""
        self._transfers.forget_in_flight()

    @property
    def transferring(self) -> Mapping[str, Request]:
        """Finished or aborted requests a KV copy holds blocks of, by id (a live read-only view)."""
        return MappingProxyType(self._transfers.transferring)

    @property
    def stats(self) -> SchedulerStats:
        return self._stats

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        """Chooses this step's batch and allocates its blocks. See the module doc. Raises
        RuntimeError (nothing changed) while the previous output holds requests neither
        update_from_output nor discard has taken: their tokens would be scheduled again.
        An exception from the connector (its interrupt too, raised at once) hands the
        batch back (discard) and propagates; a Ctrl-C anywhere else is raised once the
        batch is chosen, for the caller to apply or hand back (discard_unapplied)."""
        pending = self._unapplied
        if pending is not None and pending.num_requests:
            raise RuntimeError(
                f"schedule(): the previous output's {pending.num_requests} requests are "
                "neither applied (update_from_output) nor handed back (discard)"
            )
        # Cut anywhere else, a Ctrl-C broke the manager's records (a block half taken off
        # the free queue), left a request admitted outside `running` or preempted outside
        # `waiting`, or lost the batch whose blocks it cached: raised once it is chosen.
        with holding_interrupts(passes_on=self.user_code):
            self._transfers.apply_events()
            budget = self.config.max_num_batched_tokens
            batch = StepBatch()
            preempted: list[str] = []
            num_running = None
            try:
                budget = schedule_running(self, budget, batch, preempted)
                num_running = len(batch.requests)
                if not preempted:
                    admit_waiting(self, budget, batch)
            except BaseException:  # e.g. a connector's: what was scheduled is handed back
                self._unapplied = batch.output(tuple(preempted), ())
                self._num_running_scheduled = (
                    len(batch.requests) if num_running is None else num_running
                )
                self.discard(self._unapplied)
                raise
            finished, self._finished_ids = tuple(self._finished_ids), []
            self._unapplied = batch.output(tuple(preempted), finished)
            self._num_running_scheduled = num_running
            return self._unapplied

    def _schedule_decode(
        self, carry: DecodeCarry, budget: int, batch: StepBatch, preempted: list[str]
    ) -> int:
        """schedule_running's pass when the update's carry stands in for the requests
        (jaxkv.scheduler_running.schedule_decode): a method, so that a scheduler's use of
        the carry can be observed."""
        return schedule_decode(self, carry, budget, batch, preempted)

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self._count(num_preemptions=1)

    def discard_unapplied(self) -> bool:
        """discard() of the latest schedule()'s batch if it holds requests and neither
        update_from_output nor discard has taken it; True if it did. For a driver whose
        step an interrupt stopped before it took the batch (a Ctrl-C as schedule()
        returned, or as the update began), which schedule() would refuse to follow: its
        KV may have been written, so at worst prefix-cache entries are lost, and its
        requests compute the same tokens again."""
        pending = self._unapplied
        if pending is None or not pending.num_requests:
            return False
        self.discard(pending)
        return True

    def discard(self, output: SchedulerOutput) -> None:
        """Hands back the latest schedule()'s batch when its step failed before any of
        its KV was written (the model raised, an interrupt during a compile).

        schedule() entered the blocks the batch's tokens were to fill into the prefix
        cache; they leave it again, so that no request hits KV that was never written.
        Requests that were running stay running and schedule the same tokens next;
        requests that schedule() admitted free their blocks and go back to their places
        in the waiting queue (requeue_admitted). KV loads that schedule() started are
        cancelled (their cache hits may be among those blocks): each request keeps its
        blocks and its queue place until its copy lands or fails, then frees them and
        recomputes. The output's finished_request_ids are reported again by the next
        schedule(). Raises ValueError (nothing changed) unless `output` is the latest
        schedule()'s and not yet applied. A Ctrl-C while it runs is raised once it is done
        (cut halfway, it left blocks whose KV was never written in the prefix cache).
        """
        self._check_unapplied(output)
        with holding_interrupts():
            discard_batch(self, output)

    # ------------------------------------------------------------------ update

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Sequence[int] | np.ndarray,  # i32[R] one token per request
    ) -> list[RequestOutput]:
        """Advances every scheduled request by its tokens and appends sampled tokens.

        A request whose prompt is still partly uncomputed (a prefill chunk) discards its
        sampled token. Returns one RequestOutput per request that got a token, in
        schedule order. Finished requests leave `running`; their blocks are freed or,
        if the connector keeps them, held in `transferring`. Raises ValueError (nothing
        changed) unless `output` is the latest schedule()'s and not yet applied, and
        `sampled_token_ids` holds one integer >= 0 (not a bool) per scheduled request.

        An interrupt from the tokenizer propagates once the requests it reached are
        applied (those marked finished leave `running`); the running requests after it
        stay unadvanced and schedule the same tokens again. A Ctrl-C anywhere else, the
        connector's on_finish included (it may have started a save that reads the
        blocks), is raised once the update is done (jaxkv.held_interrupts). Either way
        `stats` counts every scheduled request's tokens, computed twice, twice, and
        those of a request aborted since schedule() too (the step ran them; a discard
        drops them).
        """
        self._check_unapplied(output)
        tokens = checked_sampled_tokens(output, sampled_token_ids)
        # Cut anywhere else, a Ctrl-C left a request computed without its token (nothing
        # left to schedule), finished yet running, or out of `running` with its blocks.
        with holding_interrupts(passes_on=self.user_code):
            self._unapplied = None
            self._unwritten_of_aborted = []  # the step wrote them
            return apply_sampled_tokens(self, output, tokens)

    def _check_unapplied(self, output: SchedulerOutput) -> None:
        if output is None or output is not self._unapplied:  # None: no schedule() pending
            raise ValueError(
                "output: not the latest schedule() call's SchedulerOutput, or already applied"
            )

    def _finish(self, finished: list[Request]) -> None:
        """Takes requests that just finished out of `running`; frees or holds their blocks."""
        done = set(map(id, finished))
        self.running = [r for r in self.running if id(r) not in done]
        self._transfers.finish_all(finished)

    # ---------------------------------------------------------------- release

    def _release(self, request: Request) -> None:
        """Frees the request's blocks (if any) and forgets it."""
        try:
            self.manager.free(request)
        except UnknownRequestError:
            pass  # never admitted, or preempted: holds no blocks
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _count(self, **deltas: int) -> None:
        s = self._stats
        self._stats = dataclasses.replace(s, **{k: getattr(s, k) + v for k, v in deltas.items()})
