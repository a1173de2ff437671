"""A PrefixAwareRouter's end, close() (see there), and its replicas' ends: which replicas
are open.

A replica closed directly (engine.close() on one of router.replicas), the router not told,
is a dead engine to it, as to vLLM's data-parallel coordinator: no new request goes there,
it is no longer stepped, asked to abort, reset or checkpointed (close still closes it), and
the router's requests on it end at the router's next step. The router reads each
replica's `closed` (Engine's property) where it needs it, so a replica that opens again
(a proxy that reconnected) is served again.
"""

from __future__ import annotations

import inspect
import reprlib
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from jaxkv.closable import TransfersPendingError, checked_timeout, raise_first, step_until_landed
from jaxkv.replica_checks import replica_name

ALL_CLOSED = (
    "every replica of the PrefixAwareRouter is closed (each replica's closed is True: "
    "engine.close() was called on it): no request can be routed; close the router"
)


def closed_replicas(replicas: Sequence[Any]) -> set[int]:
    """The indices of the replicas whose `closed` is True; one without that attribute, or
    with None, is open. ValueError naming a replica whose closed is no bool (a method)."""
    closed = set()
    for index, replica in enumerate(replicas):
        flag = getattr(replica, "closed", None)
        if flag is not None and not isinstance(flag, (bool, np.bool_)):
            raise ValueError(
                f"{replica_name(index, replica)}.closed is {reprlib.repr(flag)}; expected a "
                "bool (Engine's closed property), or no such attribute"
            )
        if flag:
            closed.add(index)
    return closed


def open_replicas(replicas: Sequence[Any], closed: set[int] | None = None) -> Sequence[int]:
    """The indices of the replicas not closed (closed_replicas, or those in `closed` if
    given), in order."""
    closed = closed_replicas(replicas) if closed is None else closed
    indices = range(len(replicas))
    return [i for i in indices if i not in closed] if closed else indices


def routable_replicas(replicas: Sequence[Any]) -> Sequence[int]:
    """open_replicas; RuntimeError saying so (ALL_CLOSED) when there is none."""
    indices = open_replicas(replicas)
    if not indices:
        raise RuntimeError(ALL_CLOSED)
    return indices


def close_router(router: Any, timeout_s: float, force: bool = False) -> None:
    """PrefixAwareRouter.close (see there): every request aborted, every replica's KV
    copies landed, then each replica closed, all within `timeout_s`; a replica that
    raises on the way keeps none of that from the others, nor the router from closing.
    `force` goes on past copies still in flight at `timeout_s` as well, each replica's
    close called with force=True."""
    if router._closed:
        return
    timeout_s = checked_timeout(timeout_s)  # before any request is aborted
    if not isinstance(force, (bool, np.bool_)):  # "no" or None read as a choice, silently
        raise ValueError(f"{force=} must be a bool")
    force = bool(force)
    closes = router._checked.methods("close")  # and a close that is no method is named
    closed = closed_replicas(router.replicas)  # and a `closed` that is no bool
    if force:  # and a close that cannot be forced
        _check_forcible(router.replicas, closes)
    router._finished_from(router._undelivered)  # dropped: their finished requests released
    router._undelivered = []
    failed: list[tuple[str, Exception]] = []  # (what raised, its error), in order
    for request_id in list(router._replica_of):
        _tried(failed, f"abort({request_id!r})", partial(router._abort_one, request_id, closed))
    deadline = time.monotonic() + timeout_s
    try:
        _land_copies(router, closed, timeout_s, failed)
    except TransfersPendingError as error:  # a step's own error is in `failed` already
        if not failed and not force:  # every replica sound: all open, for more time
            raise
        failed.append(("waiting for the KV copies", error))
    forced = {"force": True} if force else {}  # unforced, a close(timeout_s) suffices
    for index, (replica, close) in enumerate(zip(router.replicas, closes, strict=True)):
        if close is not None:  # with what is left of timeout_s
            left = max(0.0, deadline - time.monotonic())
            call = partial(close, timeout_s=left, **forced)
            _tried(failed, f"{replica_name(index, replica)}.close()", call)
    for request_id in list(router._replica_of):  # its abort raised; its replica's close was tried
        router._finish(request_id)
    router._undelivered = []
    router._closed = True
    if failed:
        raise_first(failed, "close went on: every replica's close was tried, the router closed")


def _check_forcible(replicas: Sequence[Any], closes: Sequence[Callable | None]) -> None:
    """ValueError naming the first replica whose close takes no `force` keyword (nor
    **kwargs), or whose signature cannot be read: close(force=True) could not be passed
    on, and that replica might keep its copies, and its memory, past a forced close."""
    for index, close in enumerate(closes):
        if close is None:
            continue
        try:
            parameters = inspect.signature(close).parameters.values()
        except (TypeError, ValueError):
            parameters = None
        if parameters is None or not any(
            p.kind is p.VAR_KEYWORD or (p.name == "force" and p.kind in _BY_KEYWORD)
            for p in parameters
        ):
            raise ValueError(
                f"{replica_name(index, replicas[index])}.close takes no force keyword "
                "(Engine.close's): close(force=True) cannot be passed on to it (an "
                "unforced close calls it as close(timeout_s=...))"
            )


_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _tried(failed: list[tuple[str, Exception]], what: str, call: Callable[[], object]) -> None:
    """call(); an Exception it raises is added to `failed` as `what`'s (an interrupt that
    is no Exception propagates at once)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - close raises the first once all is tried
        failed.append((what, error))


def _land_copies(router: Any, closed: set[int], timeout_s: float, failed: list) -> None:
    """Steps the open replicas with KV copies in flight until they have landed, as
    drain_transfers does (TransfersPendingError when one is still in flight past
    `timeout_s`), but a replica whose step or has_pending_transfers raises is added to
    `failed` and not asked again: one that keeps raising must not keep the others from
    closing."""
    checked, broken = router._checked, set(closed)

    def ask(index: int, what: str, call: Callable[[], object]) -> object:
        """call(), or None once replicas[index] raised (then it is not asked again)."""
        if index in broken:
            return None
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - close raises the first once all is tried
            broken.add(index)
            failed.append((f"{replica_name(index, router.replicas[index])}.{what}", error))
            return None

    def waiting() -> list[int]:
        pending = checked.pending
        return [
            i for i in router._indices if ask(i, "has_pending_transfers()", partial(pending, i))
        ]

    def step() -> bool:
        stepped = False
        for index in waiting():
            outputs: list = []
            ask(index, "step()", partial(checked.step, outputs, index))
            stepped |= bool(router._finished_from(outputs))  # those that passed its checks
        return stepped

    step_until_landed(lambda: bool(waiting()), step, timeout_s)
