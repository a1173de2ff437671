"""Streamed text (SamplingParams.stream_text): each RequestOutput carries the text its
token adds, and a request's texts joined are its finished text.

The finished text is checked against an oracle over the tiny model's bytes in
test_output_text; here the same cases stream, and random byte outputs (cut characters,
PAD between a character's bytes, stop strings, stop tokens, min_tokens) stream through a
Scheduler next to the same request unstreamed, whose finished text the streamed parts
must join to. What streaming holds back is checked step by step: a cut character, and
vLLM's stop buffer (the longest stop string's length less one characters).
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxkv import SamplingParams
from jaxkv.detokenizer import Detokenizer
from jaxkv.engine import Engine
from jaxkv.models import ByteTokenizer
from jaxkv.request import Request, RequestStatus
from tests.engine._text_cases import TOKENIZER, text_cases
from tests.engine._util import assert_all_blocks_free, engine_config, tiny_model
from tests.host._sched_util import add, make_scheduler, outputs_fed

PAD, EOS = ByteTokenizer.pad_id, ByteTokenizer.eos_id


def _streamed(params: SamplingParams) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "stream_text": True})


def test_streamed_texts_join_to_the_oracles_finished_text():
    cases = text_cases()
    engine = Engine(tiny_model(), None, engine_config(), tokenizer=TOKENIZER)
    ids = [engine.add_request(prompt, _streamed(params)) for prompt, _, params, _ in cases]
    parts: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            parts[out.request_id].append(out.text)
    for rid, (_, _, params, expected) in zip(ids, cases, strict=True):
        assert all(isinstance(p, str) for p in parts[rid]), (params, parts[rid])
        assert "".join(parts[rid]) == expected, (params, parts[rid])
    # generate joins them into CompletionOutput.text.
    outs = engine.generate([c[0] for c in cases], [_streamed(c[2]) for c in cases], progress=False)
    assert [o.text for o in outs] == [c[3] for c in cases]
    assert_all_blocks_free(engine)


def _stream(params: SamplingParams, output: bytes | list[int]) -> list[str | None]:
    """The text each token of `output` streams, read as the update pass reads it."""
    detokenizer = Detokenizer(TOKENIZER)
    request = Request("r", list(b"Q: "), params)
    parts = []
    for token in output:
        request.append_output_token_ids(token)
        parts.append(detokenizer.read(request)[1])
    return parts


def test_each_token_streams_its_own_text_without_stop_strings():
    assert _stream(SamplingParams(stream_text=True), b"A cat.") == list("A cat.")


@pytest.mark.parametrize(
    ("include", "held"),
    [(False, 2), (True, 0)],  # vLLM's stop buffer: the longest string's length less one
)
def test_the_last_characters_that_may_begin_a_stop_string_are_held_back(include, held):
    params = SamplingParams(stop=["XYZ", "Q"], stream_text=True, include_stop_str_in_output=include)
    output = b"ab XY cd"
    parts = _stream(params, output)
    for n in range(1, len(output) + 1):
        assert "".join(parts[:n]) == output[: max(0, n - held)].decode(), n


def test_a_cut_character_is_streamed_once_whole():
    params = SamplingParams(stream_text=True)
    assert _stream(params, b"a\xe2\x82\xacb") == ["a", "", "", "\u20ac", "b"]
    # Held past MAX_HELD_TOKENS (PAD between its bytes), the cut character is still not
    # handed out as U+FFFD: it streams once the bytes complete it.
    output = [*b"a\xe2", *[PAD] * 9, *b"\x82\xac"]
    assert "".join(_stream(params, output)) == "a\u20ac"
    # With stop strings (held back: 2 characters) the characters before it stream once.
    params = SamplingParams(stop="XYZ", stream_text=True)
    assert "".join(_stream(params, [*b"abc\xe2", *[PAD] * 9, *b"\x82\xacde"])) == "abc\u20ac"


def test_an_engine_without_a_tokenizer_refuses_stream_text_queueing_nothing():
    engine = Engine(tiny_model(), None, engine_config())
    with pytest.raises(ValueError, match="stream_text=True needs a tokenizer"):
        engine.add_request([1, 2], SamplingParams(stream_text=True))
    assert not engine.has_unfinished_requests()


def test_stream_text_must_be_a_bool():
    with pytest.raises(ValueError, match="stream_text=1 must be a bool"):
        SamplingParams(stream_text=1)


@pytest.mark.filterwarnings("error")
def test_a_tokenizer_that_fails_midway_streams_none_from_then_on(caplog):
    class FailsOnLongText(ByteTokenizer):
        def decode(self, ids):
            if len(ids) > 7:
                raise RuntimeError("decoder broke")
            return super().decode(ids)

    engine = Engine(tiny_model(), None, engine_config(), tokenizer=FailsOnLongText())
    params = SamplingParams(max_tokens=6, ignore_eos=True, stream_text=True)
    rid = engine.add_request([97, 98, 99, 100, 101], params)
    texts = []
    with caplog.at_level(logging.WARNING, logger="jaxkv.detokenizer"):
        while engine.has_unfinished_requests():
            texts += [o.text for o in engine.step() if o.request_id == rid]
    # The prompt's last 5 tokens are decoded with each read: the third output breaks it.
    assert [t is None for t in texts] == [False, False, True, True, True, True]
    assert "nor its text streamed" in caplog.text
    out = engine.generate([[97, 98, 99, 100, 101]], params, progress=False)[0]
    assert out.text is None and len(out.output_token_ids) == 6
    assert_all_blocks_free(engine)


def test_a_tokenizer_that_fails_once_stays_unread_though_it_recovers(caplog):
    """After one failed decode the request streams None (its finishing output too) and
    its stop strings are not looked for, even when later decodes would succeed; the
    failure is logged once."""

    class FailsOnce(ByteTokenizer):
        calls = 0

        def decode(self, ids):
            type(self).calls += 1
            if type(self).calls == 2:  # the first read's first decode ([] above is the 1st)
                raise RuntimeError("decoder broke once")
            return super().decode(ids)

    detokenizer = Detokenizer(FailsOnce())
    request = Request("r", list(b"Q: "), SamplingParams(stop="b", stream_text=True))
    reads = []
    with caplog.at_level(logging.WARNING, logger="jaxkv.detokenizer"):
        for token in b"aab":
            request.append_output_token_ids(token)
            reads.append(detokenizer.read(request))
    assert reads == [(None, None)] * 3
    request.status = RequestStatus.FINISHED_LENGTH  # and the finishing output's text: None
    assert detokenizer.text(request, None) is None
    assert caplog.text.count("decoder broke once") == 1


_TOKENS = st.sampled_from([*b"ab!XY \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x80", PAD, EOS])
_STOPS = st.lists(st.sampled_from(["a", "ab", "b!", "XY", "\xe9a", "\u20ac", " a b"]), max_size=3)


@settings(max_examples=150, deadline=None)
@example(  # a forced read of a cut character the bytes after complete, with stop strings
    prompt=[97],
    output=[*b"abc\xe2", *[PAD] * 9, *b"\x82\xacde"],
    stop=[" a b"],
    stop_token_ids=(),
    include=False,
    min_tokens=0,
)
@example(  # two forced reads inside one character: its first byte stays in the window
    prompt=[97],
    output=[*b"a\xe2", *[PAD] * 7, 0x82, *[PAD] * 7, 0xAC, *b"cd"],
    stop=[],
    stop_token_ids=(),
    include=False,
    min_tokens=0,
)
@example(  # a whole character with PADs in it before a cut one at the end
    prompt=[97],
    output=[*b"ab\xf0", PAD, PAD, *b"\x98\x9f", PAD, *b"\x80\xe2", *[PAD] * 6],
    stop=[],
    stop_token_ids=(),
    include=False,
    min_tokens=0,
)
@example(  # a stop token first: the request finishes without a read of its text
    prompt=[97],
    output=[EOS],
    stop=[],
    stop_token_ids=(EOS,),
    include=False,
    min_tokens=0,
)
@given(
    prompt=st.lists(_TOKENS, min_size=1, max_size=6),
    output=st.lists(_TOKENS, min_size=1, max_size=24),
    stop=_STOPS,
    stop_token_ids=st.sampled_from([(), (EOS,), (ord("!"),)]),
    include=st.booleans(),
    min_tokens=st.integers(0, 3),
)
def test_streamed_texts_join_to_the_unstreamed_finished_text(
    prompt, output, stop, stop_token_ids, include, min_tokens
):
    """The same request, streamed and not, through one Scheduler fed `output`: same
    tokens and reasons; the streamed parts (each a str) join to the finished text."""
    sched = make_scheduler()
    sched.detokenizer = Detokenizer(TOKENIZER)
    params = dict(
        max_tokens=len(output),
        stop=stop,
        stop_token_ids=stop_token_ids,
        include_stop_str_in_output=include,
        min_tokens=min(min_tokens, len(output)),
    )
    requests = [add(sched, "whole", prompt, **params)]
    requests.append(add(sched, "streamed", prompt, stream_text=True, **params))
    results = outputs_fed(sched, output)
    whole, streamed = results["whole"], results["streamed"]
    assert [r.output_token_ids for r in requests[:1]] == [requests[1].output_token_ids]
    assert (whole[-1].finish_reason, whole[-1].stop_reason) == (
        streamed[-1].finish_reason,
        streamed[-1].stop_reason,
    )
    assert all(isinstance(o.text, str) for o in streamed)
    assert "".join(o.text for o in streamed) == whole[-1].text
