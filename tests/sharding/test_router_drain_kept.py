"""PrefixAwareRouter.drain_transfers and the outputs a failed step() kept: a request that
finishes inside drain_transfers takes them with it, so none reaches a later request of
its id, over real engines."""

from __future__ import annotations

import pytest

from jaxkv import HostOffloadConnector, PrefixAwareRouter, SamplingParams
from tests.engine._util import BLOCK_SIZE, VOCAB, make_engine


def _fail_next_step(engine) -> None:
    real = engine.step

    def step():
        engine.step = real
        raise RuntimeError("replica step failed")

    engine.step = step


def test_a_request_finished_by_drain_transfers_leaves_no_kept_output_to_a_new_one():
    # Replica 1 failed the step in which x's sample 1 stopped: x's outputs were kept. x then
    # finished inside drain_transfers, but its kept outputs stayed, and the next step()
    # gave them to a new "x": its sample 1 ended by the old one's stop, so that replica 0's
    # next output of it was refused as of a sequence it did not run.
    connector = HostOffloadConnector(1 << 24, copy_delay_steps=4)  # x's save keeps it busy
    engines = [make_engine(connector=connector), make_engine()]
    router = PrefixAwareRouter(engines, block_size=BLOCK_SIZE, max_imbalance=0)
    prompt = list(range(1, 10))
    # Seed 4: sample 1 stops at its first token, sample 0 runs to max_tokens.
    hot = dict(temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=tuple(range(0, VOCAB, 2)))
    router.add_request(prompt, SamplingParams(n=2, max_tokens=3, seed=4, **hot), request_id="x")
    router.add_request(list(range(20, 29)), SamplingParams(max_tokens=8), request_id="other")
    assert (router.replica_of("x"), router.replica_of("other")) == (0, 1)
    _fail_next_step(engines[1])
    with pytest.raises(RuntimeError, match="replica step failed"):
        router.step()
    kept = [(o.request_id, o.index, o.finish_reason) for o in router._undelivered]
    assert kept == [("x", 0, None), ("x", 1, "stop")]
    router.drain_transfers()  # steps replica 0 until x's copy lands: x finishes there
    with pytest.raises(KeyError):
        router.replica_of("x")
    assert router.num_outstanding == (0, 1)

    router.add_request(prompt, SamplingParams(n=2, max_tokens=2), request_id="x")
    outputs = []
    while router.has_unfinished_requests():
        outputs += [o for o in router.step() if o.request_id == "x"]
    assert [(o.index, o.finish_reason) for o in outputs] == [
        (0, None),
        (1, None),
        (0, "length"),
        (1, "length"),
    ]
    assert router.num_outstanding == (0, 0)
    router.close()
