"""Requests the cascade planner leaves out of every level: those whose queries cost more
to merge than cascade can save on their reads.

Plain numpy. A request in a level saves one read of the level's blocks and costs the
merge of its queries, once per level it joins. No level covers a request past its
computed whole blocks, nor past the longest prefix of block ids it holds alike with
another scheduled request; so where merging its queries (the cost model's merge, at
least once) costs at least the read of those blocks, taking it out of every level lowers
no level's bytes saved less its merge. A prefill chunk of 512 tokens under a 2048-token
system prompt (32 query heads of 128, 8 KV heads, bf16) merges 24.2 MiB and saves at
most an 8 MiB read: it attends from block 0 in its own pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxkv.cascade_cost import AttentionShape, CascadeCostModel

__all__ = ["left_out", "merge_bytes_per_query"]


def merge_bytes_per_query(model, shape: AttentionShape) -> float:
    """What one more query token adds to a level's merge under `model` (0 for a cost
    model that is no CascadeCostModel: it has only pays)."""
    if not isinstance(model, CascadeCostModel):
        return 0.0
    s = shape
    return model.cost_bytes(1, s.num_q_heads, s.head_dim) - model.cost_bytes(
        0, s.num_q_heads, s.head_dim
    )


def left_out(
    shares: Callable[[int], np.ndarray],  # column -> bool[R] (PlanMemo.shares_column)
    num_computed_tokens: np.ndarray,  # i[R]
    query_lens: np.ndarray,  # i[R]
    merge_per_query: float,  # bytes, > 0
    block_bytes: int,  # KV bytes of one block
    block_size: int,
) -> np.ndarray | None:
    """bool[R]: the requests whose queries' merge costs at least the read of the blocks
    they could share in a level (their computed whole blocks, up to the longest prefix
    they hold alike with another request of the batch); None where there is none.

    `shares(column)`: whether each request holds at that column a prefix id another
    request of the batch holds there (so the same block ids in columns 0..column).
    Cost: a few numpy calls over R, and one shares() per distinct merge length (in
    blocks) of the requests that have computed more blocks than their merge outweighs."""
    # Left out iff min(shared, computed blocks) <= the blocks its merge outweighs.
    merge_blocks = np.floor(query_lens * merge_per_query / block_bytes).astype(np.int64)
    computed_blocks = num_computed_tokens // block_size
    candidate = (merge_blocks >= 1) & (computed_blocks >= 1)
    out = candidate & (computed_blocks <= merge_blocks)
    probe = np.flatnonzero(candidate & ~out)  # shares column merge_blocks (0-based)?
    columns = merge_blocks[probe]
    for column in np.unique(columns).tolist():
        at = probe[columns == column]
        out[at[~shares(column)[at]]] = True
    return out if out.any() else None
