"""AttentionMetadata: the padded, static-shape arrays one step's attention needs.

Built on the host from numpy slices of the KV cache manager's block table (no Python
loop over blocks) and a CascadePlan, then handed to jit as a pytree whose data fields
are arrays and whose static fields (bucket-derived bounds, backend, flags) are hashable.
Every array is padded to a bucket size (jaxkv.buckets), so a serving run compiles at
most one program per combination of buckets.

Conventions: padded page-table entries hold the null block 0; padded tokens write their
K/V into the null block (slot 0) and read nothing into a valid row.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv.buckets import BucketConfig, padded_size
from jaxkv.cascade import CascadePlan
from jaxkv.cascade_plan import positions_of_groups
from jaxkv.count_arrays import checked_step_counts
from jaxkv.field_checks import is_integer
from jaxkv.level_metadata import LevelMetadata, plan_levels, table_slice
from kernels_pallas.validation import validate_index_values

__all__ = ["AttentionMetadata", "LevelMetadata", "build_attention_metadata"]

BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")  # attention backends, as metadata names them


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs for one step, padded to buckets.

    The main pass is causal over each request's pages from suffix_start_block on (all
    of them when no cascade level is planned); each level in `levels` is a non-causal
    pass over shared pages, merged with the main pass through the LSEs. Rows of the
    main pass past num_seqs and tokens past cu_q_lens[num_seqs] are padding.
    `max_q_len` (and each level's) must be at least the pass's longest query: the xla
    backend gives the rows past it no attention. paged_attention refuses a smaller one
    when the index arrays are concrete (check_query_bounds); with traced ones (metadata
    passed into jit) it cannot, so a hand-made metadata must hold it.
    """

    slot_mapping: np.ndarray  # i32[max_num_tokens] block_id * block_size + offset; pad -> 0
    positions: np.ndarray  # i32[max_num_tokens] position of each token in its sequence
    logits_indices: np.ndarray  # i32[max_num_seqs] last scheduled token of each sequence
    cu_q_lens: np.ndarray  # i32[max_num_seqs + 1]
    kv_lens: np.ndarray  # i32[max_num_seqs] keys the main (suffix) pass reads per sequence
    page_indices: np.ndarray  # i32[max_num_seqs, pages_per_seq] main-pass pages
    num_seqs: np.ndarray  # i32[1]
    levels: tuple[LevelMetadata, ...]  # cascade levels, outermost first
    block_size: int  # static
    max_q_len: int  # static: bound on the query tokens of one sequence
    backend: str  # static: "xla" | "pallas_tpu" | "pallas_gpu"
    interpret: bool  # static: run Pallas kernels in interpret mode
    # static: blocks in the pool of the plan's manager, which kv_pages must hold (its page
    # ids address them all); None for a hand-made plan
    num_blocks: int | None = None

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def max_num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def max_num_seqs(self) -> int:
        return self.kv_lens.shape[0]


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=[
        "slot_mapping",
        "positions",
        "logits_indices",
        "cu_q_lens",
        "kv_lens",
        "page_indices",
        "num_seqs",
        "levels",
    ],
    meta_fields=["block_size", "max_q_len", "backend", "interpret", "num_blocks"],
)


def checked_passes(
    metadata: AttentionMetadata,
) -> list[tuple[str, AttentionMetadata | LevelMetadata]]:
    """(name, arrays) of each pass, the main (causal) one first, then each level; or
    ValueError naming metadata.levels unless it is a tuple (or list) of LevelMetadata:
    None failed with "'NoneType' object is not iterable", a dict with an AttributeError,
    neither naming the field."""
    levels = metadata.levels
    if not isinstance(levels, (tuple, list)) or not all(
        isinstance(level, LevelMetadata) for level in levels
    ):
        raise ValueError(f"metadata.levels={levels!r} must be a tuple of LevelMetadata")
    return [("metadata", metadata)] + [(f"metadata.levels[{i}]", lv) for i, lv in enumerate(levels)]


