"""SamplingParams' presence, frequency and repetition penalties, as vLLM applies them.

The host keeps, for each queued request with a penalty, the tokens its penalties touch:
its prompt's distinct tokens (under a repetition penalty) and every token of its output
so far with its count, read incrementally from the Request (output tokens are never
taken back, so a preemption that recomputes the request keeps them). Each request owns
a row of one table, so a step costs O(new output tokens) Python work per request and
one gather for the batch. Each batch gets padded arrays: row i lists the tokens for the
request in batch row i, with their output counts. `apply_penalties` (jittable) rewrites
those logits and leaves every other one as it was, so a batch without penalties runs the
program compiled without them (no arrays at all) and a penalised row costs a gather and
a scatter of its listed tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.batch_rows import NO_TOKEN, batch_rows
from jaxkv.sampling_params import SamplingParams

# (token ids i32[S, W], their output counts i32[S, W], presence f32[S], frequency f32[S],
# repetition f32[S]); W is a table_width, NO_TOKEN (count 0) pads each row
PenaltyArrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

_MIN_WIDTH = 64


def table_width(longest: int) -> int:
    """The padded width of a batch whose longest list holds `longest` tokens: 64, 256,
    1024, ... (powers of four from 64), so a run compiles few penalty variants: one per
    width it meets, at most ceil(log4(max_model_len / 64)) + 1 of them (a list holds at
    most max_model_len tokens)."""
    width = _MIN_WIDTH
    while width < longest:
        width *= 4
    return width


class _Entry:
    """One request's row of the table and how far it has been filled."""

    __slots__ = ("row", "repetition", "slot", "size", "seen")

    def __init__(self, row: int, repetition: float) -> None:
        self.row = row
        self.repetition = repetition
        self.slot: dict[int, int] | None = None  # token -> its column; None: prompt unread
        self.size = 0  # tokens listed: columns :size of the row
        self.seen = 0  # output tokens counted


