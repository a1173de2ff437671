"""An Engine's request intake: queueing a request (add_request) and cancelling by id
(abort).

Engine.add_request and Engine.abort's bodies (their docstrings state the guarantees):
they read and change the engine's scheduler, sampling rows, samples and request serials,
so the engine is their only caller. A refused argument raises ValueError with nothing
queued or cancelled; the changes themselves run with a Ctrl-C held
(jaxkv.held_interrupts), so a request is queued whole or not at all, and each one
cancelled leaves no sampling row or sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jaxkv.hashing import check_hash_key
from jaxkv.held_interrupts import holding_interrupts
from jaxkv.parallel_sampling import IdsInUse
from jaxkv.prompt_checks import checked_prompt_ids
from jaxkv.request import Request
from jaxkv.request_id_lists import checked_request_ids
from jaxkv.sampling_checks import checked_sampling_params
from jaxkv.sampling_params import SamplingParams

__all__ = ["abort_requests", "queue_request"]


def queue_request(
    engine: Any,
    prompt_token_ids: Sequence[int] | np.ndarray,
    sampling_params: SamplingParams | None,
    request_id: str | None,
    cache_salt: str | None,
) -> str:
    """Engine.add_request (see there) on an open engine: queues the request, or its n
    samples, and returns its id; ValueError with nothing queued and no id or seed taken.
    A request's seed mixes the engine's config.seed with its serial (jaxkv.request_serials)."""
    prompt = checked_prompt_ids(prompt_token_ids, limit=engine.vocab_size)
    sampling_params = checked_sampling_params(sampling_params, engine.model_config, engine.config)
    check_hash_key("cache_salt", cache_salt)  # before a default id exists to name
    in_use = IdsInUse(engine.scheduler.requests, engine._samples, n=sampling_params.n)
    serial, request_id = engine._serials.peek(request_id, in_use)  # a default id: all free
    request = Request(request_id, prompt, sampling_params, cache_salt=cache_salt)
    seed = (engine.config.seed * 0x9E3779B97F4A7C15 + serial) & 0xFFFFFFFFFFFFFFFF
    with holding_interrupts():  # ValueError (id in use, prompt too long): none queued
        engine._samples.queue(engine.scheduler, engine._sampling, request, seed)
        engine._serials.take(serial)  # only once queued (jaxkv.request_serials)
    return request.request_id


def abort_requests(engine: Any, request_ids: str | Iterable[str]) -> bool:
    """Engine.abort (see there): cancels each id's unfinished requests (each sample's under
    n > 1); True if one was. ValueError, cancelling none, unless each id is a str
    encodable as UTF-8."""
    aborted = False
    with holding_interrupts():  # cut, it kept rows and samples of requests it ended
        for request_id in checked_request_ids(request_ids):
            for rid in engine._samples.ids_to_abort(request_id):
                aborted = engine._samples.abort(engine.scheduler, engine._sampling, rid) or aborted
    return aborted
