"""The text of a finished request's output, as vLLM's CompletionOutput.text reads.

An Engine given a tokenizer puts it on each request's finishing RequestOutput (`text`),
and generate on each CompletionOutput: decoded once, when the request finishes, so a
step's cost does not grow with the output. As vLLM's detokenizer does, the output is
decoded after the prompt's last tokens (PROMPT_CONTEXT_TOKENS), so a tokenizer that writes
a word's leading space only after another word gives the output's first word its space.
Unless SamplingParams.include_stop_str_in_output, the text leaves out a stop token's
(EOS included) and ends before a stop string; with it, the text ends after the stop
string. Text after a stop string (in the same token) is dropped either way.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from jaxkv.request import RequestStatus
from jaxkv.stop_strings import PROMPT_CONTEXT_TOKENS

if TYPE_CHECKING:
    from jaxkv.request import Request

__all__ = ["output_text"]


def output_text(
    decode: Callable[[Sequence[int]], str], request: Request, stop_reason: int | str | None
) -> str | None:
    """The finished `request`'s output text, decoded with `decode`; `stop_reason` is what
    its finishing RequestOutput reports. None, with a RuntimeWarning, when decode raises or
    returns no str: the scheduler's update pass must not stop halfway through a batch."""
    params = request.sampling_params
    include = params.include_stop_str_in_output
    ids = request.all_token_ids
    end = len(ids)
    by_token = request.status is RequestStatus.FINISHED_STOPPED and not isinstance(stop_reason, str)
    if by_token and not include:
        end -= 1
    num_prompt = request.num_prompt_tokens
    context = max(0, num_prompt - PROMPT_CONTEXT_TOKENS)
    try:
        before, text = decode(ids[context:num_prompt]), decode(ids[context:end])
        if not isinstance(before, str) or not isinstance(text, str):
            raise TypeError(f"decode returned {type(text).__name__}, not a str")
    except Exception as e:  # noqa: BLE001 - named in the warning; the batch goes on
        warnings.warn(
            f"tokenizer.decode raised {e!r} on the output of {request.request_id!r}: its "
            "RequestOutput.text is None",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    text = text[len(before) :]
    if isinstance(stop_reason, str):
        # The string starts where jaxkv.stop_strings found it: so many characters before
        # the end of the text, decoded then up to this same last token.
        start = max(0, len(text) - request.stop_text.stop_from_end)
        text = text[: start + len(stop_reason) if include else start]
    return text
