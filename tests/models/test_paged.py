"""The paged forward (write_kv + paged_attention per layer) equals the dense forward.

Each case runs engine-like steps by hand: blocks are assigned from a shuffled pool, the
cache is poisoned with NaN before use, and per-position logits (logits_indices widened to
every token) are compared with the dense forward over the whole sequences. Tolerance:
float32 throughout, logits of magnitude ~1-10; the two paths differ only in summation
order, so |paged - dense| <= 1e-4 + 1e-4 * |dense| per logit (observed <= 3e-6).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadeLevel, CascadePlan
from jaxkv.models import make_dense_forward, make_paged_forward
from tests.models.conftest import random_model, small_config

BLOCK_SIZE = 4
MAX_BLOCKS = 8  # per sequence: 32 tokens
# One bucket per axis, so every case of a kind shares one compiled program.
BUCKETS = BucketConfig(
    max_num_tokens=32,
    max_num_seqs=4,
    max_pages_per_seq=MAX_BLOCKS,
    max_cascade_groups=2,
    min_num_tokens=32,
    min_num_seqs=4,
    min_pages_per_seq=MAX_BLOCKS,
)
TOL = dict(rtol=1e-4, atol=1e-4)

CONFIG = small_config()
MODEL = random_model(CONFIG, seed=7)
DENSE = make_dense_forward(MODEL)


def _dense_logits(seqs: list[np.ndarray]) -> list[np.ndarray]:
    """Oracle: dense causal forward of each whole sequence (right padding is invisible)."""
    length = max(len(s) for s in seqs)
    batch = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    logits = np.asarray(DENSE(jnp.asarray(batch)))
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


class PagedRun:
    """A hand-managed paged cache: row i of the block table belongs to sequence i."""

    def __init__(self, block_table: np.ndarray, num_blocks: int = 64):
        self.block_table = block_table  # i32[num_seqs, MAX_BLOCKS]
        self.forward = make_paged_forward(MODEL)
        # NaN everywhere: reading a slot that was never written would poison the logits.
        self.caches = [c + jnp.nan for c in MODEL.init_kv_caches(num_blocks, BLOCK_SIZE)]

    def step(
        self,
        chunks: list[tuple[int, np.ndarray, int]],  # (row, tokens, num_computed), batch order
        levels: tuple[CascadeLevel, ...] = (),
        suffix_start_blocks: np.ndarray | None = None,
        drop_levels: bool = False,
    ) -> list[np.ndarray]:  # per chunk: f32[len(tokens), vocab]
        rows = np.array([r for r, _, _ in chunks], np.int32)
        query_lens = np.array([len(t) for _, t, _ in chunks])
        num_computed = np.array([n for _, _, n in chunks])
        if suffix_start_blocks is None:
            suffix_start_blocks = np.zeros(len(chunks), np.int32)
        plan = CascadePlan(
            np.arange(len(chunks), dtype=np.int32), rows, suffix_start_blocks, levels, 0
        )
        md = build_attention_metadata(
            block_table=self.block_table,
            plan=plan,
            query_lens=query_lens,
            num_computed_tokens=num_computed,
            block_size=BLOCK_SIZE,
            buckets=BUCKETS,
        )
        # Logits at every token rather than only each sequence's last one.
        md = dataclasses.replace(md, logits_indices=np.arange(md.max_num_tokens, dtype=np.int32))
        if drop_levels:
            md = dataclasses.replace(md, levels=())
        input_ids = np.zeros(md.max_num_tokens, np.int32)
        input_ids[: query_lens.sum()] = np.concatenate([t for _, t, _ in chunks])
        logits, self.caches = self.forward(input_ids, md.positions, self.caches, md)
        logits = np.asarray(logits)
        starts = np.concatenate([[0], np.cumsum(query_lens)])
        return [logits[starts[i] : starts[i + 1]] for i in range(len(chunks))]


def _shuffled_table(num_seqs: int, seed: int = 0) -> np.ndarray:
    """Distinct non-null blocks per sequence, in shuffled physical order."""
    blocks = np.random.default_rng(seed).permutation(np.arange(1, 1 + num_seqs * MAX_BLOCKS))
    return blocks.reshape(num_seqs, MAX_BLOCKS).astype(np.int32)


def _sequences(lengths: list[int], seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CONFIG.vocab_size, n).astype(np.int32) for n in lengths]


def _check(got: np.ndarray, want: np.ndarray) -> None:
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **TOL)


def test_prefill_then_decode_steps_match_dense():
    seqs = _sequences([7, 13, 1, 9])  # 30 prompt tokens; 3 decode steps follow
    full = [np.concatenate([s, _sequences([3], seed=10 + i)[0]]) for i, s in enumerate(seqs)]
    want = _dense_logits(full)
    run = PagedRun(_shuffled_table(4))
    prompts = [len(s) for s in seqs]
    got = run.step([(i, full[i][:n], 0) for i, n in enumerate(prompts)])
    for i, n in enumerate(prompts):
        _check(got[i], want[i][:n])
    for t in range(3):  # decode: one token per sequence per step
        got = run.step([(i, full[i][n + t : n + t + 1], n + t) for i, n in enumerate(prompts)])
        for i, n in enumerate(prompts):
            _check(got[i], want[i][n + t : n + t + 1])


def test_chunked_prefill_mixed_with_decode_matches_dense():
    full = _sequences([22, 9])
    want = _dense_logits(full)
    run = PagedRun(_shuffled_table(2, seed=3))
    # Sequence 0 prefills in chunks of 5, 6 and 11 tokens (crossing block boundaries at odd
    # offsets) while sequence 1 prefills 6 tokens and then decodes alongside.
    schedule = [[(0, 0, 5), (1, 0, 6)], [(0, 5, 11), (1, 6, 7)], [(0, 11, 22), (1, 7, 8)]]
    for step in schedule:
        got = run.step([(r, full[r][a:b], a) for r, a, b in step])
        for (r, a, b), g in zip(step, got, strict=True):
            _check(g, want[r][a:b])


def _shared_prefix_setup(prefix_blocks: int, suffix_lens: list[int], group_blocks: int = 0):
    """Sequences sharing `prefix_blocks` physical blocks (and, in two halves, a further
    `group_blocks` per half), laid out as a prefix cache would after one prefill."""
    num_seqs = len(suffix_lens)
    table = _shuffled_table(num_seqs, seed=5)
    table[:, :prefix_blocks] = table[0, :prefix_blocks]
    halves = [list(range(num_seqs // 2)), list(range(num_seqs // 2, num_seqs))]
    shared = prefix_blocks * BLOCK_SIZE
    group_tokens = group_blocks * BLOCK_SIZE
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, CONFIG.vocab_size, shared).astype(np.int32)
    full = []
    for half in halves:
        cols = slice(prefix_blocks, prefix_blocks + group_blocks)
        table[half, cols] = table[half[0], cols]
        group = rng.integers(0, CONFIG.vocab_size, group_tokens).astype(np.int32)
        for i in half:
            own = rng.integers(0, CONFIG.vocab_size, suffix_lens[i]).astype(np.int32)
            full.append(np.concatenate([prefix, group, own]))
    return table, full, halves


def test_cascade_global_prefix_step_matches_dense_and_dropping_the_level_fails():
    prefix_blocks = 2
    table, full, _ = _shared_prefix_setup(prefix_blocks, [5, 1, 3, 2])
    want = _dense_logits(full)
    run = PagedRun(table)
    shared = prefix_blocks * BLOCK_SIZE
    # Row 0 prefills the shared prefix once (the other rows point at the same blocks).
    _check(run.step([(0, full[0][:shared], 0)])[0], want[0][:shared])
    # One cascade step: every row's suffix (prefill chunks and a decode-length query)
    # attends to the shared blocks non-causally once, and causally to its own blocks.
    level = CascadeLevel("global", *(np.array([v], np.int32) for v in (0, 4, 0, 2, 0)))
    step = [(i, full[i][shared:], shared) for i in range(4)]
    suffix_start = np.full(4, prefix_blocks, np.int32)
    got = run.step(step, (level,), suffix_start)
    for i, g in enumerate(got):
        _check(g, want[i][shared:])
    # A decode step after it, cascade again.
    nxt = _sequences([4], seed=20)[0]
    full2 = [np.concatenate([f, nxt[i : i + 1]]) for i, f in enumerate(full)]
    want2 = _dense_logits(full2)
    step = [(i, full2[i][-1:], len(full[i])) for i in range(4)]
    for i, g in enumerate(run.step(step, (level,), suffix_start)):
        _check(g, want2[i][-1:])
    # Without the prefix level the suffix pass misses the shared keys: must not match.
    step = [(i, full2[i][-1:], len(full[i])) for i in range(4)]
    got = run.step(step, (level,), suffix_start, drop_levels=True)
    assert not np.allclose(got[0], want2[0][-1:], **TOL)


def test_two_level_cascade_global_then_groups_matches_dense():
    # All four rows share block 0; rows {0, 1} and {2, 3} each share a further block.
    table, full, halves = _shared_prefix_setup(1, [3, 6, 1, 2], group_blocks=1)
    want = _dense_logits(full)
    run = PagedRun(table)
    shared = 2 * BLOCK_SIZE
    # Prefill of the shared blocks: row 0 writes global + its group's block, row 2 its own.
    got = run.step([(0, full[0][:shared], 0), (2, full[2][BLOCK_SIZE:shared], BLOCK_SIZE)])
    _check(got[0], want[0][:shared])
    _check(got[1], want[2][BLOCK_SIZE:shared])
    as_i32 = lambda *v: np.array(v, np.int32)
    global_level = CascadeLevel("global", as_i32(0), as_i32(4), as_i32(0), as_i32(1), as_i32(0))
    groups = CascadeLevel("groups", as_i32(0, 2), as_i32(2, 4), as_i32(1, 1), as_i32(2, 2),
                          as_i32(halves[0][0], halves[1][0]))  # fmt: skip
    got = run.step(
        [(i, full[i][shared:], shared) for i in range(4)],
        (global_level, groups),
        np.full(4, 2, np.int32),
    )
    for i, g in enumerate(got):
        _check(g, want[i][shared:])


def test_paged_forward_rejects_wrong_number_of_caches():
    run = PagedRun(_shuffled_table(1))
    run.caches = run.caches[:1]
    with pytest.raises(ValueError, match="num_layers"):
        run.step([(0, np.array([1, 2], np.int32), 0)])
