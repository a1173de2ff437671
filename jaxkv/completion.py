"""Running a list of prompts to completion on anything that serves requests step by step.

Shared by Engine.generate and PrefixAwareRouter.generate: both queue the prompts, step
until each has finished, and gather every request's tokens in prompt order.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from numbers import Integral
from typing import Any, Protocol

import numpy as np

from jaxkv.closable import try_each_noted
from jaxkv.field_checks import is_unordered
from jaxkv.outputs import CompletionOutput, RequestOutput


class StepDriver(Protocol):
    def add_request(self, prompt_token_ids: Sequence[int], sampling_params: Any) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def abort(self, request_id: str) -> bool: ...

    # Optional: queue_checkpoint() -> Callable[[], None] (see Engine.queue_checkpoint),
    # and last_step, replaced by each step that runs the model (see Engine.last_step), on
    # the driver or on each of its `replicas` (a tuple: PrefixAwareRouter's).


def checked_drivers(drivers, name: str) -> list:
    """`drivers` as a list; ValueError naming `name` unless it is a non-empty sequence
    of distinct objects with StepDriver's four methods (a str was taken as one per
    character)."""
    try:  # None or a lone engine used to raise TypeError from len()
        listed = None if isinstance(drivers, str) else list(drivers)
    except TypeError:
        listed = None
    if listed is None:
        raise ValueError(f"{name}={drivers!r} must be a sequence of replicas")
    if not listed:
        raise ValueError(f"{name} must not be empty")
    methods = ("add_request", "step", "has_unfinished_requests", "abort")
    for i, driver in enumerate(listed):
        if not all(callable(getattr(driver, method, None)) for method in methods):
            raise ValueError(f"{name}: {driver!r} lacks one of the methods {methods}")
        if any(driver is other for other in listed[:i]):  # stepped twice, counted twice
            raise ValueError(f"{name}: {driver!r} is given twice")
    return listed


def count_prompts(prompts: Sequence[Sequence[int]]) -> int:
    """len(prompts); ValueError naming `prompts` if it has none (an int, a generator), is
    a set or mapping (no order to return the outputs in: a set of tuples ran in hash
    order, a mapping's keys ran as the prompts), or if it is one prompt rather than a
    sequence of them (a str, or token ids)."""
    try:
        num_prompts = len(prompts)
    except TypeError:
        num_prompts = None
    if num_prompts is None or is_unordered(prompts):
        raise ValueError(
            f"prompts must be a sequence of prompts (each a sequence of token ids), not "
            f"{type(prompts).__name__}"
        )
    try:  # indexed, not iterated: iterating would consume a sequence that is an iterator
        first = prompts[0] if num_prompts else None
    except (TypeError, LookupError):
        first = None
    # A token id: an int, or a 0-d array (an element of a 1-D numpy or jax array).
    if isinstance(prompts, str) or isinstance(first, Integral) or getattr(first, "ndim", 1) == 0:
        raise ValueError(
            "prompts must be a sequence of prompts, each a sequence of token ids; it is one "
            f"{'str' if isinstance(prompts, str) else 'sequence of ints'} (for one prompt of "
            "token ids pass [prompt_token_ids])"
        )
    return num_prompts


def run_to_completion(
    driver: StepDriver,
    prompts: Sequence[Sequence[int]],
    sampling_params: Any = None,
    *,
    progress_bar: Any = None,
    progress: bool = False,
) -> list[CompletionOutput]:
    """One CompletionOutput per prompt and sample (SamplingParams.n, 1 by default), in
    prompt order, then by sample index.

    `sampling_params` is one for all prompts or a sequence of one per prompt. Prompts are
    queued in order; when queueing one raises (a ValueError for a prompt that fails
    validation, or anything else), noted with its index (`prompts[i]`; an interrupt is
    not noted), the ones before it are aborted again (none has run),
    and a driver with a `queue_checkpoint()` method is rewound to the checkpoint taken
    before the first (the next request gets the default id and seed it would have had
    without this call; another error of the rewind than its RuntimeError refusal is
    noted on the exception, as a failed abort is). An exception while stepping
    (KeyboardInterrupt too) aborts the prompts' unfinished requests before it
    propagates. In both cleanups every abort is tried, one that raises noted on that
    exception (`__notes__`), not raised instead.
    Other requests the driver holds progress too; their outputs are dropped. A prompt's
    request that ends without a final output (aborted by another caller meanwhile) gets
    finish_reason "abort" and the tokens it had, as does each sample of it that ended so.
    A prompt whose params ask for logprobs gets them, one dict per output token, and
    their cumulative_logprob (the sum of its sampled tokens' logprobs); one that asks for
    prompt logprobs gets them on each of its samples.
    `progress_bar` (tqdm-like, optional) is advanced once per finished prompt and closed.
    `progress` (a bool, else ValueError before anything is queued) draws generate's bar
    (generate_progress_bar) when no `progress_bar` is given, made once every prompt is
    queued: a refused prompt leaves no bar drawn.
    A step that returns no output while requests are unfinished is followed by a 0.5 ms
    sleep (a KV load in flight), unless the driver's `last_step` (an Engine's), or that
    of one of its `replicas` (a PrefixAwareRouter's Engines), changed in it: a model
    ran, on prefill chunks only, and the next step runs at once.
    """
    try:
        check_progress(progress)
        num_prompts = count_prompts(prompts)
        # A str is a Sequence, of characters: refused by each add_request as what it is.
        if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, (str, bytes)):
            params_list = [sampling_params] * num_prompts
        else:
            params_list = list(sampling_params)
            if len(params_list) != num_prompts:
                raise ValueError(
                    f"sampling_params: {len(params_list)} for {num_prompts} prompts; pass one "
                    "for all, or one per prompt"
                )
    except BaseException:
        if progress_bar is not None:  # a caller's bar: it must not stay drawn
            progress_bar.close()
        raise
    ids: list[str] = []
    checkpoint = getattr(driver, "queue_checkpoint", None)
    rewind = checkpoint() if checkpoint is not None else None
    try:
        for p, sp in zip(prompts, params_list, strict=True):
            ids.append(driver.add_request(p, sp))
    except BaseException as error:
        if isinstance(error, Exception):  # which prompt: its message names the prompt's fields
            error.add_note(f"raised queueing prompts[{len(ids)}] of {num_prompts}; none runs")
        try_each_noted(driver.abort, ids, "abort", error)
        if rewind is not None:
            try:
                rewind()
            except RuntimeError:  # one is still held: its id and seed stay taken
                pass
            except Exception as failure:  # noqa: BLE001 - a replica's: noted, not raised
                error.add_note(f"cleaning up, the queue checkpoint's rewind raised {failure!r}")
        if progress_bar is not None:
            progress_bar.close()
        raise
    index = {rid: i for i, rid in enumerate(ids)}
    # Per prompt, per sample (SamplingParams.n, read off the params as queued).
    counts = [getattr(sp, "n", 1) for sp in params_list]
    tokens: list[list[list[int]]] = [[[] for _ in range(n)] for n in counts]
    logprobs: list[list[list[dict]] | None] = [
        None if getattr(sp, "logprobs", None) is None else [[] for _ in range(n)]
        for sp, n in zip(params_list, counts, strict=True)
    ]
    reasons: list[list[str | None]] = [[None] * n for n in counts]
    stop_reasons: list[list[int | str | None]] = [[None] * n for n in counts]
    # A streamed text (SamplingParams.stream_text) comes in parts, one per output.
    streams = [getattr(sp, "stream_text", False) for sp in params_list]
    texts: list[list[str | None]] = [[None] * n for n in counts]
    parts: list[list[list[str | None]]] = [[[] for _ in range(n)] for n in counts]
    prompt_logprobs: list[tuple | None] = [None] * len(ids)  # from a sample's first output
    done = [False] * len(ids)
    remaining = len(ids)
    steppers = getattr(driver, "replicas", None)  # whose last_step tells: a router's
    if not isinstance(steppers, tuple) or not steppers:
        steppers = (driver,)
    try:
        if progress and progress_bar is None:  # once none is refused: none drawn before
            progress_bar = generate_progress_bar(prompts, progress)
        while remaining:
            ran = _last_steps(steppers)
            outputs = driver.step()
            if not outputs:
                if not driver.has_unfinished_requests():
                    break
                # Nothing ran (waiting on a KV load), unless a new last_step says a
                # model ran prefill chunks only: then step again at once.
                if all(map(operator.is_, _last_steps(steppers), ran)):
                    time.sleep(0.0005)
            for o in outputs:
                i = index.get(o.request_id)
                if i is None:
                    continue
                tokens[i][o.index].extend(o.new_token_ids)
                if o.logprobs is not None:
                    logprobs[i][o.index].extend(o.logprobs)
                if o.prompt_logprobs is not None:
                    prompt_logprobs[i] = o.prompt_logprobs
                if streams[i]:
                    parts[i][o.index].append(o.text)
                if o.finish_reason is not None:
                    reasons[i][o.index] = o.finish_reason
                    stop_reasons[i][o.index] = o.stop_reason
                    texts[i][o.index] = o.text if not streams[i] else _joined(parts[i][o.index])
                if o.finished:
                    done[i] = True
                    remaining -= 1
                    if progress_bar is not None:
                        progress_bar.update(1)
    except BaseException as error:
        # Nobody else knows these ids: left queued, they would run on in later calls
        # (KeyboardInterrupt included) with their outputs dropped. Each is tried, one
        # whose abort fails noted on the error raised.
        unfinished = [rid for rid, finished in zip(ids, done, strict=True) if not finished]
        try_each_noted(driver.abort, unfinished, "abort", error)
        raise
    finally:
        if progress_bar is not None:
            progress_bar.close()
    prompt_ids = [_prompt_ids(p) for p in prompts]  # once per prompt, not per sample
    return [
        CompletionOutput(
            rid,
            prompt_ids[i],
            tuple(tokens[i][k]),
            reasons[i][k] or "abort",
            *_with_cumulative(tokens[i][k], None if logprobs[i] is None else logprobs[i][k]),
            index=k,
            prompt_logprobs=prompt_logprobs[i],
            stop_reason=stop_reasons[i][k],
            text=texts[i][k],
        )
        for i, rid in enumerate(ids)
        for k in range(counts[i])
    ]


def _last_steps(steppers: Sequence[Any]) -> list:
    """Each one's last_step (None without one): a new one tells that its model ran."""
    return [getattr(s, "last_step", None) for s in steppers]


def _prompt_ids(prompt) -> tuple[int, ...]:
    """A queued prompt's token ids as Python ints, read as one array where it is one of
    integers (as add_request reads it): iterating a jax array makes a device array per
    token, about 0.3 ms each."""
    try:
        ids = np.asarray(prompt)
    except (ValueError, TypeError):  # a driver that took another form
        ids = None
    if ids is not None and ids.ndim == 1 and ids.dtype.kind in "iu":
        return tuple(ids.tolist())
    return tuple(int(t) for t in prompt)


def _joined(parts: list[str | None]) -> str | None:
    """A streamed text's parts joined; None if any is (no tokenizer, or it failed)."""
    return None if None in parts else "".join(parts)


def _with_cumulative(tokens: list[int], logprobs: list[dict] | None) -> tuple:
    """(logprobs as a tuple, the sum of the sampled tokens' logprobs), or (None, None)."""
    if logprobs is None:
        return None, None
    pairs = zip(tokens, logprobs, strict=True)
    return tuple(logprobs), sum((entry[t].logprob for t, entry in pairs), 0.0)


def generate_progress_bar(prompts: Sequence[Sequence[int]], progress: bool):
    """generate's bar: one over len(prompts) if `progress`, else None. ValueError unless
    `progress` is a bool (check_progress)."""
    check_progress(progress)
    return progress_bar(count_prompts(prompts), desc="generate") if progress else None


def check_progress(progress: bool) -> None:
    """ValueError unless `progress` is a bool (a flag read from text, "no", would show
    the bar by truthiness)."""
    if not isinstance(progress, bool):
        raise ValueError(f"{progress=} must be a bool")


def progress_bar(total: int, *, desc: str):
    """A tqdm progress bar of `total` steps, or None when tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is a nicety; tqdm is an optional dependency
        return None
    return tqdm(total=total, desc=desc, unit="req")
