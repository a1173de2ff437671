"""Which sequences and KV pages one q tile of the TPU kernel visits.

Scalar index arithmetic on the kernel's prefetched tables (SMEM refs inside the kernel;
any int32 array indexable by a traced scalar outside it, which is how the tests check it
against a brute-force walk over rows and keys). Nothing here decides what a row's output
is: the kernel masks every (row, key) pair it computes. These bounds decide what it
computes at all, so each one must cover every key a row of the tile can see (or rows lose
keys), and should cover nothing more (or the tile copies pages and runs dots for nothing).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def div_nonneg(x: jax.Array, d: int) -> jax.Array:
    """x // d for x >= 0 and static d > 0: one shift where d is a power of two, else lax.div;
    never jnp.floor_divide, whose sign fix-up's Mosaic lowering asks the device for its
    generation, which fails where there is none."""
    if d & (d - 1) == 0:
        return lax.shift_right_logical(x, jnp.asarray(d.bit_length() - 1, x.dtype))
    return lax.div(x, jnp.asarray(d, x.dtype))


def first_seq_of_tile(cu_q_lens, num_seqs, tile_start, *, max_num_seqs: int) -> jax.Array:
    """The smallest s < num_seqs with cu_q_lens[s + 1] > tile_start, or num_seqs if none.

    The first sequence with a query token at or after `tile_start`: every sequence before
    it ends at or before the tile. A binary search with a static trip count, the fewest
    that tell max_num_seqs + 1 outcomes apart. It reads entries 1..max_num_seqs of
    cu_q_lens only, and its answer depends on entries 1..num_seqs only, which must be
    non-decreasing (the kernels' argument check makes them so).
    """

    def step(_, lo_hi):
        lo, hi = lo_hi
        mid = div_nonneg(lo + hi, 2)
        go_left = cu_q_lens[jnp.minimum(mid, max_num_seqs - 1) + 1] > tile_start
        active = lo < hi
        new_lo = jnp.where(active & ~go_left, mid + 1, lo)
        new_hi = jnp.where(active & go_left, mid, hi)
        return new_lo, new_hi

    trips = math.ceil(math.log2(max_num_seqs + 1))  # each trip halves the candidates
    lo, _ = lax.fori_loop(0, trips, step, (jnp.int32(0), num_seqs))
    return lo


def seq_in_tile(cu_q_lens, num_seqs, seq, tile_end, *, max_num_seqs: int) -> jax.Array:
    """Whether the walk of a tile ending at `tile_end` goes on to sequence `seq` (one past
    a sequence it visited, or its first_seq_of_tile): a valid sequence starting before
    the tile's end. The walk so visits exactly the sequences s < num_seqs with
    cu_q_lens[s] < tile_end and cu_q_lens[s + 1] > tile_start."""
    return (seq < num_seqs) & (cu_q_lens[jnp.minimum(seq, max_num_seqs)] < tile_end)


def next_block(seq, blk, num_blocks) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(next_seq, next_blk, last): the walk's step after KV block `blk` of `seq`'s
    num_blocks: block blk + 1 of the same sequence, or, after its last block (last
    True), block 0 of sequence seq + 1. Each sequence's blocks are so visited once each,
    in order."""
    last = blk + 1 >= num_blocks
    return jnp.where(last, seq + 1, seq), jnp.where(last, 0, blk + 1), last


def kv_page_range(
    cu_q_lens,
    kv_lens,
    seq,
    tile_start,
    tile_end,
    *,
    max_num_seqs: int,
    page_size: int,
    pages_per_seq: int,
    pages_per_blk: int,
    causal: bool,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(first_page, end_page, num_blocks): the pages of `seq` its rows in the tile read.

    Pages [first_page, end_page) of the sequence's page-table row are exactly those that
    hold a key some query token of `seq` in [tile_start, tile_end) sees: every key below
    kv_len without causal masking; with it, the keys up to the token's position (query
    token t sits at position t + kv_len - q_end) and, with a sliding window, the
    `sliding_window` keys ending there. end_page is capped at pages_per_seq. No token of
    `seq` in the tile gives the empty range (0, 0). num_blocks = ceil((end_page -
    first_page) / pages_per_blk), at least 1: the kernel walks each sequence it visits
    through at least one (possibly empty) block.
    A `seq` past max_num_seqs - 1 reads the last sequence's entries.
    """
    seq = jnp.minimum(seq, max_num_seqs - 1)
    q_start = cu_q_lens[seq]
    q_end = cu_q_lens[seq + 1]
    kv_len = kv_lens[seq]
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
    first_page = div_nonneg(kv_start, page_size)
    end_page = jnp.minimum(div_nonneg(kv_end + page_size - 1, page_size), pages_per_seq)
    end_page = jnp.maximum(end_page, first_page)
    num_pages = end_page - first_page
    num_blocks = jnp.maximum(div_nonneg(num_pages + pages_per_blk - 1, pages_per_blk), 1)
    return first_page, end_page, num_blocks


def block_pages(first_page, end_page, blk, *, pages_per_blk: int) -> tuple[jax.Array, jax.Array]:
    """(page0, block_end): the pages [page0, block_end) of a sequence's range
    [first_page, end_page) that KV block `blk` holds.

    Block b holds the pages from first_page + b * pages_per_blk, up to pages_per_blk of
    them and none at or past end_page, so blocks 0..num_blocks - 1 (kv_page_range's
    count) cover the range in order, each page once; a block past the range holds none
    (block_end <= page0).
    """
    page0 = first_page + blk * pages_per_blk
    return page0, jnp.minimum(page0 + pages_per_blk, end_page)


def row_window(
    q_start, q_end, tile_start, tile_end, *, group: int, row_align: int, rows: int, window_rows: int
) -> tuple[jax.Array, jax.Array]:
    """(win_start, fits) for the rows of the sequence with query tokens [q_start, q_end)
    in a q tile of tokens [tile_start, tile_end), `group` rows per token, `rows` rows in
    all: win_start is a multiple of row_align (which divides rows and window_rows) with
    [win_start, win_start + window_rows) inside the tile, and fits is True exactly when
    some such aligned window holds all of the sequence's rows, this one among them."""
    row_lo = (jnp.maximum(q_start, tile_start) - tile_start) * group
    row_hi = (jnp.minimum(q_end, tile_end) - tile_start) * group
    win_start = jnp.minimum(div_nonneg(row_lo, row_align) * row_align, rows - window_rows)
    return win_start, row_hi - win_start <= window_rows