def check_query_bounds(metadata: AttentionMetadata) -> None:
    """checked_passes, then ValueError naming metadata.max_q_len (or a level's) unless it
    is at least the query length of every valid sequence of its pass. The xla backend
    lays each sequence out in max_q_len rows, so under paged_attention's jit a hand-made
    metadata with a smaller bound gave the rows past it no attention, without an error
    (the builder always sets it right). Checks concrete index arrays only (numpy, or jax
    arrays outside jit): traced ones, and shapes or values the kernels refuse, pass."""
    for where, arrays in checked_passes(metadata):
        cu_q_lens, num_seqs = arrays.cu_q_lens, arrays.num_seqs
        if isinstance(cu_q_lens, jax.core.Tracer) or isinstance(num_seqs, jax.core.Tracer):
            continue
        cu_q_lens, num_seqs = np.asarray(cu_q_lens), np.asarray(num_seqs)
        if cu_q_lens.ndim != 1 or num_seqs.shape != (1,) or not is_integer(arrays.max_q_len):
            continue
        n = int(num_seqs[0])
        if not 0 <= n < cu_q_lens.shape[0]:
            continue
        q_lens = np.diff(cu_q_lens[: n + 1].astype(np.int64))
        if q_lens.size and q_lens.max() > arrays.max_q_len:
            i = int(q_lens.argmax())
            raise ValueError(
                f"{where}.max_q_len={arrays.max_q_len} must be at least the query length of "
                f"every valid sequence: sequence {i} has {q_lens[i]} query tokens"
            )


def check_values(metadata: AttentionMetadata, q, kv_pages) -> None:
    """check_query_bounds, then kernels_pallas.validation.validate_index_values on each
    pass (the main causal one, each level non-causal) for q and kv_pages: ValueError
    naming the pass and the entry unless cu_q_lens, kv_lens and the pages each valid
    sequence reads are in range. paged_attention runs its kernels under jit, where the
    kernels cannot see the values: a hand-made metadata's page id past the cache read a
    clamped page, and a kv_len past its pages other keys, without an error. Concrete
    arrays only (numpy, or metadata closed over by jit); traced ones pass."""
    check_query_bounds(metadata)
    if not all(isinstance(a, (np.ndarray, jax.Array)) for a in (q, kv_pages)):
        return  # paged_attention names an argument that is no array
    if kv_pages.ndim != 4 or kv_pages.shape[1] != metadata.block_size:
        return  # paged_attention names the cache's shape
    for where, p in checked_passes(metadata):  # the main pass is causal, levels not
        index_arrays = (p.kv_lens, p.page_indices, p.cu_q_lens, p.num_seqs)
        try:
            validate_index_values(q, kv_pages, *index_arrays, causal=p is metadata)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _iota(n: int) -> np.ndarray:
    """Read-only i32[n] 0, 1, ..., n - 1 (a view of one shared, growing array)."""
    global _IOTA
    if len(_IOTA) < n:
        _IOTA = np.arange(max(n, 2 * len(_IOTA)), dtype=np.int32)
        _IOTA.flags.writeable = False
    return _IOTA[:n]


_IOTA = np.zeros(0, np.int32)


def _fill_pages(
    out: np.ndarray,  # i32[>= n, width] zeros; rows :n are written
    block_table: np.ndarray,  # i32[num_rows, max_blocks_per_seq]
    rows: np.ndarray,  # i32[n]
    col_starts: np.ndarray,  # i[n]
) -> None:
    """out[i, j] = block_table[rows[i], col_starts[i] + j], 0 past the table.

    One strided copy when every row starts at the same column (the null-block fill of
    the table pads it); the general gather otherwise.
    """
    n, width = len(rows), out.shape[1]
    if n == 0:
        return
    start = int(col_starts[0])
    if not (col_starts != start).any():
        end = min(start + width, block_table.shape[1])
        out[:n, : end - start] = block_table[rows, start:end]
        return
    out[:n] = table_slice(block_table, rows, col_starts, width)


def _check_arguments(block_table, plan, block_size, buckets, backend, interpret, levels):
    """ValueError naming the argument unless each has the type the builder reads."""
    if not isinstance(plan, CascadePlan):
        raise ValueError(f"plan={type(plan).__name__} must be a CascadePlan (CascadePlanner.plan)")
    if not isinstance(buckets, BucketConfig):
        raise ValueError(f"buckets={type(buckets).__name__} must be a BucketConfig")
    if not is_integer(block_size) or block_size < 1:
        raise ValueError(f"{block_size=} must be an int >= 1")
    if not isinstance(backend, str) or backend not in BACKENDS:  # else paged_attention fails
        raise ValueError(f"{backend=} must be one of {BACKENDS}")
    if not isinstance(interpret, bool):  # "no" would interpret, by its truthiness
        raise ValueError(f"{interpret=} must be a bool")
    if levels is not None and not (
        isinstance(levels, tuple) and all(isinstance(lv, LevelMetadata) for lv in levels)
    ):
        raise ValueError(f"levels={levels!r} must be None or a tuple of LevelMetadata")
    dtype = getattr(block_table, "dtype", None)
    # numpy only: a jax array clamps a row or column past it, where numpy raises
    if not isinstance(block_table, np.ndarray) or block_table.ndim != 2 or dtype.kind not in "iu":
        raise ValueError(
            f"block_table ({type(block_table).__name__}, dtype {dtype}) must be a 2-D integer "
            "array [num_rows, max_blocks_per_seq] in numpy, as KVCacheManager.block_table"
        )
    if plan.made_for is not None:
        manager, row_version = plan.made_for
        if manager.row_version != row_version:
            raise ValueError(
                "plan: made before its manager freed a request, whose block-table row may "
                "now hold another request's blocks; plan the batch again"
            )
        if manager.block_table.shape != block_table.shape:
            raise ValueError(
                f"{block_table.shape=} must be that of the plan's manager's block_table "
                f"{manager.block_table.shape}: a plan reads rows of the table it was made from"
            )
        if block_size != manager.block_size:
            raise ValueError(f"{block_size=} must be the plan's manager's {manager.block_size}")
        rows = plan.rows
        if block_table is not manager.block_table and not np.array_equal(
            block_table[rows], manager.block_table[rows]
        ):
            raise ValueError(
                "block_table: the plan's rows differ from its manager's block_table; pass "
                "the table of the manager that made the plan"
            )


