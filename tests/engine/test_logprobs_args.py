"""SamplingParams.logprobs and EngineConfig.max_logprobs are checked, naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.config import EngineConfig
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
        assert not engine.has_unfinished_requests()
    rid = engine.add_request([1, 2, 3], SamplingParams(logprobs=20))  # at the limit
    assert engine.has_unfinished_requests() and engine.abort(rid)
