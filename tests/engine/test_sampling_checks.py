"""An engine refuses stop tokens from vocab_size up (and takes vocab_size - 1), and runs a
request given no SamplingParams with SamplingParams()'s defaults."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
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
