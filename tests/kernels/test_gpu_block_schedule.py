"""The GPU kernel's block schedule against a walk over every token and key.

The interpreter runs programs one after another, so a program that stores a row of the
next sequence's token is overwritten by that sequence's program and the outputs agree;
on a GPU the two race. A key range past what a block's rows see is masked and only
slower. Here each bound is compared exactly with the tokens and keys it stands for, on
random ragged batches with zero-length sequences and poisoned padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.gpu.block_schedule import (
    block_rows,
    block_tokens,
    find_seq,
    key_block_range,
    split_range,
)
from tests.kernels import harness

POISON = -(2**30)
MAX_NUM_SEQS, MAX_Q = 6, 7


def _batch(rng, num_seqs, max_kv=40, *, stale=False):
    """A batch of num_seqs random sequences; padding past them poisoned, or (`stale`)
    holding the offsets and lengths of a whole earlier batch."""
    if stale:
        cu, kv = _batch(rng, MAX_NUM_SEQS, max_kv)
        cu[0] = 0
        return cu, kv
    q_lens = rng.integers(0, MAX_Q + 1, num_seqs)
    kv_lens = q_lens + rng.integers(0, max_kv - q_lens + 1)
    cu = np.full(MAX_NUM_SEQS + 1, POISON, np.int32)
    cu[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.full(MAX_NUM_SEQS, POISON, np.int32)
    kv[:num_seqs] = kv_lens
    return cu, kv


@functools.partial(jax.jit, static_argnames=("tokens_per_block", "block_k", "causal", "window"))
def _schedule(cu, kv, num_seqs, *, tokens_per_block, block_k, causal, window):
    """(seq, tok0, tok_end, kb_lo, kb_hi) of every block of the kernel's grid."""
    num_blocks = MAX_NUM_SEQS * MAX_Q // tokens_per_block + MAX_NUM_SEQS

    def one(pid):
        seq, tok0, tok_end = block_tokens(
            cu, num_seqs, pid, tokens_per_block=tokens_per_block, max_num_seqs=MAX_NUM_SEQS
        )
        keys = key_block_range(
            cu[seq + 1],
            kv[seq],
            tok0,
            tok_end,
            block_k=block_k,
            causal=causal,
            sliding_window=window,
        )
        return (seq, tok0, tok_end, *keys)

    return jax.vmap(one)(jnp.arange(num_blocks, dtype=jnp.int32))


def _key_blocks_seen(cu, kv, seq, tokens, *, block_k, causal, window):
    keys = harness.keys_seen(cu, kv, seq, tokens, causal=causal, window=window)
    return {key // block_k for key in keys}


CONFIGS = [
    dict(tokens_per_block=1, block_k=16, causal=True, window=None),
    dict(tokens_per_block=2, block_k=4, causal=True, window=None),
    dict(tokens_per_block=4, block_k=8, causal=False, window=None),
    dict(tokens_per_block=3, block_k=1, causal=False, window=None),
    dict(tokens_per_block=4, block_k=2, causal=True, window=3),
    dict(tokens_per_block=8, block_k=1, causal=True, window=1),
]


@pytest.mark.parametrize("seed", range(len(CONFIGS)))
def test_blocks_hold_each_token_once_and_read_exactly_the_key_blocks_it_sees(seed):
    config = CONFIGS[seed]
    tpb, block_k = config["tokens_per_block"], config["block_k"]
    rng = np.random.default_rng(seed)
    for num_seqs, stale in [(0, False), (0, True), (1, False), (3, False), (MAX_NUM_SEQS, False)]:
        cu, kv = _batch(rng, num_seqs, stale=stale)
        got = map(np.asarray, _schedule(cu, kv, np.int32(num_seqs), **config))
        held = []
        for seq, tok0, tok_end, kb_lo, kb_hi in zip(*got, strict=True):
            tokens = range(tok0, tok_end)
            assert len(tokens) <= tpb
            if not tokens:
                assert (kb_lo, kb_hi) == (0, 0)
                continue
            assert seq < num_seqs and cu[seq] <= tok0 and tok_end <= cu[seq + 1]
            held += tokens
            seen = _key_blocks_seen(
                cu,
                kv,
                seq,
                tokens,
                block_k=block_k,
                causal=config["causal"],
                window=config["window"],
            )
            want = (min(seen), max(seen) + 1) if seen else (0, 0)
            assert seen == set(range(*want)), seen
            assert (kb_lo, kb_hi) == want, (seq, tokens)
        assert sorted(held) == list(range(cu[num_seqs])), (cu, num_seqs)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 5, 8, 64, 255, 256])
def test_find_seq_among_many_one_token_sequences(max_num_seqs):
    # One token per sequence and per block: sequence i owns blocks 2i and 2i + 1 (its
    # token, and the block after it no token lands in), so deep searches are exact.
    cu = jnp.arange(max_num_seqs + 1, dtype=jnp.int32)
    pids = jnp.arange(2 * max_num_seqs + 2, dtype=jnp.int32)
    find = functools.partial(find_seq, tokens_per_block=1, max_num_seqs=max_num_seqs)
    got = jax.jit(jax.vmap(lambda pid: find(cu, jnp.int32(max_num_seqs), pid)))(pids)
    np.testing.assert_array_equal(np.asarray(got), np.minimum(pids // 2, max_num_seqs - 1))


@pytest.mark.parametrize("group", [1, 3, 4])
def test_block_rows_are_the_tokens_query_heads_and_no_more(group):
    block_m = 16
    for tok0, tok_end in [(5, 5), (5, 6), (2, 2 + block_m // group), (7, 9)]:
        tok, valid = map(np.asarray, block_rows(tok0, tok_end, block_m=block_m, group=group))
        r = np.arange(block_m)
        np.testing.assert_array_equal(tok, tok0 + r // group)
        np.testing.assert_array_equal(valid, (tok0 + r // group < tok_end))
        assert valid.sum() == (tok_end - tok0) * group


@pytest.mark.parametrize("num_kv_splits", [1, 2, 3, 5])
def test_splits_cover_the_key_blocks_in_order_each_once(num_kv_splits):
    for kb_lo, kb_hi in [(0, 0), (0, 1), (2, 9), (3, 4), (0, 12)]:
        chunk = -(-(kb_hi - kb_lo) // num_kv_splits)
        covered = []
        for split in range(num_kv_splits):
            lo, hi = map(int, split_range(kb_lo, kb_hi, split, num_kv_splits=num_kv_splits))
            assert hi - lo <= chunk
            covered += range(lo, hi)
        assert covered == list(range(kb_lo, kb_hi))
