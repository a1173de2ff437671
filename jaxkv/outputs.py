"""What the engine hands back to its caller: per-step deltas and whole completions."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple


class RequestOutput(NamedTuple):
    """A request's progress in one step.

    finish_reason is "stop" (a stop token was sampled, or a stop string completed; the
    token that did it is included in new_token_ids) or "length" (max_tokens or
    max_model_len reached), and None while the request runs. An aborted request gets
    no further RequestOutput (its caller knows).
    logprobs is None unless the request asked (SamplingParams.logprobs), else one dict
    per token of new_token_ids: {token_id: jaxkv.logprobs.Logprob(logprob, rank,
    decoded_token)}, the sampled token first, then the top ones by descending logprob.
    index is the sample's index under SamplingParams.n > 1 (0 otherwise); such a
    request's samples report under its id, each finish_reason its sample's, and
    finished is True on the last output of its last sample (jaxkv.parallel_sampling).
    prompt_logprobs is None except on the first output of a request that asked
    (SamplingParams.prompt_logprobs; under n > 1 on sample 0's): a read-only sequence
    (jaxkv.prompt_logprobs.PromptLogprobList) of one entry per prompt token, None for
    the first. stop_reason is what stopped a request that finished with "stop": the stop
    token's id (SamplingParams.stop_token_ids, the model's eos_token_ids) or the stop
    string (SamplingParams.stop), else None, as in vLLM: None too for the tokenizer's EOS
    (its eos_token_id; unless the request ignores EOS and lists that id itself). text is
    None except on a request's finishing output when the Engine has a tokenizer: the
    whole output's text, as vLLM's CompletionOutput.text (jaxkv.detokenizer). Under
    SamplingParams.stream_text every output carries text: what its token adds ("" while
    held back; the finishing output, the rest), as vLLM's RequestOutputKind.DELTA.
    A NamedTuple: one is made per request per step. A delta, unlike vLLM's
    RequestOutput: no prompt, prompt_token_ids, num_cached_tokens or cumulative_logprob
    (CompletionOutput has prompt_token_ids and cumulative_logprob).
    """

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens sampled this step (one per step today)
    finished: bool
    finish_reason: str | None
    logprobs: tuple[dict, ...] | None = None
    index: int = 0
    prompt_logprobs: Sequence[dict | None] | None = None
    stop_reason: int | str | None = None
    text: str | None = None


# RequestOutput from the tuple of its nine fields: what RequestOutput._make does, without
# the NamedTuple's Python-level __new__ (half the cost of one; one per request per step).
# jaxkv.scheduler_update builds the tuples by position (the field order is pinned by
# tests/host/test_scheduler_update_edges.py).
request_output_of = functools.partial(tuple.__new__, RequestOutput)


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """A finished request, as Engine.generate returns it: finish_reason is "stop" or
    "length" as in RequestOutput, or "abort" if another caller aborted it meanwhile.
    logprobs (one dict per output token, as RequestOutput.logprobs) and
    cumulative_logprob (the sum of the sampled tokens' logprobs) are None unless the
    request asked for logprobs, as in vLLM's CompletionOutput. index is the sample's
    index under SamplingParams.n > 1 (0 otherwise). prompt_logprobs is None unless the
    request asked (SamplingParams.prompt_logprobs), else as RequestOutput's, the same
    for each sample of the prompt (vLLM's RequestOutput.prompt_logprobs); None too for
    the samples of a request whose sample 0 was aborted on its own before its prompt
    was computed (only sample 0 computes them). stop_reason is RequestOutput's; text is
    its finishing output's, or under SamplingParams.stream_text its outputs' texts
    joined (None unless the Engine has a tokenizer)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[dict, ...] | None = None
    cumulative_logprob: float | None = None
    index: int = 0
    prompt_logprobs: Sequence[dict | None] | None = None
    stop_reason: int | str | None = None
    text: str | None = None
