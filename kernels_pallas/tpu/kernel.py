"""Ragged paged attention for TPU (Pallas Mosaic), returning (out, lse).

Contract: the one of `kernels_pallas.reference.ragged_paged_attention` (same arguments,
same (out, lse), causal and non-causal), plus static tuning knobs and `interpret`.

Layout inside the kernel. Query heads that share a KV head are folded into the rows of
one matmul: the wrapper reshapes q [T, Hq, D] to [Hkv, T * G, D] (G = Hq // Hkv, rows
token-major), so one q tile of `num_queries_per_block` tokens is a [bq * G, D] operand per
KV head and each KV block read from HBM serves all G query heads at once. A non-causal
prefix pass that holds the whole batch as one sequence therefore reads each shared page
once per q tile.

Grid: (KV-head blocks, q tiles), both independent. One grid step walks the sequences that
own tokens of its q tile and, for each, the KV blocks it needs (causal: only keys up to
the tile's last position; sliding window: only keys from the window start of its first
position). KV pages are gathered page by page from HBM with async copies into a
two-slot VMEM buffer: the next block (of the same or the next sequence) is in flight
while the current one computes. Pages past what a block needs are not copied at all.
Page tables, lengths and offsets reach the kernel through scalar prefetch (SMEM).
Online softmax keeps m, l and the f32 accumulator per row in VMEM; out and lse are
written once per q tile.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.tpu.tuning import TUNED_BLOCK_SIZES, block_sizes, detect_tpu_generation
from kernels_pallas.validation import (
    checks_index_values,
    output_dtype,
    validate_ragged_paged_attention_inputs,
)

# Finite stand-in for -inf in masked logits: keeps exp/max free of inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LANES = 128
SUPPORTED_HEAD_DIMS = (64, 128, 256)
Q_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
KV_DTYPES = Q_DTYPES + (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 16, 256


def sublane_tiling(dtype) -> int:
    """Rows of one (rows, 128) Mosaic tile of `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _div(x: jax.Array, d: int) -> jax.Array:
    """x // d for x >= 0 and static d > 0, without jnp.floor_divide's sign fix-up (whose
    Mosaic lowering asks the device for its generation, which fails where there is none)."""
    if d & (d - 1) == 0:
        return lax.shift_right_logical(x, jnp.asarray(d.bit_length() - 1, x.dtype))
    return lax.div(x, jnp.asarray(d, x.dtype))


def _kernel(
    # Prefetch
    kv_lens_ref,  # i32[max_num_seqs]
    page_indices_ref,  # i32[max_num_seqs * pages_per_seq]
    cu_q_lens_ref,  # i32[max_num_seqs + 1]
    num_seqs_ref,  # i32[1]
    # Input
    q_ref,  # [kv_heads_per_blk, rows_per_blk, head_dim], rows = tokens x group
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
    kv_heads_per_blk, rows, head_dim = q_ref.shape
    _, pages_per_blk, page_size, combined_heads_per_blk, _ = kv_bufs.shape
    kv_per_blk = pages_per_blk * page_size
    q_per_blk = rows // group
    compute_dtype = q_ref.dtype
    precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    score_scale = sm_scale * (1.0 if k_scale is None else k_scale)

    heads_blk = pl.program_id(0)
    tile_start = pl.program_id(1) * q_per_blk
    tile_end = tile_start + q_per_blk
    num_seqs = num_seqs_ref[0]

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def first_seq_of_tile():
        # Smallest s < num_seqs with cu_q_lens[s + 1] > tile_start (num_seqs if none):
        # binary search, static trip count.
        def step(_, lo_hi):
            lo, hi = lo_hi
            mid = _div(lo + hi, 2)
            go_left = cu_q_lens_ref[jnp.minimum(mid, max_num_seqs - 1) + 1] > tile_start
            active = lo < hi
            new_lo = jnp.where(active & ~go_left, mid + 1, lo)
            new_hi = jnp.where(active & go_left, mid, hi)
            return new_lo, new_hi

        trips = max(1, math.ceil(math.log2(max_num_seqs + 1)) + 1)
        lo, _ = lax.fori_loop(0, trips, step, (jnp.int32(0), num_seqs))
        return lo

    def kv_page_range(seq):
        """(first_page, end_page, num_blocks) that seq's rows in this tile need."""
        seq = jnp.minimum(seq, max_num_seqs - 1)
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        t0 = jnp.maximum(q_start, tile_start)
        t1 = jnp.minimum(q_end, tile_end)
        if causal:
            shift = kv_len - q_end  # position of token t is t + shift
            kv_end = jnp.clip(t1 + shift, 0, kv_len)
            kv_start = jnp.int32(0)
            if sliding_window is not None:
                kv_start = jnp.clip(t0 + shift - sliding_window + 1, 0, kv_end)
        else:
            kv_start, kv_end = jnp.int32(0), kv_len
        kv_end = jnp.where(t1 > t0, kv_end, 0)
        kv_start = jnp.minimum(kv_start, kv_end)
        first_page = _div(kv_start, page_size)
        end_page = jnp.minimum(_div(kv_end + page_size - 1, page_size), pages_per_seq)
        end_page = jnp.maximum(end_page, first_page)
        num_blocks = jnp.maximum(_div(end_page - first_page + pages_per_blk - 1, pages_per_blk), 1)
        return first_page, end_page, num_blocks

    def copy_block(seq, first_page, end_page, blk, slot, *, wait: bool):
        """Starts (or waits for) the copies of one KV block's pages into kv_bufs[slot]."""
        page0 = first_page + blk * pages_per_blk
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

        # Pages past end_page are neither copied nor waited for; the start and the wait of
        # one block see the same (seq, first_page, end_page, blk), so they always agree.
        for i in range(pages_per_blk):

            @pl.when(page0 + i < end_page)
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
        kv_base = (first_page + blk * pages_per_blk) * page_size
        # Keys at or past this limit sit in pages that were not copied (or past kv_len).
        kv_limit = jnp.minimum(kv_len, end_page * page_size)
        key_ok = (kv_base + lax.broadcasted_iota(jnp.int32, (kv_per_blk, head_dim), 0)) < kv_limit

        def update_rows(h, k, v, row_start, num_rows):
            """Online-softmax update of rows [row_start, row_start + num_rows) of head h."""
            rows_here = pl.ds(row_start, num_rows)
            shape = (num_rows, kv_per_blk)
            row = row_start + lax.broadcasted_iota(jnp.int32, shape, 0)
            token = tile_start + _div(row, group)
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
            s = jnp.where(visible, s, MASK_VALUE)

            # Rows of other sequences see no key here: their m, l and acc stay unchanged
            # (alpha = 1, p = 0), so whole row windows are updated without masked stores.
            m_prev = m_ref[h, rows_here, :][:, :1]
            l_prev = l_ref[h, rows_here, :][:, :1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(visible, jnp.exp(s - m_next), 0.0)
            alpha = jnp.exp(m_prev - m_next)
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
        row_lo = (jnp.maximum(q_start, tile_start) - tile_start) * group
        row_hi = (jnp.minimum(q_end, tile_end) - tile_start) * group
        if window_rows < rows:
            win_start = jnp.minimum(_div(row_lo, row_align) * row_align, rows - window_rows)
            win_start = pl.multiple_of(win_start, row_align)
            fits = row_hi - win_start <= window_rows
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

    seq0 = first_seq_of_tile()
    first0, end0, nblk0 = kv_page_range(seq0)
    has_work = seq0 < num_seqs

    @pl.when(has_work)
    def _():
        copy_block(seq0, first0, end0, 0, 0, wait=False)

    def body(carry):
        seq, blk, slot, first_page, end_page, num_blocks, _ = carry
        last_blk = blk + 1 >= num_blocks
        next_seq = jnp.where(last_blk, seq + 1, seq)
        next_blk = jnp.where(last_blk, 0, blk + 1)
        next_slot = 1 - slot
        next_in_tile = (next_seq < num_seqs) & (
            cu_q_lens_ref[jnp.minimum(next_seq, max_num_seqs)] < tile_end
        )
        n_first, n_end, n_num = kv_page_range(next_seq)
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
    seen = denom > 0.0
    l_safe = jnp.where(seen, denom, 1.0)
    out = acc_ref[...] / l_safe
    if v_scale is not None:
        out = out * v_scale
    out_ref[...] = jnp.where(seen, out, 0.0).astype(out_ref.dtype)
    lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)
    lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def _validate_tpu(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    *,
    num_queries_per_block: int | None,
    num_kv_pages_per_block: int | None,
    num_kv_heads_per_block: int | None,
    vmem_limit_bytes: int | None,
) -> None:
    """What this kernel adds to the shared validation: Mosaic's dtypes and tiling."""
    head_dim = q.shape[2]
    page_size = kv_pages.shape[1]
    num_kv_heads = kv_pages.shape[2] // 2
    group = q.shape[1] // num_kv_heads
    if jnp.dtype(q.dtype) not in Q_DTYPES:
        raise ValueError(f"{q.dtype=} must be float32 or bfloat16 for the TPU kernel")
    if jnp.dtype(kv_pages.dtype) not in KV_DTYPES:
        raise ValueError(
            f"{kv_pages.dtype=} must be float32, bfloat16, int8 or float8_e4m3fn for the TPU kernel"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{q.shape[2]=} (head_dim) must be one of {SUPPORTED_HEAD_DIMS}")
    tiling = max(sublane_tiling(q.dtype), 8)
    if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE or page_size % tiling:
        raise ValueError(
            f"{kv_pages.shape[1]=} (page_size) must be in [{MIN_PAGE_SIZE}, {MAX_PAGE_SIZE}] "
            f"and a multiple of {tiling} (sublane tiling of {jnp.dtype(q.dtype).name})"
        )
    q_tiling = sublane_tiling(q.dtype)
    if num_queries_per_block is not None and (
        num_queries_per_block <= 0 or (num_queries_per_block * group) % q_tiling
    ):
        raise ValueError(
            f"{num_queries_per_block=} must be positive and num_queries_per_block * "
            f"{group=} a multiple of {q_tiling}"
        )
    if num_kv_pages_per_block is not None and num_kv_pages_per_block <= 0:
        raise ValueError(f"{num_kv_pages_per_block=} must be positive")
    if num_kv_heads_per_block is not None:
        combined = 2 * num_kv_heads_per_block
        kv_tiling = sublane_tiling(kv_pages.dtype)
        if (
            num_kv_heads_per_block <= 0
            or num_kv_heads % num_kv_heads_per_block
            or (combined != 2 * num_kv_heads and combined % kv_tiling)
        ):
            raise ValueError(
                f"{num_kv_heads_per_block=} must divide {num_kv_heads=} and be either all of "
                f"them or a multiple of {kv_tiling // 2} (tiling of {kv_pages.dtype})"
            )
    if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:
        raise ValueError(f"{vmem_limit_bytes=} must be positive")


def _default_kv_heads_per_block(num_kv_heads: int, kv_dtype) -> int:
    # A block of combined heads must fill whole sublane tiles of kv_pages for the page DMA,
    # or be every head.
    kv_tiling = sublane_tiling(kv_dtype)
    if (2 * num_kv_heads) % kv_tiling == 0:
        return kv_tiling // 2
    return num_kv_heads


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@checks_index_values
@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "causal",
        "sliding_window",
        "soft_cap",
        "k_scale",
        "v_scale",
        "interpret",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "num_kv_heads_per_block",
        "vmem_limit_bytes",
        "tpu_generation",
        "out_dtype",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    num_kv_heads_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    tpu_generation: str = "default",
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Paged attention of a ragged batch on TPU; (out in out_dtype (None: q.dtype), lse
    f32[T, Hq]).

    Semantics are those of `kernels_pallas.reference.ragged_paged_attention`: only the
    first num_seqs sequences (and their page-table rows, lengths) are read; a row that sees
    no key and every row past cu_q_lens[num_seqs] gives out 0 and lse -inf.

    Tuning knobs (static; None takes the `tpu_generation` row of `tuning.TUNED_BLOCK_SIZES`
    and no device is queried, except with `tpu_generation="auto"`, which asks the first
    JAX device for its kind): `num_queries_per_block` query tokens per q tile,
    `num_kv_pages_per_block` pages per KV block, `num_kv_heads_per_block` KV heads per grid
    step, `vmem_limit_bytes` Mosaic's scoped VMEM limit. `interpret=True` (or an
    `InterpretParams`) runs the kernel in the TPU interpreter, on any backend.

    Raises ValueError at trace time for arguments the kernel cannot take (head_dim not in
    64/128/256, page size outside 16..256 or not a multiple of the sublane tiling,
    mismatched heads, unsupported dtypes, bad knobs), naming the argument; called on
    concrete arrays, also for index values out of range (a page id past kv_pages, a
    kv_len past its pages; kernels_pallas.validation), before anything runs.
    """
    validate_ragged_paged_attention_inputs(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, causal=causal, sliding_window=sliding_window,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype,
    )  # fmt: skip
    _validate_tpu(
        q,
        kv_pages,
        num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_kv_heads_per_block=num_kv_heads_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )
    if tpu_generation == "auto":
        tpu_generation = detect_tpu_generation() or "default"
        tpu_generation = tpu_generation if tpu_generation in TUNED_BLOCK_SIZES else "default"
    defaults = block_sizes(tpu_generation)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, _ = kv_pages.shape
    num_kv_heads = num_combined_kv_heads // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape

    q_tiling = sublane_tiling(q.dtype)
    q_step = q_tiling // math.gcd(group, q_tiling)  # smallest bq with bq * group tiled
    bq = num_queries_per_block
    if bq is None:
        bq = defaults.num_queries_per_block
        if not causal:
            bq = defaults.num_queries_per_block_non_causal
        bq = min(_round_up(bq, q_step), _round_up(num_tokens, q_step))
    pages_per_blk = num_kv_pages_per_block
    if pages_per_blk is None:
        pages_per_blk = min(max(1, defaults.kv_tokens_per_block // page_size), pages_per_seq)
    kv_heads_per_blk = num_kv_heads_per_block or _default_kv_heads_per_block(
        num_kv_heads, kv_pages.dtype
    )
    if vmem_limit_bytes is None:
        vmem_limit_bytes = defaults.vmem_limit_bytes

    padded_tokens = _round_up(num_tokens, bq)
    rows = bq * group
    # Smallest aligned row window that always holds one decode token's `group` rows.
    window_rows = min(rows, _round_up(group + q_tiling - 1, q_tiling))
    # [T, Hq, D] -> [Hkv, T * G, D]: the G query heads of a KV head become matmul rows.
    q_rows = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    q_rows = q_rows.reshape(padded_tokens, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group, head_dim)

    grid = (num_kv_heads // kv_heads_per_blk, padded_tokens // bq)
    tile_spec = pl.BlockSpec((kv_heads_per_blk, rows, head_dim), lambda h, t, *_: (h, t, 0))
    lse_spec = pl.BlockSpec((kv_heads_per_blk, rows, LANES), lambda h, t, *_: (h, t, 0))
    row_stats = pltpu.VMEM((kv_heads_per_blk, rows, LANES), jnp.float32)
    scratch_shapes = [
        pltpu.VMEM(
            (2, pages_per_blk, page_size, 2 * kv_heads_per_blk, head_dim), kv_pages.dtype
        ),  # kv_bufs
        pltpu.SemaphoreType.DMA((2,)),  # sems
        row_stats,  # m_ref
        row_stats,  # l_ref
        pltpu.VMEM((kv_heads_per_blk, rows, head_dim), jnp.float32),  # acc_ref
    ]
    scalar_prefetch = (kv_lens, page_indices.reshape(-1), cu_q_lens, num_seqs)
    kernel = functools.partial(
        _kernel,
        group=group,
        window_rows=window_rows,
        row_align=q_tiling,
        pages_per_seq=pages_per_seq,
        max_num_seqs=max_num_seqs,
        sm_scale=float(sm_scale),
        causal=causal,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if interpret is True:
        interpret = pltpu.InterpretParams()
    out_rows, lse_rows = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_prefetch),
            in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[tile_spec, lse_spec],
            grid=grid,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q_rows.shape, output_dtype(q, out_dtype)),
            jax.ShapeDtypeStruct((num_kv_heads, padded_tokens * group, LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            # Grid steps share no state (each starts its own first copy), so both axes
            # may be split across TensorCores.
            dimension_semantics=("parallel", "parallel"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        interpret=interpret or False,
        name="jaxkv_ragged_paged_attention",
    )(*scalar_prefetch, q_rows, kv_pages)

    out = out_rows.reshape(num_kv_heads, padded_tokens, group, head_dim).transpose(1, 0, 2, 3)
    out = out.reshape(padded_tokens, num_q_heads, head_dim)[:num_tokens]
    lse = lse_rows[..., 0].reshape(num_kv_heads, padded_tokens, group).transpose(1, 0, 2)
    lse = lse.reshape(padded_tokens, num_q_heads)[:num_tokens]
    return out, lse
