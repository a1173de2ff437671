"""Logprob.decoded_token: as vLLM's, each sample and prompt logprob entry carries its
token decoded alone (tokenizer.decode([id]) with the decode's defaults), None without a
tokenizer; the values and ranks are those of an engine without one."""

from __future__ import annotations

import logging
import pickle
import threading

import numpy as np

from jaxkv import SamplingParams
from jaxkv.engine import Engine
from jaxkv.logprobs import Logprob
from jaxkv.models import ByteTokenizer
from jaxkv.token_texts import TokenTexts
from tests.engine._util import engine_config, prompts_for, tiny_model

PARAMS = SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=4, prompt_logprobs=3)


class _Words:
    """A Hugging Face-like decode: id i is " w{i}", and id 7 is the special "<|end|>",
    kept unless skip_special_tokens (its default False). Counts the ids it decodes."""

    def __init__(self) -> None:
        self.decoded: list[int] = []

    def decode(self, ids, skip_special_tokens=False) -> str:
        self.decoded += ids
        return "".join(
            "<|end|>" if i == 7 else f" w{i}" for i in ids if not (skip_special_tokens and i == 7)
        )


def _entries(engine: Engine, prompts) -> list[dict]:
    """Every logprob dict of the prompts' completions, sample and prompt ones."""
    entries = []
    for completion in engine.generate(prompts, PARAMS):
        entries += completion.logprobs
        entries += [e for e in completion.prompt_logprobs if e is not None]
    return entries


def test_each_entry_carries_its_token_decoded_alone():
    prompts = [[*b"caf\xc3\xa9 ", *p[:6]] for p in prompts_for("shared", seed=2)[:3]]
    tokenizer = ByteTokenizer()
    with Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer) as engine:
        with_text = _entries(engine, prompts)
    with Engine(tiny_model(), None, engine_config()) as engine:
        without = _entries(engine, prompts)
    assert len(with_text) == len(without) > 0
    for entry, plain in zip(with_text, without, strict=True):
        assert list(entry) == list(plain)
        for token, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([token])
            assert lp == Logprob(plain[token].logprob, plain[token].rank, lp.decoded_token)
            assert plain[token].decoded_token is None
    assert any(lp.decoded_token == "\ufffd" for e in with_text for lp in e.values())


def test_decoded_tokens_keep_special_tokens_the_text_leaves_out():
    words = _Words()
    params = SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1)
    with Engine(tiny_model(), None, engine_config(), tokenizer=words) as engine:
        (completion,) = engine.generate([[5, 7, 9]], params)
    assert completion.prompt_logprobs[1][7].decoded_token == "<|end|>"
    assert completion.prompt_logprobs[2][9].decoded_token == " w9"
    tokens = [t for e in completion.logprobs for t in e]
    assert [e[t].decoded_token for e in completion.logprobs for t in e] == [
        "<|end|>" if t == 7 else f" w{t}" for t in tokens
    ]


def test_each_id_is_decoded_once():
    words = _Words()
    texts = TokenTexts(words.decode)
    assert [texts[i] for i in (3, 7, 3, 7, 3)] == [" w3", "<|end|>", " w3", "<|end|>", " w3"]
    assert words.decoded == [3, 7]


def test_a_decode_of_none_is_empty_and_a_failing_one_gives_none_logged(caplog):
    def decode(ids):
        if ids == [1]:
            return None
        if ids == [2]:
            return b"bytes"
        if ids == [3]:
            raise RuntimeError("no such token")
        return "ok"

    texts = TokenTexts(decode)
    with caplog.at_level(logging.ERROR, logger="jaxkv.token_texts"):
        assert [texts[i] for i in (0, 1, 2, 3, 3)] == ["ok", "", None, None, None]
    assert len(caplog.records) == 2  # each failing id once
    assert "decode([3]) raised RuntimeError('no such token')" in caplog.text


def test_a_tokenizer_failing_on_one_token_leaves_the_step_whole():
    class FailsOnSeven(_Words):
        def decode(self, ids, skip_special_tokens=False) -> str:
            if ids == [7]:
                raise ValueError("seven")
            return super().decode(ids, skip_special_tokens)

    params = SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=0)
    with Engine(tiny_model(), None, engine_config(), tokenizer=FailsOnSeven()) as engine:
        (completion,) = engine.generate([[5, 7, 9]], params)
    assert completion.prompt_logprobs[1][7].decoded_token is None
    assert completion.prompt_logprobs[2][9].decoded_token == " w9"
    assert len(completion.output_token_ids) == 2


def test_prompt_logprobs_keep_their_own_texts_not_the_tokenizer():
    # An output must pickle, and not grow with the engine's cache of token texts.
    class Unpicklable(ByteTokenizer):
        def __init__(self) -> None:
            self.lock = threading.Lock()

    params = SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=2)
    with Engine(tiny_model(), None, engine_config(), tokenizer=Unpicklable()) as engine:
        (first,) = engine.generate([[5, 6, 7, 8, 9]], params, progress=False)
        engine.generate([list(range(60, 120))], params, progress=False)  # more texts read
        (again,) = engine.generate([[5, 6, 7, 8, 9]], params, progress=False)
    copied = pickle.loads(pickle.dumps(first))
    assert copied.prompt_logprobs == first.prompt_logprobs == again.prompt_logprobs
    assert copied.logprobs == first.logprobs
    assert len(pickle.dumps(first)) == len(pickle.dumps(again))


def test_texts_of_keys_and_decodes_each_distinct_id_as_a_plain_int():
    """texts_of hands the decode, and keys its dict by, Python ints, not numpy ones."""
    words = _Words()
    texts = TokenTexts(words.decode)
    got = texts.texts_of(np.array([[9, 3], [3, 7]], np.int32))
    assert got == {3: " w3", 7: "<|end|>", 9: " w9"}
    assert all(type(t) is int for t in got) and all(type(t) is int for t in texts)
    assert sorted(words.decoded) == [3, 7, 9] and all(type(t) is int for t in words.decoded)
