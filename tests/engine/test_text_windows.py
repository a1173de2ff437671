"""DecodedText's decode window (jaxkv.stop_strings): which tokens each read decodes, for
how long tokens that add no text, or cut a character, keep it from moving on, and how
much of the text it keeps."""

from __future__ import annotations

from jaxkv import SamplingParams
from jaxkv.detokenizer import Detokenizer
from jaxkv.models import ByteTokenizer
from jaxkv.request import Request
from jaxkv.stop_strings import MAX_HELD_TOKENS, MAX_WINDOW_TOKENS, DecodedText

TOKENIZER = ByteTokenizer()
PAD = ByteTokenizer.pad_id


class _SpacedWords:
    """Token i < 3 is word WORDS[i], written with a leading space only after another
    word (as SentencePiece); PAD (3) decodes to nothing."""

    WORDS = ["Hi", "User", "there"]
    PAD = 3

    def decode(self, ids):
        return " ".join(self.WORDS[i] for i in ids if i != self.PAD)


def _windows(decode, prompt, output, keep=0):
    """Each update's text and the longest token window decoded, for `output` read one
    token at a time after `prompt`."""
    windows, texts = [], []

    def recording(token_ids):
        windows.append(len(token_ids))
        return decode(token_ids)

    state, ids = DecodedText(keep, len(prompt)), list(prompt)
    for token in output:
        ids.append(token)
        texts.append(state.update(recording, ids))
    return texts, max(windows), state


def test_a_token_that_adds_no_text_keeps_the_word_before_it_as_context():
    # vLLM holds such a token: the next word is decoded after "Hi" and gets its space.
    detokenizer = Detokenizer(_SpacedWords())
    request = Request("r", [2], SamplingParams(stop=" User"))
    found = []
    for token in (0, _SpacedWords.PAD, 1):  # " Hi", "", " User"
        request.append_output_token_ids(token)
        found.append(detokenizer.read(request)[0])
    assert found == [None, None, " User"]


def test_tokens_that_add_no_text_hold_the_window_only_max_held_tokens():
    texts, widest, state = _windows(TOKENIZER.decode, b"ab", [*b"c", *[PAD] * 20, *b"d"])
    assert "".join(texts) == "cd"
    # The window moves on after MAX_HELD_TOKENS PADs (the last read's tokens, its context,
    # and as many new ones), not after MAX_WINDOW_TOKENS.
    assert widest == 2 * MAX_HELD_TOKENS
    assert state.read_offset == 2 + 22


def test_a_cut_characters_first_bytes_stay_in_the_window_up_to_max_window_tokens():
    # A forced read hands out U+FFFD for the euro sign's first byte; its second and third
    # bytes come after PADs: within MAX_WINDOW_TOKENS tokens the sign is read whole.
    def read(pads):
        output = [*b"a\xe2", PAD, 0x82, *[PAD] * pads, 0xAC, *b"c"]
        return _windows(TOKENIZER.decode, b"x", output)

    texts, widest, _ = read(MAX_WINDOW_TOKENS - 4)
    assert [t for t in texts if t] == ["a", "\ufffd", "\u20ac", "c"]
    assert widest == MAX_WINDOW_TOKENS
    texts, widest, _ = read(MAX_WINDOW_TOKENS - 3)  # the window would be too wide
    assert [t for t in texts if t] == ["a", "\ufffd", "\ufffdc"]
    assert widest == MAX_WINDOW_TOKENS


def test_the_state_keeps_only_the_characters_a_stop_string_can_span():
    """A streamed request's state keeps none of its text without stop strings, and the
    last (longest string's length less one) characters with them: a step's cost must not
    grow with the output."""
    for stop, tail in (([], ""), (["XYZ", "Q"], "ij")):
        detokenizer = Detokenizer(TOKENIZER)
        request = Request("r", list(b"Q: "), SamplingParams(stop=stop, stream_text=True))
        for token in b"abcdefghij":
            request.append_output_token_ids(token)
            detokenizer.read(request)
        assert request.decoded_text.tail == tail, stop
