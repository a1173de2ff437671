"""Stop strings (SamplingParams.stop), as vLLM's: a request stops once the text of its
output contains one of them.

jaxkv serves token ids; the text comes from a tokenizer the engine is given (anything
with `decode(token_ids) -> str`, e.g. jaxkv.models.ByteTokenizer or a Hugging Face
tokenizer), through jaxkv.detokenizer.Detokenizer, which finds the strings. It decodes
each such request's output incrementally (DecodedText, here), as vLLM's detokenizer
does: the new tokens with context before them (at first the prompt's last 5 tokens, then
the tokens read last time), so a tokenizer that writes a word's leading space only after
another word gives the same text as a whole decode; text that ends in U+FFFD (a
character cut between tokens), or adds nothing, waits for the next token, for at most
MAX_HELD_TOKENS tokens (then it is taken as it is: a decode of a window that keeps
growing would cost more every step). A stop string is searched for only where it would
end in the text the newest tokens added (so a string spanning tokens is found, and one
found before is not found again), and only once the request has more than min_tokens
output tokens, as in vLLM (the text of the first min_tokens tokens can begin a string,
not end one, unless a cut character held it back until a later token). Where several
strings occur in that text, the one that starts first in the text wins (on a tie, the
first listed), where vLLM takes the first listed that occurs: stop=["b", "ab"] on text
ending "xab" stops before "ab" here, before "b" in vLLM. The output token ids end with
the token that completed the string, as vLLM's do; finish_reason is "stop" and
stop_reason the string. The finishing output's text (Detokenizer.text) ends before the
string, or after it with SamplingParams.include_stop_str_in_output, as vLLM's.

The decoding state lives on the Request (Request.decoded_text): the offsets and the
text's last characters (as many as the longest stop string, less one), so it is dropped
with the request, a preempted request keeps it (its tokens do not change), and a step's
cost does not grow with the output. The same state streams a request's text
(SamplingParams.stream_text): it counts the characters handed out and those held back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Set

from jaxkv.held_interrupts import UserCode

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (vLLM's)
MAX_HELD_TOKENS = 8  # tokens text may wait for: more than a UTF-8 character's 4 bytes
# Tokens the decode window may span while a character read cut waits for its other bytes
# (tokens that decode to nothing, such as PAD, between them): its first bytes stay in it.
MAX_WINDOW_TOKENS = 4 * MAX_HELD_TOKENS


def checked_stop_strings(stop) -> tuple[str, ...]:
    """SamplingParams.stop as a tuple: None (none), one str or a sequence of them, each
    non-empty. Raises ValueError naming the field otherwise."""
    if stop is None:
        return ()
    try:
        # bytes would be their int values; a set has no order (the first listed wins a tie)
        if isinstance(stop, (bytes, bytearray, Mapping, Set)):
            raise TypeError
        strings = (stop,) if isinstance(stop, str) else tuple(stop)
    except TypeError:
        strings = (None,)
    if not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop={stop!r} must be a str or a sequence of non-empty str")
    return strings


class DecodedText:
    """One request's output text, decoded incrementally (vLLM's offsets into its prompt
    and output tokens). Only the text's last `keep` characters are kept (`tail`): all a
    stop string can span before new text. `streamed` counts the characters handed out
    (SamplingParams.stream_text), `unstreamed` those read but held back, the last of the
    tail (the reader holds back no more than the tail keeps).
    """

    __slots__ = (
        "tail", "keep", "prefix_offset", "read_offset", "failed", "stop_from_end", "cut_read",
        "streamed", "unstreamed",
    )  # fmt: skip

    def __init__(self, keep: int, num_prompt_tokens: int) -> None:
        self.tail = ""
        self.keep = keep
        self.failed = False  # the tokenizer raised: the request's strings are not looked for
        # First token of the context decoded with the new ones, and tokens read so far.
        self.prefix_offset = max(0, num_prompt_tokens - PROMPT_CONTEXT_TOKENS)
        self.read_offset = num_prompt_tokens
        # Once a stop string is found: how many characters before the end of the text
        # decoded so far it starts (where Detokenizer.text cuts the text).
        self.stop_from_end = 0
        # The last read was forced (MAX_HELD_TOKENS) and its text ended in a cut character.
        self.cut_read = False
        self.streamed = self.unstreamed = 0

    def update(self, decode, token_ids, user_code: UserCode | None = None) -> str:
        """The text of `token_ids` (prompt and output) past read_offset; "" while none can
        be read yet (a character cut between tokens waits for the rest, at most
        MAX_HELD_TOKENS tokens). After a forced read that ended in a cut character, the
        character the next tokens complete is read again, whole: its U+FFFD was handed
        out already, and a stop string ending in it must still be found; tokens that add
        no text meanwhile keep its first bytes in the window (up to MAX_WINDOW_TOKENS).
        `user_code` (a held_interrupts.UserCode; one of its own if None) runs just around
        the calls of `decode`: an interrupt or exception there changes nothing."""
        if user_code is None:
            user_code = UserCode()
        user_code.runs = True
        try:
            prefix = decode(token_ids[self.prefix_offset : self.read_offset])
            full = decode(token_ids[self.prefix_offset :])
        finally:
            user_code.runs = False
        if not isinstance(full, str) or not isinstance(prefix, str):
            raise TypeError(f"decode returned {type(full).__name__}, not a str")
        start = len(prefix)
        if self.cut_read and not full.startswith(prefix):
            start = len(os.path.commonprefix([prefix, full]))
        held = len(token_ids) - self.read_offset < MAX_HELD_TOKENS
        if held and (len(full) <= start or full.endswith("\ufffd")):
            return ""
        if (
            self.cut_read
            and len(full) <= start
            and len(token_ids) - self.prefix_offset < MAX_WINDOW_TOKENS
        ):
            return ""  # moving on would drop the cut character's first bytes from the window
        if start < len(prefix):  # the U+FFFD read last time, read again now completed
            self.tail = self.tail[: max(0, len(self.tail) - (len(prefix) - start))]
            self.unstreamed = max(0, self.unstreamed - (len(prefix) - start))
        # The tokens just read are the next call's context, as in vLLM.
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.cut_read = not held and full.endswith("\ufffd")
        return full[start:]
