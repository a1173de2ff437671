"""Random serving runs through a PrefixAwareRouter over two engines, against the dense model.

The runs of tests.engine._random_runs (arrivals over steps, shared prefixes, cache
salts, aborts in any state, preemption, late KV copies, in some runs failing ones), each
engine with a connector of its own, and the router's prefix table bounded from 1 route
up. Every request must generate exactly the dense model's greedy tokens (an aborted one,
a leading part of them) whichever replica served it; afterwards both engines hold no
block and the router counts no request.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.router import PrefixAwareRouter
from tests.engine._random_runs import assert_dense_tokens, draw_run, make_engines, serve
from tests.engine._util import BLOCK_SIZE, assert_all_blocks_free

SEEDS = (7002, 7024, 7029, 7037)  # between them: aborts, preemption, 1 to 1000 routes


def _router(seed: int, engines) -> PrefixAwareRouter:
    rng = np.random.default_rng([seed, 1])
    return PrefixAwareRouter(
        engines,
        block_size=BLOCK_SIZE,
        max_prefix_blocks=int(rng.integers(1, 9)),
        max_imbalance=None if rng.random() < 0.5 else int(rng.integers(0, 4)),
        max_tracked_prefixes=int(rng.choice([1, 4, 1000])),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_run_through_the_router_generates_the_dense_models_tokens(seed):
    run = draw_run(seed)
    engines = make_engines(run, count=2)
    router = _router(seed, engines)
    served = serve(run, engines, router)
    assert_dense_tokens(run, served)
    for engine in engines:
        assert_all_blocks_free(engine)
    assert router.num_outstanding == (0, 0)
    assert all(e.metrics.num_steps > 0 for e in engines), "one replica served everything"
    router.close()
