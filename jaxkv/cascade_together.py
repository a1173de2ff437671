"""Groups that pay only together: which candidates a groups level keeps when no candidate
group pays a call of its own.

Plain Python and numpy. CascadePlanner's group search (jaxkv.cascade) hands over the
candidates that pay their own merge (a group of a level that runs anyway); the level
is planned if the disjoint ones kept save more than its one call costs.
"""

from __future__ import annotations

import numpy as np

from jaxkv.cascade_cost import AttentionShape, CascadeCostModel

__all__ = ["paying_together"]

# (blocks saved, members (sorted batch positions), end block, their query tokens)
Candidate = tuple[int, np.ndarray, int, int]


def paying_together(
    candidates: list[Candidate],
    base: int,  # the level's first block column
    block_size: int,
    shape: AttentionShape,
    model: CascadeCostModel,
    max_groups: int,
) -> list[tuple[int, np.ndarray, int]]:
    """Disjoint `candidates` (at most max_groups, as (blocks saved, members, end)) whose
    savings together pay one call of the level, else [].

    Each candidate is weighed by the bytes it saves less its queries' merge. The search
    splits a candidate only into subsets of it, so any two candidates nest or are
    disjoint. Kept are the candidates taken heaviest first while disjoint, up to
    max_groups, or, if that passed one over, the heaviest disjoint set over that nesting
    cut to its max_groups heaviest where it weighs more (summed): a candidate that
    outweighs each group of its split, but not all of them together, does not hide
    them.
    """
    if not candidates:  # a cost model with only a pays method has no cost_bytes
        return []
    s = shape
    kv_bytes_per_token = 2 * s.num_kv_heads * s.head_dim * s.kv_itemsize
    call = model.cost_bytes(0, s.num_q_heads, s.head_dim)
    weighed = []  # (weight, first member, index in candidates), heaviest first
    for i, (_, members, end, queries) in enumerate(candidates):
        saved = model.saved_bytes(len(members), (end - base) * block_size, kv_bytes_per_token)
        merge = model.cost_bytes(queries, s.num_q_heads, s.head_dim) - call
        weighed.append((saved - merge, int(members[0]), i))
    weighed.sort(key=lambda t: (-t[0], t[1]))
    best, overlapped = _heaviest_first(weighed, candidates, max_groups)
    if overlapped:  # else the candidates are disjoint: the nested set is the same
        nested = _heaviest_nested(weighed, candidates)[:max_groups]
        best = max(best, nested, key=lambda kept: sum(weighed[k][0] for k in kept))
    if sum(weighed[k][0] for k in best) <= call:
        return []
    return [candidates[weighed[k][2]][:3] for k in best]


def _heaviest_nested(weighed: list[tuple], candidates: list[Candidate]) -> list[int]:
    """Indices into `weighed` of the disjoint set of largest total weight, heaviest first,
    for candidates that nest or are disjoint: from the smallest up, a candidate replaces
    the ones kept among its members when it weighs more than they do together."""
    num_requests = max(int(candidates[i][1][-1]) for _, _, i in weighed) + 1
    weight_at = np.zeros(num_requests)  # weight of each kept candidate, at its first member
    kept_at = np.full(num_requests, -1)  # its index into `weighed`, at its first member
    for k in sorted(range(len(weighed)), key=lambda k: len(candidates[weighed[k][2]][1])):
        members = candidates[weighed[k][2]][1]
        if weighed[k][0] > weight_at[members].sum():
            weight_at[members] = 0
            kept_at[members] = -1
            weight_at[members[0]], kept_at[members[0]] = weighed[k][0], k
    return sorted(kept_at[kept_at >= 0].tolist())


def _heaviest_first(
    weighed: list[tuple], candidates: list[Candidate], max_groups: int
) -> tuple[list[int], bool]:
    """(indices into `weighed` of the candidates taken heaviest first while disjoint, up
    to max_groups; whether a candidate was passed over for holding a request taken)."""
    taken = np.zeros(max(int(candidates[i][1][-1]) for _, _, i in weighed) + 1, bool)
    kept, overlapped = [], False
    for k, (_, _, i) in enumerate(weighed):
        members = candidates[i][1]
        if taken[members].any():
            overlapped = True
        elif len(kept) < max_groups:
            taken[members] = True
            kept.append(k)
    return kept, overlapped
