"""An Engine's end: close(), and the state in which close is all it can still do.

The step program (and a KV load's scatter) donates the KV caches. When it fails after
donating them (a device failure), the engine holds only deleted caches: every KV block,
the prefix cache's included, is gone. Such an engine must be rebuilt. add_request,
generate and reset_prefix_cache then raise RuntimeError saying so, not jax's error about
a deleted or donated buffer, and so do step and drain_transfers while it holds a request;
abort, the reads (has_unfinished_requests, metrics, ...) and close still work. With no
request left (aborted), a step only lands the KV copies begun before the loss: close,
and a router's close, frees everything as on a sound engine.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxkv.closable import checked_timeout

LOST = (
    "the Engine's KV caches were lost: a step program or KV load that was given them "
    "failed (a device failure?) after they were donated to it. Build a new Engine; this "
    "one can only be closed (close() frees the rest) and its requests aborted"
)


def caches_lost(kv_caches: list[jax.Array]) -> bool:
    """Whether the engine's caches are deleted (all go together: donated to one call)."""
    return bool(kv_caches) and kv_caches[0].is_deleted()


def close_engine(engine: Any, timeout_s: float) -> None:
    """Engine.close (see there): every request aborted, the KV copies in flight landed,
    the connector unbound, the copy thread stopped, the device memory freed."""
    if engine._closed:
        return
    engine._check_not_running()
    timeout_s = checked_timeout(timeout_s)  # before any request is aborted
    scheduler = engine.scheduler
    scheduler.discard_unapplied()  # a batch an interrupt kept from its step
    for request in [*scheduler.running, *scheduler.waiting]:
        engine.abort(request.request_id)
    engine.drain_transfers(timeout_s)  # with no request left, lost caches or not
    engine._transfers_at_close = engine.connector.stats
    engine.connector.unbind(engine.copier)
    engine.copier.close()
    engine._closed = True
    engine._state_leaves = []  # the sharded copies of the weights are the engine's own
    caches, engine.kv_caches = engine.kv_caches, []
    for cache in caches:  # the engine made them and is their only user (deleting twice is fine)
        cache.delete()
