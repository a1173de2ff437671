"""Prompt logprobs (SamplingParams.prompt_logprobs), as vLLM returns them.

For each prompt token after the first: its log-probability given the tokens before it,
and the k most likely tokens at its position, from the model's raw logits in float32.
They are computed as the prompt is prefilled (chunk by chunk under chunked prefill) and
handed out once, on the request's first RequestOutput (`prompt_logprobs`), as a
PromptLogprobList: one entry per prompt token, None for the first, then
{token_id: Logprob(logprob, rank, decoded_token)} with the prompt token first and then
the top k by descending logprob (ties: lowest id first), the prompt token not twice: the
format of jaxkv.logprobs.

A request that asks reads no cached KV until its prompt is computed
(Request.skips_prefix_cache_reads): a cache hit's positions would have no logits. Its own
blocks are cached for others as usual.

Device side: the step program gathers the last layer's output at the listed rows of the
step's flat token batch (PromptRows, padded to 64, 256, 1024, ... rows, at most the
batch's token bucket) and runs jaxkv.logprobs.top_logprobs on their logits against the
next prompt tokens. Host side: PromptLogprobs lists a batch's rows and fills each
request's arrays by position, so a prefill recomputed after a preemption rewrites the
same entries. Its per-step cost is a look at the requests still owed (few, and only until
their first output) unless one of them is running.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxkv.batch_rows import batch_rows
from jaxkv.logprobs import logprob_entry
from jaxkv.penalties import table_width
from jaxkv.request import RequestStatus

if TYPE_CHECKING:
    from jaxkv.request import Request


class PromptRows(NamedTuple):
    """The rows of one step whose logits the step program turns into prompt logprobs."""

    indices: np.ndarray  # i32[P] rows of the flat token batch (plan order); padding 0
    targets: np.ndarray  # i32[P] the prompt token each row predicts; padding 0


class PromptStep(NamedTuple):
    """What one step owes requests that asked: rows to compute (None: none this step),
    where each request's go ((id, first position, end position, first row) each), and
    the ids whose prompt this step completes (their first output comes from it)."""

    rows: PromptRows | None
    segments: list[tuple[str, int, int, int]]
    completing: frozenset[str]


class _Pending:
    """One request's prompt logprobs so far; entry p is about prompt token p + 1."""

    __slots__ = ("prompt", "logprob", "rank", "top_ids", "top_logprob", "top_rank")

    def __init__(self, prompt: tuple[int, ...], k: int) -> None:
        n = len(prompt) - 1
        self.prompt = prompt
        self.logprob = np.full(n, np.nan, np.float32)
        self.rank = np.zeros(n, np.int32)
        self.top_ids = np.zeros((n, k), np.int32)
        self.top_logprob = np.zeros((n, k), np.float32)
        self.top_rank = np.zeros((n, k), np.int32)


class PromptLogprobList(Sequence):
    """One request's prompt logprobs: entry 0 is None, entry p (p >= 1) the dict of
    prompt token p. Each dict is made when first read: a long prompt's dicts, made all at
    once, would hold up the step that hands them out (about 0.1 s for 4096 tokens with
    k = 20). Compares equal to any sequence of equal entries (a tuple, a list).
    `token_logprobs()` gives the prompt tokens' own logprobs as one array, for scoring.
    """

    __slots__ = ("_pending", "_entries", "_texts")

    def __init__(self, pending: _Pending, texts: dict[int, str | None] | None = None) -> None:
        self._pending = pending
        self._texts = texts  # decoded_token of each id it holds; None: None for all
        self._entries: list[dict | None] = [None] * len(pending.prompt)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self._entries)
        if not -n <= index < n:
            raise IndexError(f"prompt_logprobs index {index} out of range for {n} tokens")
        index %= n
        entry = self._entries[index]
        if entry is None and index:
            entry = self._entries[index] = self._entry(index)
        return entry

    def _entry(self, index: int) -> dict:
        p, pending = index - 1, self._pending
        return logprob_entry(
            pending.prompt[index], float(pending.logprob[p]), int(pending.rank[p]),
            pending.top_ids[p].tolist(), pending.top_logprob[p].tolist(),
            pending.top_rank[p].tolist(), self._texts,
        )  # fmt: skip

    def token_logprobs(self) -> np.ndarray:
        """f32[len(self) - 1]: the logprob of each prompt token after the first (a copy)."""
        return self._pending.logprob.copy()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to lists: unhashable as they are

    def __repr__(self) -> str:
        return f"PromptLogprobList({len(self)} tokens)"


