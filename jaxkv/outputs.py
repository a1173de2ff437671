"""What the engine hands back to its caller: per-step deltas and whole completions."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple


class RequestOutput(NamedTuple):
    """A request's progress in one step.

    finish_reason is "stop" (a stop token was sampled; it is included in
    new_token_ids) or "length" (max_tokens or max_model_len reached), and None while the
    request runs. An aborted request gets no further RequestOutput (its caller knows).
    A NamedTuple: one is made per request per step.
    """

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens sampled this step (one per step today)
    finished: bool
    finish_reason: str | None


# RequestOutput from the tuple of its four fields: what RequestOutput._make does, without
# the NamedTuple's Python-level __new__ (half the cost of one; one per request per step).
request_output_of = functools.partial(tuple.__new__, RequestOutput)


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """A finished request, as Engine.generate returns it: finish_reason is "stop" or
    "length" as in RequestOutput, or "abort" if another caller aborted it meanwhile."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str
