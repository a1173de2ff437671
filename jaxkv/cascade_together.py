"""Which candidate groups a groups level keeps: the heaviest set of them that share no
request, and whether they pay the level's one call.

Plain Python and numpy. CascadePlanner's group search (jaxkv.cascade_groups) hands
over the candidates that pay a call of their own and those that pay their own merge (a
group of a level that runs anyway); the level is planned if the disjoint ones kept save
more than its one call costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.cascade_cost import AttentionShape, CascadeCostModel
from jaxkv.cascade_fold import folded

__all__ = [
    "global_weight",
    "kept_groups",
    "kept_of_nested",
    "level_weight",
    "net_bytes",
    "outweigh_global",
]

# (blocks saved, members (sorted batch positions), end block, their query tokens)
Candidate = tuple[int, np.ndarray, int, int]


def kept_groups(
    candidates: list[Candidate],
    base: int,  # the level's first block column
    block_size: int,
    shape: AttentionShape,
    model: CascadeCostModel,
    max_groups: int,
    rest: Callable[[np.ndarray, int], Candidate | None],
    unpaid: Sequence[Candidate] = (),
    need: np.ndarray | None = None,
) -> list[tuple[int, np.ndarray, int]]:
    """Disjoint groups (at most max_groups, as (blocks saved, members, end)) of the
    `candidates` and of the rest of a candidate's members (`rest`, below), whose savings
    together pay one call of the level, else [].

    `unpaid`: candidates that pay neither a call nor their own merge, nested or disjoint
    with the others. None is kept, but the rest of its members beside the groups kept
    among them is weighed as a candidate's rest is.

    `need`: i[R] or None, the least end of a group holding each request
    (buckets.least_suffix_starts: where the suffix pass must start to pad to fewer
    pages). A group ending short of a member's need is then never kept, and each
    request needing more than `base` is held in a kept group wherever the tree of
    candidates allows, before any heavier choice (within max_groups where the largest
    candidates holding them allow it; the planner checks the pages of the groups
    kept).

    Each group is weighed by net_bytes (a cost model that is no CascadeCostModel has a
    call that costs nothing). The search splits a candidate only into subsets of it, so
    any two candidates nest or are disjoint. Kept is the disjoint set of largest total
    weight over the tree of candidates: for each candidate, from the smallest up,
    either the candidate, or the groups kept among its members beside the group of its
    members in none of them (`rest(members, end)`: a candidate at the candidate's end
    where two or more such members pay as the search's candidates do, else None; they
    still share its blocks), whichever weighs more (the candidate on a tie: one group
    over more requests rather than several). So a candidate that outweighs each group
    of its split, but not all of them together, does not hide them, nor does a group
    hide a subset of it that shares more blocks and saves more, nor do such subsets
    hide the other members of the group they split from (16 requests under a long
    system prompt beside 48 under only the header they all share). Where that set holds
    more than max_groups, its max_groups heaviest are kept, or the candidates taken
    heaviest first while disjoint, up to max_groups, where those weigh more; with
    `need`, of those two, its groups holding such a request with its heaviest others
    (where those holding one are at most max_groups) and the largest candidates holding
    each request needing more than `base` (where they are at most max_groups), the
    heaviest whose groups hold every such request and end at or past their members'
    need, where one does. Where the set kept then holds not every such request, or does
    not pay the call, the candidates are weighed again, each free to keep the groups
    kept among its members but some whose members join its rest at its end instead,
    within max_groups (cascade_fold.folded), and that set is kept where it holds every
    such request: under a header, the rest of the four requests in two of three runs
    beside the third, whose members need a longer group, where two groups are allowed;
    or a pair under a header in the rest beside the one other request there needing a
    group, where a deeper group keeps the others. This second look makes one `rest` call
    more per candidate and group kept inside it, at most.
    """
    if not candidates:
        return []
    call = model.cost_bytes(0, shape.num_q_heads, shape.head_dim) if _costed(model) else 0
    weigh = _weigher(model, shape, base, block_size)
    # (weight, first member, candidate), heaviest first
    weighed = sorted(
        ((weigh(group), int(group[1][0]), group) for group in candidates),
        key=lambda t: (-t[0], t[1]),
    )
    never = [(-math.inf, int(group[1][0]), group) for group in unpaid]
    needed = _needed(need, base)
    best = _heaviest_nested(weighed + never, weigh, rest, needed)
    best = _within(best, weighed, need, base, max_groups)
    if needed is not None and not (sum(t[0] for t in best) > call and _holds(best, *needed)):
        again = _heaviest_nested(weighed + never, weigh, rest, needed, max_groups)
        again = _within(again, weighed, need, base, max_groups)
        if _holds(again, *needed):
            best = again
    if sum(t[0] for t in best) <= call:
        return []
    return [group[:3] for _, _, group in best]


def _within(
    best: list[tuple], weighed: list[tuple], need: np.ndarray | None, base: int, max_groups: int
) -> list[tuple]:
    """`best` (_heaviest_nested's) where it holds at most max_groups groups, else the
    heaviest of kept_groups' options of at most max_groups."""
    if len(best) <= max_groups:
        return best
    options = [best[:max_groups], _heaviest_first(weighed, max_groups)]
    if need is not None:  # those holding every request that must be held, if any
        must = need > base
        options.append(_holding_first(best, must, max_groups))
        options.append(_outermost_holding(weighed, need, base, max_groups))
        options = [o for o in options if o and _holds(o, need, must)] or options[:2]
    return max(options, key=lambda o: sum(t[0] for t in o))  # the first on ties


def kept_of_nested(
    candidates: list[Candidate],  # any two nest or are disjoint
    weights: list[float],  # net_bytes of each
    base: int,  # the level's first block column
    block_size: int,
    shape: AttentionShape,
    model: CascadeCostModel,
    rest: Callable[[np.ndarray, int], Candidate | None],
    need: np.ndarray | None = None,  # as for kept_groups
) -> list[Candidate]:
    """The disjoint set of largest total weight that kept_groups finds among
    `candidates` and their rest groups, before its max_groups and call limits. The
    search weighs a cut chain (_past_cap's groups) with it where no other candidate
    lies inside the chain, so its choice stands for the chain's in kept_groups."""
    weighed = [(w, int(g[1][0]), g) for w, g in zip(weights, candidates, strict=True)]
    weigh = _weigher(model, shape, base, block_size)
    chosen = _heaviest_nested(weighed, weigh, rest, _needed(need, base))
    return [group for _, _, group in chosen]


def net_bytes(
    model: CascadeCostModel,
    shape: AttentionShape,
    num_requests: int,
    prefix_tokens: int,
    num_query_tokens: int,
) -> float:
    """What a group adds to a groups level that runs anyway: the bytes it saves less its
    queries' merge (for a cost model that is no CascadeCostModel, which has only pays,
    the bytes it saves)."""
    s, kv_bytes_per_token = shape, shape.kv_bytes_per_token
    if not _costed(model):
        return max(num_requests - 1, 0) * prefix_tokens * kv_bytes_per_token
    saved = model.saved_bytes(num_requests, prefix_tokens, kv_bytes_per_token)
    call = model.cost_bytes(0, s.num_q_heads, s.head_dim)
    return saved - (model.cost_bytes(num_query_tokens, s.num_q_heads, s.head_dim) - call)


def outweigh_global(
    model: CascadeCostModel,
    shape: AttentionShape,
    num_requests: int,  # the batch's
    global_tokens: int,  # the global level's prefix
    num_query_tokens: int,  # the batch's
    group_sizes: list[int],  # members of each group of the groups level under it
    rest_weight: float = 0.0,  # net_bytes of the others as a group over its prefix
) -> bool:
    """Whether the groups under a global level weigh more starting at column 0, without
    it: they then read its prefix once per group, and the requests in no group read it
    themselves or, where they pay their merge as one more group over its prefix, once
    (`rest_weight`), but its call and its merge of every query go (global_weight).
    False for a cost model that is no CascadeCostModel (it has no costs to weigh)."""
    if not _costed(model):
        return False
    kv_bytes_per_token = shape.kv_bytes_per_token
    grouped = sum(model.saved_bytes(n, global_tokens, kv_bytes_per_token) for n in group_sizes)
    grouped += rest_weight
    return grouped > global_weight(model, shape, num_requests, global_tokens, num_query_tokens)


def global_weight(
    model: CascadeCostModel,
    shape: AttentionShape,
    num_requests: int,  # the batch's
    global_tokens: int,  # the global level's prefix
    num_query_tokens: int,  # the batch's
) -> float:
    """What a global level saves less its call and its merge of every query."""
    s = shape
    saved = model.saved_bytes(num_requests, global_tokens, s.kv_bytes_per_token)
    return saved - model.cost_bytes(num_query_tokens, s.num_q_heads, s.head_dim)


def level_weight(
    model: CascadeCostModel,
    shape: AttentionShape,
    groups: list[tuple[np.ndarray, int]],  # (members, end block) of each group
    base: int,  # the level's first block column
    block_size: int,
    query_lens: np.ndarray,  # i[R] the batch's
) -> float:
    """What a groups level of `groups` saves less its call and merges (net_bytes of each
    group, less the call); 0 for no groups."""
    if not groups:
        return 0.0
    s = shape
    weight = -model.cost_bytes(0, s.num_q_heads, s.head_dim)
    for members, end in groups:
        queries = int(query_lens[members].sum())
        weight += net_bytes(model, s, len(members), (end - base) * block_size, queries)
    return weight


def _costed(model) -> bool:
    return isinstance(model, CascadeCostModel)


def _weigher(
    model: CascadeCostModel, shape: AttentionShape, base: int, block_size: int
) -> Callable[[Candidate], float]:
    """net_bytes of a group of a level starting at column `base`."""

    def weigh(group: Candidate) -> float:
        _, members, end, queries = group
        return net_bytes(model, shape, len(members), (end - base) * block_size, queries)

    return weigh


def _needed(need: np.ndarray | None, base: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(need, bool[R] the requests a group must hold) for _heaviest_nested."""
    return None if need is None else (need, need > base)


def _heaviest_nested(weighed: list[tuple], weigh, rest, needed=None, fold=0) -> list[tuple]:
    """The entries of `weighed` and rest groups (as (weight, first member, candidate))
    of the disjoint set of largest total weight, heaviest first, for candidates that
    nest or are disjoint: from the smallest up, a candidate replaces the groups kept
    among its members when it weighs at least as much as they do together with the rest
    of its members (kept_groups), else that rest joins them where it pays. `needed`:
    (need, must) (_needed): a group whose end falls short of a member's need is never
    kept, and of the two choices one that holds every `must` member is taken first.
    `fold` > 0 (with `needed`): a third choice, the groups kept among a candidate's
    members less those folded into its rest (cascade_fold.folded, at most `fold` groups
    among them), replaces the other two where it weighs at least as much as the
    candidate: on a tie the fold keeps the deeper groups, which the candidates around
    it may still keep beside their own rest, where the candidate whole would hide them."""
    num_requests = max(int(group[1][-1]) for _, _, group in weighed) + 1
    weight_at = np.zeros(num_requests)  # weight of each kept group, at its first member
    kept_at = np.full(num_requests, -1)  # its index into `entries`, at its first member
    covered = np.zeros(num_requests, bool)  # members of the kept groups
    entries = list(weighed)
    for k in sorted(range(len(weighed)), key=lambda k: len(weighed[k][2][1])):
        weight, _, (_, members, end, _) = weighed[k]
        if needed is not None and int(needed[0][members].max()) > end:
            weight = -math.inf  # a member's suffix pass would pad to as many pages as flat
        together, others = weight_at[members].sum(), None
        if together:  # some groups kept among its members
            others = members[~covered[members]]
            fits = needed is None or int(needed[0][others].max(initial=0)) <= end
            others = rest(others, end) if len(others) > 1 and fits else None
            if others is not None:
                others = (weigh(others), int(others[1][0]), others)
                together += others[0]
        take = weight > 0 and weight >= together
        if needed is not None and weight > 0 and not take:
            # members that the heavier groups among them and their rest leave in no group
            alone = ~covered[members]
            if others is not None and others[0] > 0:
                alone[np.searchsorted(members, others[2][1])] = False
            if needed[1][members[alone]].any():
                take = True  # only the candidate holds every member that must be held
        if fold and together:  # groups kept among the members may join their rest
            found = folded(entries, kept_at, covered, members, end, weigh, rest, needed, fold)
            if found is not None and not (weight > 0 and weight > found[0]):
                _, firsts, group = found
                weight_at[firsts], kept_at[firsts] = 0, -1
                if group is not None:
                    entries.append((weigh(group), int(group[1][0]), group))
                    first = entries[-1][1]
                    weight_at[first], kept_at[first] = entries[-1][0], len(entries) - 1
                    covered[group[1]] = True
                continue
            take = take or found is not None  # the candidate outweighs the fold
        if take:
            weight_at[members], kept_at[members], covered[members] = 0, -1, True
            weight_at[members[0]], kept_at[members[0]] = weight, k
        elif others is not None and others[0] > 0:
            first, at = others[1], others[2][1]
            entries.append(others)
            weight_at[first], kept_at[first], covered[at] = others[0], len(entries) - 1, True
    kept = [entries[k] for k in kept_at[kept_at >= 0].tolist()]
    return sorted(kept, key=lambda t: (-t[0], t[1]))


def _holds(entries: list[tuple], need: np.ndarray, must: np.ndarray) -> bool:
    """Whether the groups of `entries` hold every request of bool[R] `must`, each group
    ending at or past its members' `need` (kept_groups')."""
    held = np.zeros(len(must), bool)
    for entry in entries:
        members, end = entry[2][1], entry[2][2]
        if int(need[members].max()) > end:
            return False
        held[members] = True
    return bool(held[must].all())


def _holding_first(entries: list[tuple], must: np.ndarray, max_groups: int) -> list[tuple]:
    """The entries of disjoint, heaviest-first `entries` that hold a request of bool[R]
    `must`, then the heaviest of the others, up to max_groups in all; [] where those
    holding one are more than max_groups."""
    holding = [e for e in entries if must[e[2][1]].any()]
    if len(holding) > max_groups:
        return []
    others = [e for e in entries if not must[e[2][1]].any()][: max_groups - len(holding)]
    return sorted(holding + others, key=lambda t: (-t[0], t[1]))


def _outermost_holding(
    weighed: list[tuple], need: np.ndarray, base: int, max_groups: int
) -> list[tuple]:
    """For each request needing more than `base` (kept_groups' `need`), the largest
    entry of `weighed` that holds it and ends at or past each member's need: disjoint,
    as candidates nest or are disjoint. [] where they are more than max_groups."""
    outermost = {}  # first member -> entry
    for entry in weighed:
        members, end = entry[2][1], entry[2][2]
        if entry[0] > 0 and int(need[members].max()) <= end and (need[members] > base).any():
            first = int(members[0])
            if not any(  # inside one kept already: it holds this entry's members too
                len(e[2][1]) >= len(members) and np.isin(members[0], e[2][1])
                for e in outermost.values()
            ):
                inside = [f for f, e in outermost.items() if np.isin(e[2][1][0], members)]
                for f in inside:
                    del outermost[f]
                outermost[first] = entry
    found = sorted(outermost.values(), key=lambda t: (-t[0], t[1]))
    return found if len(found) <= max_groups else []


def _heaviest_first(weighed: list[tuple], max_groups: int) -> list[tuple]:
    """The entries of `weighed` taken heaviest first while disjoint, up to max_groups."""
    taken = np.zeros(max(int(group[1][-1]) for _, _, group in weighed) + 1, bool)
    kept = []
    for entry in weighed:
        members = entry[2][1]
        if len(kept) < max_groups and not taken[members].any():
            taken[members] = True
            kept.append(entry)
    return kept
