"""SamplingParams.logprobs and EngineConfig.max_logprobs are checked, naming the field; the
sampler's logprob arrays on hand-made logits (ties, ranks, the width-0 variant)."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.config import EngineConfig
from jaxkv.logprobs import top_logprobs
from jaxkv.sampler import sample, seed_words
from tests.engine._util import make_engine


@pytest.mark.parametrize(
    "value, match",
    [
        (-1, "logprobs=-1 must be None or an int >= 0"),
        (1.5, "logprobs=1.5 must be None or an int >= 0"),
        (True, "logprobs=True must be None or an int >= 0"),
        ("3", "logprobs='3' must be None or an int >= 0"),
        (np.array([1, 2]), "logprobs=array"),
    ],
)
def test_bad_logprobs_are_refused_naming_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logprobs=value)


def test_logprobs_are_stored_as_python_ints():
    assert SamplingParams().logprobs is None
    for value in (0, 3, np.int64(3), np.uint8(3)):
        stored = SamplingParams(logprobs=value).logprobs
        assert stored == value and type(stored) is int
    # stopping_at keeps them (it rebuilds the params through __post_init__)
    assert SamplingParams(logprobs=2).stopping_at((5,)).logprobs == 2


@pytest.mark.parametrize(
    "value, match",
    [
        (-1, r"max_logprobs=-1 must be an int in \[0, "),
        (True, "max_logprobs=True must be an int"),
        (2.0, "max_logprobs=2.0 must be an int"),
        (2**31, "max_logprobs=2147483648 must be an int in"),
    ],
)
def test_bad_max_logprobs_are_refused_naming_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(max_logprobs=value)


def test_max_logprobs_defaults_to_vllms_and_takes_numpy_ints():
    assert EngineConfig().max_logprobs == 20
    config = EngineConfig(max_logprobs=np.int32(0))
    assert config.max_logprobs == 0 and type(config.max_logprobs) is int


def test_the_engine_refuses_more_logprobs_than_max_logprobs_queueing_nothing():
    engine = make_engine()
    for value in (21, 10**6):
        with pytest.raises(ValueError, match=rf"logprobs={value} exceeds max_logprobs=20"):
            engine.add_request([1, 2, 3], SamplingParams(logprobs=value))
        assert not engine.has_unfinished_requests() and not engine._sampling.logprobs
    # At the limit it queues; aborted, nothing of it stays.
    rid = engine.add_request([1, 2, 3], SamplingParams(logprobs=20))
    assert engine.has_unfinished_requests() and engine._sampling.logprobs == {rid: 20}
    assert engine.abort(rid)
    assert not engine.has_unfinished_requests() and not engine._sampling.logprobs


_sample = jax.jit(sample, static_argnames="num_logprobs")
_top = jax.jit(top_logprobs, static_argnums=2)


def _sampled(logits, temperature, num_logprobs):
    n = len(logits)
    return _sample(
        np.asarray(logits, np.float32), np.full(n, temperature, np.float32),
        np.zeros(n, np.int32), np.ones(n, np.float32), seed_words(np.arange(n)),
        np.zeros(n, np.uint32), np.zeros(n, np.int32), num_logprobs=num_logprobs,
    )  # fmt: skip


@functools.cache
def _logits() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(4, 32)).astype(np.float32)


def test_without_num_logprobs_sample_returns_the_tokens_alone():
    tokens = _sampled(_logits(), 0.0, None)
    assert isinstance(tokens, jax.Array) and tokens.shape == (4,)


def test_logprobs_are_the_raw_log_softmax_whatever_the_temperature():
    logits = _logits()
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1))[:, None]
    for temperature in (0.0, 0.3, 2.0):
        tokens, (ids, top, top_rank, sampled, rank) = _sampled(logits, temperature, 3)
        tokens = np.asarray(tokens)
        assert ids.shape == top.shape == top_rank.shape == (4, 3) and sampled.shape == (4,)
        np.testing.assert_array_equal(ids, np.argsort(-ref, axis=-1, kind="stable")[:, :3])
        np.testing.assert_allclose(top, np.take_along_axis(ref, np.asarray(ids), -1), atol=1e-5)
        np.testing.assert_allclose(sampled, ref[np.arange(4), tokens], atol=1e-5)
        np.testing.assert_array_equal(rank, 1 + (ref > ref[np.arange(4), tokens][:, None]).sum(-1))
        np.testing.assert_array_equal(top_rank, np.tile([1, 2, 3], (4, 1)))


def test_ties_put_the_lowest_id_first_and_share_a_rank():
    logits = np.array([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]], np.float32)
    ids, top, top_rank, sampled, rank = _top(logits, np.array([4], np.int32), 5)
    assert ids.tolist() == [[1, 3, 5, 2, 4]]
    assert top_rank.tolist() == [[1, 1, 1, 4, 4]]
    assert rank.tolist() == [4]  # token 4: three tokens strictly above it
    assert sampled[0] == top[0, 3] == top[0, 4]


def test_a_width_of_zero_gives_the_sampled_token_only():
    tokens, (ids, top, top_rank, sampled, rank) = _sampled(_logits(), 0.0, 0)
    assert ids.shape == top.shape == top_rank.shape == (4, 0)
    np.testing.assert_array_equal(rank, np.ones(4))  # greedy: the argmax
    assert sampled.shape == (4,)


def test_bfloat16_logits_give_float32_logprobs_of_their_float32_values():
    """top_logprobs takes log_softmax in float32 whatever the logits' dtype."""
    logits = jax.numpy.asarray(_logits(), jax.numpy.bfloat16)
    ids, top, top_rank, sampled, rank = _top(logits, np.zeros(4, np.int32), 3)
    assert top.dtype == sampled.dtype == np.float32
    exact = np.asarray(logits, np.float64)
    ref = exact - np.log(np.exp(exact).sum(-1))[:, None]
    np.testing.assert_allclose(sampled, ref[:, 0], atol=1e-5)
    np.testing.assert_allclose(top, np.take_along_axis(ref, np.asarray(ids), -1), atol=1e-5)
