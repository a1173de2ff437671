"""Applying one step's sampled tokens: computed tokens advance, tokens append, requests stop.

Plain Python, no JAX. The body of Scheduler.update_from_output (whose docstring states
the guarantees): it reads and changes the scheduler's running queue, decode carry and
counters, so the scheduler is its only caller. It also prepares the next step's decode
carry: when this step covered every running request, what the next decode step needs
from each is gathered here, in the same pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxkv.field_checks import ints_as_python, is_bool
from jaxkv.outputs import RequestOutput, request_output_of
from jaxkv.request import MAX_TOKEN_ID, Request, RequestStatus
from jaxkv.scheduler_output import DecodeCarry, SchedulerOutput

if TYPE_CHECKING:
    from jaxkv.scheduler import Scheduler

__all__ = ["apply_sampled_tokens", "checked_sampled_tokens"]

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
}  # the update finishes a request only by these two


def checked_sampled_tokens(output: SchedulerOutput, sampled_token_ids) -> list[int]:
    """The sampled tokens as ints; ValueError unless there is one integer (not a bool) in
    [0, MAX_TOKEN_ID] per request of `output`."""
    try:
        tokens = np.asarray(sampled_token_ids)
    except (ValueError, TypeError):  # ragged nesting
        tokens = np.asarray(None)
    if tokens.dtype.kind == "f" and not hasattr(sampled_token_ids, "dtype"):  # uint64 among int64
        tokens = np.asarray(ints_as_python(sampled_token_ids))
    if tokens.shape != (output.num_requests,) or (tokens.size and tokens.dtype.kind not in "iu"):
        raise ValueError(
            f"sampled_token_ids: {tokens.shape} {tokens.dtype} must be integers of shape "
            f"({output.num_requests},), one per scheduled request"
        )
    # An array of ints holds no bool; numpy reads a list's bool among ints as an int.
    if not hasattr(sampled_token_ids, "dtype") and any(map(is_bool, sampled_token_ids)):
        raise ValueError(f"sampled_token_ids: {sampled_token_ids!r} holds a bool, not a token")
    tokens = tokens.tolist()
    if tokens and not 0 <= min(tokens) <= max(tokens) <= MAX_TOKEN_ID:
        raise ValueError(
            f"sampled_token_ids: {min(tokens)}..{max(tokens)} must lie in [0, {MAX_TOKEN_ID}]"
        )
    return tokens


def apply_sampled_tokens(
    scheduler: Scheduler, output: SchedulerOutput, tokens: list[int]
) -> list[RequestOutput]:
    """scheduler.update_from_output(output, tokens) once its arguments are checked."""
    outputs: list[RequestOutput] = []
    finished: list[Request] = []
    max_len = scheduler.config.max_model_len
    running, stopped = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED
    num_prompt = num_decode = num_generated = 0
    any_aborted = False
    # The next step's decode carry: computed tokens, next token, and the requests whose
    # next token needs the manager (a new block, or a block to cache), as in
    # slot_allocation.needs_manager for one token. Valid only if this output covers all of
    # `running`.
    carry = DecodeCarry([], [], []) if output.requests == scheduler.running else None
    bs = scheduler.manager.block_size
    cache_offset = bs - 1 if scheduler.manager.enable_prefix_caching else 0
    detokenizer = scheduler.detokenizer  # None: the engine has no tokenizer
    eos = None if detokenizer is None else detokenizer.eos_token_id
    # The caller holds a Ctrl-C back (Scheduler.update_from_output) but for the tokenizer
    # (user code, which the detokenizer marks in `user_code` just around its calls, so that
    # its own bookkeeping is whole), which it must stop at once: an interrupt there
    # loses this step's outputs, but each request keeps its tokens so far, and those
    # marked finished leave `running` with their blocks (the carry stays None: the next
    # step takes a full pass). The requests after it stay unadvanced and compute their
    # tokens again in a later step: the counters count both runs (_uncounted_tokens).
    user_code = scheduler.user_code
    try:
        for request, n, token in zip(
            output.requests, output.num_scheduled_tokens.tolist(), tokens, strict=True
        ):
            if request.status is not running:
                any_aborted = True  # between schedule and update: counted below
                continue
            computed = request.num_computed_tokens + n
            request.num_computed_tokens = computed
            output_ids = request.output_token_ids
            all_ids = request._all_token_ids  # appended below as append_output_token_ids does
            num_tokens = len(all_ids)
            # A decode computes only the last sampled token; every other chunk is prefill, a
            # preempted request's recompute too (in 1-token chunks when the budget is tight).
            if n == 1 and output_ids and computed == num_tokens:
                num_decode += 1
            else:
                num_prompt += n
            if computed < num_tokens:
                carry = None
                continue  # a prefill chunk: the sampled token is not the next one
            # The tokens are checked ints (checked_sampled_tokens), which is all that
            # append_output_token_ids checks; its call cost about 0.2 us a request.
            output_ids.append(token)
            all_ids.append(token)
            num_generated += 1
            params = request.sampling_params
            # As vLLM's check_stop: a stop token first (the sampler bans them before
            # min_tokens, jaxkv.min_tokens; should a row have nothing else left to sample,
            # one still does not stop it early), so one sampled as the last allowed token
            # ends the request as stopped; then the length limit; then a stop string in the
            # text, in which a stop token's text counts only if the output keeps it.
            stop_reason = status = None
            if token in params.stop_token_ids and len(output_ids) > params.min_tokens:
                status = stopped
                # vLLM reports the tokenizer's EOS as None, any other stop token as its id.
                if params.ignore_eos or token != eos:
                    stop_reason = token
            elif computed + 1 >= max_len or (
                params.max_tokens is not None and len(output_ids) >= params.max_tokens
            ):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                # Marked before the tokenizer runs: interrupted there, the request must
                # leave `running` rather than sample a token past its end.
                finished.append(request)
                request.status = status
            streamed = None  # the text this output streams (SamplingParams.stream_text)
            if (
                detokenizer is not None
                and (params.stop or params.stream_text)
                and (status is not stopped or params.include_stop_str_in_output)
            ):
                string, streamed = detokenizer.read(request, user_code)
                if string is not None:
                    if status is None:
                        finished.append(request)
                    status, stop_reason = stopped, string
                    request.status = status
            if status is None:
                outputs.append(
                    request_output_of(
                        (request.request_id, (token,), False, None, None, 0, None, None, streamed)
                    )
                )
                if carry is not None:
                    carry.num_computed.append(computed)
                    carry.token_ids.append(token)
                    offset = computed % bs
                    if offset == 0 or offset == cache_offset:
                        carry.needing.append(request)
                continue
            reason = _FINISH_REASONS[request.status]
            text = None
            if detokenizer is not None:
                text = detokenizer.text(request, stop_reason, streamed, user_code)
            outputs.append(
                request_output_of(
                    (request.request_id, (token,), True, reason, None, 0, None, stop_reason, text)
                )
            )
    except BaseException:
        prompt, decode = _uncounted_tokens(output, unadvanced=True)
        num_prompt += prompt
        num_decode += decode
        raise
    else:
        if any_aborted:  # the step ran their tokens too
            prompt, decode = _uncounted_tokens(output, unadvanced=False)
            num_prompt += prompt
            num_decode += decode
    finally:
        scheduler._count(
            num_prompt_tokens_computed=num_prompt,
            num_decode_tokens_computed=num_decode,
            num_generated_tokens=num_generated,
        )
        finished = [r for r in finished if r.status is not running]
        if finished:  # may raise the connector's interrupt: the carry then stays None
            scheduler._finish(finished)
    scheduler._decode_carry = carry
    return outputs


def _uncounted_tokens(output: SchedulerOutput, *, unadvanced: bool) -> tuple[int, int]:
    """Prompt and decode tokens of the requests of `output` that its update's pass did not
    count, though the model computed them in this step: those aborted since schedule()
    and, `unadvanced` (an interrupted update), the running ones it left unadvanced, which
    compute them again in a later step (each run counts, as a preempted request's
    recompute does)."""
    prompt = decode = 0
    aborted, running = RequestStatus.FINISHED_ABORTED, RequestStatus.RUNNING
    for request, n, computed in zip(
        output.requests,
        output.num_scheduled_tokens.tolist(),
        output.num_computed_tokens.tolist(),
        strict=True,
    ):
        status = request.status
        if status is aborted or (
            unadvanced and status is running and request.num_computed_tokens == computed
        ):
            # apply_sampled_tokens' test, before the advance
            if n == 1 and request.output_token_ids and computed + 1 == request.num_tokens:
                decode += 1
            else:
                prompt += n
    return prompt, decode
