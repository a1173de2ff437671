"""The engine under JAX's stricter global settings: the same greedy tokens as the dense model.

Projects often switch these on for their own code: implicit rank promotion raising
(the model's RMSNorm weight, its RoPE frequencies and the sampler's top-p mask used to
rely on it), strict dtype promotion, and 64-bit types. Each test serves greedy requests
and sampled ones (top-k and top-p, two samples each, logprobs, stop tokens banned by
min_tokens) under the setting, so the model, the attention dispatch, cascade and the
sampler all run under it.

A serving loop under jax.transfer_guard("disallow") catches its own implicit transfers;
the engine's step and its KV copies transfer on purpose, and used to be stopped by it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.deliberate_transfers import allowing_transfers
from tests.engine._random_runs import assert_dense_tokens, draw_run, make_engines, serve
from tests.engine._util import (
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    make_engine,
    prompts_for,
)

SETTINGS = {
    "rank_promotion_raise": lambda: jax.numpy_rank_promotion("raise"),
    "strict_dtype_promotion": lambda: jax.numpy_dtype_promotion("strict"),
    "x64": lambda: jax.enable_x64(True),
}
_EACH = tuple(SETTINGS.values())
SETTINGS["all three"] = lambda: _stacked(*(setting() for setting in _EACH))


@contextlib.contextmanager
def _stacked(*contexts):
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_the_engine_serves_exact_greedy_tokens_under_the_setting(setting):
    prompts = prompts_for("two_groups")
    with SETTINGS[setting]():
        engine = make_engine()
        greedy = engine.generate(prompts, SamplingParams(max_tokens=4), progress=False)
        hot = SamplingParams(
            max_tokens=4, temperature=0.8, top_k=20, top_p=0.9, seed=1, n=2, logprobs=2,
            stop_token_ids=tuple(range(VOCAB // 2)), min_tokens=4,
        )  # fmt: skip
        sampled = engine.generate(prompts[:2], hot, progress=False)
        expected = dense_greedy(prompts, 4)
    assert [list(o.output_token_ids) for o in greedy] == expected
    assert [o.index for o in sampled] == [0, 1, 0, 1]
    for o in sampled:  # min_tokens kept out the half of the vocabulary that stops them
        assert len(o.output_token_ids) == 4 and min(o.output_token_ids) >= VOCAB // 2
        assert len(o.logprobs) == 4 and o.cumulative_logprob < 0
    assert engine.metrics.cascade_steps > 0
    assert_all_blocks_free(engine)


def test_a_serving_loop_under_transfer_guard_disallow_serves_offloads_and_reloads():
    run = draw_run(5008)  # a tight cache and a connector: it offloads and reloads KV,
    # some of its copies failing (one load's start raising, which serve steps past)
    engines = make_engines(run)  # built outside: creating the caches transfers
    with jax.transfer_guard("disallow"):
        served = serve(run, engines)
    assert_dense_tokens(run, served)
    (engine,) = engines
    assert engine.metrics.bytes_offloaded > 0 and engine.metrics.bytes_reloaded > 0
    assert_all_blocks_free(engine)


GUARDS = {
    "all": jax.transfer_guard,
    "host_to_device": jax.transfer_guard_host_to_device,
    "device_to_host": jax.transfer_guard_device_to_host,
    "device_to_device": jax.transfer_guard_device_to_device,
}


@pytest.mark.parametrize("guard", sorted(GUARDS))
@pytest.mark.parametrize("level", ["disallow", "log", "disallow_explicit", "log_explicit"])
def test_deliberate_transfers_allow_themselves_under_any_guard(guard, level):
    with GUARDS[guard](level):
        assert not isinstance(allowing_transfers(), contextlib.nullcontext)
        with allowing_transfers():  # an implicit transfer each way
            assert np.asarray(jnp.add(np.arange(3), 1)).tolist() == [1, 2, 3]


def test_deliberate_transfers_skip_the_guard_when_none_is_set():
    # Entering and leaving jax.transfer_guard costs about 10 us a step, far more after an
    # idle wait for the device: it is entered only when the caller set a guard.
    assert isinstance(allowing_transfers(), contextlib.nullcontext)
    with jax.transfer_guard("allow"):
        assert isinstance(allowing_transfers(), contextlib.nullcontext)
