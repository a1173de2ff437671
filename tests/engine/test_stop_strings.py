"""Stop strings (SamplingParams.stop) against an oracle over the dense model's bytes.

The tiny model's tokens are bytes (jaxkv.models.ByteTokenizer decodes them). The oracle
searches the greedy continuation's raw bytes for an ASCII stop string (ASCII bytes decode
to themselves whatever surrounds them): the request must end with the token that
completes the first occurrence ending at or after min_tokens tokens.
"""

from __future__ import annotations

import logging
import re

import pytest

from jaxkv import SamplingParams
from jaxkv.detokenizer import Detokenizer
from jaxkv.engine import Engine
from jaxkv.models import ByteTokenizer
from jaxkv.request import Request, RequestStatus
from jaxkv.router import PrefixAwareRouter
from jaxkv.stop_strings import MAX_HELD_TOKENS, DecodedText
from tests.engine._util import (
    BLOCK_SIZE,
    TIGHT_BLOCKS,
    assert_all_blocks_free,
    dense_greedy,
    engine_config,
    prompts_for,
    tiny_model,
)

MAX_TOKENS = 24
TOKENIZER = ByteTokenizer()


def _engine(**config) -> Engine:
    return Engine(tiny_model(), None, engine_config(**config), tokenizer=TOKENIZER)


def _oracle_length(tokens: list[int], stops: tuple[str, ...], min_tokens: int = 0) -> int | None:
    """Output tokens up to the one completing the first stop string that ends after
    min_tokens tokens, as vLLM's (None: no stop string ends in `tokens`)."""
    data = bytes(tokens)
    ends = []
    for s in stops:
        needle, start = s.encode("ascii"), 0
        while (at := data.find(needle, start)) >= 0:
            if at + len(needle) > min_tokens:
                ends.append(at + len(needle))
                break
            start = at + 1
    return min(ends) if ends else None


def _ascii_stops(tokens: list[int], length: int = 2) -> list[str]:
    """ASCII strings of `length` characters in the continuation, in order of appearance."""
    return [
        bytes(tokens[i : i + length]).decode("ascii")
        for i in range(len(tokens) - length + 1)
        if all(32 <= t < 127 for t in tokens[i : i + length])
    ]


def _cases():
    """(prompt, its greedy tokens, stop strings, min_tokens) for prompts whose greedy
    continuation holds ASCII pairs to stop at: the first pair, a later one with a string
    that never occurs listed first, and the first pair again past min_tokens."""
    prompts = prompts_for("none", seed=3) + prompts_for("shared", seed=3)
    cases = []
    for prompt, tokens in zip(prompts, dense_greedy(prompts, MAX_TOKENS), strict=True):
        pairs = _ascii_stops(tokens)
        if len(pairs) < 2:
            continue
        cases.append((prompt, tokens, (pairs[0],), 0))
        cases.append((prompt, tokens, ("\x00never", pairs[-1]), 0))
        past = min(tokens.index(ord(pairs[0][1])) + 2, MAX_TOKENS)
        cases.append((prompt, tokens, (pairs[0],), past))
        cases.extend((prompt, tokens, (s,), 0) for s in _ascii_stops(tokens, 4)[:1])
    assert len(cases) >= 6, "too few ASCII pairs: pick a new seed"
    return cases


@pytest.mark.parametrize("config", [{}, {"num_blocks": TIGHT_BLOCKS}], ids=["roomy", "preempted"])
def test_requests_end_with_the_token_completing_the_first_stop_string(config):
    cases = _cases()
    engine = _engine(**config)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, stop=stops, min_tokens=min_tokens)
        for _, _, stops, min_tokens in cases
    ]
    outs = engine.generate([c[0] for c in cases], params, progress=False)
    stopped = 0
    for (_, tokens, stops, min_tokens), out in zip(cases, outs, strict=True):
        length = _oracle_length(tokens, stops, min_tokens)
        if length is None:
            assert list(out.output_token_ids) == tokens and out.finish_reason == "length"
            assert out.stop_reason is None
            continue
        stopped += 1
        assert list(out.output_token_ids) == tokens[:length]
        assert out.finish_reason == "stop"
        text = TOKENIZER.decode(out.output_token_ids)
        assert out.stop_reason in stops and text.endswith(out.stop_reason)
    assert stopped >= 4
    if config:
        assert engine.metrics.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_stop_strings_pass_through_the_router_and_samples():
    (prompt, tokens, stops, _), *_ = _cases()
    engines = [_engine(), _engine()]
    router = PrefixAwareRouter(engines, block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=MAX_TOKENS, stop=stops, n=2)
    outs = router.generate([prompt], params, progress=False)
    length = _oracle_length(tokens, stops)
    assert [list(o.output_token_ids) for o in outs] == [tokens[:length]] * 2
    assert [o.stop_reason for o in outs] == [stops[0]] * 2


