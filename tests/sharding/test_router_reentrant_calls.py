"""A call back into the PrefixAwareRouter from inside one of its calls (a replica's
add_request or step calling a tokenizer, a proxy's callback) is refused with
RuntimeError, and the call goes on as if it had not been made: a nested add_request
took the same default id as the one in progress, so one id ran twice and its replica
stayed counted for a request that did not exist."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter
from tests.sharding._router_util import BLOCK, FakeReplica

CALLS = {
    "add_request": lambda router: router.add_request([9] * BLOCK),
    "step": lambda router: router.step(),
    "abort": lambda router: router.abort("dp-0"),
    "generate": lambda router: router.generate([[9] * BLOCK], progress=False),
    "drain_transfers": lambda router: router.drain_transfers(),
    "reset_prefix_cache": lambda router: router.reset_prefix_cache(),
    "close": lambda router: router.close(),
}


class CallingBackReplica(FakeReplica):
    """Makes `call` on `router` from its add_request and step once armed (as a tokenizer
    it calls would); records what the call raised."""

    def __init__(self, index: int, call) -> None:
        super().__init__(index)
        self.call, self.router, self.errors = call, None, []

    def _call_back(self) -> None:
        router, self.router = self.router, None  # not from inside its own call back
        if router is not None:
            try:
                self.call(router)
            except Exception as e:  # noqa: BLE001 - which one is the point
                self.errors.append(e)
            finally:
                self.router = router

    def add_request(self, prompt_token_ids, sampling_params=None, *, request_id, cache_salt=None):
        self._call_back()
        return super().add_request(prompt_token_ids, sampling_params, request_id=request_id)

    def step(self):
        self._call_back()
        return super().step()

    def reset_prefix_cache(self) -> bool:
        return not self.running


def _run(call) -> tuple[list, list[CallingBackReplica]]:
    replicas = [CallingBackReplica(i, call) for i in range(2)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    for r in replicas:
        r.router = router
    ids = [router.add_request([i] * BLOCK, SamplingParams(max_tokens=3)) for i in (1, 2, 3)]
    outputs = []
    while router.has_unfinished_requests():
        outputs.append([(o.request_id, o.new_token_ids, o.finished) for o in router.step()])
    for r in replicas:
        r.router = None
    assert ids == ["dp-0", "dp-1", "dp-2"] and not router.closed
    assert router.num_outstanding == (0, 0) and not any(r.running for r in replicas)
    assert router.add_request([4] * BLOCK) == "dp-3"
    return outputs, replicas


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_back_into_the_router_from_a_replica_is_refused(name):
    expected, _ = _run(lambda router: None)
    outputs, replicas = _run(CALLS[name])
    assert outputs == expected
    errors = [e for r in replicas for e in r.errors]
    assert errors and all(type(e) is RuntimeError for e in errors)
    inside = {"inside PrefixAwareRouter.add_request()", "inside PrefixAwareRouter.step()"}
    assert {next(s for s in inside if s in str(e)) for e in errors} == inside
