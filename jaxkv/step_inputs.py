"""Host-side pieces of one engine step's jit inputs (batch_inputs: metadata, token ids,
coarser buckets, sampling arrays, prompt-logprob rows; program keys), and its outputs
back in schedule order."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxkv.batch import AttentionMetadata, LevelMetadata, build_attention_metadata
from jaxkv.buckets import BucketConfig, padded_size

if TYPE_CHECKING:
    from jaxkv.cascade_plan import CascadePlan
    from jaxkv.config import EngineConfig
    from jaxkv.kv_cache_manager import KVCacheManager
    from jaxkv.prompt_logprobs import PromptRows
    from jaxkv.sampler import SamplingRows
    from jaxkv.scheduler_output import SchedulerOutput


def batch_inputs(
    out: SchedulerOutput,
    plan: CascadePlan,
    *,
    manager: KVCacheManager,
    buckets: BucketConfig,
    config: EngineConfig,
    backend: str,
    sampling_rows: SamplingRows,
):
    """(order, metadata, input ids, sampling arrays, jaxkv.prompt_logprobs.PromptStep or
    None) of a scheduled batch in plan order, for an engine's step program. `order` is
    None when the plan keeps schedule order, else the plan's permutation."""
    n = out.num_requests
    if plan.keeps_order:
        order = None
        query_lens, num_computed = out.num_scheduled_tokens, out.num_computed_tokens
    else:
        order = plan.order
        query_lens = out.num_scheduled_tokens[order]
        num_computed = out.num_computed_tokens[order]
    md = build_attention_metadata(
        block_table=manager.block_table,
        plan=plan,
        query_lens=query_lens,
        num_computed_tokens=num_computed,
        block_size=manager.block_size,
        buckets=buckets,
        backend=backend,
        interpret=config.interpret,
    )
    pad_to = buckets.level_seq_buckets[-1] if config.pad_cascade_levels else None
    md = coarsen_metadata(md, config.q_len_buckets, pad_to)
    input_ids = gather_input_ids(out.token_ids, out.num_scheduled_tokens, order, md)
    positions = np.zeros(md.max_num_seqs, np.int32)  # of the tokens being sampled
    positions[:n] = num_computed + query_lens
    sampling = sampling_rows.step_arrays(out.requests, order, md.max_num_seqs, positions)
    prompt = sampling_rows.prompt_logprobs.rows(
        out.requests, out.num_computed_tokens, out.num_scheduled_tokens, order,
        md.cu_q_lens, md.max_num_tokens,
    )  # fmt: skip
    return order, md, input_ids, sampling, prompt


def pad_level(level: LevelMetadata, num_seqs: int) -> LevelMetadata:
    """The same cascade level with `num_seqs` sequence slots (extra ones empty)."""
    extra = num_seqs - level.kv_lens.shape[0]
    if extra <= 0:
        return level
    return dataclasses.replace(
        level,
        cu_q_lens=np.pad(level.cu_q_lens, (0, extra), mode="edge"),
        kv_lens=np.pad(level.kv_lens, (0, extra)),
        page_indices=np.pad(level.page_indices, ((0, extra), (0, 0))),
    )


def program_key(
    metadata: AttentionMetadata,
    sampling: Sequence = (),
    num_logprobs: int | None = None,
    prompt_rows: PromptRows | None = None,
) -> tuple:
    """Identifies the compiled program a metadata pytree and the sampler's arrays need:
    the metadata's static fields and the padded sizes that fix every leaf's shape (all
    leaves are int32 by construction), each sampling argument's shape (None for None, a
    tuple of shapes for a tuple of arrays), the number of prompt-logprob rows (None
    without them), and the step program's static logprob width `num_logprobs` (None: no
    logprobs), last.

    Equal keys mean equal pytree structure and leaf shapes; read off the fields
    directly because flattening the pytree each step costs more than the rest."""
    md = metadata
    return (
        tuple(_shape(a) for a in sampling),
        md.slot_mapping.shape,
        md.page_indices.shape,
        md.block_size,
        md.max_q_len,
        md.backend,
        md.interpret,
        tuple((lv.page_indices.shape, lv.max_q_len) for lv in md.levels),
        None if prompt_rows is None else prompt_rows.indices.shape,
        md.num_blocks,
        num_logprobs,
    )


