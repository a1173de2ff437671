"""A PrefixAwareRouter's end, close() (see there), and its replicas' ends: which replicas
are open.

A replica closed directly (engine.close() on one of router.replicas), the router not told,
is a dead engine to it, as to vLLM's data-parallel coordinator: no new request goes there,
none of its methods but close is called again, and the router's requests on it end at the
router's next step. The router reads each replica's `closed` (Engine's property) where it
needs it, so a replica that opens again (a proxy that reconnected) is served again.
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxkv.closable import checked_timeout
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


def close_router(router: Any, timeout_s: float) -> None:
    """PrefixAwareRouter.close (see there): every request aborted, every replica's KV
    copies landed, then each replica closed, all within `timeout_s`."""
    if router._closed:
        return
    router._check_not_running()
    timeout_s = checked_timeout(timeout_s)  # before any request is aborted
    closes = router._checked.methods("close")  # and a close that is no method is named
    router._finished_from(router._undelivered)  # dropped: their finished requests released
    router._undelivered = []
    router.abort(list(router._replica_of))  # each is tried, then the first error raised
    deadline = time.monotonic() + timeout_s
    router.drain_transfers(timeout_s)  # first: a timeout leaves every replica open
    router._checked.close_each(closes, deadline)  # each tried, then the first error raised
    router._closed = True
