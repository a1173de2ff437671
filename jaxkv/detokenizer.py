"""The engine's tokenizer, read for text: stop strings, finished requests' text, the EOS.

An Engine given a tokenizer (anything with `decode(token_ids) -> str`, e.g.
jaxkv.models.ByteTokenizer or a Hugging Face tokenizer) hands the scheduler a Detokenizer,
which the update pass calls with each request's new output token:

- read(): the stop string (SamplingParams.stop) the token completed, if any, found in
  the output text decoded incrementally (jaxkv.stop_strings), and, under
  SamplingParams.stream_text, the text the token hands out (see below);
- text(): a finished request's output text, as vLLM's CompletionOutput.text reads
  (RequestOutput.text on its finishing output, CompletionOutput.text): decoded once, as
  the request finishes, so a step's cost does not grow with the output; decoded after
  the prompt's last PROMPT_CONTEXT_TOKENS tokens, as vLLM's detokenizer does, so a
  tokenizer that writes a word's leading space only after another word gives the first
  word its space. Unless SamplingParams.include_stop_str_in_output, it leaves out a stop
  token's text (EOS included) and ends where a stop string starts; with it, it keeps
  them. Text after a stop string (in the same token) is dropped either way, and so is a
  character still cut at the end (text ending in U+FFFD after up to MAX_HELD_TOKENS
  tokens), which vLLM's detokenizer holds back and never hands out. Under
  SamplingParams.stream_text it is the part of that text not streamed yet;
- SamplingParams.skip_special_tokens (True by default, as vLLM's) goes to every decode
  of the request's text when the tokenizer's decode names such a parameter (Hugging
  Face's, whose own default is False); a decode without it (ByteTokenizer's, which
  always leaves out its specials) decodes as it does. A decode that names
  clean_up_tokenization_spaces (Hugging Face's) gets it False: vLLM's incremental text
  never cleans up spaces, and a clean-up (" ." -> ".", " 's" -> "'s") rewrites text
  that a later token follows, which streaming has handed out already;
- eos_token_id: the tokenizer's EOS (its `eos_token_id`, as vLLM reads it), the one stop
  token a finished request reports as stop_reason None.

Streamed text (SamplingParams.stream_text) is vLLM's RequestOutputKind.DELTA text: each
output before the finishing one carries the text read from its token, less what is held
back, as vLLM's detokenizer holds it: a character still cut between tokens, and, with
stop strings and without include_stop_str_in_output, the text's last characters (as
many as the longest stop string, less one), which may begin a stop string that the
finished text leaves out. The finishing output carries the rest of the finished text
(text()), so a request's streamed texts joined are its finished text whenever the
tokenizer's decode of a longer id list extends its decode of a shorter one (byte-level
tokenizers do; a Hugging Face decode that cleans up spaces may not, and then the
finishing output's part starts after as many characters as were streamed).

The tokenizer is user code: read() and text() set a held_interrupts.UserCode just around
its calls, which Scheduler.update_from_output lets a Ctrl-C stop at once, while it holds
one back anywhere else. Interrupted there, read() leaves the request's text as it was
(its next read reads this token's text too); the detokenizer's own bookkeeping is done
whole or not at all.

A tokenizer that raises (or returns no str) is logged (logger "jaxkv.detokenizer"), not
raised or warned: the update pass must not stop halfway through a batch, and a warnings
filter could turn a warning into an exception there. A request whose text the tokenizer
fails to read runs on without its stop strings, and streams text None from then on
(the finishing output's too); a failed final decode gives it text None.
"""

from __future__ import annotations

import functools
import inspect
import logging
import numbers
from typing import TYPE_CHECKING

from jaxkv.held_interrupts import UserCode
from jaxkv.request import RequestStatus
from jaxkv.stop_strings import MAX_HELD_TOKENS, PROMPT_CONTEXT_TOKENS, DecodedText

if TYPE_CHECKING:
    from jaxkv.request import Request

__all__ = ["Detokenizer"]

logger = logging.getLogger(__name__)


