"""LevelMetadata: the padded arrays of one cascade level, built once per plan and layout.

Plain numpy, no JAX. build_attention_metadata (jaxkv.batch) calls `plan_levels` for the
levels of a plan. A level's metadata depends only on the plan, the block-table rows it
reads, the block size, the buckets and the step's token layout (query_lens). For a plan
made by CascadePlanner those rows cannot change while the plan is valid (a row only
gains blocks after the ones a level reads, and the builder refuses the plan once its
manager frees a request), so the builder keeps the last level metadata it built on the
plan itself and returns that same tuple while the rest repeats: a steady decode batch
builds its levels once. Its arrays are read-only, since later steps hand them out again.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv.buckets import BucketConfig, padded_size
from jaxkv.cascade_plan import CascadeLevel, CascadePlan


@dataclasses.dataclass(frozen=True)
class LevelMetadata:
    """One non-causal cascade pass: each sequence is a group of the batch (or a gap)."""

    cu_q_lens: np.ndarray  # i32[level_seqs + 1] token ranges of the groups
    kv_lens: np.ndarray  # i32[level_seqs] shared prefix length of each group (0 in gaps)
    page_indices: np.ndarray  # i32[level_seqs, level_pages] shared blocks of each group
    num_seqs: np.ndarray  # i32[1]
    max_q_len: int  # static: bound on the tokens of one group


jax.tree_util.register_dataclass(
    LevelMetadata,
    data_fields=["cu_q_lens", "kv_lens", "page_indices", "num_seqs"],
    meta_fields=["max_q_len"],
)

_ARRAYS = ("cu_q_lens", "kv_lens", "page_indices", "num_seqs")


def table_slice(
    block_table: np.ndarray,  # i32[num_rows, max_blocks_per_seq]
    rows: np.ndarray,  # i32[n]
    col_starts: np.ndarray,  # i[n]
    width: int,
    col_ends: np.ndarray | None = None,  # i[n] exclusive; default: the table's width
) -> np.ndarray:
    """i32[n, width]: block_table[rows[i], col_starts[i] + j], 0 past col_ends or the table."""
    cols = col_starts[:, None] + np.arange(width)[None, :]
    limit = block_table.shape[1] if col_ends is None else col_ends[:, None]
    valid = cols < limit
    out = block_table[rows[:, None], np.minimum(cols, block_table.shape[1] - 1)]
    return np.where(valid, out, 0).astype(np.int32)


def plan_levels(
    plan: CascadePlan,
    given: tuple[LevelMetadata, ...] | None,
    block_table: np.ndarray,
    token_starts: np.ndarray,  # i[R + 1] cumulative query tokens in plan order
    decode_only: bool,  # every query_lens entry is 1 (token_starts is then 0..R)
    block_size: int,
    buckets: BucketConfig,
) -> tuple[LevelMetadata, ...]:
    """The level metadata of `plan` for this step: the memo's while the plan (a
    CascadePlanner's), buckets and token layout repeat, else built (and, for a planner's
    plan, remembered; its block size is its manager's, which the builder checks).

    `given`: level metadata the caller kept from an earlier step, or None. It is returned
    only if it equals what this step needs; ValueError otherwise (metadata of another
    plan or layout would attend to other requests' blocks). It costs nothing when it is
    the memo's own tuple; otherwise the levels are built and compared.
    `block_table` must hold every row the levels name: the builder has read each from it
    before (a planner's leader rows are among its plan's rows; a hand-made plan's are
    checked), so numpy raises no IndexError here.
    """
    if not plan.levels:
        if given:
            raise ValueError(f"{len(given)=} level metadata given; the plan has no levels")
        return ()
    key = (None if decode_only else token_starts.tobytes(), buckets)
    memo = plan.level_memo
    if memo and memo[0] == key:
        levels = memo[1]
    else:
        starts = token_starts.tolist()
        levels = tuple(
            _level_metadata(level, block_table, starts, block_size, buckets)
            for level in plan.levels
        )
    if given is not None and given is not levels and not _equal_levels(given, levels):
        raise ValueError(
            f"levels: the {len(given)} given level metadata differ from those of this plan "
            f"and query_lens ({len(levels)} levels); pass levels built for the same plan "
            "object and query_lens, or None"
        )
    if plan.made_for is not None and not (memo and memo[1] is levels):
        for lv in levels:
            for name in _ARRAYS:
                getattr(lv, name).flags.writeable = False
        memo[:] = [key, levels]
    return levels if given is None else given


def _equal_levels(a: tuple[LevelMetadata, ...], b: tuple[LevelMetadata, ...]) -> bool:
    return len(a) == len(b) and all(
        x.max_q_len == y.max_q_len
        and all(np.array_equal(getattr(x, name), getattr(y, name)) for name in _ARRAYS)
        for x, y in zip(a, b, strict=True)
    )


def _level_metadata(
    level: CascadeLevel,
    block_table: np.ndarray,
    token_starts: list[int],  # [R + 1] cumulative query tokens in batch order
    block_size: int,
    buckets: BucketConfig,
) -> LevelMetadata:
    """Groups become sequences; the token ranges between groups become empty sequences."""
    bounds, kv_lens, group_pos = [0], [], []
    block_starts, block_ends = level.block_starts.tolist(), level.block_ends.tolist()
    for s, e, first, last in zip(
        level.group_starts.tolist(), level.group_ends.tolist(), block_starts, block_ends,
        strict=True,
    ):  # fmt: skip
        if s > 0 and token_starts[s] > bounds[-1]:
            bounds.append(token_starts[s])
            kv_lens.append(0)
        group_pos.append(len(kv_lens))
        bounds.append(token_starts[e])
        kv_lens.append((last - first) * block_size)
    num_level_seqs = len(kv_lens)
    seqs = padded_size(
        buckets.level_seq_buckets, num_level_seqs, name=f"sequences of cascade level {level.name!r}"
    )
    num_pages = max(b - a for a, b in zip(block_starts, block_ends, strict=True))
    width = padded_size(
        buckets.page_buckets, num_pages, name=f"pages of cascade level {level.name!r}"
    )
    cu = np.array(bounds + bounds[-1:] * (seqs + 1 - len(bounds)), np.int32)
    kv = np.array(kv_lens + [0] * (seqs - num_level_seqs), np.int32)
    pages = np.zeros((seqs, width), np.int32)
    if len(group_pos) == 1 and block_ends[0] - block_starts[0] <= width:
        first, last = block_starts[0], block_ends[0]
        pages[group_pos[0], : last - first] = block_table[int(level.leader_rows[0]), first:last]
    else:
        pages[group_pos] = table_slice(
            block_table, level.leader_rows, level.block_starts.astype(np.int64), width,
            level.block_ends.astype(np.int64),
        )  # fmt: skip
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)), default=1)
    return LevelMetadata(
        cu_q_lens=cu,
        kv_lens=kv,
        page_indices=pages,
        num_seqs=np.array([num_level_seqs], np.int32),
        max_q_len=padded_size(buckets.q_len_buckets, max(longest, 1), name="level query length"),
    )