def test_a_stop_token_reports_its_id_and_other_finishes_none():
    (prompt, tokens, _, _), *_ = _cases()
    engine = _engine()
    outs = engine.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[tokens[3]]), SamplingParams()],
        progress=False,
    )
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == tokens[3]
    assert outs[1].finish_reason == "length" and outs[1].stop_reason is None


def test_text_is_decoded_incrementally_and_a_cut_character_waits():
    decode, ids, state, text_so_far = TOKENIZER.decode, [], DecodedText(0, 0), ""
    for token, text in zip(
        b"a" + "é".encode() + "€b".encode(),
        ["a", "a", "aé", "aé", "aé", "aé€", "aé€b"],
        strict=True,
    ):
        ids.append(token)
        text_so_far += state.update(decode, ids)
        assert text_so_far == text


def test_each_read_decodes_only_the_tokens_read_last_time_and_the_new_ones():
    """The context of a read is the tokens the previous read took (at first the prompt's
    last 5), as vLLM's offsets: the decoded window does not grow with the output."""
    windows = []

    def decode(token_ids):
        windows.append(bytes(token_ids))
        return TOKENIZER.decode(token_ids)

    ids, state = list(b"Hello, "), DecodedText(0, 7)
    texts = []
    for token in b"abc":
        ids.append(token)
        texts.append(state.update(decode, ids))
    assert texts == ["a", "b", "c"]
    # (context, context + new) per read: "llo, " then the one token read before.
    assert windows == [b"llo, ", b"llo, a", b"a", b"ab", b"b", b"bc"]
    assert (state.prefix_offset, state.read_offset) == (9, 10)


def test_a_string_is_found_where_it_ends_in_new_text_only():
    stops = Detokenizer(TOKENIZER)
    request = Request("r", [1], SamplingParams(stop=("c", "bc", "xyz")))
    found = []
    for token in b"abcxyzc":
        request.append_output_token_ids(token)
        found.append(stops.read(request)[0])
    # "c" and "bc" end at the same token: "bc", listed later, starts first; "xyz" spans
    # three tokens; "bc" is not found again once "c" (a shorter string) ends later.
    assert found == [None, None, "bc", None, None, "xyz", "c"]


@pytest.mark.parametrize(
    ("stop", "tokens", "expected"),
    [(("ab",), b"abab", [None, None, None, "ab"]), (("ab", "ba"), b"aba", [None, None, "ba"])],
)
def test_min_tokens_hides_strings_that_end_in_its_tokens_text(stop, tokens, expected):
    # As vLLM's: a string must end after the first min_tokens tokens' text; it may begin
    # in it ("ba" at the 2nd token).
    stops = Detokenizer(TOKENIZER)
    request = Request("r", [1], SamplingParams(stop=stop, min_tokens=2, max_tokens=9))
    found = []
    for token in tokens:
        request.append_output_token_ids(token)
        found.append(stops.read(request)[0])
    assert found == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [(b"ab", "stop=b'ab'"), (["a", ""], "stop=\\['a', ''\\]"), ([1], "stop=\\[1\\]"),
     ({"a": 1}, "stop=\\{'a': 1\\}"), ("", "stop=''"), ({"ab"}, "stop=\\{'ab'\\}")],
)  # fmt: skip
def test_bad_stop_strings_are_refused_naming_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(stop=value)


def test_stop_takes_one_str_a_sequence_or_none():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["ab", "c"]).stop == ("ab", "c")
    assert SamplingParams(stop=None).stop == ()


def test_an_engine_without_a_tokenizer_refuses_stop_strings_queueing_nothing():
    engine = Engine(tiny_model(), None, engine_config())
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(stop="ab", n=2))
    assert not engine.has_unfinished_requests()
    assert engine.add_request([1, 2, 3]) == "0"  # the default id was not taken


@pytest.mark.parametrize(
    "tokenizer",
    [
        object(),
        type("T", (), {"decode": lambda self, ids: 1})(),
        type("T", (), {"decode": lambda self, ids, skip: ""})(),
    ],
)
def test_a_tokenizer_without_a_text_decode_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="tokenizer"):
        Engine(tiny_model(), None, engine_config(), tokenizer=tokenizer)


@pytest.mark.parametrize("tokenizer", [object(), type("T", (), {"decode": "abc"})()])
def test_a_tokenizer_with_no_decode_to_call_is_refused_as_such(tokenizer):
    """Not as a decode([]) that raised: the tokenizer has no decode method at all."""
    with pytest.raises(ValueError, match=r"^tokenizer=.* must have a decode\(token_ids\) method$"):
        Detokenizer(tokenizer)


class _FailingTokenizer:
    """Decodes as ByteTokenizer until the output holds a 0x58 ('X'), then raises."""

    def decode(self, ids):
        if 0x58 in ids:
            raise KeyError("no such token")
        return TOKENIZER.decode(ids)


