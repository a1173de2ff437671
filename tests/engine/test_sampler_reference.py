"""The sampler against a numpy statement of its documented distribution, and its edge cases.

The reference: softmax(logits / T), cut to the top_k most likely tokens, renormalised, cut to
the smallest prefix (most likely first) whose mass reaches top_p, renormalised. Counts of
20,000 draws are compared with a chi-square test at p = 1e-6 (the seeds are fixed, so a pass
is deterministic); a control shows the same test rejects a near-miss distribution.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest
from scipy import stats

from jaxkv.request import SamplingParams
from jaxkv.sampler import (
    DEFAULT_STREAM,
    SEED_STREAM,
    sample,
    sampling_arrays,
    sampling_row,
    seed_words,
)

_sample = jax.jit(sample)
LOGITS = np.array([2.0, 1.5, 1.1, 0.7, 0.2, -0.3, -1.0, -2.0], np.float32)
N = 20_000
ROWS = 4000  # every other test pads its batch to this many rows


def _run(
    logits, temperature, top_k=0, top_p=1.0, seeds=0, positions=0, streams=0, min_p=None
) -> np.ndarray:
    """Tokens of `logits` rows; batches smaller than ROWS are padded (one compiled shape).
    `min_p` None passes none (the sampler's default)."""
    logits = np.asarray(logits, np.float32)
    n = len(logits)
    size = n if n == N else ROWS
    full = lambda v, dt, pad: np.concatenate([np.broadcast_to(np.asarray(v, dt), (n,)),
                                              np.full(size - n, pad, dt)])  # fmt: skip
    rows = np.concatenate([logits, np.zeros((size - n, logits.shape[1]), np.float32)])
    out = _sample(
        rows,
        full(temperature, np.float32, 0),
        full(top_k, np.int32, 0),
        full(top_p, np.float32, 1),
        seed_words(full(seeds, np.uint64, 0)),
        full(streams, np.uint32, 0),
        full(positions, np.int32, 0),
        *(() if min_p is None else (None, None, full(min_p, np.float32, 0))),
    )
    return np.asarray(out)[:n]


def reference_probs(logits, temperature, top_k, top_p) -> np.ndarray:  # f64[vocab]
    z = np.asarray(logits, np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    k = len(probs) if top_k == 0 else min(top_k, len(probs))
    kept = order[probs[order] >= probs[order[k - 1]]]  # ties with the k-th are in
    mass = probs[kept] / probs[kept].sum()
    before = np.cumsum(mass) - mass
    last = probs[kept[before < top_p]].min()
    kept = kept[probs[kept] >= last]  # ties with the last one kept are in
    out = np.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    expected = probs[support] * counts.sum()
    statistic = (((counts[support] - expected) ** 2) / expected).sum()
    return float(stats.chi2.sf(statistic, max(int(support.sum()) - 1, 1)))


CASES = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (2.0, 6, 0.9), (0.5, 3, 0.97)]


@pytest.mark.parametrize("temperature, top_k, top_p", CASES)
def test_draws_follow_the_documented_distribution_across_seeds_and_along_one_stream(
    temperature, top_k, top_p
):
    want = reference_probs(LOGITS, temperature, top_k, top_p)
    rows = np.tile(LOGITS, (N, 1))
    across_seeds = _run(rows, temperature, top_k, top_p, seeds=np.arange(N), positions=11)
    one_stream = _run(rows, temperature, top_k, top_p, seeds=123, positions=np.arange(N))
    for draws in (across_seeds, one_stream):
        counts = np.bincount(draws, minlength=len(LOGITS))
        assert _chi2_pvalue(counts, want) > 1e-6, (counts / N, want)
    # Control: the test has the power to see a 25% change of temperature.
    near = reference_probs(LOGITS, temperature * 1.25, top_k, top_p)
    assert _chi2_pvalue(np.bincount(across_seeds, minlength=len(LOGITS)), near) < 1e-6


def test_top_k_one_tiny_top_p_and_zero_temperature_equal_greedy():
    logits = np.random.default_rng(0).normal(0, 3, (ROWS, 8))
    greedy = np.argmax(logits, -1)
    seeds = np.arange(ROWS)
    np.testing.assert_array_equal(_run(logits, 1.0, top_k=1, seeds=seeds), greedy)
    np.testing.assert_array_equal(_run(logits, 1.0, top_p=1e-6, seeds=seeds), greedy)
    np.testing.assert_array_equal(_run(logits, 0.0, top_k=5, top_p=0.5, seeds=seeds), greedy)
    # The same rows at temperature 1 with no cut are not all greedy: the checks above bite.
    assert (_run(logits, 1.0, seeds=seeds) != greedy).mean() > 0.1


def test_a_top_p_that_underflows_float32_still_keeps_the_most_likely_token():
    # SamplingParams takes any top_p > 0; 1e-50 is 0 in float32 and 1e-40 a subnormal
    # that the CPU flushes to 0: the cut must still keep the top token, not drop them all.
    logits = np.random.default_rng(1).normal(0, 3, (ROWS, 8))
    greedy = np.argmax(logits, -1)
    seeds = np.arange(ROWS)
    assert (greedy != 0).any()  # an all-masked row draws token 0: that must be visible
    for top_p in (1e-40, 1e-50):
        np.testing.assert_array_equal(_run(logits, 1.0, top_p=top_p, seeds=seeds), greedy)


def test_a_prefix_whose_mass_equals_top_p_exactly_ends_the_cut():
    # Powers of two: probabilities and running sums are exact in float32. The prefix {0}
    # has mass exactly 0.5, {0, 1} exactly 0.75: each reaches that top_p, so nothing more
    # is kept (a draw from outside the support fails the set comparison).
    logits = np.tile(np.log(np.float32([0.5, 0.25, 0.125, 0.0625, 0.0625])), (ROWS, 1))
    for top_p, support in ((0.5, {0}), (0.75, {0, 1}), (0.875, {0, 1, 2})):
        draws = _run(logits, 1.0, top_p=top_p, seeds=np.arange(ROWS))
        assert set(draws.tolist()) == support, top_p


def test_top_p_one_keeps_tokens_after_the_float32_running_mass_reaches_one():
    # e**-17.4 + e**-17.45 is under half an ulp of 1: float32 softmax gives token 0 a
    # probability of exactly 1, so the running mass before either tail token is 1 too.
    # top_p = 1 is no cut all the same; at this position seed 0's draw (about one in
    # twenty million) falls on the tail, which any top_p below 1 removes.
    logits = np.float32([[0.0, -17.4, -17.45]])
    assert _run(logits, 1.0, top_p=1.0, positions=7_222_309).tolist() == [1]
    assert _run(logits, 1.0, top_p=0.999, positions=7_222_309).tolist() == [0]


def test_vanishing_temperature_is_greedy_even_where_logits_over_temperature_overflow():
    # 40 / 1e-37 and 50 / 1e-37 both overflow float32 to inf: without care they tie.
    logits = np.tile(np.array([40.0, 50.0, -1.0, 0.5, 0, 0, 0, 0], np.float32), (64, 1))
    for temperature in (1e-37, 1e-30, 1e-3):
        draws = _run(logits, temperature, seeds=np.arange(64))
        np.testing.assert_array_equal(draws, 1, err_msg=f"{temperature=}")
        np.testing.assert_array_equal(_run(logits, temperature, top_k=1, seeds=np.arange(64)), 1)


def test_a_positive_infinite_logit_is_always_drawn():
    # A token forced with +inf (a logit bias) takes all the mass; two such tokens share it.
    one = np.tile(np.float32([0.5, 2.0, -1.0, np.inf, 0, 0, 0, 0]), (ROWS, 1))
    two = one.copy()
    two[:, 6] = np.inf
    seeds = np.arange(ROWS)
    for temperature, cut in ((1.0, {}), (0.5, dict(top_k=3)), (2.0, dict(top_p=0.5))):
        np.testing.assert_array_equal(_run(one, temperature, seeds=seeds, **cut), 3)
        counts = np.bincount(_run(two, temperature, seeds=seeds, **cut), minlength=8)
        assert counts[3] + counts[6] == ROWS and abs(counts[3] - ROWS / 2) < 200, counts


def test_top_k_at_or_beyond_vocab_is_no_cut():
    rows = np.tile(LOGITS, (ROWS, 1))
    seeds = np.arange(ROWS)
    free = _run(rows, 1.0, seeds=seeds)
    for top_k in (len(LOGITS), len(LOGITS) + 1, 2**31 - 1):
        np.testing.assert_array_equal(_run(rows, 1.0, top_k=top_k, seeds=seeds), free)


def test_ties_greedy_takes_lowest_id_and_sampling_keeps_every_tied_token():
    logits = np.tile(np.array([0.0, 3.0, 1.0, 3.0, 0, 0, 0, 0], np.float32), (ROWS, 1))
    assert set(_run(logits, 0.0, seeds=np.arange(ROWS)).tolist()) == {1}
    # top_k = 1 and tiny top_p keep the tokens tied with the last kept one (documented).
    for cut in (dict(top_k=1), dict(top_p=1e-6)):
        counts = np.bincount(_run(logits, 1.0, seeds=np.arange(ROWS), **cut), minlength=8)
        assert counts[1] + counts[3] == ROWS and abs(counts[1] - ROWS / 2) < 200, counts


def test_top_p_weighs_every_token_tied_with_the_kth():
    # top_k = 2 keeps all three tokens tied at the 2nd logit (as vLLM's cut does); their
    # mass puts top_p = 0.6 past the first of them, which keeps all three (ties).
    logits = np.array([2.0, 1.0, 1.0, 1.0, -1.0], np.float32)
    want = reference_probs(logits, 1.0, 2, 0.6)
    np.testing.assert_allclose(want[:4], np.exp([2, 1, 1, 1]) / np.exp([2, 1, 1, 1]).sum())
    counts = np.bincount(
        _run(np.tile(logits, (N, 1)), 1.0, 2, 0.6, seeds=np.arange(N), positions=3), minlength=5
    )
    assert _chi2_pvalue(counts, want) > 1e-6, counts


def test_a_row_depends_only_on_its_seed_and_position_and_seeds_are_independent():
    uniform = np.zeros((ROWS, 8), np.float32)
    seeds = np.arange(ROWS)
    a = _run(uniform, 1.0, seeds=seeds, positions=7)
    # The same (seed, position) in other rows, beside other rows' logits and params:
    # the same token.
    perm = np.random.default_rng(1).permutation(ROWS)[:100]
    mixed = np.random.default_rng(2).normal(0, 2, (ROWS, 8)).astype(np.float32)
    mixed[:100] = 0
    temperature = np.r_[np.ones(100), np.full(ROWS - 100, 0.3)]
    top_k = np.r_[np.zeros(100), np.full(ROWS - 100, 3)]
    got = _run(mixed, temperature, top_k, seeds=np.r_[perm, seeds[100:]], positions=7)
    np.testing.assert_array_equal(got[:100], a[perm])
    # Streams of neighbouring seeds, far seeds, neighbouring positions and the same seed
    # as an engine default agree as often as independent uniform draws do (1/8, sd 0.005).
    for other in (
        _run(uniform, 1.0, seeds=seeds + 1, positions=7),
        _run(uniform, 1.0, seeds=seeds + 2**31, positions=7),
        _run(uniform, 1.0, seeds=seeds, positions=8),
        _run(uniform, 1.0, seeds=seeds, positions=7, streams=DEFAULT_STREAM),
    ):
        agree = float((other == a).mean())
        assert 0.1 < agree < 0.15, agree
    # Seeds are 64-bit: ones equal modulo 2**32 draw apart (they drew alike when seeds
    # were folded into 32 bits), and a negative one counts modulo 2**64 (but -1, vLLM's
    # "no seed", is None).
    for far in (seeds + 2**32, seeds + 2**40, seeds.astype(np.uint64) + np.uint64(2**63)):
        agree = float((_run(uniform, 1.0, seeds=far, positions=7) == a).mean())
        assert 0.1 < agree < 0.15, agree
    row = lambda seed: sampling_row(SamplingParams(temperature=1.0, seed=seed), 0)
    assert row(2**32 + 5)[3] == 2**32 + 5 and row(-2)[3] == 2**64 - 2
    assert sampling_row(SamplingParams(temperature=1.0, seed=-1), 7)[3:] == (7, DEFAULT_STREAM)
    assert row(99)[3:] == (99, SEED_STREAM)
    assert sampling_row(SamplingParams(temperature=1.0), 99)[3:] == (99, DEFAULT_STREAM)


def test_sampling_arrays_hold_a_huge_top_k_without_overflow():
    rows = [sampling_row(SamplingParams(temperature=1.0, top_k=2**40), 0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns on an out-of-range float->int cast
        _, top_k, _, _, _ = sampling_arrays(rows, 2)
    assert top_k[0] >= 2**31 - 1 and top_k[1] == 0


def test_sampling_arrays_put_each_row_in_its_column_and_pad_with_greedy_rows():
    rows = [(0.7, 5, 0.9, 11, SEED_STREAM), (1.3, 0, 0.25, 2**32 - 1, DEFAULT_STREAM)]
    rows += [(1.0, 0, 1.0, 2**64 - 1, SEED_STREAM)]  # both words, exact in the float table
    temperature, top_k, top_p, seeds, streams = sampling_arrays(rows, 4)
    assert temperature.dtype == np.float32 and top_p.dtype == np.float32
    assert top_k.dtype == np.int32 and seeds.dtype == streams.dtype == np.uint32
    np.testing.assert_array_equal(temperature, np.float32([0.7, 1.3, 1, 0]))
    np.testing.assert_array_equal(top_k, [5, 0, 0, 0])
    np.testing.assert_array_equal(top_p, np.float32([0.9, 0.25, 1, 1]))
    np.testing.assert_array_equal(seeds, [[0, 11], [0, 2**32 - 1], [2**32 - 1] * 2, [0, 0]])
    np.testing.assert_array_equal(streams, [SEED_STREAM, DEFAULT_STREAM, SEED_STREAM, 0])
    empty = sampling_arrays([], 2)
    assert [a.tolist() for a in empty] == [[0, 0], [0, 0], [1, 1], [[0, 0], [0, 0]], [0, 0]]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("temperature", "1.0"),
        pytest.param("temperature", 10**400, id="temperature-10**400"),  # OverflowError
        ("temperature", 1e39),  # infinite in float32, where the sampler divides
        ("top_k", -2),  # -1 is vLLM's spelling of "off"
        ("top_k", 2.0),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("seed", 1.5),
        pytest.param("seed", 2**64, id="seed-2**64"),  # beyond 64 bits: was folded silently
        pytest.param("seed", -(2**63) - 1, id="seed-below-int64"),
        ("max_tokens", 0),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", 5),  # a lone id, not a sequence: was a TypeError
    ],
)
def test_bad_sampling_params_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**{field: value})


def test_a_sampled_token_is_the_high_dynamic_range_gumbel_draw():
    # JAX's default ("low") Gumbel noise cannot reach about 20 logits below the maximum:
    # with a 32k vocabulary 17 logits below the top, 8 draws in 30,000 fell on those
    # tokens where softmax expects 41. The sampler draws with mode="high"; with no cut and
    # a row maximum of 0 its masked row is the logits themselves, so each token must be
    # that draw exactly.
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 0.1, (64, 8)).astype(np.float32)
    logits -= logits.max(axis=1, keepdims=True)
    seeds, positions = np.arange(64, dtype=np.uint32), np.arange(64, dtype=np.int32) % 5
    got = _run(logits, 1.0, seeds=seeds, positions=positions)
    key = lambda s, p: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), SEED_STREAM), p)
    keys = jax.vmap(key)(seeds, positions)
    draw = jax.vmap(lambda k, row: jax.random.categorical(k, row, mode="high"))
    np.testing.assert_array_equal(got, np.asarray(draw(keys, logits)))
    assert SamplingParams(temperature=3.4e38).temperature == 3.4e38  # the largest f32 works
