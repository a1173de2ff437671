"""A router over Engines, one of them closed directly (engine.close()): the router goes on
serving on the others, generate and reset_prefix_cache included, as vLLM's data-parallel
coordinator stops routing to a dead engine."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams
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
