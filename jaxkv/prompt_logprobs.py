"""Prompt logprobs (SamplingParams.prompt_logprobs), as vLLM returns them.

For each prompt token after the first: its log-probability given the tokens before it,
and the k most likely tokens at its position, from the model's raw logits in float32.
They are computed as the prompt is prefilled (chunk by chunk under chunked prefill) and
handed out once, on the request's first RequestOutput (`prompt_logprobs`): a tuple with
one entry per prompt token, None for the first, then {token_id: Logprob(logprob, rank)}
with the prompt token first and then the top k by descending logprob (ties: lowest id
first), the prompt token not twice: the format of jaxkv.logprobs.

A request that asks reads no cached KV until its prompt is computed
(Request.skips_prefix_cache_reads): a cache hit's positions would have no logits. Its own
blocks are cached for others as usual.

Device side: the step program gathers the last layer's output at the listed rows of the
step's flat token batch (PromptRows, padded to 64, 256, 1024, ... rows, at most the
batch's token bucket) and runs jaxkv.logprobs.top_logprobs on their logits against the
next prompt tokens. Host side: PromptLogprobs lists a batch's rows and fills each
request's arrays by position, so a prefill recomputed after a preemption rewrites the
same entries.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxkv.logprobs import logprob_of
from jaxkv.penalties import table_width


class PromptRows(NamedTuple):
    """The rows of one step whose logits the step program turns into prompt logprobs."""

    indices: np.ndarray  # i32[P] rows of the flat token batch (plan order); padding 0
    targets: np.ndarray  # i32[P] the prompt token each row predicts; padding 0


class _Pending:
    """One request's prompt logprobs so far; entry p is about prompt token p + 1."""

    __slots__ = ("k", "logprob", "rank", "top_ids", "top_logprob", "top_rank")

    def __init__(self, num_prompt_tokens: int, k: int) -> None:
        n = num_prompt_tokens - 1
        self.k = k
        self.logprob = np.full(n, np.nan, np.float32)
        self.rank = np.zeros(n, np.int32)
        self.top_ids = np.zeros((n, k), np.int32)
        self.top_logprob = np.zeros((n, k), np.float32)
        self.top_rank = np.zeros((n, k), np.int32)


class PromptLogprobs:
    """The queued requests that asked for prompt logprobs, and what they have so far.

    `width` is the step program's static top-token width (the engine's max_logprobs, at
    most the vocabulary): every request asks for at most that many.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self._wanted: dict[str, int] = {}  # request id -> its k, until its first output
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._wanted)

    def add(self, request_id: str, k: int | None) -> None:
        """Registers a queued request asking for `k` top tokens (None: not asking)."""
        self._pending.pop(request_id, None)
        if k is None:
            self._wanted.pop(request_id, None)
        else:
            self._wanted[request_id] = min(k, self.width)

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
    ) -> tuple[PromptRows, list[tuple[str, int, int, int, int]]] | None:
        """(the rows, and per request (id, prompt length, first position, end position,
        first row)) of the
        prompt positions this step computes for requests still owed prompt logprobs; None
        when there are none. Position p's logits predict prompt token p + 1, so a request
        of P prompt tokens needs positions 0 to P - 2."""
        wanted = self._wanted
        if not wanted:
            return None
        found = [(s, r) for s, r in enumerate(requests) if r.request_id in wanted]
        if not found:
            return None
        if order is None:
            batch_row = np.arange(len(requests))
        else:
            batch_row = np.empty(len(order), np.intp)
            batch_row[order] = np.arange(len(order))
        segments, indices, targets, total = [], [], [], 0
        for s, request in found:
            start = int(num_computed[s])
            end = min(start + int(num_scheduled[s]), request.num_prompt_tokens - 1)
            if end <= start:
                continue
            first = int(cu_q_lens[batch_row[s]])
            segments.append((request.request_id, request.num_prompt_tokens, start, end, total))
            indices.append(np.arange(first, first + end - start, dtype=np.int32))
            targets.append(request.prompt_token_ids[start + 1 : end + 1])
            total += end - start
        if not segments:
            return None
        size = min(table_width(total), max_rows)
        rows = PromptRows(np.zeros(size, np.int32), np.zeros(size, np.int32))
        rows.indices[:total] = np.concatenate(indices)
        rows.targets[:total] = np.concatenate([np.asarray(t, np.int32) for t in targets])
        return rows, segments

    def record(self, segments: list, arrays) -> None:
        """Stores one step's top_logprobs rows (five arrays, host or device) at the
        positions `segments` (from rows) name."""
        top_ids, top, top_rank, logprob, rank = (np.asarray(a) for a in arrays)
        for request_id, num_prompt, start, end, first in segments:
            k = self._wanted[request_id]
            pending = self._pending.get(request_id)
            if pending is None:
                pending = self._pending[request_id] = _Pending(num_prompt, k)
            rows = slice(first, first + end - start)
            pending.logprob[start:end] = logprob[rows]
            pending.rank[start:end] = rank[rows]
            pending.top_ids[start:end] = top_ids[rows, :k]
            pending.top_logprob[start:end] = top[rows, :k]
            pending.top_rank[start:end] = top_rank[rows, :k]

    def attach(self, outputs: list, requests: list) -> list:
        """`outputs` (RequestOutputs of the step's `requests`, before n > 1 relabelling)
        with the prompt logprobs of each request that asked, on its first output. The
        request is then forgotten."""
        if not self._wanted:
            return outputs
        wanted = self._wanted
        prompts = {r.request_id: r.prompt_token_ids for r in requests if r.request_id in wanted}
        for j, output in enumerate(outputs):
            request_id = output.request_id
            if request_id not in self._wanted:
                continue
            del self._wanted[request_id]
            pending = self._pending.pop(request_id, None)
            entries = _entries(prompts[request_id], pending)
            outputs[j] = output._replace(prompt_logprobs=entries)
        return outputs


def _entries(prompt: tuple[int, ...], pending: _Pending | None) -> tuple:
    """(None, then one dict per prompt token after the first), from `pending`."""
    if pending is None:  # a one-token prompt: nothing to predict
        return (None,)
    entries: list = [None]
    for p, (lp, rank, ids, top, top_rank) in enumerate(
        zip(
            pending.logprob.tolist(),
            pending.rank.tolist(),
            pending.top_ids.tolist(),
            pending.top_logprob.tolist(),
            pending.top_rank.tolist(),
            strict=True,
        )
    ):
        entry = {prompt[p + 1]: logprob_of((lp, rank))}
        for t, t_lp, t_rank in zip(ids, top, top_rank, strict=True):
            if t not in entry:
                entry[t] = logprob_of((t_lp, t_rank))
        entries.append(entry)
    return tuple(entries)
