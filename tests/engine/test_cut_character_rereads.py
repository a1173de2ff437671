"""A character cut between tokens and read again once completed (jaxkv.stop_strings):
what the read keeps of the text before it, for a tokenizer whose token holds several
bytes, the last of them a character's first (as a byte-level BPE's may), and where the
output's text starts when the prompt's last character is the one cut."""

from __future__ import annotations

from jaxkv import SamplingParams
from jaxkv.detokenizer import Detokenizer
from jaxkv.models import ByteTokenizer
from jaxkv.request import Request, RequestStatus
from jaxkv.stop_strings import MAX_HELD_TOKENS, DecodedText

TOKENIZER = ByteTokenizer()


class _Pieces:
    """Token i decodes to PIECES[i]'s bytes, invalid UTF-8 replaced by U+FFFD."""

    PIECES = [b"Q", b"xb\xe2", b"", b"\x82\xac", b"c"]

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


# "xb" and the euro sign's first byte, PADs that force a read ending in U+FFFD, the
# sign's last bytes, then "c".
OUTPUT = [1, *[2] * (MAX_HELD_TOKENS - 1), 3, 4]


def _read(detokenizer: Detokenizer, **params):
    """Each read's stop string and streamed text for OUTPUT after the prompt "QQQ", up
    to a stop string, and the request."""
    request = Request("r", [0, 0, 0], SamplingParams(max_tokens=len(OUTPUT), **params))
    found, streamed = [], []
    for token in OUTPUT:
        request.append_output_token_ids(token)
        string, text = detokenizer.read(request)
        found.append(string)
        streamed.append(text)
        if string is not None:
            break
    return found, streamed, request


def test_a_string_ending_in_a_reread_character_spans_the_text_read_with_its_first_byte():
    # The forced read handed out "xb" and the cut sign's U+FFFD in one token's text; read
    # again whole, the sign follows the "b" the search keeps, not that U+FFFD.
    found, _, _ = _read(Detokenizer(_Pieces()), stop=["b\u20ac"])
    assert found == [None] * MAX_HELD_TOKENS + ["b\u20ac"]


def test_a_reread_character_streams_after_the_text_held_back_before_it():
    # "zz" holds back one character: "b", then the sign, are streamed one read late;
    # none is lost or doubled, and the streamed texts join to the finished text.
    detokenizer = Detokenizer(_Pieces())
    found, streamed, request = _read(detokenizer, stop=["zz"], stream_text=True)
    assert found == [None] * len(OUTPUT)
    assert streamed == [""] * (MAX_HELD_TOKENS - 1) + ["x", "b", "\u20ac"]
    request.status = RequestStatus.FINISHED_LENGTH
    rest = detokenizer.text(request, None, unsent=streamed[-1])
    assert "".join(streamed[:-1]) + rest == "xb\u20acc"


def test_a_character_the_output_completes_in_the_prompt_is_no_output_text():
    """A prompt that ends in a cut character: the output's first bytes complete it, and
    the output text starts after the context's decoded length, as vLLM's detokenizer
    takes it (the character is the prompt's; no forced read handed out its U+FFFD)."""
    state, ids, texts = DecodedText(0, 2), list(b"x\xe2"), []
    for token in b"\x82\xacc":
        ids.append(token)
        texts.append(state.update(TOKENIZER.decode, ids))
    assert texts == ["", "", "c"]
