"""Data parallelism: several engine replicas behind a prefix-aware, load-balancing router.

Each replica (an Engine on its own group of devices, see `engine_replicas`) keeps its own
prefix cache, so a shared prompt prefix is computed once per replica that sees it. The
router therefore sends requests that share a prefix to the same replica: it remembers which
replica each prefix went to, keyed by the chained hashes of the prompt's first full blocks
(jaxkv.hashing, the same keys the prefix cache uses), and routes a new request to the
replica of its longest remembered prefix, unless that replica has more than max_imbalance
outstanding sequences beyond the least-loaded one. A request with no remembered prefix goes
to the replica with the fewest outstanding (queued or running) sequences, the first of
them on a tie: a request of SamplingParams.n counts n (jaxkv.router_rule).

The router is plain Python: it needs only the `Replica` interface (jaxkv.replica), so it
works with engines in one process (on CPU devices too) and is testable without engines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np

from jaxkv.closable import Closable, no_reentry, one_at_a_time, step_until_landed, try_each
from jaxkv.completion import checked_drivers, run_to_completion
from jaxkv.engine_replicas import engine_replicas as engine_replicas  # its former home
from jaxkv.hashing import BlockHash
from jaxkv.held_interrupts import holding_interrupts
from jaxkv.outputs import CompletionOutput, RequestOutput
from jaxkv.parallel_sampling import IdsInUse
from jaxkv.prefix_routes import Route as Route  # re-exported: route() returns one
from jaxkv.prefix_routes import routable_prompt_ids
from jaxkv.replica import Replica as Replica  # its former home
from jaxkv.replica import check_one_model
from jaxkv.replica_checks import CheckedReplicas
from jaxkv.request_id_lists import checked_request_ids, is_id_text, plain_id
from jaxkv.request_serials import RequestSerials, rewind_together
from jaxkv.router_lifetime import close_router, closed_replicas, open_replicas, routable_replicas
from jaxkv.router_release import RequestEnds
from jaxkv.router_rule import RoutingRule
from jaxkv.router_samples import RunningSamples
from jaxkv.sampling_params import SamplingParams


class PrefixAwareRouter(RoutingRule, RequestEnds, Closable):
    """Routes requests over `replicas`: shared prefixes together, the rest to the least loaded.

    replicas: the engines routed over (any Replica); those with a model_config must
    serve one model (jaxkv.replica.check_one_model: ValueError naming replicas).
    block_size: tokens per hashed block (use the replicas' KV block size).
    max_prefix_blocks: how many leading full blocks are hashed (longer prefixes share the
    route of their first max_prefix_blocks blocks).
    max_imbalance: a request leaves its prefix's replica (and moves the prefix) when that
    replica has more than max_imbalance outstanding sequences beyond the least-loaded
    one; None keeps prefix affinity strictly, which sends every prompt that opens with
    one common block (a BOS and chat-template header) to one replica for good: hence 16.
    max_tracked_prefixes: bound on remembered prefix hashes (least recently used dropped).

    Outstanding sequences are counted by the router: +n on add_request (SamplingParams.n,
    1 without params), -1 when step() returns the output that says one sample finished,
    and the samples still running when it is aborted or when a failed step() leaves its
    replica with no unfinished request (see step); so add, step and abort through the
    router only (a request added to a replica directly is not counted, and its outputs
    are dropped; one aborted there counts until the router's abort). Not thread-safe; a
    call back into the router from inside its add_request, step, abort, drain_transfers
    or reset_prefix_cache (a replica's tokenizer, a proxy's callback) raises
    RuntimeError, changing nothing. Replicas should sample with different default
    seeds (engine_replicas sees to it): otherwise unseeded sampled requests on two
    replicas can draw the same tokens.

    A replica closed directly (engine.close() on one of `replicas`: its `closed` is True;
    one without that attribute is always open) is a dead engine to the router, as to vLLM's
    data-parallel coordinator: new requests go to the open replicas only (add_request and
    route raise RuntimeError, changing nothing, once every replica is closed), and it is
    no longer stepped, asked to abort, reset or checkpointed (close still closes it). The
    router's requests on it end at its next step(), released as abort() releases them,
    with no output (generate reports finish_reason "abort"); until then they count, and
    has_unfinished_requests() is True.
    """

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        block_size: int,
        max_prefix_blocks: int = 8,
        max_imbalance: int | None = 16,
        max_tracked_prefixes: int = 1 << 16,
        hash_seed: int = 0,
    ) -> None:
        self._replicas = tuple(checked_drivers(replicas, "replicas"))
        check_one_model(self._replicas)
        RoutingRule.__init__(
            self, len(self.replicas), block_size, max_prefix_blocks, max_imbalance,
            max_tracked_prefixes, hash_seed,
        )  # fmt: skip
        self._indices = range(len(self.replicas))
        self._replica_of: dict[str, int] = {}  # request_id -> replica, while unfinished
        # request_id -> its prompt's prefix keys: a list new to each queueing, its token
        self._queued: dict[str, list[BlockHash]] = {}
        self._samples = RunningSamples()  # of requests of n > 1
        self._checked = CheckedReplicas(self.replicas, self._samples.is_parent, self._replica_of)
        self._undelivered: list[RequestOutput] = []  # gathered by a step() that raised
        self._serials = RequestSerials("dp-")  # of generated ids

    def _open_replicas(self) -> Sequence[int]:
        """The replicas a request may go to, in order: the open ones (RuntimeError when
        every one is closed)."""
        return routable_replicas(self.replicas)

    @property
    def replicas(self) -> tuple[Replica, ...]:
        """The replicas, in the order given: a tuple, fixed for the router's life (its
        counts, routes and requests are kept by replica index)."""
        return self._replicas

    # ---------------------------------------------------------------- routing

    def replica_of(self, request_id: str) -> int:
        """The replica an unfinished request runs on; KeyError if unknown or finished."""
        if isinstance(request_id, str):  # a subclass hashing apart from its text
            request_id = plain_id(request_id)
        try:
            return self._replica_of[request_id]
        except TypeError:  # unhashable: no request's id
            raise KeyError(request_id) from None

    @one_at_a_time
    def reset_prefix_cache(self) -> bool:
        """Empties every open replica's prefix cache (Engine.reset_prefix_cache) and forgets
        the prefixes routed to each replica that emptied its own, but those of the requests
        it still holds (queued there, they fill its cache again); True if every one did.
        A replica that refuses (one of its requests holds blocks), or has no such method,
        keeps its cache and routes. Raises RuntimeError after close(); ValueError naming
        a replica whose reset_prefix_cache is no method (none reset) or answers no bool
        (all reset first, as each acts before it answers; that one keeps its routes)."""
        emptied: list[int] = []
        try:
            return self._checked.reset_prefix_caches(emptied.append, closed_replicas(self.replicas))
        finally:  # all at once: which replica reset first must not matter
            if emptied:
                held = [(self._replica_of[r], hashes) for r, hashes in self._queued.items()]
                self._caches_emptied(emptied, held)

    # --------------------------------------------------------------- requests

    @one_at_a_time
    def add_request(
        self,
        prompt_token_ids: Sequence[int] | np.ndarray,
        sampling_params: Any = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Routes and queues a request on one replica; returns its id (unique across all
        replicas; generated ones are "dp-0", "dp-1", ... skipping ids callers hold).
        Prompts route together only under equal `cache_salt`s, as the replicas cache them.
        Raises ValueError on an id in use (a running request's, a running sample's, one an
        open replica's ids_in_use holds, or under n > 1 one whose samples' ids are any of
        these) or one that is not a str encodable as UTF-8; the replica's ValueError (bad prompt or
        params) leaves the router unchanged, the next generated id included. When the
        replica raises, or returns another id (ValueError naming the replica and both ids,
        the router unchanged), the id is aborted on it first, in case it was queued there,
        and so is the str id it returned, unless one of the router's requests or running
        samples on that replica has it (left running: the answer is the replica's error).
        A Ctrl-C in the replica's add_request is such an error; anywhere else once the
        replica queued the request, it is raised when the router counts the request."""
        if request_id is not None and not (is_id_text(request_id) and request_id):
            # abort() and close() take only str ids: a replica that queued an int id would
            # leave a request the router can never abort, and a close() that always raises.
            raise ValueError(f"{request_id=} must be None or a non-empty str encodable as UTF-8")
        if request_id is not None:
            request_id = plain_id(request_id)
        prompt = routable_prompt_ids(prompt_token_ids)
        generated = request_id is None
        # Anything else the replica refuses by name. A default id is one whose samples'
        # ids are free too; no id may be a running sample's, whichever replica runs it.
        n = sampling_params.n if isinstance(sampling_params, SamplingParams) else 1
        held = self._checked.held_ids(closed_replicas(self.replicas))  # a closed one's: lost
        in_use = IdsInUse(self._replica_of, self._samples, *held, n=n)
        serial, request_id = self._serials.peek(request_id, in_use)
        if request_id in self._replica_of:
            raise ValueError(f"{request_id=} is already running")
        if request_id in in_use:
            raise ValueError(
                f"{request_id=} is already in use: it, or one of its {n} samples' ids, is "
                "a running sample's or one a replica holds (added to it directly, or finished "
                "with its KV copy in flight: drain_transfers frees those)"
            )
        hashes = self._routes.hashes(prompt, cache_salt)
        replica = self._route(hashes).replica
        ours = partial(self._runs_on, replica)  # ids a wrong answer there must not abort
        with holding_interrupts(passes_on=self._checked.user_code):  # see the docstring
            args = (prompt, sampling_params, request_id, cache_salt, n, ours)
            self._checked.add_request(replica, *args)
            if generated:  # only once queued: a refused request leaves later ids as they were
                self._serials.take(serial)
            self._routes.remember(hashes, replica)
            self._outstanding[replica] += n
            self._replica_of[request_id] = replica
            self._queued[request_id] = hashes
            if n > 1:
                self._samples.add(request_id, n)
        return request_id

    def queue_checkpoint(self) -> Callable[[], None]:
        """A function that, called once every request queued since has been aborted (as
        generate does when it refuses a prompt), gives back what queueing them changed:
        the next generated id, the prefix routes they added, and the default ids and seeds
        of replicas with a queue_checkpoint method (Engine). Only that: a
        reset_prefix_cache() since stays in force, the routes it dropped not given back
        (those caches are gone). It raises RuntimeError, changing nothing, while the
        router, or such a replica, still holds one of them (a request added to the replica
        directly counts too): it checks every checkpoint before it rewinds any. A
        replica's rewind with no check() method (Engine's has one) is checked only by
        calling it, before anything else is rewound: with two or more such replicas, a
        later one refusing comes after the first rewound, so every other one, the router
        and the Engines are rewound before its RuntimeError is raised
        (jaxkv.request_serials.rewind_together). Taking it, and each rewind, copies the
        prefix routes (5-10 ms for a full default max_tracked_prefixes, 2-core CPU); while
        the rewind lives, each reset_prefix_cache() resets that copy too. Raises
        RuntimeError after close()."""
        self._check_open()
        # By token, not replica: an id aborted and queued again on its replica is new.
        rewind_ids = self._serials.checkpoint(self._queued)
        # ValueError naming one not callable; a closed replica queues nothing more
        rewinds = self._checked.queue_checkpoints(closed_replicas(self.replicas))
        rewind_routes = self._checkpoint_routes(self._queued.values())
        return rewind_together([rewind_ids, *rewinds], then=rewind_routes)

    @no_reentry
    def abort(self, request_ids: str | Iterable[str]) -> bool:
        """Aborts an unfinished request, or each of an iterable of them, on its replica
        (under n > 1 each of its running samples; a sample's own id, "i_<id>", aborts that
        one); True if one was, False if each is unknown or finished. Raises ValueError,
        aborting none, unless each id is a str encodable as UTF-8 (as add_request's). A replica's
        abort that raises leaves its request held; every other id is still aborted, then
        the first error raised, with a note naming the others (jaxkv.closable.try_each).

        A request (or sample) its replica no longer runs, with no finishing output left
        to deliver (it finished inside a replica step() that raised, its output lost with
        it), is released here too, and False returned. Outputs a failed step() kept for a
        sequence released here are dropped: they must not reach a later request of its id.
        A replica's abort answering no bool is read by its truth (none: False), logged.
        A Ctrl-C (in a replica's abort too) is raised once every id is aborted."""
        request_ids = checked_request_ids(request_ids)
        if self._closed:  # it holds no request: a cleanup after close asks no replica
            return False
        closed = closed_replicas(self.replicas)
        with holding_interrupts():  # cut after a replica's abort, it kept the request counted
            return any(try_each(lambda r: self._abort_one(r, closed), request_ids, "abort"))

    def _owner(self, request_id: str) -> tuple[str, tuple[str, int] | None]:
        """(the request `request_id` names, the running sample (parent, index) it names or
        None): a request's own id comes before a sample id of the same text."""
        sample = None if request_id in self._replica_of else self._samples.sample_of(request_id)
        return (request_id if sample is None else sample[0]), sample

    def _runs_on(self, replica: int, request_id: str) -> bool:
        """Whether `request_id` is that of one of the router's requests, or of a running
        sample of one, on replicas[replica]."""
        return self._replica_of.get(self._owner(request_id)[0]) == replica

    def _abort_one(self, request_id: str, closed: set[int]) -> bool:
        owner, sample = self._owner(request_id)
        replica = self._replica_of.get(owner)
        if replica is None:
            return False
        aborted = replica not in closed and self._checked.abort(replica, request_id)
        self._release(owner, sample, aborted)
        return aborted

    def has_unfinished_requests(self) -> bool:
        """True while an open replica has unfinished requests, a step() has outputs to give
        or the router holds a request on a closed replica (step() releases it). Raises
        ValueError naming a replica whose has_unfinished_requests or closed is no bool."""
        closed = closed_replicas(self.replicas)
        if self._undelivered or (closed and not closed.isdisjoint(self._replica_of.values())):
            return True
        return any(map(self._checked.unfinished, open_replicas(self.replicas, closed)))

    @one_at_a_time
    def step(self) -> list[RequestOutput]:
        """One step of every replica with unfinished requests or KV copies in flight (an
        idle one's step collects its copies, freeing their blocks and ids), in replica order.

        When one replica's step raises, the outputs of the replicas before it are kept
        and the next step() returns them first: no token, and no finish, is lost. If that
        replica then has no unfinished request, the router's requests on it ended in the
        failed step, their outputs lost, and are released at once as abort() releases
        them (one that still runs some keeps all counted until abort() releases them). A
        finished request is released (its id free, its replica's count down) once its
        finishing output is returned, so a kept output never reaches a later request
        of its id. A replica's step() that returns what the router cannot deliver (an
        output of a request it sent another replica, or of one that finished; see
        jaxkv.replica.Replica) counts as one that raised: ValueError naming it, its
        outputs that pass kept with those before it, the others dropped. Outputs of
        requests the router does not hold (added to a replica directly) are dropped. A
        Ctrl-C in a replica's step is an error it raised; anywhere else it is raised once
        the finished requests are released (cut before, they stayed counted for good).
        """
        checked, index = self._checked, None
        with holding_interrupts(passes_on=checked.user_code):
            closed = closed_replicas(self.replicas)  # ValueError naming one: nothing done yet
            self._release_on(closed)  # before the kept outputs are taken: theirs end them
            outputs, self._undelivered = self._undelivered, []
            try:
                for index in (i for i in self._indices if i not in closed):
                    if checked.unfinished(index) or checked.pending(index):
                        checked.step(outputs, index)
            except BaseException as error:
                self._undelivered = outputs
                checked.ended_in(outputs, self._replica_of)
                if index is not None:  # None: interrupted before the first replica's turn
                    self._release_if_idle(index, error)
                raise
            return self._finished_from(outputs)

    def has_pending_transfers(self) -> bool:
        """True while an open replica's finished requests hold blocks for KV copies in
        flight (replicas without a `has_pending_transfers` method have none)."""
        return any(map(self._checked.pending, open_replicas(self.replicas)))

    @one_at_a_time
    def drain_transfers(self, timeout_s: float = 60.0) -> None:
        """Steps replicas until every KV copy in flight has landed; see Engine.drain_transfers.

        Outputs of requests stepped meanwhile are dropped (their finishes are still
        counted, and a request finishing so drops the outputs a failed step() kept of
        it; a failed replica step releases what it ended, as in step()); call it when the router
        is otherwise idle. Raises TimeoutError and ValueError as jaxkv.closable.step_until_landed
        does: copies that landed within `timeout_s` are collected, under timeout_s=0 too.
        """

        def step() -> bool:
            stepped = False
            for index in filter(self._checked.pending, open_replicas(self.replicas)):
                outputs: list[RequestOutput] = []
                try:  # the outputs that passed its checks count, whatever else it returned
                    self._checked.step(outputs, index)
                except BaseException as error:
                    self._finished_from(outputs)
                    self._release_if_idle(index, error)  # its requests that ended with it
                    raise
                stepped |= bool(self._finished_from(outputs))
            return stepped

        step_until_landed(self.has_pending_transfers, step, timeout_s)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: Any = None,
        *,
        progress: bool = True,
    ) -> list[CompletionOutput]:
        """Runs `prompts` to completion over all replicas; one CompletionOutput per prompt
        and sample (SamplingParams.n), in prompt order, then by sample index.
        `sampling_params` is one for all or a sequence of one per prompt. `progress`
        shows a progress bar (tqdm, when installed) once all are queued, as Engine.generate
        does."""
        self._check_open()
        return run_to_completion(self, prompts, sampling_params, progress=progress)

    # --------------------------------------------------------------- lifetime

    @no_reentry  # a replica's callback from inside it is refused
    def close(self, timeout_s: float = 60.0, *, force: bool = False) -> None:
        """Aborts every unfinished request, waits for every open replica's KV copies in
        flight to land, then closes each replica that has a `close(timeout_s)` method
        (Engine.close: the copy thread stops, device memory is freed), all within
        `timeout_s`. Outputs that a failed step() kept for the next one are dropped.

        Afterwards add_request, step, generate, queue_checkpoint, drain_transfers and
        reset_prefix_cache raise RuntimeError, and abort returns False (for a caller's
        cleanup); closing again does nothing. Raises ValueError, changing nothing,
        unless `timeout_s` is a number >= 0, each replica's close, if any, a method and
        its closed, if any, a bool. A replica that raises an Exception on the way (its
        abort, step or has_pending_transfers while copies land, or close) stops nothing:
        the other requests are aborted, the other replicas' copies landed, every
        replica's close is tried, every request released and the router closed; then the
        first error is raised, with a note naming it and each later one. A replica whose
        close raised is the caller's to retry (router.replicas[i].close()): an Engine's
        that raised a TimeoutError, unforced, stays open (close(force=True) ends it),
        while any other error of its close is raised once it is closed. Only a timeout
        with no replica failing, unforced, leaves the router open, as Engine.close does:
        TimeoutError when the copies have not landed in time, every request aborted and
        no replica closed, so that close can be called again with more time.

        `force` goes on past that timeout as past a failing replica, as Engine.close's
        does: every replica's close is tried as close(timeout_s=..., force=True) (an
        Engine ends closed, the copies not landed lost), the router closed, then the
        first error raised with its note. Unforced, a replica's close is called without
        `force`. ValueError, changing nothing, when `force` is no bool, or, forced, a
        replica's close takes no `force` keyword (nor **kwargs): it could not be forced.
        """
        close_router(self, timeout_s, force)