def _shape(argument) -> tuple | None:
    if argument is None:
        return None
    if isinstance(argument, tuple):
        return tuple(a.shape for a in argument)
    return argument.shape


def coarsen_metadata(
    md: AttentionMetadata,
    q_len_buckets: tuple[int, ...] | None,
    level_seqs: int | None,
) -> AttentionMetadata:
    """Re-pads static bounds to coarser buckets, so fewer programs compile.

    `q_len_buckets` bounds every pass's max_q_len by the smallest of its buckets that holds
    the pass's longest query (read from its cu_q_lens where a bucket below the bound as
    built could hold it; a bound past the largest bucket raises ValueError), never past
    md.max_num_tokens (as the metadata builder caps it: no sequence has more query tokens
    than the step); `level_seqs` pads each cascade level to that many sequence slots.
    None leaves that part as built. The bucket is the smallest for the bounds the builder
    makes (1 for one-token queries only); a looser hand-made bound, 4 for queries of one
    token, may keep a larger one (4 of (1, 4, 8)), still at least the longest query.
    """
    if q_len_buckets is None and level_seqs is None:
        return md
    max_tokens = md.max_num_tokens

    def q_bucket(bound: int, cu_q_lens: np.ndarray) -> int:
        if q_len_buckets is None:
            return bound
        padded = padded_size(q_len_buckets, bound, name="max_q_len (q_len_buckets)")
        i = bisect.bisect_left(q_len_buckets, padded)
        # The built bound is a power of two: a smaller bucket between powers of two may
        # still hold the longest query (24 of (1, 24, 64) a 20-token one, bound 32). A
        # bound above 1 means a query of 2 or more, so a bucket of 1 below never does.
        if bound > 1 and i and q_len_buckets[i - 1] > 1:
            longest = int((cu_q_lens[1:] - cu_q_lens[:-1]).max())
            if longest <= q_len_buckets[i - 1]:
                padded = padded_size(q_len_buckets, max(longest, 1))
        return min(padded, max_tokens)

    levels = tuple(
        dataclasses.replace(
            lv if level_seqs is None else pad_level(lv, level_seqs),
            max_q_len=q_bucket(lv.max_q_len, lv.cu_q_lens),
        )
        for lv in md.levels
    )
    return dataclasses.replace(md, max_q_len=q_bucket(md.max_q_len, md.cu_q_lens), levels=levels)


def gather_input_ids(
    token_ids: Sequence[int],  # the step's tokens, request by request, in schedule order
    num_scheduled_tokens: np.ndarray,  # i32[R] tokens per request, schedule order
    order: np.ndarray | None,  # i32[R] batch position -> index in schedule order
    md: AttentionMetadata,
) -> np.ndarray:  # i32[max_num_tokens]
    """The step's token ids in batch (plan) order, padded with 0 to md.max_num_tokens.

    `order` None: the batch keeps the schedule order (CascadePlan.keeps_order)."""
    ids = np.zeros(md.max_num_tokens, np.int32)
    total = len(token_ids)
    if order is None:
        ids[:total] = token_ids
        return ids
    num_requests = len(order)
    if not (order != np.arange(num_requests)).any():
        ids[:total] = token_ids  # the plan kept the schedule order
    elif total == num_requests:  # decode only: one token per request
        ids[:total] = np.asarray(token_ids, np.int32)[order]
    else:
        starts = np.zeros(num_requests, np.int64)
        np.cumsum(num_scheduled_tokens[:-1], out=starts[1:])
        batch_starts = md.cu_q_lens[:num_requests].astype(np.int64)
        lens = num_scheduled_tokens[order]
        source = np.repeat(starts[order] - batch_starts, lens) + np.arange(total)
        ids[:total] = np.asarray(token_ids, np.int32)[source]
    return ids


def in_schedule_order(rows, n: int, order: np.ndarray | None) -> np.ndarray:
    """The first `n` rows of a step program's output (batch order) in schedule order.

    `order` None: the batch kept the schedule order; else batch row i is request order[i].
    """
    rows = np.asarray(rows)[:n]
    if order is None:
        return rows
    scheduled = np.empty_like(rows)
    scheduled[order] = rows
    return scheduled