class PromptLogprobs:
    """The queued requests that asked for prompt logprobs, and what they have so far.

    `width` is the step program's static top-token width (the engine's max_logprobs, at
    most the vocabulary): every request asks for at most that many.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        # request id -> (its k, the Request), until its first output
        self._wanted: dict[str, tuple[int, Request]] = {}
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._wanted)

    def add(self, request: Request) -> None:
        """Registers a queued request (its params' prompt_logprobs None: not asking)."""
        request_id, k = request.request_id, request.sampling_params.prompt_logprobs
        self._pending.pop(request_id, None)
        if k is None:
            self._wanted.pop(request_id, None)
        else:
            self._wanted[request_id] = (min(k, self.width), request)

    def discard(self, request_id: str) -> None:
        self._wanted.pop(request_id, None)
        self._pending.pop(request_id, None)

    def rows(
        self,
        requests: list,  # the step's Requests, schedule order
        num_computed: np.ndarray,  # i32[R] computed tokens before the step, schedule order
        num_scheduled: np.ndarray,  # i32[R] tokens this step, schedule order
        order: np.ndarray | None,  # batch row -> schedule index; None: schedule order
        cu_q_lens: np.ndarray,  # i32[>R] first flat row of each batch row (plan order)
        max_rows: int,  # the batch's padded token count
    ) -> PromptStep | None:
        """The prompt positions this step computes for requests still owed prompt
        logprobs, or None when no such request is in the batch. Position p's logits
        predict prompt token p + 1, so a request of P prompt tokens needs positions 0 to
        P - 2."""
        wanted = self._wanted
        if not wanted or not any(r.status is RequestStatus.RUNNING for _, r in wanted.values()):
            return None  # only a running request can be in the batch
        found = [(s, r) for s, r in enumerate(requests) if r.request_id in wanted]
        if not found:
            return None
        first_rows = cu_q_lens[batch_rows([s for s, _ in found], order)].tolist()
        segments, indices, targets, completing, total = [], [], [], [], 0
        for (s, request), first in zip(found, first_rows, strict=True):
            start = int(num_computed[s])
            stop = start + int(num_scheduled[s])
            if stop >= request.num_prompt_tokens:
                completing.append(request.request_id)
            end = min(stop, request.num_prompt_tokens - 1)
            if end <= start:
                continue
            segments.append((request.request_id, start, end, total))
            indices.append(np.arange(first, first + end - start, dtype=np.int32))
            targets.append(request.prompt_token_ids[start + 1 : end + 1])
            total += end - start
        rows = None
        if segments:
            size = min(table_width(total), max_rows)
            rows = PromptRows(np.zeros(size, np.int32), np.zeros(size, np.int32))
            rows.indices[:total] = np.concatenate(indices)
            rows.targets[:total] = np.concatenate([np.asarray(t, np.int32) for t in targets])
        return PromptStep(rows, segments, frozenset(completing))

    def record(self, step: PromptStep, arrays) -> None:
        """Stores one step's top_logprobs rows (five arrays, host or device) at the
        positions `step.segments` name."""
        top_ids, top, top_rank, logprob, rank = (np.asarray(a) for a in arrays)
        for request_id, start, end, first in step.segments:
            k, request = self._wanted[request_id]
            pending = self._pending.get(request_id)
            if pending is None:
                pending = self._pending[request_id] = _Pending(request.prompt_token_ids, k)
            rows = slice(first, first + end - start)
            pending.logprob[start:end] = logprob[rows]
            pending.rank[start:end] = rank[rows]
            pending.top_ids[start:end] = top_ids[rows, :k]
            pending.top_logprob[start:end] = top[rows, :k]
            pending.top_rank[start:end] = top_rank[rows, :k]

    def attach(self, outputs: list, step: PromptStep | None, texts=None) -> list:
        """`outputs` (one step's RequestOutputs, before n > 1 relabelling) with the prompt
        logprobs of each request whose prompt `step` completed, on its first output, their
        decoded_token from `texts` (jaxkv.token_texts.TokenTexts; None: None), read here
        for every id they hold: the list keeps a plain dict, not the tokenizer. The
        request is then forgotten."""
        if step is None or not step.completing:
            return outputs
        for j, output in enumerate(outputs):
            request_id = output.request_id
            if request_id not in step.completing or request_id not in self._wanted:
                continue
            k, request = self._wanted.pop(request_id)
            pending = self._pending.pop(request_id, None)
            if pending is None:  # a one-token prompt: nothing to predict
                pending = _Pending(request.prompt_token_ids, k)
            held = None
            if texts is not None:
                held = texts.texts_of(np.concatenate([pending.prompt, pending.top_ids.ravel()]))
            outputs[j] = output._replace(prompt_logprobs=PromptLogprobList(pending, held))
        return outputs
