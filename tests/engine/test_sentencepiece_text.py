"""Text read with a tokenizer that decodes as a Hugging Face SentencePiece one does
(Llama-2's): "▁" word starts whose space is stripped at the start of a text,
byte-fallback pieces that form a character only together, and, with
clean_up_tokenization_spaces (True by default in many tokenizer configs), " ." written
"." once the "." arrives, which rewrites text already streamed. As vLLM's incremental
detokenizer (which never cleans up spaces), the engine reads text with the clean-up off
when the decode names the parameter."""

from __future__ import annotations

import re

import pytest

from jaxkv.detokenizer import Detokenizer
from tests.host._sched_util import add, make_scheduler, outputs_fed


class SentencePieceLike:
    """Pieces decoded as a Hugging Face Llama-2 tokenizer decodes them."""

    PIECES = [
        "<s>",
        "</s>",
        "▁Hello",
        "▁world",
        "▁.",
        "▁n't",
        "▁User",
        "<0xE2>",
        "<0x82>",
        "<0xAC>",
        "▁'",
        "s",
    ]
    SPECIAL = {0, 1}
    eos_token_id = 1

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
        text, pending = "", bytearray()
        for i in ids:
            if skip_special_tokens and i in self.SPECIAL:
                continue
            if m := re.fullmatch(r"<0x([0-9A-F]{2})>", self.PIECES[i]):
                pending.append(int(m.group(1), 16))
                continue
            text += pending.decode(errors="replace") + self.PIECES[i].replace("▁", " ")
            pending = bytearray()
        text = (text + pending.decode(errors="replace")).removeprefix(" ")
        if clean_up_tokenization_spaces:
            text = text.replace(" .", ".").replace(" n't", "n't").replace(" 's", "'s")
        return text


HELLO, WORLD, DOT, NT, USER, E2, B82, BAC, QUOTE, S = range(2, 12)


def _run(output, **params):
    """The outputs of one request streamed and one not, fed `output` after a prompt."""
    sched = make_scheduler()
    sched.detokenizer = Detokenizer(SentencePieceLike())
    for rid, stream in (("whole", False), ("streamed", True)):
        add(sched, rid, [HELLO], max_tokens=len(output), stream_text=stream, **params)
    results = outputs_fed(sched, output)
    return results["whole"], [o.text for o in results["streamed"]]


@pytest.mark.parametrize("stop", [None, "XYZ"])  # "XYZ": the last 2 characters held back
@pytest.mark.parametrize(
    ("output", "text"),
    [
        ([WORLD, DOT, NT, WORLD], " world . n't world"),  # vLLM's text: no clean-up
        # Cleaned up, the "s" would rewrite the " '" streamed before it ("'s"): the
        # finishing output's part then lost a character of what was never streamed.
        ([WORLD, QUOTE, S, WORLD], " world 's world"),
        ([WORLD, E2, B82, BAC, HELLO], " world€ Hello"),
        ([E2, B82, BAC, 0, WORLD], "€ world"),  # <s> skipped
        ([WORLD, E2, B82], " world"),  # a character still cut at the end is left out
    ],
)
def test_streamed_texts_join_to_the_finished_text_of_a_sentencepiece_decode(output, text, stop):
    whole, parts = _run(output, stop=stop)
    assert "".join(parts) == text, parts
    assert whole[-1].text == text
    assert not any("\ufffd" in p for p in parts), parts  # a cut character is held back


@pytest.mark.parametrize(
    ("stop", "output", "text"),
    [
        ("€ H", [WORLD, E2, B82, BAC, HELLO, WORLD], " world"),  # across byte pieces and "▁"
        ("d .", [WORLD, DOT, NT], " worl"),  # spans a " ." clean-up would remove
        (" User", [WORLD, USER, WORLD], " world"),
    ],
)
def test_stop_strings_spanning_pieces_cut_the_text_before_them(stop, output, text):
    whole, parts = _run(output, stop=stop)
    assert (whole[-1].finish_reason, whole[-1].stop_reason, whole[-1].text) == ("stop", stop, text)
    assert "".join(parts) == text


def test_a_decode_without_the_clean_up_parameter_decodes_as_it_does():
    class NoParameter(SentencePieceLike):
        def decode(self, ids, skip_special_tokens=False):
            return super().decode(ids, skip_special_tokens)

    detokenizer = Detokenizer(NoParameter())
    assert detokenizer._decodes[True]([HELLO, DOT]) == "Hello."
