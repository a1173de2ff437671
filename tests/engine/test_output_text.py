"""A finished request's text (RequestOutput.text, CompletionOutput.text) against an
oracle over the dense model's bytes, and jaxkv.detokenizer's rules on a word tokenizer.

The tiny model's tokens are bytes, decoded by jaxkv.models.ByteTokenizer. The prompts are
ASCII, so the output's text is its own bytes decoded as UTF-8 (with replacement), which
is what the oracle takes: a stop string (ASCII) cuts the bytes where it starts, a stop
token leaves its byte out, unless include_stop_str_in_output; and bytes still cutting a
character at the end (up to MAX_HELD_TOKENS of them) are left out, as vLLM's streaming
detokenizer never hands them out.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.detokenizer import Detokenizer
from jaxkv.engine import Engine
from jaxkv.models import ByteTokenizer
from jaxkv.request import Request, RequestStatus
from jaxkv.router import PrefixAwareRouter
from jaxkv.stop_strings import MAX_HELD_TOKENS
from tests.engine._text_cases import TOKENIZER, streamed_text, text_cases
from tests.engine._util import BLOCK_SIZE, assert_all_blocks_free, engine_config, tiny_model
from tests.host._sched_util import add, make_scheduler, outputs_fed

PAD = ByteTokenizer.pad_id


def _engine(tokenizer=TOKENIZER) -> Engine:
    return Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)


def test_generate_returns_each_requests_text_as_the_oracle_decodes_it():
    cases = text_cases()
    engine = _engine()
    outs = engine.generate([c[0] for c in cases], [c[2] for c in cases], progress=False)
    for (_, _, params, expected), out in zip(cases, outs, strict=True):
        assert out.text == expected, (params, out)
    assert_all_blocks_free(engine)


def test_only_the_finishing_step_output_carries_text():
    (prompt, tokens, params, expected), *_ = text_cases()
    engine = _engine()
    rid = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    assert [o.text for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    assert outputs[-1].finished and outputs[-1].text == expected


@pytest.mark.parametrize(("stop", "expected"), [("XY", "ab c"), ("QQ", "ab cXYd")])
def test_a_request_read_for_stop_strings_carries_text_only_on_its_finishing_output(stop, expected):
    """Read each step for its stop strings, a request that does not stream text still
    carries none before its finishing output."""
    sched = make_scheduler()
    sched.detokenizer = Detokenizer(TOKENIZER)
    add(sched, "r", list(b"Q: "), max_tokens=7, stop=stop, include_stop_str_in_output=False)
    outputs = outputs_fed(sched, list(b"ab cXYd"))["r"]
    assert [o.text for o in outputs[:-1]] == [None] * (len(outputs) - 1)
    assert outputs[-1].finished and outputs[-1].text == expected


@pytest.mark.parametrize("stream", [False, True])  # streamed: generate joins the parts
def test_samples_and_the_router_carry_each_samples_text(stream):
    prompt, tokens, *_ = text_cases()[0]
    params = SamplingParams(max_tokens=8, n=2, stop_token_ids=[tokens[5]], stream_text=stream)
    router = PrefixAwareRouter([_engine(), _engine()], block_size=BLOCK_SIZE)
    outs = router.generate([prompt], params, progress=False)
    assert [o.text for o in outs] == [streamed_text(tokens[: min(8, tokens.index(tokens[5]))])] * 2


def test_an_engine_without_a_tokenizer_gives_no_text():
    engine = Engine(tiny_model(), None, engine_config())
    assert (
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), progress=False)[0].text is None
    )


class _Words:
    """Word ids; a word after another gets a leading space, as sentencepiece writes it."""

    words = ["<s>", "the", "cat", "saysXYmeXYow", "sat", "XY", "</s>"]
    eos_token_id = 6

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


def _finished(output, status=RequestStatus.FINISHED_STOPPED, **params) -> Request:
    request = Request("r", [0, 1], SamplingParams(**params))
    request.append_output_token_ids(output)
    request.status = status
    return request


@pytest.mark.parametrize(("include", "expected"), [(False, " cat says"), (True, " cat saysXY")])
def test_text_has_the_first_words_space_and_ends_where_the_found_string_starts(include, expected):
    detokenizer = Detokenizer(_Words())
    request = Request("r", [0, 1], SamplingParams(stop="XY", include_stop_str_in_output=include))
    found = []
    for token in (2, 3):
        request.append_output_token_ids(token)
        found.append(detokenizer.read(request)[0])
    assert found == [None, "XY"]
    request.status = RequestStatus.FINISHED_STOPPED
    # Decoded after the prompt, as vLLM does: " cat", not "cat"; the text after the first
    # "XY" of the token is dropped.
    assert detokenizer.text(request, "XY") == expected


def test_a_string_in_min_tokens_text_is_not_where_the_text_is_cut():
    detokenizer = Detokenizer(_Words())
    request = Request("r", [0], SamplingParams(stop="XY", min_tokens=1))
    found = []
    for token in (5, 2, 3):  # "XY", hidden by min_tokens; then " cat saysXY..."
        request.append_output_token_ids(token)
        found.append(detokenizer.read(request)[0])
    assert found == [None, None, "XY"]
    request.status = RequestStatus.FINISHED_STOPPED
    assert detokenizer.text(request, "XY") == " XY cat says"


@pytest.mark.parametrize(
    ("status", "params", "reason", "expected"),
    [
        (RequestStatus.FINISHED_LENGTH, {}, None, " cat sat"),
        (RequestStatus.FINISHED_STOPPED, {}, None, " cat"),  # EOS: its text left out
        (RequestStatus.FINISHED_STOPPED, {"include_stop_str_in_output": True}, None, " cat </s>"),
        (RequestStatus.FINISHED_STOPPED, {"stop_token_ids": [4]}, 4, " cat"),
    ],
)
def test_a_stop_tokens_text_is_left_out_unless_included(status, params, reason, expected):
    last = 6 if reason is None and status is RequestStatus.FINISHED_STOPPED else 4
    request = _finished([2, last], status, **params)
    assert Detokenizer(_Words()).text(request, reason) == expected


def test_the_tokenizers_eos_reports_none_and_a_stop_token_completing_a_string_the_string():
    sched = make_scheduler()
    sched.detokenizer = Detokenizer(ByteTokenizer())
    eos = ByteTokenizer.eos_token_id
    add(sched, "eos", [97], stop_token_ids=[eos])
    add(sched, "other", [97], stop_token_ids=[eos, 33])
    add(sched, "kept", [97], stop_token_ids=[33], stop="b!", include_stop_str_in_output=True)
    add(sched, "cut", [97], stop_token_ids=[33], stop="b!")
    out = sched.schedule()
    assert [o.finished for o in sched.update_from_output(out, [98] * 4)] == [False] * 4
    outputs = sched.update_from_output(sched.schedule(), [eos, 33, 33, 33])
    # vLLM decodes a stop token's text only to keep it: then "b!" stops "kept", not "!".
    assert [(o.stop_reason, o.text) for o in outputs] == [
        (None, "b"), (33, "b"), ("b!", "b!"), (33, "b"),
    ]  # fmt: skip


@pytest.mark.filterwarnings("error")  # logged, not warned: no filter can raise it
def test_a_tokenizer_that_fails_at_the_end_is_logged_and_the_request_still_finishes(caplog):
    class FailsOnLongText(ByteTokenizer):
        def decode(self, ids):
            if len(ids) > 6:
                raise RuntimeError("decoder broke")
            return super().decode(ids)

    engine = _engine(FailsOnLongText())
    with caplog.at_level(logging.WARNING, logger="jaxkv.detokenizer"):
        out = engine.generate([[97, 98]], SamplingParams(max_tokens=8), progress=False)[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 8
    assert out.text is None
    assert "RuntimeError('decoder broke') on the output of '0': its text is None" in caplog.text
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("eos", "expected"),
    [(np.int64(6), 6), (0, 0), ([6, 2], None), ((6, 2), None), (None, None)],
)
def test_the_tokenizers_eos_is_read_as_one_int_and_a_list_as_none(eos, expected):
    # A list (or tuple) names no single EOS to report as stop_reason None; it must not be
    # refused.
    got = Detokenizer(type("T", (_Words,), {"eos_token_id": eos})()).eos_token_id
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("eos", [6.0, "6", True, -1])
def test_a_tokenizers_eos_that_is_no_token_id_is_refused_by_name(eos):
    tokenizer = type("T", (_Words,), {"eos_token_id": eos})()
    with pytest.raises(ValueError, match=r"tokenizer.eos_token_id=.* must be None, a token id"):
        Detokenizer(tokenizer)


def test_a_decode_returning_no_str_for_the_prompt_is_logged_and_gives_no_text(caplog):
    class NoStrForThePrompt(ByteTokenizer):
        def decode(self, ids):
            return None if list(ids) == [97, 98] else super().decode(ids)

    request = Request("r", [97, 98], SamplingParams())
    request.append_output_token_ids(99)
    request.status = RequestStatus.FINISHED_LENGTH
    with caplog.at_level(logging.WARNING, logger="jaxkv.detokenizer"):
        assert Detokenizer(NoStrForThePrompt()).text(request, None) is None
    assert "decode returned NoneType, not a str" in caplog.text


def test_include_stop_str_in_output_must_be_a_bool():
    with pytest.raises(ValueError, match="include_stop_str_in_output='no' must be a bool"):
        SamplingParams(include_stop_str_in_output="no")


def test_a_character_the_prompt_cut_is_read_with_the_prompts_last_tokens_as_vllm_does():
    # vLLM decodes the output after the prompt's last 5 tokens: the emoji the prompt began
    # is not the output's, and the byte finishing it adds no text of its own.
    request = Request("r", list(b"ab\xf0\x9f\x98"), SamplingParams())
    request.append_output_token_ids(list(b"\x80!"))
    request.status = RequestStatus.FINISHED_LENGTH
    assert Detokenizer(ByteTokenizer()).text(request, None) == "!"


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (b"ab\xe4", "ab"),
        (b"ab\xe4\xb8", "ab"),  # two bytes of a 3-byte character: both held back
        (b"ab\xe4\xb8\xad", "ab\u4e2d"),  # complete
        (b"\xe4\xb8", ""),
        (b"ab" + b"\x80" * (MAX_HELD_TOKENS + 1), "ab\ufffd"),  # held back at most 8 tokens
        (b"\xc3\x98\x9f", "\xd8"),  # a whole character, then a stray byte
        # PAD decodes to nothing, even between a character's bytes.
        ([*b"a\xe2", *[PAD] * 4, *b"\x82\xac\xe2"], "a\u20ac"),
        ([*b"a\xf0", *[PAD] * 3, *b"\x9f\x98\x80\xe2"], "a\U0001f600"),
        ([*b"a\xe2", *[PAD] * 6], "a"),
        # Its first byte 9 tokens back, past MAX_HELD_TOKENS: its U+FFFD is not held back.
        ([*b"a\xe2\x82", *[PAD] * 7], "a\ufffd"),
        # A whole character with PADs in it, then a cut one: only the cut one is left out.
        ([*b"ab\xf0", PAD, PAD, *b"\x98\x9f", PAD, *b"\x80\xe2", *[PAD] * 6], "ab\U000187c0"),
    ],
)
def test_a_character_cut_at_the_end_is_left_out(output, expected):
    request = Request("r", list(b"xyz"), SamplingParams())
    request.append_output_token_ids(list(output))
    request.status = RequestStatus.FINISHED_LENGTH
    assert Detokenizer(ByteTokenizer()).text(request, None) == expected


def test_a_stop_token_comes_before_the_length_limit_and_a_stop_string_after_it():
    # As vLLM's check_stop: the max_tokens-th token stops the request when it is a stop
    # token (its text left out unless include_stop_str_in_output); a stop string it
    # completes stops it too, where the length limit alone would have ended it.
    sched = make_scheduler()
    sched.detokenizer = Detokenizer(ByteTokenizer())
    add(sched, "token", [97], max_tokens=2, stop_token_ids=[33])
    add(sched, "kept", [97], max_tokens=2, stop_token_ids=[33], include_stop_str_in_output=True)
    add(sched, "string", [97], max_tokens=2, stop="b!")
    add(sched, "neither", [97], max_tokens=2, stop_token_ids=[34])
    sched.update_from_output(sched.schedule(), [98] * 4)
    outputs = sched.update_from_output(sched.schedule(), [33] * 4)
    assert [(o.finish_reason, o.stop_reason, o.text) for o in outputs] == [
        ("stop", 33, "b"), ("stop", 33, "b!"), ("stop", "b!", ""), ("length", None, "b!"),
    ]  # fmt: skip


class _Chunks:
    """Token i is the bytes CHUNKS[i], decoded as UTF-8 with replacement: token 1 holds
    "b" and the first byte of a character, as a byte-level BPE token may; token 2 is
    empty, as PAD."""

    CHUNKS = [b"x", b"b\xe2", b""]

    def decode(self, ids):
        return b"".join(self.CHUNKS[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize(("include", "expected"), [(False, ""), (True, "b")])
def test_a_string_found_in_a_forced_read_of_a_cut_character_cuts_the_text_there(include, expected):
    # "b\ufffd" is held back until MAX_HELD_TOKENS tokens force its read, which finds
    # "b". The finished text is cut where "b" starts; its cut character, after the
    # string, is not held back first (that would move where the string starts).
    detokenizer = Detokenizer(_Chunks())
    params = SamplingParams(stop="b", include_stop_str_in_output=include, max_tokens=20)
    request = Request("r", [0, 0, 0], params)
    found = []
    for token in [1] + [2] * (MAX_HELD_TOKENS - 1):
        request.append_output_token_ids(token)
        found.append(detokenizer.read(request)[0])
    assert found == [None] * (MAX_HELD_TOKENS - 1) + ["b"]
    request.status = RequestStatus.FINISHED_STOPPED
    assert detokenizer.text(request, "b") == expected