def _check_hand_made_levels(block_table: np.ndarray, plan: CascadePlan) -> None:
    """ValueError unless, in every level of a hand-made plan, each group member's row
    holds its leader row's blocks (none of them the null block 0) in the group's columns:
    the level reads the leader's blocks, so a member without them would attend to other
    requests' KV. A CascadePlanner's plan is so by construction (exact shared prefixes;
    CascadePlan.by_planner), not once dataclasses.replace has changed it.
    Raises IndexError for a row outside block_table (the builder names it)."""
    for level in plan.levels:
        group, pos = positions_of_groups(level)
        starts = level.block_starts[group].astype(np.int64)
        ends = level.block_ends[group].astype(np.int64)
        width = int((level.block_ends - level.block_starts).max())
        mine = table_slice(block_table, plan.rows[pos], starts, width, ends)
        leader = table_slice(block_table, level.leader_rows[group], starts, width, ends)
        inside = np.arange(width)[None, :] < (ends - starts)[:, None]
        bad = np.argwhere(inside & ((mine != leader) | (leader == 0)))
        if bad.size:
            i, j = (int(x) for x in bad[0])
            raise ValueError(
                f"plan: level {level.name!r} reads block {int(leader[i, j])} (column "
                f"{int(starts[i]) + j} of leader row {int(level.leader_rows[group[i]])}) for "
                f"batch position {int(pos[i])}, whose row {int(plan.rows[pos[i]])} holds "
                f"block {int(mine[i, j])} there: a level's blocks must be held by every "
                "request of its group (and not be the null block 0)"
            )


def _outside(block_table) -> ValueError:
    return ValueError(
        f"a scheduled token or plan row lies outside {block_table.shape=}: the plan must "
        "come from the manager owning block_table, and every num_computed_tokens + "
        "query_lens entry must fit in the blocks its request holds"
    )


