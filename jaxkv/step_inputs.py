"""Host-side pieces of one engine step's jit inputs (token ids, coarser buckets, program
keys), and its outputs back in schedule order."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from jaxkv.batch import AttentionMetadata, LevelMetadata
from jaxkv.buckets import padded_size


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
) -> tuple:
    """Identifies the compiled program a metadata pytree and the sampler's arrays need:
    the metadata's static fields and the padded sizes that fix every leaf's shape (all
    leaves are int32 by construction), each sampling argument's shape (None for None, a
    tuple of shapes for a tuple of arrays), and the step program's static logprob width
    `num_logprobs` (None: no logprobs), last.

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

    `q_len_buckets` bounds every pass's max_q_len; `level_seqs` pads each cascade level
    to that many sequence slots. None leaves that part as built.
    """
    if q_len_buckets is None and level_seqs is None:
        return md
    q_bucket = (
        (lambda n: n) if q_len_buckets is None else functools.partial(padded_size, q_len_buckets)
    )
    levels = tuple(
        dataclasses.replace(
            lv if level_seqs is None else pad_level(lv, level_seqs),
            max_q_len=q_bucket(lv.max_q_len),
        )
        for lv in md.levels
    )
    return dataclasses.replace(md, max_q_len=q_bucket(md.max_q_len), levels=levels)


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