class Detokenizer:
    """Reads requests' output text with `tokenizer` (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        """Raises ValueError naming `tokenizer` unless its decode takes a list of ids and
        returns a str, and its eos_token_id (if any) is None, a token id or a list."""
        decode = getattr(tokenizer, "decode", None)
        if not callable(decode):
            raise ValueError(f"tokenizer={tokenizer!r} must have a decode(token_ids) method")
        try:
            text = decode([])
        except Exception as e:  # noqa: BLE001 - named as the tokenizer's fault
            raise ValueError(f"tokenizer.decode([]) raised {e!r}: it must take a list") from e
        if not isinstance(text, str):
            raise ValueError(f"tokenizer.decode([]) returned {text!r}, not a str")
        # Per SamplingParams.skip_special_tokens: the flag goes to a decode that takes it;
        # clean-up of spaces (" ." -> ".") is off where the decode names it, as vLLM's
        # incremental text never cleans up: cleaned, a later token rewrites earlier text.
        names = _parameters(decode)
        off = (
            {"clean_up_tokenization_spaces": False}
            if "clean_up_tokenization_spaces" in names
            else {}
        )
        self._decodes = {}
        for skip in (True, False):
            flag = {"skip_special_tokens": skip} if "skip_special_tokens" in names else {}
            self._decodes[skip] = (
                functools.partial(decode, **flag, **off) if flag or off else decode
            )
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = None  # a list too: no single EOS to report as None
        if eos is not None and not isinstance(eos, (list, tuple)):
            if isinstance(eos, bool) or not isinstance(eos, numbers.Integral) or eos < 0:
                raise ValueError(
                    f"tokenizer.eos_token_id={eos!r} must be None, a token id (an int >= 0) "
                    "or a list of them"
                )
            self.eos_token_id = int(eos)

    def read(
        self, request: Request, user_code: UserCode | None = None
    ) -> tuple[str | None, str | None]:
        """Reads the text of the request's newest output token; call once per new output
        token, after it is appended, for a request with stop strings or stream_text.
        Returns (stop string, streamed text): the stop string the token completed, if
        any (the one that starts first in the text; on a tie, the first listed), and,
        under stream_text, the text it hands out ("" while held back), else None. A
        tokenizer that fails is logged, and the request runs on without its stop strings,
        streaming None. `user_code` is set just around the tokenizer's calls (module
        doc; a flag of its own if None)."""
        params = request.sampling_params
        state = request.decoded_text
        if state is None:
            keep = max(map(len, params.stop)) - 1 if params.stop else 0
            state = request.decoded_text = DecodedText(keep, request.num_prompt_tokens)
        elif state.failed:
            return None, None
        output = request.output_token_ids
        try:
            new = state.update(
                self._decodes[params.skip_special_tokens],
                request.all_token_ids,
                user_code,
            )
        except Exception as e:  # noqa: BLE001 - logged; the update pass goes on
            state.failed = True
            logger.warning(
                "tokenizer.decode raised %r on the output of %r: its stop strings are no "
                "longer looked for, nor its text streamed",
                e,
                request.request_id,
            )
            return None, None
        if not new:
            return None, "" if params.stream_text else None
        text, new_from = state.tail + new, len(state.tail)
        keep = state.keep
        cut = len(text) - len(text.rstrip("\ufffd")) if state.cut_read else 0
        state.tail = text[-(keep + cut) :] if keep + cut else ""  # its U+FFFDs may be read again
        streamed = None
        if params.stream_text:
            # Held back: a cut character, and (vLLM's stop buffer) what may begin a stop
            # string the finished text leaves out. Never more than the tail keeps.
            unstreamed = state.unstreamed + len(new)
            held = cut + (0 if params.include_stop_str_in_output else keep)
            ready = max(0, unstreamed - held)
            first = max(0, len(text) - unstreamed)
            streamed = text[first : first + ready]
            state.streamed += ready
            state.unstreamed = unstreamed - ready
        if not params.stop or len(output) <= params.min_tokens:
            return None, streamed
        found = [  # each string where it would end in the new text, not before
            (i, n, s)
            for n, s in enumerate(params.stop)
            if (i := text.find(s, max(0, new_from - len(s) + 1))) >= 0
        ]
        if not found:
            return None, streamed
        start, _, string = min(found)
        state.stop_from_end = len(text) - start
        return string, streamed

    def text(
        self,
        request: Request,
        stop_reason: int | str | None,
        unsent: str | None = None,
        user_code: UserCode | None = None,
    ) -> str | None:
        """The finished `request`'s output text, or under stream_text the part of it not
        streamed yet; `stop_reason` is what its finishing RequestOutput reports, and
        `unsent` what read() streamed for its last token, which no output carried. None
        (logged) when the tokenizer fails. Changes nothing; `user_code` as in read()."""
        params = request.sampling_params
        include = params.include_stop_str_in_output
        ids = request.all_token_ids
        end = len(ids)
        by_string = isinstance(stop_reason, str)
        if request.status is RequestStatus.FINISHED_STOPPED and not by_string and not include:
            end -= 1
        num_prompt = request.num_prompt_tokens
        context = max(0, num_prompt - PROMPT_CONTEXT_TOKENS)
        decode = self._decodes[params.skip_special_tokens]
        flag = UserCode() if user_code is None else user_code
        try:
            before = _decoded(decode, ids[context:num_prompt], flag)
            text = _decoded(decode, ids[context:end], flag)
            if not by_string and text.endswith("\ufffd"):  # (a found string's text was whole)
                text = text[: len(text) - _held_chars(decode, ids, num_prompt, end, text, flag)]
        except Exception as e:  # noqa: BLE001 - logged; the update pass goes on
            logger.warning(
                "tokenizer.decode raised %r on the output of %r: its text is None",
                e,
                request.request_id,
            )
            return None
        text = text[len(before) :]
        if by_string:
            # The string starts where read() found it: so many characters before the
            # end of the text, decoded then up to this same last token.
            start = max(0, len(text) - request.decoded_text.stop_from_end)
            text = text[: start + len(stop_reason) if include else start]
        if params.stream_text and (state := request.decoded_text) is not None:
            return None if state.failed else text[state.streamed - len(unsent or "") :]
        return text


def _held_chars(
    decode, ids: list[int], num_prompt: int, end: int, text: str, user_code: UserCode
) -> int:
    """How many characters at the end of `text`, the text of ids[:end] (decoded after the
    prompt's last tokens), which ends in U+FFFD, come from the last output tokens (at most
    MAX_HELD_TOKENS) whose text a streaming detokenizer would still hold back. Decodes
    from one start, PROMPT_CONTEXT_TOKENS before the earliest candidate end (tokens that
    decode to nothing, such as PAD, may lie between a character's bytes), not the whole
    output, unless that start cuts a character (its text is then no end of `text`)."""
    start = max(0, end - MAX_HELD_TOKENS - PROMPT_CONTEXT_TOKENS)
    whole = kept = _decoded(decode, ids[start:end], user_code)
    if not text.endswith(whole):
        start = max(0, num_prompt - PROMPT_CONTEXT_TOKENS)
        whole = kept = text
    held = end
    while held > num_prompt and end - held < MAX_HELD_TOKENS:
        held -= 1
        kept = _decoded(decode, ids[start:held], user_code)
        if not kept.endswith("\ufffd"):
            break
    return len(whole) - len(kept)


def _decoded(decode, token_ids, user_code: UserCode) -> str:
    user_code.runs = True
    try:
        text = decode(token_ids)
    finally:
        user_code.runs = False
    if not isinstance(text, str):
        raise TypeError(f"decode returned {type(text).__name__}, not a str")
    return text


def _parameters(decode) -> set[str]:
    """The parameters `decode` names (Hugging Face's: skip_special_tokens and
    clean_up_tokenization_spaces)."""
    try:
        return set(inspect.signature(decode).parameters)
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return set()