class TokenPenalties:
    """The penalties of the queued requests that have one; see the module doc."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._free: list[int] = []  # rows no request holds
        self._ids = np.full((0, _MIN_WIDTH), NO_TOKEN, np.int32)  # listed tokens per row
        self._counts = np.zeros((0, _MIN_WIDTH), np.int32)  # their output counts
        self._params = np.zeros((0, 3), np.float32)  # presence, frequency, repetition

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Holds the request if its params have a penalty; replaces an earlier add's entry
        (a reused id starts counting afresh)."""
        self.discard(request_id)
        if not params.has_penalties:
            return
        if not self._free:
            size = len(self._ids)
            grown = max(2 * size, 64)
            self._ids = np.concatenate(
                [self._ids, np.full((grown - size, self._ids.shape[1]), NO_TOKEN, np.int32)]
            )
            self._counts = np.concatenate(
                [self._counts, np.zeros((grown - size, self._ids.shape[1]), np.int32)]
            )
            self._params = np.concatenate([self._params, np.zeros((grown - size, 3), np.float32)])
            self._free = list(range(grown - 1, size - 1, -1))
        row = self._free.pop()
        self._ids[row] = NO_TOKEN
        self._counts[row] = 0
        self._params[row] = (
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        self._entries[request_id] = _Entry(row, params.repetition_penalty)

    def discard(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._free.append(entry.row)

    def arrays(
        self, requests: list, order: np.ndarray | None, num_rows: int
    ) -> PenaltyArrays | None:
        """The PenaltyArrays of a batch: row i for requests[order[i]] (requests[i] when
        `order` is None), rows without a penalty listing nothing (and 0, 0, 1); None when
        no request of the batch lists a token (none has a penalty, or only presence and
        frequency penalties before any output). W is table_width of the longest list."""
        entries = self._entries
        if not entries:
            return None
        held = [
            (i, entries[r.request_id], r) for i, r in enumerate(requests) if r.request_id in entries
        ]
        if not held:
            return None
        longest = self._sync(held)
        if not longest:  # presence or frequency only, before any output: nothing to change
            return None
        width = table_width(longest)
        self._reserve(width)
        positions = batch_rows([i for i, _, _ in held], order)
        table_rows = np.array([entry.row for _, entry, _ in held], np.intp)
        tokens = np.full((num_rows, width), NO_TOKEN, np.int32)
        counts = np.zeros((num_rows, width), np.int32)
        params = np.zeros((num_rows, 3), np.float32)
        params[:, 2] = 1.0
        tokens[positions] = self._ids[table_rows, :width]
        counts[positions] = self._counts[table_rows, :width]
        params[positions] = self._params[table_rows]
        return tokens, counts, params[:, 0], params[:, 1], params[:, 2]

    def _sync(self, held: list[tuple[int, _Entry, object]]) -> int:
        """Lists what each (index, entry, request) generated since the last call (and, the
        first time, its prompt's distinct tokens under a repetition penalty); returns the
        longest list. The new tokens of all of them are written in two numpy calls."""
        new_rows, new_cols, new_ids, rows, cols = [], [], [], [], []
        longest = 0
        for _, entry, request in held:
            if entry.slot is None:
                self._list_prompt(entry, request)
            outputs = request.output_token_ids
            if len(outputs) > entry.seen:
                slot, row = entry.slot, entry.row
                for t in outputs[entry.seen :]:
                    col = slot.get(t)
                    if col is None:
                        col = slot[t] = entry.size
                        entry.size += 1
                        new_rows.append(row)
                        new_cols.append(col)
                        new_ids.append(t)
                    rows.append(row)
                    cols.append(col)
                entry.seen = len(outputs)
            if entry.size > longest:
                longest = entry.size
        self._reserve(longest)
        if new_ids:
            self._ids[new_rows, new_cols] = new_ids
        if rows:  # a token repeated within the new ones counts each time
            np.add.at(self._counts, (rows, cols), 1)
        return longest

    def _list_prompt(self, entry: _Entry, request) -> None:
        entry.slot = {}
        if entry.repetition != 1.0:
            prompt = np.unique(np.asarray(request.prompt_token_ids, np.int64))
            self._reserve(len(prompt))
            self._ids[entry.row, : len(prompt)] = prompt
            entry.size = len(prompt)
            entry.slot = dict(zip(prompt.tolist(), range(len(prompt)), strict=True))

    def _reserve(self, width: int) -> None:
        """Widens the table to at least `width` columns (a table_width)."""
        size = self._ids.shape[1]
        if width <= size:
            return
        extra = table_width(width) - size
        self._ids = np.pad(self._ids, ((0, 0), (0, extra)), constant_values=NO_TOKEN)
        self._counts = np.pad(self._counts, ((0, 0), (0, extra)))


def apply_penalties(logits: jax.Array, penalties) -> jax.Array:
    """f32[S, vocab] logits with each row's listed tokens penalised (see PenaltyArrays):
    a logit > 0 divided by the row's repetition penalty, any other multiplied by it; then
    frequency * count and presence * (count > 0) subtracted. Listed ids outside
    [0, vocab) (the padding) change nothing; each row lists a token at most once."""
    tokens, counts, presence, frequency, repetition = penalties
    logits = jnp.asarray(logits)
    vocab = logits.shape[-1]
    rows = jnp.arange(logits.shape[0], dtype=jnp.int32)[:, None]
    listed = (tokens >= 0) & (tokens < vocab)
    old = logits[rows, jnp.where(listed, tokens, 0)]
    rep = repetition[:, None]
    new = jnp.where(old > 0, old / rep, old * rep)
    n = counts.astype(jnp.float32)
    new = new - frequency[:, None] * n - jnp.where(n > 0, presence[:, None], 0.0)
    return logits.at[rows, jnp.where(listed, tokens, vocab)].set(new, mode="drop")
