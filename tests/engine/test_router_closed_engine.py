"""A router over Engines, one of them closed directly (engine.close()): the router goes on
serving on the others, generate and reset_prefix_cache included, as vLLM's data-parallel
coordinator stops routing to a dead engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import BLOCK_SIZE, VOCAB, dense_greedy, make_engine


def test_a_router_serves_on_the_engines_left_open():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, 9).tolist() for _ in range(3)]
    engines = [make_engine(), make_engine()]
    router = PrefixAwareRouter(engines, block_size=BLOCK_SIZE)
    held = router.add_request(prompts[0], SamplingParams(max_tokens=4))
    assert router.replica_of(held) == 0
    engines[0].close()  # directly: the router is not told
    outputs = router.generate(prompts, SamplingParams(max_tokens=3), progress=False)
    assert [list(o.output_token_ids) for o in outputs] == dense_greedy(prompts, 3)
    assert router.num_outstanding == (0, 0)  # held was released as ended with its engine
    with pytest.raises(KeyError):
        router.replica_of(held)
    assert router.reset_prefix_cache() is True  # every open engine's cache emptied
    engines[1].close()
    with pytest.raises(RuntimeError, match="every replica"):
        router.add_request(prompts[0])
    router.close()
    assert router.closed


def test_ids_a_closed_engine_lost_with_its_copies_are_free_on_the_others():
    # A replica closed past a KV copy that never lands (close(force=True)) still listed
    # the finished request's id in its ids_in_use, and the router refused that id for
    # good: drain_transfers, which the error pointed to, skips a closed replica.
    prompt = np.random.default_rng(4).integers(0, VOCAB, 20).tolist()
    engines = [make_engine(connector=HostOffloadConnector(1 << 24)), make_engine()]
    copier, hung = engines[0].copier, threading.Event()
    copier.start_save = lambda block_ids: copier._executor.submit(hung.wait)
    router = PrefixAwareRouter(engines, block_size=BLOCK_SIZE)
    try:
        router.add_request(prompt, SamplingParams(max_tokens=2), request_id="a")
        while router.has_unfinished_requests():
            router.step()
        assert engines[0].has_pending_transfers() and "a" in engines[0].ids_in_use
        with pytest.raises(ValueError, match="in use"):
            router.add_request(prompt, request_id="a")  # its copy is in flight
        with pytest.raises(TimeoutError):
            engines[0].close(timeout_s=0, force=True)
        assert engines[0].closed
        router.drain_transfers()
        assert router.add_request(prompt, request_id="a") == "a"
        assert router.replica_of("a") == 1
        router.close()
    finally:
        hung.set()
