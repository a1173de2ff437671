"""What PrefixAwareRouter checks of its replicas' answers, where it reads them.

A replica may be any object with the `Replica` methods (a proxy of a remote engine, say),
so the router trusts none of its answers blindly: an output under the wrong request, or
a finish reported twice, would release a request the router still runs elsewhere or end
a generate early, and a None where a bool belongs would stall a request for good. A bad
answer raises ValueError naming the replica (its index and type), the method, what it
returned and what was expected; `abort`'s answer, given after the replica acted, is read
by its truth (False if it has none) with a logged warning instead (as the scheduler
reads a connector's on_finish).

What a step's outputs must be, and how they are checked, is in jaxkv.replica_outputs: a
few passes of C over them (set operations), not a Python loop; the output-by-output pass
runs only once those have found something wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from jaxkv.held_interrupts import UserCode
from jaxkv.outputs import RequestOutput
from jaxkv.replica import Replica
from jaxkv.replica_outputs import outputs_fit, passing_outputs, request_of, sequence_key, shown

__all__ = ["CheckedReplicas"]

logger = logging.getLogger(__name__)


def replica_name(index: int, replica: object) -> str:
    return f"replicas[{index}] ({type(replica).__name__})"


class CheckedReplicas:
    """The router's replicas, each answer checked as the Replica protocol says, and the
    sequences each runs for the router: those its step() may report. A request's
    sequence of sample index i is keyed `request_id` for i = 0 (a request of one sample
    has only that one) and `(request_id, i)` for the others (SamplingParams.n).
    `is_parent` tells a request of n > 1 with a sample still running; `held` holds the
    ids of the router's unfinished requests, on any replica (a live view)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        is_parent: Callable[[str], bool],
        held: Container[str],
    ) -> None:
        self._replicas = replicas
        self._is_parent = is_parent
        self._held = held
        self.user_code = UserCode()  # set around a replica's add_request and step
        self._running: list[set[str | tuple[str, int]]] = [set() for _ in replicas]

    def unfinished(self, index: int) -> bool:
        """replicas[index].has_unfinished_requests()."""
        replica = self._replicas[index]
        answer = replica.has_unfinished_requests()
        return _checked_bool(index, replica, "has_unfinished_requests", answer)

    def pending(self, index: int) -> bool:
        """Whether replicas[index] holds blocks for KV copies in flight (False without a
        has_pending_transfers method); ValueError naming one that is no method or that
        answers no bool."""
        pending = self._method(index, "has_pending_transfers")
        answer = pending is not None and pending()
        return _checked_bool(index, self._replicas[index], "has_pending_transfers", answer)

    def held_ids(self, closed: Container[int] = ()) -> list[Container[str]]:
        """The ids_in_use of each replica that has it (Engine's) but those in `closed` (an
        Engine closed past copies that never landed lists their ids, which nothing will
        free); ValueError naming one that is no container (a method, None, an iterator
        that `in` would consume)."""
        held = []
        for index, replica in enumerate(self._replicas):
            if index not in closed and hasattr(replica, "ids_in_use"):
                ids = replica.ids_in_use
                if not isinstance(ids, Container):
                    raise ValueError(
                        f"{replica_name(index, replica)}.ids_in_use is {shown(ids)}; "
                        "expected a container of request ids (a set, or Engine's live view)"
                    )
                held.append(ids)
        return held

    def reset_prefix_caches(self, emptied: Callable[[int], None], closed: Container[int]) -> bool:
        """Calls reset_prefix_cache() of every replica that has it but those in `closed`
        (not asked: a closed Engine holds no cache), and `emptied(index)` for each that
        answers True; returns whether every replica but those did. Each acts before it
        answers, so every one is asked before a ValueError names the first whose answer
        is no bool (that replica's emptied() is not called). ValueError naming the first
        whose reset_prefix_cache is not callable comes before any is asked."""
        resets = self.methods("reset_prefix_cache")
        everyone, first = True, None
        for index, (replica, reset) in enumerate(zip(self._replicas, resets, strict=True)):
            if index in closed:
                continue
            answer = False if reset is None else reset()
            if not isinstance(answer, (bool, np.bool_)):
                first = first or f"{replica_name(index, replica)} returned {shown(answer)}"
                everyone = False
            elif answer:
                emptied(index)
            else:
                everyone = False
        if first is not None:
            raise ValueError(
                f"reset_prefix_cache() of {first}; expected a bool (that replica's routes "
                "are kept; every replica was asked to reset)"
            )
        return everyone

    def queue_checkpoints(self, closed: Container[int]) -> list[Callable[[], None]]:
        """The rewind queue_checkpoint() returns, of each replica not in `closed` that has
        that method (Engine's); ValueError naming one whose answer is not callable (it
        would raise a bare TypeError only when rewound, after the rewinds before it ran)."""
        rewinds = []
        for index, take in enumerate(self.methods("queue_checkpoint")):
            if take is None or index in closed:
                continue
            rewind = take()
            if not callable(rewind):
                raise ValueError(
                    f"{replica_name(index, self._replicas[index])}.queue_checkpoint() "
                    f"returned {shown(rewind)}; expected a function (its rewind)"
                )
            rewinds.append(rewind)
        return rewinds

    def methods(self, name: str) -> list[Callable | None]:
        """Each replica's optional method `name` (_method), read before any is called."""
        return [self._method(index, name) for index in range(len(self._replicas))]

    def _method(self, index: int, name: str) -> Callable | None:
        """replicas[index]'s optional method `name`, None if it has none; ValueError
        naming an attribute of that name that is not callable."""
        replica = self._replicas[index]
        method = getattr(replica, name, None)
        if method is not None and not callable(method):
            raise ValueError(
                f"{replica_name(index, replica)}.{name} is {shown(method)}; expected a "
                "method (or no such attribute)"
            )
        return method

    def add_request(
        self,
        index: int,
        prompt: list[int],
        sampling_params: Any,
        request_id: str,
        cache_salt: str | None,
        n: int,
        ours: Callable[[str], bool],
    ) -> None:
        """Queues a request of `n` sequences on replicas[index] as `request_id`. When the
        replica raises, or returns another id (ValueError naming both), the id is aborted
        there before the error propagates: a replica (a remote one whose reply was lost)
        may have queued it, and a request the router does not hold must not run. Another
        id it returns, a str, is aborted there too (it may have queued the request under
        that one) unless ours(it) (the id of a request, or running sample, the router runs
        there): a wrong answer must not end a request the router still counts."""
        replica = self._replicas[index]
        try:
            queued = self.user_code.call(
                replica.add_request,
                prompt,
                sampling_params,
                request_id=request_id,
                cache_salt=cache_salt,
            )
        except BaseException as error:
            _abort_after(index, replica, request_id, error)
            raise
        if not (isinstance(queued, str) and queued == request_id):
            named = isinstance(queued, str)  # an id it may have queued it under
            theirs = named and not ours(queued)
            left = f"; {queued!r}, the router's own, left running" if named and not theirs else ""
            error = ValueError(
                f"{replica_name(index, replica)}.add_request(request_id={request_id!r}) "
                f"returned {shown(queued)}; expected that id ("
                f"{'both' if theirs else repr(request_id)} aborted there, nothing queued{left})"
            )
            for aborted in (request_id, queued) if theirs else (request_id,):
                _abort_after(index, replica, aborted, error)
            raise error
        self._running[index].update(map(sequence_key, repeat(request_id), range(n)))

    def abort(self, index: int, request_id: str) -> bool:
        """replicas[index].abort(request_id), an answer other than a bool read by its truth
        with a logged warning naming it: the replica has acted on it already. One with no
        truth value (bool() raises: an array of two or more) is read as False, its error
        in the warning: it used to propagate, unnamed, with the router's bookkeeping of an
        abort the replica had made left undone."""
        replica = self._replicas[index]
        answer = replica.abort(request_id)
        if isinstance(answer, (bool, np.bool_)):
            return bool(answer)
        try:
            read, why = bool(answer), ""
        except Exception as error:  # noqa: BLE001 - the replica acted: its answer is only read
            read, why = False, f" (it has no truth value: {error!r})"
        logger.warning(
            "%s.abort(%r) returned %s, not a bool; read as %s%s",
            replica_name(index, replica),
            request_id,
            shown(answer),
            read,
            why,
        )
        return read

    def end(self, index: int, request_id: str, indices: Iterable[int]) -> None:
        """The request's sequences of those sample indices no longer run on replicas[index]."""
        self._running[index].difference_update(map(sequence_key, repeat(request_id), indices))

    def ended_in(self, outputs: list[RequestOutput], replica_of: dict[str, int]) -> None:
        """The sequences `outputs` (kept for a later step()) end are over now: their
        replicas reporting them again is refused before the outputs are delivered."""
        for o in outputs:
            index = replica_of.get(o.request_id)
            if index is None or (o.finish_reason is None and not o.finished):
                continue
            running = self._running[index]
            running.discard(sequence_key(o.request_id, o.index))
            if o.finished:  # every sample of its request
                running.difference_update([k for k in running if request_of(k) == o.request_id])

    def step(self, outputs: list[RequestOutput], index: int) -> None:
        """Steps replicas[index] and appends what it returned to `outputs`: a list (or
        tuple) of RequestOutput, each of a sequence the replica runs (its index an int,
        no bool), none twice or after the output that finished its request, each
        finished one with a finish_reason, and a finish_reason without finished only on
        a sample's (`is_parent` of its request). Outputs of requests not `held` (added
        to the replica directly, or released) are dropped: they reach no caller and
        change nothing. Otherwise appends the outputs that pass, and raises ValueError
        naming the first that does not."""
        replica = self._replicas[index]
        result = self.user_code.call(replica.step)
        if type(result) is list and outputs_fit(result, self._running[index], self._is_parent):
            outputs.extend(result)
            return
        name = f"{replica_name(index, replica)}.step()"
        if not isinstance(result, (list, tuple)):
            raise ValueError(f"{name} returned {shown(result)}; expected a list")
        ours = [o for o in result if not self._unheld(o)]
        if len(ours) < len(result) and outputs_fit(ours, self._running[index], self._is_parent):
            outputs.extend(ours)
            return
        kept, first = passing_outputs(ours, self._running[index], self._is_parent)
        outputs.extend(kept)
        if first is not None:
            raise ValueError(
                f"{name} returned {first} ({len(result) - len(kept)} of its {len(result)} "
                "outputs dropped, the rest kept for the router's next step())"
            )

    def _unheld(self, o: object) -> bool:
        """Whether `o` is an output of a request the router does not hold."""
        return (
            isinstance(o, RequestOutput)
            and isinstance(o.request_id, str)
            and o.request_id not in self._held
        )


def _checked_bool(index: int, replica: Replica, method: str, answer: object) -> bool:
    """`answer`, what replica.method() returned, if a bool (numpy's is one); else
    ValueError naming them."""
    if isinstance(answer, (bool, np.bool_)):
        return bool(answer)
    raise ValueError(
        f"{replica_name(index, replica)}.{method}() returned {shown(answer)}; expected a bool"
    )


def _abort_after(index: int, replica: Replica, request_id: str, error: BaseException) -> None:
    try:
        replica.abort(request_id)
    except Exception as abort_error:  # noqa: BLE001 - the replica's own error is the one to raise
        error.add_note(
            f"aborting {request_id!r} on {replica_name(index, replica)} then raised "
            f"{abort_error!r}: it may still run there"
        )