def test_a_tokenizer_that_raises_is_logged_and_the_batch_runs_on(caplog):
    stops = Detokenizer(_FailingTokenizer())
    request = Request("r", [1], SamplingParams(stop=("ab",)))
    for token in b"aX":
        request.append_output_token_ids(token)
        if token == 0x58:
            with caplog.at_level(logging.WARNING, logger="jaxkv.detokenizer"):
                assert stops.read(request)[0] is None
            assert re.search("decode raised KeyError.*'r'", caplog.text)
        else:
            assert stops.read(request)[0] is None
    for token in b"ab":  # no longer looked for
        request.append_output_token_ids(token)
        assert stops.read(request)[0] is None


def test_a_long_string_spanning_many_tokens_is_found():
    stops = Detokenizer(TOKENIZER)
    request = Request("r", [1], SamplingParams(stop=("hello world", "User:")))
    found = []
    for token in b"> User: hello world!":
        request.append_output_token_ids(token)
        found.append(stops.read(request)[0])
    assert found.index("User:") == len("> User:") - 1
    assert found.index("hello world") == len("> User: hello world") - 1


class _WordTokenizer:
    """Token i is word WORDS[i]; like SentencePiece, a word's leading space is written
    only after another word, so the text of a token depends on the one before it."""

    WORDS = ["Hi", "User", ":", "there"]

    def decode(self, ids):
        return " ".join(self.WORDS[i] for i in ids)


def test_the_first_output_token_is_read_after_the_prompt_as_vllm_does():
    stops = Detokenizer(_WordTokenizer())
    request = Request("r", [0], SamplingParams(stop=(" User",)))
    request.append_output_token_ids(1)  # "Hi User": the space belongs to the output
    assert stops.read(request)[0] == " User"


@pytest.mark.parametrize("stop", [(" Use", " U"), (" U", " Use")])
def test_strings_starting_at_the_same_character_go_to_the_first_listed(stop):
    # One token completes both strings, which start at its space: a tie, which the
    # string listed first wins, whichever is longer.
    stops = Detokenizer(_WordTokenizer())
    request = Request("r", [0], SamplingParams(stop=stop))
    request.append_output_token_ids(1)  # " User"
    assert stops.read(request)[0] == stop[0]


def test_text_that_cannot_be_read_waits_only_a_few_tokens():
    decode, state = TOKENIZER.decode, DecodedText(0, 1)
    ids, read = [65], []
    for _ in range(20):
        ids.append(0x80)  # a lone continuation byte: the text keeps ending in U+FFFD
        read.append(state.update(decode, ids))
    assert read[: MAX_HELD_TOKENS - 1] == [""] * (MAX_HELD_TOKENS - 1)
    assert read[MAX_HELD_TOKENS - 1] == "\ufffd" * MAX_HELD_TOKENS
    assert state.read_offset >= len(ids) - MAX_HELD_TOKENS  # the window stays short


def test_a_character_completed_after_a_forced_read_is_searched_whole():
    # 'a', 6 invalid bytes and an emoji's first two bytes: 8 held tokens force a read
    # ending in U+FFFD; the emoji's last two bytes then complete it, and it is found (it
    # used to be dropped from the searched text, while the finished text held it).
    stops = Detokenizer(TOKENIZER)
    request = Request("r", list(b"Hello "), SamplingParams(stop="\U0001f600", max_tokens=12))
    found = []
    for token in b"a" + b"\x80" * 6 + "\U0001f600".encode():
        request.append_output_token_ids(token)
        found.append(stops.read(request)[0])
    assert found == [None] * 10 + ["\U0001f600"]  # at the emoji's last byte
    request.status = RequestStatus.FINISHED_STOPPED
    assert stops.text(request, "\U0001f600") == "a" + "\ufffd" * 6


def test_a_string_spanning_a_character_completed_after_a_forced_read_is_found():
    # The forced read handed out "ab" and the U+FFFD of the cut euro sign; read again
    # whole, the sign follows "b" in the searched text, not that U+FFFD.
    pad = ByteTokenizer.pad_id
    stops = Detokenizer(TOKENIZER)
    request = Request("r", list(b"xyz"), SamplingParams(stop="b\u20ac", max_tokens=20))
    found = []
    for token in [*b"ab\xe2", *[pad] * 7, *b"\x82\xac"]:
        request.append_output_token_ids(token)
        found.append(stops.read(request)[0])
    assert found == [None] * 11 + ["b\u20ac"]
    request.status = RequestStatus.FINISHED_STOPPED
    assert stops.text(request, "b\u20ac") == "a"


class _BytesForOneToken:
    """Decodes as ByteTokenizer, but returns bytes for a single token."""

    def decode(self, ids):
        return bytes(ids) if len(ids) == 1 else TOKENIZER.decode(ids)


def test_a_decode_returning_no_str_for_the_context_stops_the_reads(caplog):
    # The first read's context is the one prompt token: its bytes are no text to count.
    stops = Detokenizer(_BytesForOneToken())
    request = Request("r", [1], SamplingParams(stop="a"))
    request.append_output_token_ids(ord("a"))
    with caplog.at_level(logging.WARNING, logger="jaxkv.detokenizer"):
        assert stops.read(request) == (None, None)
    assert request.decoded_text.failed and "not a str" in caplog.text
