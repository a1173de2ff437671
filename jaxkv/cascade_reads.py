"""The group search's reads of each request's computed tokens, kept so that a later step
can tell, with a few numpy calls, whether the search would decide everything alike.

Plain numpy. The cascade group search (jaxkv.cascade_groups) reads num_computed_tokens
only through a SearchReads: which members have computed a column, the least computed
blocks of a member set (capped at its shared blocks), a decision that only turns true as
the most computed blocks of one grow, and whether a group pays (its members' contexts
enter the cost model's min_saved_fraction test). Everything else the search reads is
fixed while its batch, the manager's sharing and the other arguments are (PlanMemo keys
it on them). So where each read gives the same answer for other counts, the search
takes the same path and returns the same groups: `holds` checks that for all of them at
once. A verdict is checked against its context's limit
(CascadeCostModel.max_context_tokens), so contexts that grow by a token a step keep it
until it turns.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["SearchReads"]

# (requests, prefix tokens, query tokens, model) -> the largest context for which such a
# group pays (-1: for none; CascadeCostModel.max_context_tokens), or None where the cost
# model gives no such limit.
ContextLimit = Callable[[int, int, int, object], int | None]


class SearchReads:
    """The reads of one search over `num_computed_tokens`, as the answers it took."""

    def __init__(
        self,
        num_computed_tokens: np.ndarray,  # i[R]
        block_size: int,
        pays: Callable[..., bool],  # CascadePlanner.pays
        context_limit: ContextLimit,
    ) -> None:
        self._counts = num_computed_tokens
        self._bs = block_size
        self._pays = pays
        self._context_limit = context_limit
        self._eligible: list[tuple[np.ndarray, int, np.ndarray]] = []  # members, column, mask
        self._least: list[tuple[np.ndarray, int, int]] = []  # members, shared, end
        self._most: list[tuple[np.ndarray, int, bool]] = []  # members, most blocks, answer
        # members, context less their counts, context, (n, prefix, queries, model), verdict
        self._verdicts: list[tuple[np.ndarray, int, int, tuple, bool]] = []
        self._checks: tuple | None = None  # the reads as arrays, made by the first `holds`

    def eligible(self, members: np.ndarray, column: int) -> np.ndarray:
        """The `members` (indices, in order) that have computed block `column` whole."""
        mask = self._counts[members] >= (column + 1) * self._bs
        if len(members):
            self._eligible.append((members, column, mask))
        return members[mask]

    def end(self, members: np.ndarray, shared: int) -> int:
        """min(shared, the least whole blocks a member (two or more) has computed)."""
        end = min(shared, int(self._counts[members].min()) // self._bs)
        self._least.append((members, shared, end))
        return end

    def rising(self, members: np.ndarray, decide: Callable[[int], bool]) -> bool:
        """decide(the most whole blocks a member (one or more) has computed), where
        `decide` is never False for more blocks where it is True for fewer. (Other
        counts answer alike where the answer was True and those blocks are no fewer,
        or it was False and they are no more.)"""
        most = int(self._counts[members].max()) // self._bs
        answer = bool(decide(most))
        self._most.append((members, most, answer))
        return answer

    def pays(
        self, members: np.ndarray, prefix_tokens: int, queries: int, base: int, model=None
    ) -> bool:
        """CascadePlanner.pays for `members` (two or more) as a group over `prefix_tokens`
        past column `base`, with `queries` query tokens: their contexts past `base`."""
        n = len(members)
        offset = queries - n * base * self._bs
        context = int(self._counts[members].sum()) + offset
        verdict = self._pays(n, prefix_tokens, queries, context, model=model)
        if n:  # no members: a verdict on no counts
            args = (n, prefix_tokens, queries, model)
            self._verdicts.append((members, offset, context, args, verdict))
        return verdict

    def holds(self, num_computed_tokens: np.ndarray) -> bool:
        """Whether every read would give the same answer for `num_computed_tokens` (i[R],
        the same requests). False where a verdict's cost model gives no context limit."""
        counts = num_computed_tokens
        if counts.shape != self._counts.shape:
            return False
        if self._checks is None:
            self._checks = _checks(self)
        if self._checks is False:
            return False
        at, starts, eligible, least, most, verdicts = self._checks
        found = counts[at]  # the members of each member set read, concatenated
        if eligible is not None:
            positions, thresholds, mask = eligible
            if ((found[positions] >= thresholds) != mask).any():
                return False
        if least is not None:
            sets, shared, ends = least
            blocks = np.minimum.reduceat(found, starts)[sets] // self._bs
            if (np.minimum(blocks, shared) != ends).any():
                return False
        if most is not None:
            sets, blocks, answers = most
            now = np.maximum.reduceat(found, starts)[sets] // self._bs
            if np.where(answers, now < blocks, now > blocks).any():
                return False
        if verdicts is not None:
            sets, offsets, limits, paid = verdicts
            contexts = np.add.reduceat(found, starts, dtype=np.int64)[sets] + offsets
            if (((limits >= 0) & (contexts <= limits)) != paid).any():
                return False
        return True


def _checks(reads: SearchReads) -> tuple | bool:
    """The reads of `reads` as arrays: (the member sets read, concatenated, where each
    starts, then per kind of read (None for a kind with none) the index of each read's
    member set and what it found); False where a verdict has no context limit or its
    limit disagrees with it."""
    verdicts = None
    if reads._verdicts:
        limits = []
        for _, _, context, (n, prefix, queries, model), verdict in reads._verdicts:
            limit = reads._context_limit(n, prefix, queries, model)
            if limit is None or (0 <= limit and context <= limit) != verdict:
                return False  # no limit to check a verdict by
            limits.append(limit)
    index: dict[int, int] = {}  # id of a member set -> its place among the sets
    sets: list[np.ndarray] = []

    def place(members: np.ndarray) -> int:
        k = index.get(id(members))
        if k is None:
            k = index[id(members)] = len(sets)
            sets.append(members)
        return k

    kinds = (reads._eligible, reads._least, reads._most, reads._verdicts)
    placed = [np.array([place(r[0]) for r in kind], np.int64) for kind in kinds]
    sizes = np.array([len(m) for m in sets], np.int64)
    starts = np.cumsum(sizes) - sizes
    eligible = least = most = None
    if reads._eligible:
        k = placed[0]
        positions = np.concatenate([np.arange(starts[j], starts[j] + sizes[j]) for j in k])
        thresholds = np.repeat([(r[1] + 1) * reads._bs for r in reads._eligible], sizes[k])
        eligible = (positions, thresholds, np.concatenate([r[2] for r in reads._eligible]))
    if reads._least:
        shared = np.array([r[1] for r in reads._least], np.int64)
        least = (placed[1], shared, np.array([r[2] for r in reads._least], np.int64))
    if reads._most:
        blocks = np.array([r[1] for r in reads._most], np.int64)
        most = (placed[2], blocks, np.array([r[2] for r in reads._most], bool))
    if reads._verdicts:
        offsets = np.array([r[1] for r in reads._verdicts], np.int64)
        paid = np.array([r[4] for r in reads._verdicts], bool)
        verdicts = (placed[3], offsets, np.array(limits, np.int64), paid)
    at = np.concatenate(sets) if sets else np.zeros(0, np.int64)
    return at, starts, eligible, least, most, verdicts
