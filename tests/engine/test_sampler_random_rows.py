"""The jitted sampler against a plain numpy statement of vLLM's per-row transforms.

Random batches mix greedy and sampled rows, ties, -inf logits, rows with one finite logit,
min_tokens bans (with padding and out-of-vocabulary ids), penalties, top_k of 0, 1, k and
past the vocabulary, top_p of 1 down to tiny, and min_p. The reference takes vLLM's order:
the ban, then the penalties (on the listed tokens: a logit > 0 divided by the repetition
penalty, else multiplied, then frequency * count and presence subtracted), then greedy's
argmax (lowest id on ties); for sampled rows temperature, min_p (against the most likely
token), top-k (tokens tied with the k-th kept) and top-p (the smallest prefix, most likely
first, whose mass reaches top_p; tokens tied with the last one kept, as documented).

Greedy rows must be the reference's token; a sampled row's draws over many seeds must lie
in its reference support (taken with top_p and min_p loosened by 1e-5, as float32 rounding
may move a token that sits on either boundary) and must include every token the reference
gives at least 5% (missed in 400 draws with probability below 1e-8).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv.batch_rows import NO_TOKEN
from jaxkv.sampler import sample, seed_words

_sample = jax.jit(sample)
VOCAB = 16
ROWS = 64
DRAWS = 400  # seeds per row
LOOSE = 1e-5


def _penalised(logits, listed, counts, presence, frequency, repetition) -> np.ndarray:
    """f32 logits with the listed tokens penalised, in float32 as the sampler computes."""
    out = np.array(logits, np.float32)
    for token, count in zip(listed, counts, strict=True):
        if 0 <= token < len(out):
            old = out[token]
            new = old / repetition if old > 0 else old * repetition
            out[token] = new - frequency * np.float32(count) - (presence if count else 0)
    return out


def reference(logits, temperature, top_k, top_p, min_p) -> np.ndarray:
    """f64[vocab]: the probability of each token for a sampled row whose ban and penalties
    are already in `logits`."""
    z = np.asarray(logits, np.float64)
    z = np.where(z == z.max(), 0.0, z - z.max()) / temperature  # also for a +inf maximum
    p = np.exp(z)
    p = np.where(p >= min_p * p.max(), p, 0.0)
    order = np.argsort(-p, kind="stable")
    k = len(p) if top_k == 0 else min(top_k, len(p))
    p = np.where(p >= p[order[k - 1]], p, 0.0)  # ties with the k-th are in
    mass = p[order] / p.sum()
    before = np.cumsum(mass) - mass
    kept = order[(before < top_p) | (np.arange(len(p)) == 0)]
    p = np.where(p >= p[kept].min(), p, 0.0)  # ties with the last one kept are in
    return p / p.sum()


def _batch(rng: np.random.Generator):
    logits = rng.normal(0, 2, (ROWS, VOCAB))
    scale = rng.choice([1, 2, 1000], size=(ROWS, 1))  # 1 and 2: many ties
    logits = (np.round(logits * scale) / scale).astype(np.float32)
    logits[rng.random((ROWS, VOCAB)) < rng.choice([0, 0.3, 0.9], size=(ROWS, 1))] = -np.inf
    for r in np.flatnonzero(rng.random(ROWS) < 0.1):  # all but one masked
        logits[r] = -np.inf
        logits[r, rng.integers(VOCAB)] = rng.normal()
    for r in np.flatnonzero(~np.isfinite(logits).any(axis=1)):
        logits[r, rng.integers(VOCAB)] = 0.0
    banned = rng.integers(-2, VOCAB + 2, (ROWS, 2)).astype(np.int32)
    banned[rng.random(ROWS) < 0.5] = NO_TOKEN
    for r in range(ROWS):  # a row keeps a finite logit its ban leaves
        ban = banned[r][(banned[r] >= 0) & (banned[r] < VOCAB)]
        if not np.isfinite(np.delete(logits[r], ban)).any():
            banned[r] = NO_TOKEN
    listed = np.full((ROWS, 4), NO_TOKEN, np.int32)
    counts = np.zeros((ROWS, 4), np.int32)
    for r in np.flatnonzero(rng.random(ROWS) < 0.5):
        listed[r] = rng.choice(VOCAB, 4, replace=False)
        counts[r] = rng.integers(0, 4, 4)
    presence = rng.choice([0.0, 0.5, -1.0, 2.0], ROWS).astype(np.float32)
    frequency = rng.choice([0.0, 0.3, -0.7], ROWS).astype(np.float32)
    repetition = rng.choice([1.0, 0.5, 1.7], ROWS).astype(np.float32)
    params = dict(
        temperature=rng.choice([0.0, 0.0, 0.3, 1.0, 2.5], ROWS).astype(np.float32),
        top_k=rng.choice([0, 1, 2, 3, 5, VOCAB, VOCAB + 3], ROWS).astype(np.int32),
        top_p=rng.choice([1.0, 0.9, 0.5, 0.1, 1e-6], ROWS).astype(np.float32),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3, 1.0], ROWS).astype(np.float32),
    )
    return logits, banned, (listed, counts, presence, frequency, repetition), params


@pytest.mark.parametrize("seed", range(12))
def test_each_row_draws_from_the_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    logits, banned, penalties, params = _batch(rng)
    tile = lambda a: np.tile(a, (DRAWS,) + (1,) * (a.ndim - 1))  # noqa: E731
    seeds = np.repeat(np.arange(DRAWS, dtype=np.uint64), ROWS) + np.uint64(seed << 32)
    draws = np.asarray(
        _sample(
            tile(logits),
            tile(params["temperature"]),
            tile(params["top_k"]),
            tile(params["top_p"]),
            seed_words(seeds),
            np.zeros(ROWS * DRAWS, np.uint32),
            np.full(ROWS * DRAWS, 5, np.int32),
            tile(banned),
            tuple(tile(a) for a in penalties),
            tile(params["min_p"]),
        )
    ).reshape(DRAWS, ROWS)
    listed, counts, presence, frequency, repetition = penalties
    for r in range(ROWS):
        row = logits[r].copy()
        row[banned[r][(banned[r] >= 0) & (banned[r] < VOCAB)]] = -np.inf
        row = _penalised(row, listed[r], counts[r], presence[r], frequency[r], repetition[r])
        t, k, p, m = (params[name][r] for name in ("temperature", "top_k", "top_p", "min_p"))
        case = f"row {r}: {row}, T={t} top_k={k} top_p={p} min_p={m}"
        if t == 0:
            np.testing.assert_array_equal(draws[:, r], np.argmax(row), err_msg=case)
            continue
        want = reference(row, t, k, p, m)
        loose = reference(row, t, k, min(float(p) + LOOSE, 1.0), max(float(m) - LOOSE, 0.0))
        drawn = np.unique(draws[:, r])
        assert (loose[drawn] > 0).all(), f"{case}: drew {drawn}, support {np.flatnonzero(loose)}"
        likely = np.flatnonzero(want >= 0.05)
        assert np.isin(likely, drawn).all(), f"{case}: drew {drawn}, want {want.round(3)}"


def test_the_check_sees_a_sampler_that_ignores_ties_with_the_kth():
    # Control: the reference keeps all three tokens tied with the 2nd; a cut that kept
    # exactly k would leave one of them out, which the draws would show.
    row = np.float32([3.0, 1.0, 1.0, 1.0, -1.0] + [-np.inf] * (VOCAB - 5))
    want = reference(row, 1.0, 2, 1.0, 0.0)
    assert (want > 0).sum() == 4
    draws = np.asarray(
        _sample(
            np.tile(row, (DRAWS, 1)),
            np.ones(DRAWS, np.float32),
            np.full(DRAWS, 2, np.int32),
            np.ones(DRAWS, np.float32),
            seed_words(np.arange(DRAWS)),
            np.zeros(DRAWS, np.uint32),
            np.zeros(DRAWS, np.int32),
        )
    )
    assert set(draws.tolist()) == {0, 1, 2, 3}
