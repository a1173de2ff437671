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
import numpy as np

from jaxkv.closable import TransfersPendingError, checked_timeout, raise_first
from jaxkv.held_interrupts import holding_interrupts

LOST = (
    "the Engine's KV caches were lost: a step program or KV load that was given them "
    "failed (a device failure?) after they were donated to it. Build a new Engine; this "
    "one can only be closed (close() frees the rest) and its requests aborted"
)


def caches_lost(kv_caches: list[jax.Array]) -> bool:
    """Whether the engine's caches are deleted (all go together: donated to one call)."""
    return bool(kv_caches) and kv_caches[0].is_deleted()


def close_engine(engine: Any, timeout_s: float, force: bool) -> None:
    """Engine.close (see there): every request aborted, the KV copies in flight landed,
    the copy thread stopped, the connector unbound, the device memory freed. Only a
    timeout with sound copies, unforced, or an interrupt leaves the engine open: any
    other failure on the way would fail a second close the same way (a connector's poll
    that raises at every step), so close goes on past it and raises it at the end."""
    if engine._closed:
        return
    engine._check_not_running()
    timeout_s = checked_timeout(timeout_s)  # before any request is aborted
    if not isinstance(force, (bool, np.bool_)):  # "no" or None read as a choice, silently
        raise ValueError(f"{force=} must be a bool")
    scheduler = engine.scheduler
    scheduler.discard_unapplied()  # a batch an interrupt kept from its step
    for request in [*scheduler.running, *scheduler.waiting]:
        engine.abort(request.request_id)
    failed: list[tuple[str, Exception]] = []  # (what raised, its error), in order
    try:
        engine.drain_transfers(timeout_s)  # with no request left, lost caches or not
    except TransfersPendingError as error:  # not a step's own TimeoutError: one that failed
        if not force:  # the copies may land given more time: open, for another close
            raise
        failed.append(("waiting for the KV copies", error))
    except Exception as error:  # noqa: BLE001 - raised below, once the engine is closed
        failed.append(("a step landing the KV copies", error))
    _free(engine, failed)
    if failed:
        raise_first(
            failed,
            "close went on: the engine is closed, its copy thread told to stop and its KV "
            "caches freed; the blocks of KV copies that had not landed are lost with it",
        )


def _free(engine: Any, failed: list[tuple[str, Exception]]) -> None:
    """The end of close, past copies still in flight (lost) and failing connector calls
    (added to `failed`), done whole: a Ctrl-C is raised once the engine is closed (cut
    halfway, it left the connector forgetting copies the scheduler still waited for)."""
    in_flight = engine.scheduler.has_pending_transfers()
    connector, copier = engine.connector, engine.copier
    with holding_interrupts():
        try:
            engine._transfers_at_close = connector.stats
        except Exception as error:  # noqa: BLE001 - raised by close once it is done
            failed.append(("connector.stats", error))
        copier.close(wait=not in_flight)  # a copy that never returns must not hold close
        try:
            connector.unbind(copier)  # closed: it forgets the copies in flight, if any
        except Exception as error:  # noqa: BLE001 - raised by close once it is done
            failed.append(("connector.unbind(copier)", error))
        try:  # the copies lost: their requests go, blocks and ids with them
            if in_flight:
                engine.scheduler.forget_transfers()
        except Exception as error:  # noqa: BLE001 - raised by close once it is done
            failed.append(("releasing the requests of the copies lost", error))
        engine._closed = True
        engine._state_leaves = []  # the sharded copies of the weights are the engine's own
        caches, engine.kv_caches = engine.kv_caches, []
        for cache in caches:  # the engine made them and is their only user (twice is fine)
            cache.delete()
