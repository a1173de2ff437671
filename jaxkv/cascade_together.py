"""Which candidate groups a groups level keeps: the heaviest set of them that share no
request, and whether they pay the level's one call.

Plain Python and numpy. CascadePlanner's group search (jaxkv.cascade_groups) hands
over the candidates that pay a call of their own and those that pay their own merge (a
group of a level that runs anyway); the level is planned if the disjoint ones kept save
more than its one call costs.
"""

from __future__ import annotations

import numpy as np

from jaxkv.cascade_cost import AttentionShape, CascadeCostModel

__all__ = ["global_weight", "kept_groups", "level_weight", "net_bytes", "outweigh_global"]

# (blocks saved, members (sorted batch positions), end block, their query tokens)
Candidate = tuple[int, np.ndarray, int, int]


def kept_groups(
    candidates: list[Candidate],
    base: int,  # the level's first block column
    block_size: int,
    shape: AttentionShape,
    model: CascadeCostModel,
    max_groups: int,
) -> list[tuple[int, np.ndarray, int]]:
    """Disjoint `candidates` (at most max_groups, as (blocks saved, members, end)) whose
    savings together pay one call of the level, else [].

    Each candidate is weighed by net_bytes (a cost model that is no CascadeCostModel
    has a call that costs nothing). The search splits a candidate only into subsets of
    it, so any two candidates nest or are disjoint. Kept is the disjoint set of largest
    total weight (a candidate rather than those nested in it where it weighs as much as
    they do together): a candidate that outweighs each group of its split, but not all
    of them together, does not hide them, nor does a group hide a subset of it that
    shares more blocks and saves more. Where that set holds more than max_groups, its
    max_groups heaviest are kept, or the candidates taken heaviest first while
    disjoint, up to max_groups, where those weigh more.
    """
    if not candidates:
        return []
    call = model.cost_bytes(0, shape.num_q_heads, shape.head_dim) if _costed(model) else 0
    weighed = []  # (weight, first member, index in candidates), heaviest first
    for i, (_, members, end, queries) in enumerate(candidates):
        weight = net_bytes(model, shape, len(members), (end - base) * block_size, queries)
        weighed.append((weight, int(members[0]), i))
    weighed.sort(key=lambda t: (-t[0], t[1]))
    best = _heaviest_nested(weighed, candidates)
    if len(best) > max_groups:
        best = best[:max_groups]
        first = _heaviest_first(weighed, candidates, max_groups)
        if sum(weighed[k][0] for k in first) > sum(weighed[k][0] for k in best):
            best = first
    if sum(weighed[k][0] for k in best) <= call:
        return []
    return [candidates[weighed[k][2]][:3] for k in best]


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
) -> bool:
    """Whether the groups under a global level weigh more starting at column 0, without
    it: they then read its prefix once per group, and the requests in no group read it
    themselves, but its call and its merge of every query go. False for a cost model
    that is no CascadeCostModel (it has no costs to weigh)."""
    if not _costed(model):
        return False
    s, kv_bytes_per_token = shape, shape.kv_bytes_per_token
    grouped = sum(model.saved_bytes(n, global_tokens, kv_bytes_per_token) for n in group_sizes)
    alone = model.saved_bytes(num_requests, global_tokens, kv_bytes_per_token)
    return grouped > alone - model.cost_bytes(num_query_tokens, s.num_q_heads, s.head_dim)


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


def _heaviest_nested(weighed: list[tuple], candidates: list[Candidate]) -> list[int]:
    """Indices into `weighed` of the disjoint set of largest total weight, heaviest first,
    for candidates that nest or are disjoint: from the smallest up, a candidate replaces
    the ones kept among its members when it weighs at least as much as they do together
    (on a tie, one group over more requests rather than several)."""
    num_requests = max(int(candidates[i][1][-1]) for _, _, i in weighed) + 1
    weight_at = np.zeros(num_requests)  # weight of each kept candidate, at its first member
    kept_at = np.full(num_requests, -1)  # its index into `weighed`, at its first member
    for k in sorted(range(len(weighed)), key=lambda k: len(candidates[weighed[k][2]][1])):
        members = candidates[weighed[k][2]][1]
        if weighed[k][0] > 0 and weighed[k][0] >= weight_at[members].sum():
            weight_at[members] = 0
            kept_at[members] = -1
            weight_at[members[0]], kept_at[members[0]] = weighed[k][0], k
    return sorted(kept_at[kept_at >= 0].tolist())


def _heaviest_first(
    weighed: list[tuple], candidates: list[Candidate], max_groups: int
) -> list[int]:
    """Indices into `weighed` of the candidates taken heaviest first while disjoint, up to
    max_groups."""
    taken = np.zeros(max(int(candidates[i][1][-1]) for _, _, i in weighed) + 1, bool)
    kept = []
    for k, (_, _, i) in enumerate(weighed):
        members = candidates[i][1]
        if len(kept) < max_groups and not taken[members].any():
            taken[members] = True
            kept.append(k)
    return kept
