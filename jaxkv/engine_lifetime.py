"""An Engine's end: close() aborts its requests, lets its KV copies land and frees what
it holds on the device (Engine.close documents it)."""

from __future__ import annotations

from typing import Any

from jaxkv.closable import checked_timeout


def close_engine(engine: Any, timeout_s: float) -> None:
    """Engine.close (see there): every request aborted, the KV copies in flight landed,
    the connector unbound, the copy thread stopped, the device memory freed."""
    if engine._closed:
        return
    engine._check_not_running()
    timeout_s = checked_timeout(timeout_s)  # before any request is aborted
    scheduler = engine.scheduler
    for request in [*scheduler.running, *scheduler.waiting]:
        engine.abort(request.request_id)
    engine.drain_transfers(timeout_s)
    engine._transfers_at_close = engine.connector.stats
    engine.connector.unbind(engine.copier)
    engine.copier.close()
    engine._closed = True
    engine._state_leaves = []  # the sharded copies of the weights are the engine's own
    caches, engine.kv_caches = engine.kv_caches, []
    for cache in caches:  # the engine made them and is their only user
        cache.delete()