def build_attention_metadata(
    *,
    block_table: np.ndarray,  # i32[num_rows, max_blocks_per_seq] the manager's host table
    plan: CascadePlan,
    query_lens: np.ndarray,  # i[R] tokens scheduled per request, in plan (batch) order
    num_computed_tokens: np.ndarray,  # i[R] tokens already cached per request, batch order
    block_size: int,
    buckets: BucketConfig,
    backend: str = "xla",
    interpret: bool = False,
    levels: tuple[LevelMetadata, ...] | None = None,
) -> AttentionMetadata:
    """Pads one planned batch to buckets. Raises ValueError if it exceeds the buckets, a
    scheduled token lies past the blocks its request holds, or a cascade level reads
    blocks past a request's num_computed_tokens (it would cover a query token); also if
    CascadePlanner made `plan` before its manager last freed a request (the plan's rows
    may hold other requests' blocks now), or for a table shape, block size or plan rows
    other than its manager's (a hand-made plan is not checked against a manager, but
    each of its levels' group members must hold the leader row's blocks it reads; so
    must those of a planner's plan changed by dataclasses.replace). The
    metadata names that manager's pool size: paged_attention refuses a smaller cache.

    `levels`: None, or level metadata kept from an earlier step; ValueError unless it
    equals what this plan and query_lens need. Either way, the level metadata of a
    CascadePlanner's plan is built once while the plan, query_lens, block size and
    buckets repeat (jaxkv.level_metadata), and handed out read-only.

    The caller lays out the step's tokens in plan order: request plan.order[i]'s query
    tokens occupy positions cu_q_lens[i]:cu_q_lens[i+1] of the flat token arrays.
    Cost: a fixed number of numpy calls (a Python loop only over cascade groups); a
    decode-only batch (one token per request) takes a shorter path.
    """
    _check_arguments(block_table, plan, block_size, buckets, backend, interpret, levels)
    num_requests = len(plan.rows)
    query_lens, num_computed = checked_step_counts(query_lens, num_computed_tokens, num_requests)
    decode_only = num_requests > 0 and not (query_lens != 1).any()
    if decode_only:
        total = num_requests
    else:
        if num_requests and query_lens.min() < 1:
            raise ValueError(f"every query_lens entry must be >= 1, got {query_lens.min()}")
        total = int(query_lens.sum())
    max_tokens = padded_size(buckets.token_buckets, max(total, 1), name="query_lens.sum()")
    max_seqs = padded_size(buckets.seq_buckets, max(num_requests, 1), name="len(query_lens)")
    rows = plan.rows
    suffix_start = plan.suffix_start_blocks
    main_kv = (num_computed + 1) if decode_only else (num_computed + query_lens)
    main_kv -= suffix_start * block_size
    if plan.levels and (suffix_start * block_size > num_computed).any():
        # A level would read past a request's cached tokens: its non-causal pass would
        # show the request's query tokens keys after their own positions.
        i = int(np.argmax(suffix_start * block_size > num_computed))
        raise ValueError(
            f"batch position {i}: the cascade levels read {int(suffix_start[i])} blocks, "
            f"past its {int(num_computed[i])} cached tokens (block size {block_size})"
        )
    if plan.levels and not plan.by_planner:
        try:
            _check_hand_made_levels(block_table, plan)
        except IndexError:
            raise _outside(block_table) from None
    longest_main = int(main_kv.max(initial=1))
    width = padded_size(
        buckets.page_buckets, max(-(-longest_main // block_size), 1), name="main-pass pages"
    )

    # The int32 vectors share one zeroed buffer (one allocation instead of five).
    buffer = np.zeros(2 * max_tokens + 3 * max_seqs + 1, np.int32)
    positions, slot_mapping = buffer[:max_tokens], buffer[max_tokens : 2 * max_tokens]
    logits_indices = buffer[2 * max_tokens : 2 * max_tokens + max_seqs]
    kv_lens = buffer[2 * max_tokens + max_seqs : 2 * max_tokens + 2 * max_seqs]
    cu = buffer[2 * max_tokens + 2 * max_seqs :]
    if decode_only:
        token_starts = _iota(num_requests + 1)
        logits_indices[:num_requests] = token_starts[:-1]
    else:
        token_starts = np.zeros(num_requests + 1, np.int64)
        np.cumsum(query_lens, out=token_starts[1:])
        logits_indices[:num_requests] = token_starts[1:] - 1
    cu[: num_requests + 1] = token_starts
    cu[num_requests + 1 :] = total
    kv_lens[:num_requests] = main_kv
    page_indices = np.zeros((max_seqs, width), np.int32)
    # Per-token position and KV slot, vectorised over tokens.
    if decode_only:
        pos, token_rows = num_computed, rows
    else:
        token_req = np.repeat(np.arange(num_requests), query_lens)
        pos = num_computed[token_req] + (np.arange(total) - token_starts[token_req])
        token_rows = rows[token_req]
    positions[:total] = pos
    block_col, offset = np.divmod(pos, block_size)
    try:  # numpy's IndexError names neither argument
        _fill_pages(page_indices, block_table, rows, suffix_start)
        token_blocks = block_table[token_rows, block_col]
    except IndexError:
        raise _outside(block_table) from None
    if not token_blocks.all():  # the null block: its KV would land where every pad writes
        i = int(np.argmin(token_blocks != 0))
        raise ValueError(
            f"position {int(pos[i])} of a request in block-table row {int(token_rows[i])} "
            "lies past the blocks it holds (allocate slots for every scheduled token first)"
        )
    slot_mapping[:total] = token_blocks * block_size + offset

    # Every row a level reads was read above: a planner's leader rows are among the
    # plan's rows, a hand-made plan's were read by _check_hand_made_levels.
    levels = plan_levels(plan, levels, block_table, token_starts, decode_only, block_size, buckets)
    longest_query = 1 if decode_only else int(query_lens.max(initial=1))
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        positions=positions,
        logits_indices=logits_indices,
        cu_q_lens=cu,
        kv_lens=kv_lens,
        page_indices=page_indices,
        num_seqs=np.array([num_requests], np.int32),
        levels=levels,
        block_size=block_size,
        max_q_len=min(
            padded_size(buckets.q_len_buckets, longest_query, name="max(query_lens)"), max_tokens
        ),
        backend=backend,
        interpret=interpret,
        num_blocks=None if plan.made_for is None else plan.made_for[0].pool.num_blocks,
    )
