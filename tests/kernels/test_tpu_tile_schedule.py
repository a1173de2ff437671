"""The TPU kernel's tile schedule against a walk over every (query token, key) pair.

Kernel tests compare outputs, and the kernel masks every pair it computes, so a schedule
that visits too much (an earlier first sequence, a page range past what a tile needs)
gives the same output only slower. Here each bound is compared exactly with the rows and
keys it stands for, on random ragged batches with zero-length sequences and poisoned
padding past num_seqs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.tpu.tile_schedule import (
    block_pages,
    div_nonneg,
    first_seq_of_tile,
    kv_page_range,
    next_block,
    row_window,
    seq_in_tile,
)
from tests.kernels import harness

POISON = -(2**30)


def _batch(rng, *, max_num_seqs, num_seqs, page_size, pages_per_seq, max_q=5):
    """cu_q_lens and kv_lens for num_seqs random sequences (some of 0 query tokens),
    padded to max_num_seqs with entries no valid read may see."""
    q_lens = rng.integers(0, min(max_q, pages_per_seq * page_size) + 1, num_seqs)
    kv_lens = q_lens + rng.integers(0, pages_per_seq * page_size - q_lens + 1)
    cu = np.full(max_num_seqs + 1, POISON, np.int32)
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.full(max_num_seqs, POISON, np.int32)
    kv[:num_seqs] = kv_lens
    return cu, kv


def _first_seq_walk(cu, num_seqs, tile_start):
    return next((s for s in range(num_seqs) if cu[s + 1] > tile_start), num_seqs)


def _pages_seen(cu, kv, seq, tile_start, tile_end, *, page_size, causal, window):
    """Every page index holding a key that some token of seq in the tile sees."""
    tokens = range(max(int(cu[seq]), tile_start), min(int(cu[seq + 1]), tile_end))
    keys = harness.keys_seen(cu, kv, seq, tokens, causal=causal, window=window)
    return {key // page_size for key in keys}


def assert_page_range(got, pages, *, pages_per_seq, pages_per_blk):
    """got (first_page, end_page, num_blocks) covers exactly `pages`, which must be one run."""
    first, end, num_blocks = (int(x) for x in got)
    pages = {p for p in pages if p < pages_per_seq}
    if pages:
        assert pages == set(range(min(pages), max(pages) + 1)), pages
        assert (first, end) == (min(pages), max(pages) + 1)
    else:
        assert (first, end) == (0, 0)
    assert num_blocks == max(1, -(-(end - first) // pages_per_blk))


@functools.partial(jax.jit, static_argnames=("max_num_seqs",))
def _first_seqs(cu, num_seqs, tile_starts, *, max_num_seqs):
    find = functools.partial(first_seq_of_tile, cu, num_seqs, max_num_seqs=max_num_seqs)
    return jax.vmap(find)(tile_starts)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 7, 8, 64])
def test_first_seq_of_tile_is_the_first_sequence_ending_past_the_tile_start(max_num_seqs):
    rng = np.random.default_rng(max_num_seqs)
    for num_seqs in sorted({0, 1, max_num_seqs // 2, max_num_seqs - 1, max_num_seqs}):
        for _ in range(3):
            cu, _kv = _batch(
                rng, max_num_seqs=max_num_seqs, num_seqs=num_seqs, page_size=4, pages_per_seq=4
            )
            starts = np.arange(max_num_seqs * 5 + 3, dtype=np.int32)  # one shape: one compile
            got = _first_seqs(cu, np.int32(num_seqs), starts, max_num_seqs=max_num_seqs)
            want = [_first_seq_walk(cu, num_seqs, int(t)) for t in starts]
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{cu=} {num_seqs=}")


def test_first_seq_of_tile_among_many_one_token_sequences():
    # Deep searches: every tile start lands on its own sequence.
    max_num_seqs = 256
    cu = np.arange(max_num_seqs + 1, dtype=np.int32)
    starts = np.arange(max_num_seqs + 2, dtype=np.int32)
    got = _first_seqs(cu, np.int32(max_num_seqs), starts, max_num_seqs=max_num_seqs)
    np.testing.assert_array_equal(np.asarray(got), np.minimum(starts, max_num_seqs))


_STATIC = (
    "max_num_seqs", "page_size", "pages_per_seq", "pages_per_blk", "causal", "sliding_window",
)  # fmt: skip


@functools.partial(jax.jit, static_argnames=_STATIC + ("tile",))
def _page_ranges(cu, kv, *, tile, **static):
    """(first_page, end_page, num_blocks), each [num_tiles, max_num_seqs]."""
    starts = jnp.arange(0, static["max_num_seqs"] * 6, tile, dtype=jnp.int32)
    seqs = jnp.arange(static["max_num_seqs"], dtype=jnp.int32)

    def one(start, seq):
        return kv_page_range(cu, kv, seq, start, start + tile, **static)

    return jax.vmap(lambda s: jax.vmap(lambda q: one(s, q))(seqs))(starts)


CONFIGS = [
    dict(page_size=4, pages_per_blk=2, causal=True, sliding_window=None, tile=4),
    dict(page_size=1, pages_per_blk=2, causal=True, sliding_window=3, tile=3),
    dict(page_size=1, pages_per_blk=2, causal=False, sliding_window=None, tile=2),
    dict(page_size=3, pages_per_blk=1, causal=True, sliding_window=None, tile=2),
    dict(page_size=1, pages_per_blk=3, causal=True, sliding_window=None, tile=5),
    dict(page_size=4, pages_per_blk=2, causal=True, sliding_window=1, tile=4),
    dict(page_size=3, pages_per_blk=2, causal=True, sliding_window=5, tile=3),
    dict(page_size=16, pages_per_blk=1, causal=True, sliding_window=7, tile=8),
    dict(page_size=4, pages_per_blk=3, causal=False, sliding_window=None, tile=4),
    dict(page_size=2, pages_per_blk=1, causal=False, sliding_window=None, tile=1),
]


@pytest.mark.parametrize("seed", range(len(CONFIGS)))
def test_kv_page_range_is_exactly_the_pages_the_tiles_tokens_see(seed):
    config = dict(CONFIGS[seed])
    tile = config.pop("tile")
    max_num_seqs, pages_per_seq = 5, 4
    static = dict(config, max_num_seqs=max_num_seqs, pages_per_seq=pages_per_seq)
    rng = np.random.default_rng(seed)
    for num_seqs in (1, 3, 5, 5, 5):
        cu, kv = _batch(
            rng,
            max_num_seqs=max_num_seqs,
            num_seqs=num_seqs,
            page_size=config["page_size"],
            pages_per_seq=pages_per_seq,
        )
        ranges = np.stack(_page_ranges(cu, kv, tile=tile, **static), axis=-1)
        for t, tile_start in enumerate(range(0, max_num_seqs * 6, tile)):
            for seq in range(num_seqs):
                pages = _pages_seen(
                    cu,
                    kv,
                    seq,
                    tile_start,
                    tile_start + tile,
                    page_size=config["page_size"],
                    causal=config["causal"],
                    window=config["sliding_window"],
                )
                assert_page_range(
                    ranges[t, seq],
                    pages,
                    pages_per_seq=pages_per_seq,
                    pages_per_blk=config["pages_per_blk"],
                )


@pytest.mark.parametrize(
    "broken",
    [(1, 3, 1), (0, 2, 1), (0, 3, 2), (0, 0, 1)],
    ids=["late first page", "early end page", "extra block", "empty"],
)
def test_the_page_range_check_rejects_a_range_one_off(broken):
    with pytest.raises(AssertionError):
        assert_page_range(broken, {0, 1, 2}, pages_per_seq=4, pages_per_blk=4)
    assert_page_range((0, 3, 1), {0, 1, 2}, pages_per_seq=4, pages_per_blk=4)


def test_a_tile_that_misses_a_sequence_reads_none_of_its_pages():
    # Sequence 1 has 3 query tokens at 2..4 over 9 keys; tiles of 2 tokens.
    cu = np.array([0, 2, 5, 5], np.int32)
    kv = np.array([2, 9, 4], np.int32)
    static = dict(max_num_seqs=3, page_size=2, pages_per_seq=5, pages_per_blk=2)
    got = _page_ranges(cu, kv, tile=2, causal=True, sliding_window=None, **static)
    first, end, _ = (np.asarray(a)[:3, 1] for a in got)  # tiles 0..2 of sequence 1
    np.testing.assert_array_equal(end - first, [0, 4, 5])  # keys 0..7, then 0..8
    # The empty sequence 2 at the end of the batch reads nothing in any tile.
    np.testing.assert_array_equal(np.asarray(got[1])[:, 2] - np.asarray(got[0])[:, 2], 0)


@pytest.mark.parametrize("pages_per_blk", [1, 2, 3])
def test_the_blocks_of_a_page_range_cover_it_in_order_each_page_once(pages_per_blk):
    for first, end in [(0, 0), (0, 1), (2, 3), (1, 7), (4, 10), (0, 9)]:
        num_blocks = max(1, -(-(end - first) // pages_per_blk))
        covered = []
        for blk in range(num_blocks + 1):  # and one block past the range
            page0, block_end = block_pages(first, end, blk, pages_per_blk=pages_per_blk)
            assert page0 == first + blk * pages_per_blk
            covered += range(int(page0), int(block_end))
        assert covered == list(range(first, end))


@pytest.mark.parametrize(
    "group, row_align, q_per_blk, window_rows",
    [(1, 8, 16, 8), (4, 8, 8, 16), (3, 8, 8, 16), (8, 16, 4, 16), (2, 8, 16, 24)],
)
def test_row_window_fits_exactly_when_an_aligned_window_holds_the_rows(
    group, row_align, q_per_blk, window_rows
):
    rows = q_per_blk * group
    window = jax.jit(
        functools.partial(
            row_window, group=group, row_align=row_align, rows=rows, window_rows=window_rows
        )
    )
    for tile_start in (0, q_per_blk):
        tile_end = tile_start + q_per_blk
        for q_start in range(tile_start - 2, tile_end + 1):
            for q_end in range(max(q_start, 0), tile_end + 3):
                win_start, fits = map(int, window(q_start, q_end, tile_start, tile_end))
                assert win_start % row_align == 0 and 0 <= win_start <= rows - window_rows
                lo = (max(q_start, tile_start) - tile_start) * group
                hi = (min(q_end, tile_end) - tile_start) * group
                aligned = range(0, rows - window_rows + 1, row_align)
                holds = [s for s in aligned if s <= lo and hi <= s + window_rows]
                assert fits == bool(holds), (q_start, q_end, tile_start)
                if fits:
                    assert win_start <= lo and hi <= win_start + window_rows


def test_the_walk_visits_each_sequence_of_the_tile_and_each_of_its_blocks_once_in_order():
    # The kernel's loop, step for step: start at first_seq_of_tile if it is in the tile,
    # go on with next_block while the next sequence is.
    rng = np.random.default_rng(7)
    max_num_seqs, tile = 6, 4
    static = dict(max_num_seqs=max_num_seqs, page_size=2, pages_per_seq=6, pages_per_blk=2)
    for num_seqs in (0, 1, 4, 6, 6, 6):
        cu, kv = _batch(
            rng, max_num_seqs=max_num_seqs, num_seqs=num_seqs, page_size=2, pages_per_seq=6
        )
        cu_j = jnp.asarray(cu)  # indexed by traced scalars in the search
        for tile_start in range(0, int(cu[num_seqs]) + tile, tile):
            start, end = jnp.int32(tile_start), jnp.int32(tile_start + tile)
            in_tile = functools.partial(
                seq_in_tile, cu_j, num_seqs, tile_end=end, max_num_seqs=max_num_seqs
            )
            seq = first_seq_of_tile(cu_j, num_seqs, start, max_num_seqs=max_num_seqs)
            blk, visited = jnp.int32(0), []
            go_on = in_tile(seq=seq)
            while go_on:
                num_blocks = kv_page_range(
                    cu, kv, seq, start, end, causal=True, sliding_window=None, **static
                )[2]
                visited.append((int(seq), int(blk)))
                seq, blk, _ = next_block(seq, blk, num_blocks)
                go_on = in_tile(seq=seq)
            want = []
            for s in range(num_seqs):
                if cu[s] < tile_start + tile and cu[s + 1] > tile_start:
                    num_blocks = kv_page_range(
                        cu, kv, jnp.int32(s), start, end, causal=True, sliding_window=None, **static
                    )[2]
                    want += [(s, b) for b in range(int(num_blocks))]
            assert visited == want, (cu, num_seqs, tile_start)


class _RecordedReads:
    """A prefetched table whose reads are recorded; one outside it raises IndexError (on
    a TPU it would read other scalars of SMEM)."""

    def __init__(self, values):
        self.values, self.read = np.asarray(values, np.int32), set()

    def __getitem__(self, index):
        index = int(index)
        if not 0 <= index < len(self.values):
            raise IndexError(f"read at {index} of a table of {len(self.values)}")
        self.read.add(index)
        return jnp.int32(self.values[index])


def test_the_schedule_reads_its_tables_in_bounds():
    rng = np.random.default_rng(0)
    max_num_seqs = 5
    static = dict(max_num_seqs=max_num_seqs, page_size=2, pages_per_seq=4, pages_per_blk=2)
    for num_seqs in (0, 2, 5):
        cu, kv = _batch(
            rng, max_num_seqs=max_num_seqs, num_seqs=num_seqs, page_size=2, pages_per_seq=4
        )
        cu_reads, kv_reads = _RecordedReads(cu), _RecordedReads(kv)
        with jax.disable_jit():  # the loops run in Python, so each index is concrete
            for tile_start in range(0, int(cu[num_seqs]) + 2, 3):
                cu_reads.read.clear()
                first_seq_of_tile(
                    cu_reads, jnp.int32(num_seqs), jnp.int32(tile_start), max_num_seqs=max_num_seqs
                )
                assert cu_reads.read <= set(range(1, max_num_seqs + 1))  # never cu_q_lens[0]
                for seq in range(max_num_seqs + 1):  # the walk asks one past the last
                    start = jnp.int32(tile_start)
                    kv_page_range(
                        cu_reads,
                        kv_reads,
                        jnp.int32(seq),
                        start,
                        start + 3,
                        causal=True,
                        sliding_window=2,
                        **static,
                    )


@pytest.mark.parametrize("d", [1, 2, 3, 4, 6, 8, 128, 129])
def test_div_nonneg_is_floor_division(d):
    x = np.arange(0, 1000, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(div_nonneg(jnp.asarray(x), d)), x // d)


@pytest.mark.parametrize(
    "d, op", [(1, "shift_right_logical"), (8, "shift_right_logical"), (6, "div")]
)
def test_div_nonneg_shifts_for_a_power_of_two(d, op):
    eqns = jax.make_jaxpr(lambda x: div_nonneg(x, d))(jnp.int32(7)).eqns
    assert [e.primitive.name for e in eqns] == [op]
