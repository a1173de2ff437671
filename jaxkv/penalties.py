"""SamplingParams' presence, frequency and repetition penalties, as vLLM applies them.

The host keeps, for each queued request with a penalty, the count of every token in its
output so far (read incrementally from the Request: output tokens are never taken back,
so a preemption that recomputes the request keeps them) and its prompt's distinct tokens.
Each batch gets padded arrays: row i lists the tokens the penalties touch for the
request in batch row i, with their output counts. `apply_penalties` (jittable) rewrites
those logits and leaves every other one as it was, so a batch without penalties runs the
program compiled without them (no arrays at all) and a penalised row costs a gather and
a scatter of its listed tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.request import SamplingParams

NO_TOKEN = np.iinfo(np.int32).max  # padding: past every vocabulary, so the scatter drops it

# (token ids i32[S, W], their output counts i32[S, W], presence f32[S], frequency f32[S],
# repetition f32[S]); W is a power of two, NO_TOKEN (count 0) pads each row
PenaltyArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class _Entry:
    """One request's penalties and what it has generated so far."""

    __slots__ = ("presence", "frequency", "repetition", "counts", "seen", "prompt")

    def __init__(self, params: SamplingParams) -> None:
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.counts: dict[int, int] = {}  # output token -> times generated
        self.seen = 0  # output tokens counted
        self.prompt: np.ndarray | None = None  # distinct prompt tokens, read once

    def tokens(self, request) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, output counts) the penalties touch: the output's tokens, then,
        under a repetition penalty, the prompt's that are not in the output (count 0)."""
        outputs = request.output_token_ids
        if len(outputs) > self.seen:
            counts = self.counts
            for t in outputs[self.seen :]:
                counts[t] = counts.get(t, 0) + 1
            self.seen = len(outputs)
        ids = np.fromiter(self.counts, np.int64, len(self.counts))
        counts = np.fromiter(self.counts.values(), np.int32, len(self.counts))
        if self.repetition == 1.0:
            return ids, counts
        if self.prompt is None:
            self.prompt = np.unique(np.asarray(request.prompt_token_ids, np.int64))
        prompt_only = self.prompt[~np.isin(self.prompt, ids)]
        return np.concatenate([ids, prompt_only]), np.pad(counts, (0, len(prompt_only)))


class TokenPenalties:
    """The penalties of the queued requests that have one; see the module doc."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Holds the request if its params have a penalty; replaces an earlier add's entry
        (a reused id starts counting afresh)."""
        if params.has_penalties:
            self._entries[request_id] = _Entry(params)
        else:
            self._entries.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def arrays(
        self, requests: list, order: np.ndarray | None, num_rows: int
    ) -> PenaltyArrays | None:
        """The PenaltyArrays of a batch: row i for requests[order[i]] (requests[i] when
        `order` is None), rows without a penalty listing nothing (and 0, 0, 1); None when
        no request of the batch has a penalty. W is the longest list rounded up to a
        power of two, at least 1 (a bounded number of shapes)."""
        entries = self._entries
        if not entries:
            return None
        rows = [
            (i, entries[r.request_id]) for i, r in enumerate(requests) if r.request_id in entries
        ]
        if not rows:
            return None
        lists = [entry.tokens(requests[i]) for i, entry in rows]
        longest = max(len(ids) for ids, _ in lists)
        width = 1 << max(longest - 1, 0).bit_length()
        tokens = np.full((num_rows, width), NO_TOKEN, np.int32)
        counts = np.zeros((num_rows, width), np.int32)
        presence = np.zeros(num_rows, np.float32)
        frequency = np.zeros(num_rows, np.float32)
        repetition = np.ones(num_rows, np.float32)
        row_of = np.arange(len(requests))
        if order is not None:
            row_of[order] = np.arange(len(order))
        for (i, entry), (ids, n) in zip(rows, lists, strict=True):
            row = row_of[i]
            tokens[row, : len(ids)] = ids
            counts[row, : len(n)] = n
            presence[row], frequency[row] = entry.presence, entry.frequency
            repetition[row] = entry.repetition
        return tokens, counts, presence, frequency, repetition


def apply_penalties(logits: jax.Array, penalties) -> jax.Array:
    """f32[S, vocab] logits with each row's listed tokens penalised (see PenaltyArrays):
    a logit > 0 divided by the row's repetition penalty, any other multiplied by it; then
    frequency * count and presence * (count > 0) subtracted. Listed ids outside
    [0, vocab) (the padding) change nothing; each row lists a token at most once."""
    tokens, counts, presence, frequency, repetition = penalties
    logits = jnp.asarray(logits)
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0])[:, None]
    listed = (tokens >= 0) & (tokens < vocab)
    old = logits[rows, jnp.where(listed, tokens, 0)]
    rep = repetition[:, None]
    new = jnp.where(old > 0, old / rep, old * rep)
    n = counts.astype(jnp.float32)
    new = new - frequency[:, None] * n - jnp.where(n > 0, presence[:, None], 0.0)
    return logits.at[rows, jnp.where(listed, tokens, vocab)].set(new, mode="drop")
