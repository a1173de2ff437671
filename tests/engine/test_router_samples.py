"""The router and the samples of requests of SamplingParams.n > 1: a running sample's id
is in use on every replica, a sample's own id aborts that sample, and each sample counts
as one outstanding sequence until it ends, however it ends."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import BLOCK_SIZE, VOCAB, assert_all_blocks_free, make_engine

HOT = dict(temperature=1.0, top_k=0, top_p=1.0)

_rng = np.random.default_rng(12)
A, B = (_rng.integers(0, VOCAB, 9).tolist() for _ in range(2))  # 2 full blocks + 1 each


@pytest.fixture(scope="module")
def engines():
    engines = [make_engine(), make_engine()]
    yield engines
    for engine in engines:
        engine.close()


def _router(engines) -> PrefixAwareRouter:
    # max_imbalance 0: a prompt without a remembered prefix goes to the emptier replica.
    return PrefixAwareRouter(engines, block_size=BLOCK_SIZE, max_imbalance=0)


def _run(router) -> dict:
    """(request id, index) -> finish_reason of everything that ends."""
    ended = {}
    while router.has_unfinished_requests():
        for o in router.step():
            if o.finish_reason is not None:
                ended[o.request_id, o.index] = o.finish_reason
    return ended


def test_a_running_samples_id_is_in_use_whichever_replica_the_prompt_routes_to(engines):
    router = _router(engines)
    router.add_request(A, SamplingParams(n=2, max_tokens=3), request_id="x")
    on = router.replica_of("x")
    for prompt in (A, B):  # B routes to the other replica: it was accepted there
        with pytest.raises(ValueError, match=r"request_id='1_x' is already in use"):
            router.add_request(prompt, SamplingParams(max_tokens=3), request_id="1_x")
    router.add_request(B, SamplingParams(max_tokens=3), request_id="0_z")
    with pytest.raises(ValueError, match=r"request_id='z' is already in use: .* 2 samples"):
        router.add_request(A, SamplingParams(n=2, max_tokens=3), request_id="z")
    assert router.num_outstanding[on] == 2 and sum(router.num_outstanding) == 3
    # Ids that only look like sample ids are free.
    for rid in ("2_x", "01_x", "1_y", "1_"):
        router.add_request(B, SamplingParams(max_tokens=1), request_id=rid)
    assert set(_run(router)) == {
        ("x", 0),
        ("x", 1),
        ("0_z", 0),
        *((r, 0) for r in ("2_x", "01_x", "1_y", "1_")),
    }
    # Once x's samples ended, their ids are free again.
    router.add_request(A, SamplingParams(max_tokens=1), request_id="1_x")
    _run(router)
    assert router.num_outstanding == (0, 0)
    for engine in engines:
        assert_all_blocks_free(engine)


def test_a_samples_own_id_aborts_that_sample_and_the_last_ends_the_request(engines):
    router = _router(engines)
    rid = router.add_request(A, SamplingParams(n=3, max_tokens=6))
    router.step()
    assert router.abort(f"1_{rid}") and not router.abort(f"1_{rid}")
    assert sum(router.num_outstanding) == 2
    assert router.abort(f"0_{rid}") and sum(router.num_outstanding) == 1
    ended = _run(router)  # sample 2 alone runs on, and its end ends the request
    assert ended == {(rid, 2): "length"} and router.num_outstanding == (0, 0)
    # Aborting every sample by its id ends the request with no output saying so.
    rid = router.add_request(A, SamplingParams(n=2, max_tokens=6))
    router.step()
    assert router.abort(f"0_{rid}") and router.abort(f"1_{rid}")
    assert not router.has_unfinished_requests() and router.num_outstanding == (0, 0)
    assert not router.abort(rid) and not router.abort(f"0_{rid}")
    assert router.add_request(A, SamplingParams(max_tokens=1), request_id=rid) == rid
    _run(router)
    for engine in engines:
        assert_all_blocks_free(engine)


@pytest.mark.parametrize("request_id", [None, "q"])
def test_params_of_another_type_are_refused_by_name_on_both_id_paths(engines, request_id):
    router = _router(engines)
    with pytest.raises(
        ValueError, match=r"sampling_params=namespace\(n='2'\) must be None or a SamplingParams"
    ):  # a TypeError before
        router.add_request(A, types.SimpleNamespace(n="2"), request_id=request_id)
    assert router.num_outstanding == (0, 0) and router.add_request(A) == "dp-0"
    assert router.abort("dp-0")


def _fails_once(engine, *, after_running: bool) -> None:
    """engine.step raises once: before running, or after (its outputs lost)."""
    real = engine.step

    def step():
        engine.step = real
        if after_running:
            real()
        raise RuntimeError("replica step failed")

    engine.step = step


def _lose_the_last_outputs(router, engines) -> None:
    """Replica 1's step fails first (replica 0's outputs are kept for the next step());
    then replica 0's step runs and fails, its outputs lost."""
    _fails_once(engines[1], after_running=False)
    with pytest.raises(RuntimeError):
        router.step()
    _fails_once(engines[0], after_running=True)
    with pytest.raises(RuntimeError):
        router.step()


def test_aborting_a_request_whose_outputs_were_lost_releases_each_sample_once(engines):
    # Seed 3: sample 0 stops at its first token (kept); sample 1's last one is lost.
    router = _router(engines)
    stop = tuple(range(VOCAB // 2))
    params = SamplingParams(n=2, max_tokens=2, seed=3, stop_token_ids=stop, **HOT)
    router.add_request(A, params, request_id="x")
    router.add_request(B, SamplingParams(max_tokens=8), request_id="other")
    _lose_the_last_outputs(router, engines)
    # Replica 0 runs nothing after its failed step: sample 1 is released then (its kept
    # token dropped with it), sample 0 on the delivery of its kept finish.
    assert [(o.index, o.finish_reason) for o in router._undelivered if o.request_id == "x"] == [
        (0, "stop")
    ]
    assert not router.abort("x")  # nothing runs, nothing more to release
    ended = _run(router)
    assert ended[("x", 0)] == "stop" and ("x", 1) not in ended
    assert router.num_outstanding == (0, 0)
    router.add_request(A, SamplingParams(max_tokens=1), request_id="x")
    assert _run(router) == {("x", 0): "length"}


def test_a_request_released_by_abort_leaves_no_kept_output_to_a_later_one(engines):
    router = _router(engines)
    router.add_request(A, SamplingParams(max_tokens=2), request_id="x")
    router.add_request(B, SamplingParams(max_tokens=8), request_id="other")
    _lose_the_last_outputs(router, engines)  # x's first token kept, its finish lost
    assert router.num_outstanding[0] == 0  # released: replica 0 runs nothing
    assert not router.abort("x") and router.num_outstanding[0] == 0
    router.add_request(A, SamplingParams(max_tokens=1, n=2), request_id="x")
    outputs = []
    while router.has_unfinished_requests():
        outputs += [o for o in router.step() if o.request_id == "x"]
    assert sorted((o.index, len(o.new_token_ids), o.finish_reason) for o in outputs) == [
        (0, 1, "length"),
        (1, 1, "length"),
    ]
    assert router.num_outstanding == (0, 0)
