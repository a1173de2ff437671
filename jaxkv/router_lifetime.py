"""A PrefixAwareRouter's end: close() (see there), apart from the router's requests."""

from __future__ import annotations

import time
from typing import Any

from jaxkv.closable import checked_timeout


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
