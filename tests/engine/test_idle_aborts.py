"""An idle engine keeps nothing of the requests aborted while it is not stepped.

A serving loop steps an engine only while it has unfinished requests (README's
`while engine.has_unfinished_requests()`), and PrefixAwareRouter steps only its busy
replicas. A request aborted before its first step left that loop idle, and its id was
kept for the next scheduler output's finished_request_ids, which the engine never reads:
one id per request for as long as no other request came.
"""

from __future__ import annotations

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import BLOCK_SIZE, make_engine

NUM_REQUESTS = 30


def _finished_ids_held(engine) -> tuple[str, ...]:
    """The finished ids the engine's scheduler holds for its next output (taking them)."""
    return engine.scheduler.schedule().finished_request_ids


def test_an_engine_aborting_requests_before_their_first_step_keeps_none_of_them():
    engine = make_engine()
    ids = []
    for i in range(NUM_REQUESTS):
        params = SamplingParams(max_tokens=4, n=1 + i % 3)
        ids.append(engine.add_request([1 + i, 2, 3, 4, 5], params))
        assert engine.abort(ids[-1])
        while engine.has_unfinished_requests():
            engine.step()
    assert _finished_ids_held(engine) == ()
    assert not engine.scheduler.requests and not any(rid in engine.ids_in_use for rid in ids)


def test_a_router_replica_left_idle_keeps_none_of_the_requests_aborted_on_it():
    replicas = [make_engine(), make_engine()]
    router = PrefixAwareRouter(replicas, block_size=BLOCK_SIZE)
    for i in range(NUM_REQUESTS):
        router.abort(router.add_request([1 + i, 2, 3, 4, 5], SamplingParams(max_tokens=4)))
        router.step()  # no replica has a request to step
    assert [_finished_ids_held(engine) for engine in replicas] == [(), ()]
    assert router.num_outstanding == (0, 0)
