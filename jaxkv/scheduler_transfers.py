"""The scheduler's side of KV transfers: requests whose blocks a connector's copy holds.

Plain Python, no JAX. Two kinds of copy hold blocks outside the running queue:

- loads: a waiting request whose KV the connector can supply gets blocks for all its
  tokens and waits (WAITING_FOR_REMOTE_KV) until poll() reports the load. A landed
  load makes it WAITING again (PREEMPTED if it was preempted before: its
  Request.waiting_status) with those tokens computed and their blocks in the prefix
  cache, still holding blocks for all its tokens, so it needs no further block to be
  admitted; a failed load frees its blocks and the request recomputes from scratch.
- a load started by a schedule() whose batch is discarded (Scheduler.discard) is
  cancelled: its device prefix-cache hit may be a block that the failed step was to
  write, so the request may not count it as computed. The copy may still write its
  blocks, so they stay held until it lands or fails; then they are freed and the
  request recomputes from scratch (WAITING or PREEMPTED, keeping its queue place), like
  a failed load.
- saves: a finished request whose blocks the connector is copying out stays
  FINISHED_TRANSFERRING until poll() reports the save, landed or failed; then its
  blocks are freed and it gets back the status it finished with (FINISHED_STOPPED or
  FINISHED_LENGTH). A request aborted while its load is in flight is held the same way
  until that load lands or fails.

Every copy lands or fails, so every block held here is released or handed back to the
scheduler's queues; the Scheduler's liveness argument rests on that. It also bounds the
wait of a request whose next block another request's load brings (is_loading): admission
holds it back only while that load is in flight, so one load serves both.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.held_interrupts import UserCode, holding_interrupts
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.kv_transfer import KVConnector, TransferEvents
from jaxkv.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class TransferTracker:
    """Tracks loads in flight, landed loads, and finished requests held for a copy.

    Guarantees: a request enters `transferring` only finished (FINISHED_TRANSFERRING, or
    FINISHED_ABORTED with a load in flight) and leaves it exactly once, through
    `release`, when apply_events() sees its copy land or fail. landed() lists only
    waiting requests whose load landed and that were neither admitted nor aborted since;
    each holds blocks for all its tokens. Changes the manager's blocks only through
    start_load, apply_events (a landed load's blocks cached; a failed or cancelled load's
    freed) and `release`.
    """

    def __init__(
        self,
        connector: KVConnector,
        manager: KVCacheManager,
        release: Callable[[Request], None],
        user_code: UserCode | None = None,
    ) -> None:
        self._connector = connector
        # Set while the connector's on_admission or start_load runs: the scheduler holds
        # Ctrl-C around its changes but lets it stop those at once. A connector that marks
        # its user code itself (its copier's calls) takes the flag: those hooks then set
        # one that nothing reads.
        self._user_code = UserCode() if user_code is None else user_code
        if connector.marks_user_code(self._user_code):
            self._user_code = UserCode()
        self._manager = manager
        self._release = release  # frees a request's blocks (if any) and forgets it
        self.transferring: dict[str, Request] = {}  # finished or aborted, blocks held
        self._finished_as: dict[str, RequestStatus] = {}  # saving req_id -> its end status
        # req_id -> (request, its computed tokens once the load lands; None: cancelled)
        self._loading: dict[str, tuple[Request, int | None]] = {}
        self._landed: dict[str, Request] = {}  # waiting requests whose load landed, in order
        self._new_loads: list[Request] = []  # loads started since apply_events (this schedule)
        # Block hash -> how many loads in flight (not cancelled) fill a block of that hash
        # (no zero counts), and each such load's hashes, taken back exactly as added.
        self._loading_hashes: dict[object, int] = {}
        self._hashes_of: dict[str, list] = {}
        # The no-op connector's poll() reports nothing: no interrupt to hold around it.
        self._polls_copies = type(connector).poll is not KVConnector.poll

    # ------------------------------------------------------------------ loads

    def start_load(
        self,
        request: Request,
        hit_ids: Sequence[int],
        num_hit: int,
        num_external: int,
    ) -> bool:
        """Allocates blocks for all of a fresh waiting request's tokens and starts its load.

        `hit_ids` and `num_hit` are its device prefix-cache hit; the connector claimed
        `num_external` further tokens. The loaded blocks enter the prefix cache when the
        load lands (apply_events), before the request is admitted again. Returns False
        (nothing changed) when the pool cannot hold the blocks; else the request is
        WAITING_FOR_REMOTE_KV with `num_hit` tokens computed until the load lands.

        Raises ValueError, with nothing changed, for a claim that is not whole blocks
        ending before the request's last token; an exception from the connector's
        start_load frees the blocks again and propagates.
        """
        m = self._manager
        num_external = self._check_claim(request, num_hit, num_external, least=1)
        new_ids = m.allocate_slots(
            request,
            0,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_ids,
            num_lookahead_tokens=request.num_tokens - num_hit,
        )
        if new_ids is None:
            return False
        request.num_computed_tokens = num_hit
        user_code = self._user_code
        try:
            user_code.runs = True
            try:
                self._connector.start_load(request, new_ids[: num_external // m.block_size])
            finally:
                user_code.runs = False
        except BaseException:
            m.free(request)
            request.num_computed_tokens = 0
            raise
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._loading[request.request_id] = (request, num_hit + num_external)
        if self._manager.enable_prefix_caching:  # else no later request could hit them
            hashes = request.block_hashes[
                num_hit // m.block_size : (num_hit + num_external) // m.block_size
            ]
            self._hashes_of[request.request_id] = hashes
            counts = self._loading_hashes
            for block_hash in hashes:
                counts[block_hash] = counts.get(block_hash, 0) + 1
        self._new_loads.append(request)
        return True

    def claim(self, request: Request, num_hit: int) -> int:
        """The tokens past the device hit's `num_hit` that the connector's on_admission
        claims, as an int: 0, or whole blocks ending before the request's last token.
        Raises ValueError naming any other answer (None, a bool, a float), changing
        nothing."""
        user_code = self._user_code
        user_code.runs = True
        try:
            answer = self._connector.on_admission(request, num_hit)
        finally:
            user_code.runs = False
        return self._check_claim(request, num_hit, answer, least=0)

    def _check_claim(self, request: Request, num_hit: int, answer: object, *, least: int) -> int:
        """The claim as an int >= `least`; ValueError unless whole blocks before the last
        token."""
        block_size = self._manager.block_size
        most = (request.num_tokens - 1) // block_size * block_size - num_hit
        try:
            claim = None if isinstance(answer, (bool, np.bool_)) else operator.index(answer)
        except TypeError:
            claim = None
        if claim is None or not (least <= claim <= most and claim % block_size == 0):
            raise ValueError(
                f"{type(self._connector).__name__}.on_admission({request.request_id!r}, "
                f"{num_hit}) returned {answer!r}: a claim must be a whole number of "
                f"{block_size}-token blocks (an int{', 0 for none' if least == 0 else ''}) "
                f"ending before the request's last token (at most {max(most, 0)} tokens here)"
            )
        return claim

    def cancel_new_loads(self) -> None:
        """Cancels the loads started since apply_events() (by a schedule() whose batch is
        discarded): when each lands or fails, its blocks are freed and its request, if
        not aborted, recomputes from scratch (see the module doc)."""
        for request in self._new_loads:
            if request.request_id in self._loading:
                self._loading[request.request_id] = (request, None)
                self._forget_hashes(request.request_id)
        self._new_loads.clear()

    def is_loading(self, block_hash: object) -> bool:
        """True while a load in flight (not cancelled) fills a block of `block_hash`: once
        it lands, the block is in the prefix cache."""
        return block_hash in self._loading_hashes

    def _forget_hashes(self, req_id: str) -> None:
        counts = self._loading_hashes
        for block_hash in self._hashes_of.pop(req_id, ()):
            left = counts[block_hash] - 1
            if left:
                counts[block_hash] = left
            else:
                del counts[block_hash]

    def landed(self) -> list[Request]:
        """Waiting requests whose load landed, in landing order (a copy: safe to admit)."""
        return list(self._landed.values())

    def forget_landed(self, request_id: str) -> None:
        """The request left the waiting queue (admitted); no-op unless its load landed."""
        self._landed.pop(request_id, None)

    # ---------------------------------------------------------------- finishing

    def finish_all(self, finished: Sequence[Request]) -> None:
        """finish() for each request, in order. An interrupt (a KeyboardInterrupt that a
        connector's on_finish raises itself, say) finishes the rest before it propagates: no
        finished request is left outside both `transferring` and the manager's free list."""
        interrupt: BaseException | None = None
        for request in finished:
            try:
                self.finish(request)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                interrupt = interrupt or e
        if interrupt is not None:
            raise interrupt

    def finish(self, request: Request) -> None:
        """A request just finished: held (FINISHED_TRANSFERRING) while the connector saves
        its blocks, then released with its finished status back; else released now. A
        connector whose on_finish raises counts as a save that failed to start: the
        blocks are freed and a logged warning says why (a warnings filter could turn a
        warning into an exception before they were); an interrupt that is no Exception
        frees them too, then propagates. An answer other than a bool (numpy's is one) is
        read by its truth, with a logged warning naming it.

        Its caller holds a Ctrl-C back through on_finish (Scheduler.update_from_output):
        raised inside it once the connector had started and recorded the save, it freed
        the blocks the save still read, and the save's report was then refused."""
        block_ids = self._manager.block_ids(request.request_id)
        try:
            held = self._connector.on_finish(request, block_ids)
        except Exception as e:  # noqa: BLE001 - a failed save frees the blocks, as below
            logger.warning(
                "KV connector on_finish(%r) raised %r; its blocks are freed without saving them",
                request.request_id,
                e,
            )
            held = False
        except BaseException:
            self._release(request)
            raise
        if not isinstance(held, (bool, np.bool_)):
            # Read by its truth: a truthy answer may have started a save that reads the
            # blocks, and freeing them under it could store another request's KV.
            logger.warning(
                "KV connector on_finish(%r) returned %r, not a bool; read as %s",
                request.request_id,
                held,
                bool(held),
            )
        if held:
            self._finished_as[request.request_id] = request.status
            request.status = RequestStatus.FINISHED_TRANSFERRING
            self.transferring[request.request_id] = request
        else:
            self._release(request)

    def abort(self, request: Request) -> None:
        """Makes an unfinished request, already out of its queue, FINISHED_ABORTED.

        A request whose load is in flight stays in `transferring` (its blocks held)
        until the load lands or fails (a landed load's blocks enter the prefix cache
        before they are freed); every other one is released now.
        """
        self._landed.pop(request.request_id, None)
        loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KV
        request.status = RequestStatus.FINISHED_ABORTED
        if loading:
            self.transferring[request.request_id] = request
        else:
            self._release(request)

    # ----------------------------------------------------------------- events

    def apply_events(self) -> None:
        """Applies the connector's events since the last call (see the module doc).

        Called first by each schedule(): the loads started before it can no longer be
        cancelled by a discard. A report that is not a TransferEvents raises ValueError
        with nothing applied. Entries that name no copy in flight, or one already named,
        are ignored: the rest are applied (each a copy that ended, whose blocks would
        otherwise stay held), then ValueError names the connector and every ignored entry.
        A Ctrl-C during poll() or while its report is applied is raised once it is applied
        (jaxkv.held_interrupts): raised before, it lost the copies poll() had seen end,
        their blocks held for good.
        """
        self._new_loads.clear()
        with holding_interrupts(self._polls_copies):
            self._apply(self._connector.poll())

    def forget_in_flight(self) -> None:
        """Ends every copy in flight as failed, its request released (blocks freed, id
        forgotten): its connector forgot it, as its engine closed without it landing."""
        saves, loads = tuple(self._finished_as), tuple(self._loading)
        self._apply(TransferEvents(failed_saves=saves, failed_loads=loads))

    def _apply(self, events: object) -> None:
        if type(events) is TransferEvents and not events:
            return
        saves, loads, ignored = self._sorted_events(events)
        for req_id, _ in saves:
            request = self.transferring.pop(req_id)
            request.status = self._finished_as.pop(req_id)
            self._release(request)
        for req_id, landed in loads:
            self._load_ended(req_id, landed=landed)
        if ignored:
            raise ValueError(
                f"{type(self._connector).__name__}.poll() reported {'; '.join(ignored)}. "
                "Those entries were ignored; the others were applied"
            )

    def _sorted_events(self, events: object) -> tuple[list, list, list[str]]:
        """((request id, landed) of each ended save, the same of each ended load, why each
        other entry is ignored): a save or load counts if its request has one in flight,
        once. ValueError unless `events` is a TransferEvents."""
        if not isinstance(events, TransferEvents):
            raise ValueError(
                f"{type(self._connector).__name__}.poll() returned {events!r}; expected a "
                "TransferEvents (nothing was applied)"
            )
        saves: list[tuple[str, bool]] = []
        loads: list[tuple[str, bool]] = []
        ignored: list[str] = []
        # Each kind's fields name its landed copies, then its failed ones.
        for kind, fields, in_flight, ended in (
            ("save", ("saved", "failed_saves"), self._finished_as, saves),
            ("load", ("loaded", "failed_loads"), self._loading, loads),
        ):
            seen: set[str] = set()
            for field in fields:
                ids = getattr(events, field)
                if not isinstance(ids, (tuple, list)):
                    ignored.append(f"{field}={ids!r}, not a tuple of request ids")
                    continue
                for req_id in ids:
                    if type(req_id) is not str or req_id not in in_flight:
                        ignored.append(f"{field} {req_id!r}, but no {kind} of it is in flight")
                    elif req_id in seen:
                        ignored.append(f"{field} {req_id!r}, but its {kind} ended already")
                    else:
                        seen.add(req_id)
                        ended.append((req_id, field == fields[0]))
        return saves, loads, ignored

    def _load_ended(self, req_id: str, *, landed: bool) -> None:
        request, num_computed = self._loading.pop(req_id)
        self._forget_hashes(req_id)
        aborted = self.transferring.pop(req_id, None) is not None
        computed = landed and num_computed is not None  # else failed or cancelled
        if computed:
            request.num_computed_tokens = num_computed
            # Caches the loaded blocks now (it needs no fresh block), even for an aborted
            # request: one that misses them before this one is admitted, or that waited
            # for this load (is_loading), hits them instead of loading them again.
            self._manager.allocate_slots(request, 0)
        if aborted:
            self._release(request)
        elif computed:
            request.status = request.waiting_status  # PREEMPTED if it was, as a discard
            self._landed[req_id] = request
        else:  # failed or cancelled: recompute from scratch
            self._manager.free(request)
            request.num_computed_tokens = 0
            request.status = request.waiting_status
