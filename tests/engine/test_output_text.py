"""A finished request's text (RequestOutput.text, CompletionOutput.text) against an
oracle over the dense model's bytes.

The tiny model's tokens are bytes, decoded by jaxkv.models.ByteTokenizer. The prompts are
ASCII, so the output's text is its own bytes decoded as UTF-8 (with replacement), which
is what the oracle takes: a stop string (ASCII) cuts the bytes where it starts, a stop
token leaves its byte out, unless include_stop_str_in_output.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.engine import Engine
from jaxkv.models import ByteTokenizer
from jaxkv.output_text import output_text
from jaxkv.request import Request, RequestStatus
from jaxkv.router import PrefixAwareRouter
from jaxkv.stop_strings import StopStrings
from tests.engine._util import (
    BLOCK_SIZE,
    assert_all_blocks_free,
    dense_greedy,
    engine_config,
    tiny_model,
)

MAX_TOKENS = 24
TOKENIZER = ByteTokenizer()


def _text(data) -> str:
    return bytes(data).decode("utf-8", errors="replace")


def _engine(tokenizer=TOKENIZER) -> Engine:
    return Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)


def _cases():
    """(prompt, greedy tokens, params, expected text): ASCII prompts, each run to length,
    to its first ASCII pair as a stop string and to its fourth token as a stop token, each
    with and without include_stop_str_in_output."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(ord("a"), ord("z") + 1, int(n)).tolist() for n in (3, 9, 14, 20)]
    cases = []
    for prompt, tokens in zip(prompts, dense_greedy(prompts, MAX_TOKENS), strict=True):
        cases.append((prompt, tokens, SamplingParams(max_tokens=MAX_TOKENS), _text(tokens)))
        pairs = [i for i in range(len(tokens) - 1) if all(32 <= t < 127 for t in tokens[i : i + 2])]
        if pairs and tokens.index(tokens[pairs[0]]) == pairs[0]:
            at = pairs[0]
            stop = _text(tokens[at : at + 2])
            if _text(tokens).find(stop) == len(_text(tokens[:at])):  # first in the text too
                for include in (False, True):
                    params = SamplingParams(
                        max_tokens=MAX_TOKENS, stop=stop, include_stop_str_in_output=include
                    )
                    cases.append((prompt, tokens, params, _text(tokens[: at + 2 * include])))
        first = tokens.index(tokens[3])
        for include in (False, True):
            params = SamplingParams(
                max_tokens=MAX_TOKENS,
                stop_token_ids=[tokens[3]],
                include_stop_str_in_output=include,
            )
            cases.append((prompt, tokens, params, _text(tokens[: first + include])))
    assert sum(bool(p.stop) for _, _, p, _ in cases) >= 4, "too few ASCII pairs: pick a new seed"
    return cases


def test_generate_returns_each_requests_text_as_the_oracle_decodes_it():
    cases = _cases()
    engine = _engine()
    outs = engine.generate([c[0] for c in cases], [c[2] for c in cases], progress=False)
    for (_, _, params, expected), out in zip(cases, outs, strict=True):
        assert out.text == expected, (params, out)
    assert_all_blocks_free(engine)


def test_only_the_finishing_step_output_carries_text():
    (prompt, tokens, params, expected), *_ = _cases()
    engine = _engine()
    rid = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    assert [o.text for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    assert outputs[-1].finished and outputs[-1].text == expected


def test_samples_and_the_router_carry_each_samples_text():
    prompt, tokens, *_ = _cases()[0]
    params = SamplingParams(max_tokens=8, n=2, stop_token_ids=[tokens[5]])
    router = PrefixAwareRouter([_engine(), _engine()], block_size=BLOCK_SIZE)
    outs = router.generate([prompt], params, progress=False)
    assert [o.text for o in outs] == [_text(tokens[: min(8, tokens.index(tokens[5]))])] * 2


def test_an_engine_without_a_tokenizer_gives_no_text():
    engine = Engine(tiny_model(), None, engine_config())
    assert (
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), progress=False)[0].text is None
    )


class _Words:
    """Word ids; a word after another gets a leading space, as sentencepiece writes it."""

    words = ["<s>", "the", "cat", "saysXYmeow", "sat"]

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


@pytest.mark.parametrize(("include", "expected"), [(False, " cat says"), (True, " cat saysXY")])
def test_text_has_the_first_words_space_and_ends_at_a_stop_string_inside_a_token(include, expected):
    request = Request("r", [0, 1], SamplingParams(stop="XY", include_stop_str_in_output=include))
    stops = StopStrings(_Words())
    found = []
    for token in (2, 3):
        request.append_output_token_ids(token)
        found.append(stops.matched(request))
    assert found == [None, "XY"]
    request.status = RequestStatus.FINISHED_STOPPED
    # Decoded after the prompt, as vLLM does: " cat", not "cat"; "meow" is dropped.
    assert output_text(stops.decode, request, "XY") == expected


def test_text_without_stop_strings_decodes_after_the_prompt():
    request = Request("r", [0, 1], SamplingParams())
    request.append_output_token_ids([2, 4])
    request.status = RequestStatus.FINISHED_LENGTH
    assert output_text(_Words().decode, request, None) == " cat sat"


def test_a_tokenizer_that_fails_at_the_end_warns_and_the_request_still_finishes():
    class FailsOnLongText(ByteTokenizer):
        def decode(self, ids):
            if len(ids) > 6:
                raise RuntimeError("decoder broke")
            return super().decode(ids)

    engine = _engine(FailsOnLongText())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.generate([[97, 98]], SamplingParams(max_tokens=8), progress=False)[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 8
    assert out.text is None
    assert any("RequestOutput.text is None" in str(w.message) for w in caught)
    assert_all_blocks_free(engine)


def test_include_stop_str_in_output_must_be_a_bool():
    with pytest.raises(ValueError, match="include_stop_str_in_output='no' must be a bool"):
        SamplingParams(include_stop_str_in_output="no")
