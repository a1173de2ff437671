"""An engine refuses stop tokens from vocab_size up (and takes vocab_size - 1), and runs a
request given no SamplingParams with SamplingParams()'s defaults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxkv import EngineConfig, SamplingParams
from jaxkv.sampling_checks import checked_sampling_params
from tests.engine._util import VOCAB, make_engine


def test_stop_token_ids_must_lie_below_vocab_size_exactly():
    engine = make_engine()
    with pytest.raises(ValueError, match=rf"stop_token_ids \[{VOCAB}\] must be < vocab_size"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(VOCAB,)))
    assert not engine.has_unfinished_requests()
    engine.add_request([1, 2], SamplingParams(stop_token_ids=(VOCAB - 1,)))
    assert engine.has_unfinished_requests()


def test_a_request_without_sampling_params_runs_with_the_defaults():
    engine = make_engine()
    [out] = engine.generate([[1, 2, 3]], progress=False)
    [want] = engine.generate([[1, 2, 3]], SamplingParams(), progress=False)
    assert len(out.output_token_ids) == SamplingParams().max_tokens == 16
    assert out.output_token_ids == want.output_token_ids


def test_checked_params_default_and_stop_at_the_models_eos_ids():
    model, config = SimpleNamespace(vocab_size=8, eos_token_ids=(7,)), EngineConfig()
    assert checked_sampling_params(None, model, config).stop_token_ids == (7,)
    params = SamplingParams(stop_token_ids=(2,))
    assert checked_sampling_params(params, model, config).stop_token_ids == (2, 7)
    with pytest.raises(ValueError, match="must be None or a SamplingParams"):
        checked_sampling_params({"max_tokens": 4}, model, config)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_up_to_max_logprobs_are_taken_and_one_more_refused(name):
    model, config = SimpleNamespace(vocab_size=8, eos_token_ids=()), EngineConfig(max_logprobs=3)
    checked = checked_sampling_params(SamplingParams(**{name: 3}), model, config)
    assert getattr(checked, name) == 3
    with pytest.raises(ValueError, match=f"SamplingParams.{name}=4 exceeds max_logprobs=3"):
        checked_sampling_params(SamplingParams(**{name: 4}), model, config)
