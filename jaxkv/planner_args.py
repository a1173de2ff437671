"""Argument checks of the cascade planner: its settings, and each plan() call's batch.

Plain Python and numpy. CascadePlanner runs these before it keeps or plans anything, so
a refused argument fails where it is given, with a ValueError naming it, rather than as
an AttributeError at the first plan() or, for a flag read by truthiness, not at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.cascade_cost import DEFAULT_COST_MODELS, AttentionShape, CascadeCostModel
from jaxkv.count_arrays import widened_counts
from jaxkv.field_checks import increasing_sizes, is_integer
from jaxkv.kv_cache_manager import KVCacheManager

__all__ = [
    "check_computed_held",
    "check_distinct",
    "checked_plan_args",
    "checked_planner_settings",
]


def checked_planner_settings(
    shape, *, backend, cost_model, enable_cascade, enable_groups, max_groups, sliding_window,
    page_buckets,
) -> CascadeCostModel:  # fmt: skip
    """The planner's cost model (the backend's default when `cost_model` is None);
    ValueError naming the first argument CascadePlanner cannot use."""
    if not isinstance(shape, AttentionShape):  # a tuple failed in plan(), on .num_q_heads
        raise ValueError(f"shape={shape!r} must be an AttentionShape")
    for name, flag in (("enable_cascade", enable_cascade), ("enable_groups", enable_groups)):
        if not isinstance(flag, bool):  # "no" planned cascade, by its truthiness
            raise ValueError(f"{name}={flag!r} must be a bool")
    if not is_integer(max_groups) or max_groups < 1:  # 2.0 used to fail every plan()
        raise ValueError(f"{max_groups=} must be an int >= 1")
    if sliding_window is not None and (not is_integer(sliding_window) or sliding_window < 1):
        raise ValueError(f"{sliding_window=} must be None or an int >= 1")
    if page_buckets is not None and increasing_sizes(page_buckets) is None:
        raise ValueError(f"{page_buckets=} must be ascending distinct ints >= 1")
    if cost_model is None:
        if not isinstance(backend, str) or backend not in DEFAULT_COST_MODELS:
            raise ValueError(f"{backend=} must be one of {sorted(DEFAULT_COST_MODELS)}")
        return DEFAULT_COST_MODELS[backend]
    needs = ("reads_padded_pages",) if page_buckets else ()  # what the planner reads of it
    if not callable(getattr(cost_model, "pays", None)) or not all(
        hasattr(cost_model, name) for name in needs
    ):  # a dict of CascadeCostModel's fields failed in plan(), on .pays
        raise ValueError(
            f"cost_model={cost_model!r} must be a CascadeCostModel (or have its pays method, "
            "and reads_padded_pages with page_buckets)"
        )
    return cost_model


def checked_plan_args(request_ids: Sequence[str], num_computed_tokens, query_lens, manager):
    """The two per-request counts as arrays; ValueError naming a bad argument (a count
    below 0 too)."""
    try:
        num_requests = len(request_ids)
    except TypeError:  # None, a generator: plan() needs the ids twice
        raise ValueError(f"{request_ids=} must be a sequence of request ids") from None
    if isinstance(request_ids, str):  # its characters would be read as ids
        raise ValueError(f"{request_ids=} must be a sequence of request ids, not a str")
    num_computed_tokens = np.asarray(num_computed_tokens)
    query_lens = np.asarray(query_lens)
    if num_computed_tokens.shape != (num_requests,) or query_lens.shape != (num_requests,):
        raise ValueError(
            f"{num_computed_tokens.shape=} and {query_lens.shape=} must be ({num_requests},)"
        )
    if not isinstance(manager, KVCacheManager):
        raise ValueError(f"manager={type(manager).__name__} must be a KVCacheManager")
    if num_requests and (
        num_computed_tokens.dtype.kind not in "iu" or query_lens.dtype.kind not in "iu"
    ):  # floats used to plan fractional block caps; bools passed as 0/1
        raise ValueError(
            f"{num_computed_tokens.dtype=} and {query_lens.dtype=} must be integer dtypes"
        )
    num_computed_tokens = widened_counts(num_computed_tokens)
    query_lens = widened_counts(query_lens)
    for name, counts in (("num_computed_tokens", num_computed_tokens), ("query_lens", query_lens)):
        if num_requests and counts.min() < 0:  # a level would start at a negative column
            i = int(np.argmin(counts))
            raise ValueError(f"{name}[{i}]={int(counts[i])} must be >= 0")
    return num_computed_tokens, query_lens


def check_computed_held(num_computed_tokens: np.ndarray, rows: np.ndarray, manager) -> None:
    """ValueError naming the first batch position whose num_computed_tokens lies past the
    blocks its request holds: a level over them would read blocks it does not hold."""
    held = manager.num_blocks_of_rows(rows).astype(np.int64) * manager.block_size
    past = num_computed_tokens > held
    if past.any():
        i = int(np.argmax(past))
        raise ValueError(
            f"num_computed_tokens[{i}]={int(num_computed_tokens[i])} lies past the "
            f"{int(held[i])} token slots its request holds (allocate them first)"
        )


def check_distinct(rows: np.ndarray, request_ids: Sequence[str]) -> None:
    """ValueError naming an id given twice: its two batch positions would both write its
    KV slots and each attend as the whole request."""
    if len(rows) > 1:
        repeats = np.bincount(rows)[rows] > 1
        if repeats.any():
            req_id = list(request_ids)[int(np.argmax(repeats))]
            raise ValueError(f"request_ids: {req_id!r} is given more than once")
