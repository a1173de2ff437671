"""SamplingParams.min_tokens: a request's stop tokens are banned until it has that many.

Plain numpy, no JAX. As in vLLM, the ban is a logit mask: the sampler never draws a
banned token (greedy rows take the best token that is not banned), so a request with
min_tokens=m generates at least m tokens before any stop token, EOS included: the
model's EOS ids are banned under ignore_eos too, as vLLM bans them (its
all_stop_token_ids), though they do not stop such a request.
"""

from __future__ import annotations

import numpy as np

from jaxkv.batch_rows import NO_TOKEN, batch_rows
from jaxkv.sampling_params import SamplingParams


class StopTokenBans:
    """The stop tokens each row of a batch may not sample yet.

    Holds the queued requests that have stop tokens and a min_tokens they have not
    reached. A request leaves once it has min_tokens output tokens (it never needs the
    ban again: output tokens are never taken back, a preemption recomputes them) or
    when discarded. With none held, a batch's array is an empty (num_rows, 0) one, so
    the step program is the one compiled without bans.
    """

    def __init__(self, eos_token_ids: tuple[int, ...] = ()) -> None:
        self._eos = tuple(eos_token_ids)  # the model's; banned under ignore_eos too
        # request id -> (min_tokens, stop token ids)
        self._pending: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._empty: dict[int, np.ndarray] = {}  # num_rows -> i32[num_rows, 0]

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Holds the request if its params ban tokens; replaces an earlier add's entry."""
        stops = params.stop_token_ids
        if params.ignore_eos and self._eos:
            stops = tuple(dict.fromkeys(stops + self._eos))
        if params.min_tokens and stops:
            self._pending[request_id] = (params.min_tokens, stops)
        else:
            self._pending.pop(request_id, None)

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def array(self, requests: list, order: np.ndarray | None, num_rows: int) -> np.ndarray:
        """i32[num_rows, width]: row i lists the stop tokens banned for the request in
        batch row i (requests[order[i]], or requests[i] when `order` is None), padded
        with NO_TOKEN. width is 0 when no row bans a token, else the longest banned list
        rounded up to a power of two (a bounded number of shapes)."""
        banned = self._banned(requests) if self._pending else []
        if not banned:
            empty = self._empty.get(num_rows)
            if empty is None:
                empty = self._empty[num_rows] = np.zeros((num_rows, 0), np.int32)
            return empty
        longest = max(len(stops) for _, stops in banned)
        out = np.full((num_rows, 1 << (longest - 1).bit_length()), NO_TOKEN, np.int32)
        rows = batch_rows([index for index, _ in banned], order).tolist()
        for row, (_, stops) in zip(rows, banned, strict=True):
            out[row, : len(stops)] = stops
        return out

    def _banned(self, requests: list) -> list[tuple[int, tuple[int, ...]]]:
        """(schedule index, stop tokens) of each request still short of its min_tokens."""
        pending, banned = self._pending, []
        for index, request in enumerate(requests):
            entry = pending.get(request.request_id)
            if entry is None:
                continue
            if len(request.output_token_ids) >= entry[0]:
                del pending[request.request_id]
            else:
                banned.append((index, entry[1]))
        return banned
