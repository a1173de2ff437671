"""Folding groups into the rest of a candidate around them: kept_groups' second look at
its candidates, where the groups it kept first leave a request whose pages need a group
(buckets.least_suffix_starts) in none, or more groups than max_groups, or do not pay the
level's call.

Plain Python and numpy. It reads and returns kept_groups' entries, (weight, first
member, (blocks saved, members, end, queries)).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["folded"]


def folded(
    entries: list[tuple],
    kept_at: np.ndarray,  # i[R] index into `entries` of each kept group, at its first member
    covered: np.ndarray,  # bool[R] members of the kept groups
    members: np.ndarray,  # a candidate's, sorted
    end: int,  # the candidate's end block
    weigh: Callable[[tuple], float],
    rest: Callable[[np.ndarray, int], tuple | None],  # kept_groups' `rest`
    needed: tuple[np.ndarray, np.ndarray],  # (need, must): kept_groups' need, need > base
    limit: int,  # the most groups kept among `members`
) -> tuple[float, list[int], tuple | None] | None:
    """(weight, first members of the groups folded, the rest group or None) of the
    heaviest choice, among the groups kept inside a candidate, of those whose members
    instead join the candidate's other members in its rest at its `end`, such that
    every `must` member is held, each group ends at or past its members' need and at most
    `limit` groups are kept among `members`; None where no choice does.

    Folding a group loses its weight and adds its members and their queries to the rest,
    whose net_bytes is linear in both: what a fold gains is the same whatever else is
    folded, so the heaviest choice of k folds is the k gaining most, and the choices
    weighed are the groups sorted by gain, folded one more at a time: one `rest` call per
    group kept among `members`."""
    need, must = needed
    alone = members[~covered[members]]
    if int(need[alone].max(initial=0)) > end:
        return None  # only a group ending later can hold it: no rest at `end` does
    inside = kept_at[members]
    inside = inside[inside >= 0].tolist()
    weight, by_gain = 0.0, []
    for k in inside:
        group_weight, first, group = entries[k]
        weight += group_weight
        if int(need[group[1]].max()) <= end:
            gain = weigh((0, group[1], end, group[3])) - group_weight
            by_gain.append((-gain, first, k))
    by_gain.sort()
    best, pool, firsts = None, [alone], []
    for j in range(len(by_gain) + 1):
        if j:
            _, first, k = by_gain[j - 1]
            pool.append(entries[k][2][1])
            firsts.append(first)
            weight -= entries[k][0]
        held = np.sort(np.concatenate(pool))
        group = rest(held, end) if len(held) > 1 else None
        if group is None and (j or must[held].any()):
            continue  # a member folded or that must be held would be in no group
        count = len(inside) - j + (group is not None)
        total = weight + (0.0 if group is None else weigh(group))
        if count <= limit and (best is None or total > best[0]):
            best = (total, list(firsts), group)
    return best
