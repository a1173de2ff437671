"""SamplingParams.skip_special_tokens: as vLLM's, a request's text, and the text its stop
strings are looked for in, leave out the tokenizer's special tokens unless it is False;
the flag goes to a decode that names it (as Hugging Face's does)."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from jaxkv.detokenizer import Detokenizer
from jaxkv.models import ByteTokenizer
from jaxkv.request import Request, RequestStatus
from tests.host._sched_util import add, make_scheduler


class _Chat:
    """Word ids, of which <s> and <|end|> are special, decoded as a Hugging Face tokenizer
    decodes: specials kept unless skip_special_tokens (its default False)."""

    words = ["<s>", "hi", "there", "<|end|>", "you"]
    special = {0, 3}

    def decode(self, ids, skip_special_tokens=False) -> str:
        skip = self.special if skip_special_tokens else set()
        return "".join(" " + self.words[i] for i in ids if i not in skip)


def _finished_text(tokenizer, output, **params) -> str | None:
    request = Request("r", [0, 1], SamplingParams(**params))
    request.append_output_token_ids(output)
    request.status = RequestStatus.FINISHED_LENGTH
    return Detokenizer(tokenizer).text(request, None)


@pytest.mark.parametrize(
    ("params", "expected"),
    [({}, " there you"), ({"skip_special_tokens": False}, " there <|end|> you")],
)
def test_the_text_leaves_out_special_tokens_unless_asked_not_to(params, expected):
    assert _finished_text(_Chat(), [2, 3, 4], **params) == expected


@pytest.mark.parametrize("skip", [False, True])
def test_a_decode_without_the_flag_decodes_as_it_does(skip):
    eos = ByteTokenizer.eos_id
    text = _finished_text(ByteTokenizer(), [*b"ab", eos, *b"c"], skip_special_tokens=skip)
    assert text == "abc"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("skip", "reasons"), [(True, ["length"]), (False, ["stop"])])
def test_stop_strings_are_looked_for_in_the_text_the_flag_decodes(stream, skip, reasons):
    sched = make_scheduler()
    sched.detokenizer = Detokenizer(_Chat())
    add(sched, "r", [0, 1], max_tokens=3, stop="<|end|>", skip_special_tokens=skip,
        stream_text=stream)  # fmt: skip
    outputs = []
    for token in (2, 3, 4):
        if sched.has_unfinished_requests():
            outputs += sched.update_from_output(sched.schedule(), [token])
    assert [o.finish_reason for o in outputs if o.finished] == reasons
    text = "".join(o.text for o in outputs) if stream else outputs[-1].text
    assert text == (" there you" if skip else " there ")  # cut where the string starts


def test_skip_special_tokens_must_be_a_bool():
    with pytest.raises(ValueError, match="skip_special_tokens=0 must be a bool"):
        SamplingParams(skip_special_tokens=0)


class _UnreadSignature:
    """A decode whose signature cannot be read (inspect raises ValueError, as for builtins
    such as operator.itemgetter), decoding bytes."""

    @property
    def __signature__(self):
        raise ValueError("no signature found")

    def __call__(self, ids) -> str:
        return bytes(ids).decode(errors="replace")


def test_a_decode_whose_signature_cannot_be_read_decodes_as_it_does():
    tokenizer = type("T", (), {"decode": _UnreadSignature()})()
    assert _finished_text(tokenizer, [*b"ab"], skip_special_tokens=False) == "ab"
