"""The body of the TPU (Pallas Mosaic) ragged paged attention kernel: one grid step.

The wrapper that lays out the operands, picks the tiling and calls it is
`kernels_pallas.tpu.ragged_paged_attention`; its contract is the one of
`kernels_pallas.reference.ragged_paged_attention`.

Layout inside the kernel. Query heads that share a KV head are folded into the rows of
one matmul: the wrapper reshapes q [T, Hq, D] to [Hkv, T * G, D] (G = Hq // Hkv, rows
token-major) in the dtype of both dots (kernels_pallas.precision: the wider of q's and a
float cache's), so one q tile of `num_queries_per_block` tokens is a [bq * G, D] operand per
KV head and each KV block read from HBM serves all G query heads at once. A non-causal
prefix pass that holds the whole batch as one sequence therefore reads each shared page
once per q tile.

Grid: (KV-head blocks, q tiles), both independent. One grid step walks the sequences
that own tokens of its q tile and, for each, the KV blocks it needs (causal: only keys
up to the tile's last position; sliding window: only keys from the window start of its
first position), as kernels_pallas.tpu.tile_schedule bounds them. KV pages are gathered
page by page from HBM with async copies into a two-slot VMEM buffer: the next block (of
the same or the next sequence) is in flight while the current one computes. Pages past
what a block needs are not copied at all. Page tables, lengths and offsets reach the
kernel through scalar prefetch (SMEM). Online softmax keeps m, l and the f32 accumulator
per row in VMEM; out and lse are written once per q tile.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.precision import matmul_precision
from kernels_pallas.tpu.tile_schedule import (
    block_pages,
    div_nonneg,
    first_seq_of_tile,
    kv_page_range,
    next_block,
    row_window,
    seq_in_tile,
)

LANES = 128


def paged_attention_kernel(
    # Prefetch
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs * pages_per_seq]
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1]
    # Input
    q_ref,  # [kv_heads_per_blk, rows_per_blk, head_dim] in the dots' dtype; rows: tokens x G
    kv_pages_hbm_ref,  # [num_pages, page_size, 2 * num_kv_heads, head_dim] in HBM
    # Output
    out_ref,  # [kv_heads_per_blk, rows_per_blk, head_dim]
    lse_ref,  # f32[kv_heads_per_blk, rows_per_blk, LANES], lane-replicated
    # Scratch
    kv_bufs,  # [2, pages_per_blk, page_size, 2 * kv_heads_per_blk, head_dim]
    sems,  # DMA semaphores [2], one per buffer slot
    m_ref,  # f32[kv_heads_per_blk, rows_per_blk, LANES] running max, lane-replicated
    l_ref,  # f32[kv_heads_per_blk, rows_per_blk, LANES] running denominator
    acc_ref,  # f32[kv_heads_per_blk, rows_per_blk, head_dim] running numerator
    *,
    group: int,
    window_rows: int,
    row_align: int,
    pages_per_seq: int,
    max_num_seqs: int,
    sm_scale: float,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
):
    """One grid step (a block of KV heads, a q tile): out and lse of its rows.

    Reads only the KV pages its sequences need, through a two-slot VMEM buffer; rows of
    no valid sequence, and rows that see no key, get out 0 and lse -inf.
    """
    kv_heads_per_blk, rows, head_dim = q_ref.shape
    _, pages_per_blk, page_size, combined_heads_per_blk, _ = kv_bufs.shape
    kv_per_blk = pages_per_blk * page_size
    q_per_blk = rows // group
    # The wrapper hands q over in the dots' dtype (kernels_pallas.precision).
    compute_dtype = q_ref.dtype
    precision = matmul_precision(compute_dtype)
    score_scale = sm_scale * (1.0 if k_scale is None else k_scale)

    heads_blk = pl.program_id(0)
    tile_start = pl.program_id(1) * q_per_blk
    tile_end = tile_start + q_per_blk
    num_seqs = num_seqs_ref[0]

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def page_range(seq):
        return kv_page_range(
            cu_q_lens_ref,
            kv_lens_ref,
            seq,
            tile_start,
            tile_end,
            max_num_seqs=max_num_seqs,
            page_size=page_size,
            pages_per_seq=pages_per_seq,
            pages_per_blk=pages_per_blk,
            causal=causal,
            sliding_window=sliding_window,
        )

    def copy_block(seq, first_page, end_page, blk, slot, *, wait: bool):
        """Starts (or waits for) the copies of one KV block's pages into kv_bufs[slot]."""
        page0, block_end = block_pages(first_page, end_page, blk, pages_per_blk=pages_per_blk)
        if kv_pages_hbm_ref.shape[2] == combined_heads_per_blk:
            heads = slice(None)  # every head: a static slice, nothing for Mosaic to prove
        else:
            # A whole number of sublane tiles: Mosaic must see that the offset is aligned.
            first_head = pl.multiple_of(heads_blk * combined_heads_per_blk, combined_heads_per_blk)
            heads = pl.ds(first_head, combined_heads_per_blk)

        def page_copy(i):
            page = page_indices_ref[seq * pages_per_seq + page0 + i]
            return pltpu.make_async_copy(
                kv_pages_hbm_ref.at[page, :, heads, :], kv_bufs.at[slot, i], sems.at[slot]
            )

        # Pages past block_end are neither copied nor waited for; the start and the wait
        # of one block see the same (seq, first_page, end_page, blk), so they always agree.
        for i in range(pages_per_blk):

            @pl.when(page0 + i < block_end)
            def _(i=i):
                copy = page_copy(i)
                if wait:
                    copy.wait()
                else:
                    copy.start()

    def load_kv(slot, combined_head):
        # Raw K or V in the matmul dtype; k_scale and v_scale are applied to the scores
        # and to the output instead, which is exact and saves a multiply per element.
        x = kv_bufs[slot, :, :, combined_head, :]  # [pages_per_blk, page_size, head_dim]
        if x.dtype != compute_dtype:
            # Mosaic converts between arbitrary types only through float32.
            x = x.astype(jnp.float32).astype(compute_dtype)
        return x.reshape(kv_per_blk, head_dim)

    def attend_block(seq, first_page, end_page, blk, slot):
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        page0, block_end = block_pages(first_page, end_page, blk, pages_per_blk=pages_per_blk)
        kv_base = page0 * page_size
        # Keys at or past this limit sit in pages that were not copied (or past kv_len).
        kv_limit = jnp.minimum(kv_len, block_end * page_size)
        key_ok = (kv_base + lax.broadcasted_iota(jnp.int32, (kv_per_blk, head_dim), 0)) < kv_limit

        def update_rows(h, k, v, row_start, num_rows):
            """Online-softmax update of rows [row_start, row_start + num_rows) of head h."""
            rows_here = pl.ds(row_start, num_rows)
            shape = (num_rows, kv_per_blk)
            row = row_start + lax.broadcasted_iota(jnp.int32, shape, 0)
            token = tile_start + div_nonneg(row, group)
            key = kv_base + lax.broadcasted_iota(jnp.int32, shape, 1)
            visible = (token >= q_start) & (token < q_end) & (key < kv_limit)
            if causal:
                pos = token + (kv_len - q_end)
                visible &= key <= pos
                if sliding_window is not None:
                    visible &= key > pos - sliding_window

            s = lax.dot_general(
                q_ref[h, rows_here, :],
                k,
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            s = s * score_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            # Masked logits are -inf, not a finite stand-in: a finite one (-0.7 * float32
            # max) hid every key of a row whose logits all lay below it.
            s = jnp.where(visible, s, -jnp.inf)

            # Rows of other sequences see no key here: their m, l and acc stay unchanged
            # (alpha = 1, p = 0; or, before a row's first key, all three stay 0-valued),
            # so whole row windows are updated without masked stores.
            m_prev = m_ref[h, rows_here, :][:, :1]
            l_prev = l_ref[h, rows_here, :][:, :1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            # The max stays -inf until a row sees a key; shifting by 0 then keeps exp off
            # -inf - -inf (NaN).
            shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            p = jnp.where(visible, jnp.exp(s - shift), 0.0)
            alpha = jnp.exp(m_prev - shift)
            l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(
                p.astype(compute_dtype),
                v,
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            acc_ref[h, rows_here, :] = alpha * acc_ref[h, rows_here, :] + pv
            m_ref[h, rows_here, :] = jnp.broadcast_to(m_next, (num_rows, LANES))
            l_ref[h, rows_here, :] = jnp.broadcast_to(l_next, (num_rows, LANES))

        # The sequence's rows in this tile. When they fit in an aligned window of
        # window_rows (a decode token is `group` rows), only that window is computed:
        # the full tile would spend rows / window_rows times the VPU work on rows that
        # belong to other sequences.
        if window_rows < rows:
            win_start, fits = row_window(
                q_start,
                q_end,
                tile_start,
                tile_end,
                group=group,
                row_align=row_align,
                rows=rows,
                window_rows=window_rows,
            )
            win_start = pl.multiple_of(win_start, row_align)
        for h in range(kv_heads_per_blk):
            k = load_kv(slot, 2 * h)
            v = load_kv(slot, 2 * h + 1)
            # Pages hold NaN or stale data past kv_limit: 0 * NaN would poison p @ v.
            v = jnp.where(key_ok, v, jnp.zeros_like(v))
            if window_rows < rows:
                pl.when(fits)(functools.partial(update_rows, h, k, v, win_start, window_rows))
                pl.when(~fits)(functools.partial(update_rows, h, k, v, 0, rows))
            else:
                update_rows(h, k, v, 0, rows)

    seq0 = first_seq_of_tile(cu_q_lens_ref, num_seqs, tile_start, max_num_seqs=max_num_seqs)
    first0, end0, nblk0 = page_range(seq0)
    has_work = seq_in_tile(cu_q_lens_ref, num_seqs, seq0, tile_end, max_num_seqs=max_num_seqs)

    @pl.when(has_work)
    def _():
        copy_block(seq0, first0, end0, 0, 0, wait=False)

    def body(carry):
        seq, blk, slot, first_page, end_page, num_blocks, _ = carry
        next_seq, next_blk, last_blk = next_block(seq, blk, num_blocks)
        next_slot = 1 - slot
        next_in_tile = seq_in_tile(
            cu_q_lens_ref, num_seqs, next_seq, tile_end, max_num_seqs=max_num_seqs
        )
        n_first, n_end, n_num = page_range(next_seq)
        n_first = jnp.where(last_blk, n_first, first_page)
        n_end = jnp.where(last_blk, n_end, end_page)
        n_num = jnp.where(last_blk, n_num, num_blocks)

        @pl.when(next_in_tile)
        def _():
            copy_block(next_seq, n_first, n_end, next_blk, next_slot, wait=False)

        copy_block(seq, first_page, end_page, blk, slot, wait=True)
        attend_block(seq, first_page, end_page, blk, slot)
        return next_seq, next_blk, next_slot, n_first, n_end, n_num, next_in_tile

    lax.while_loop(
        lambda carry: carry[-1],
        body,
        (seq0, jnp.int32(0), jnp.int32(0), first0, end0, nblk0, has_work),
    )

    m = m_ref[...][:, :, :1]
    denom = l_ref[...][:, :, :1]
    seen = denom != 0  # NaN (from NaN or inf data) must not read as "no keys"
    l_safe = jnp.where(seen, denom, 1.0)
    out = acc_ref[...] / l_safe
    if v_scale is not None:
        out = out * v_scale
    out_ref[...] = jnp.where(seen, out, 0.0).astype(out_ref.dtype)
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)
    lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)
