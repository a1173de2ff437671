"""The sampler on hand-made logits: greedy, top-k, top-p, temperature, per-row seeds."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxkv.request import Request, SamplingParams
from jaxkv.sampler import (
    SEED_STREAM,
    SamplingRows,
    sample,
    sampling_arrays,
    sampling_row,
    seed_words,
)

_sample = jax.jit(sample)
PROBS = np.array([0.5, 0.3, 0.15, 0.05])


@functools.cache
def _draws(top_k: int, top_p: float, temperature: float = 1.0, n: int = 4000) -> np.ndarray:
    logits = np.tile(np.log(PROBS).astype(np.float32), (n, 1))
    return np.asarray(
        _sample(
            logits,
            np.full(n, temperature, np.float32),
            np.full(n, top_k, np.int32),
            np.full(n, top_p, np.float32),
            seed_words(np.arange(n)),
            np.zeros(n, np.uint32),
            np.full(n, 7, np.int32),
        )
    )


def test_greedy_rows_take_the_argmax_and_sampled_rows_follow_probabilities():
    freq = np.bincount(_draws(0, 1.0), minlength=4) / 4000
    np.testing.assert_allclose(freq, PROBS, atol=0.03)
    logits = np.array([[0.1, 2.0, -1.0, 2.0]], np.float32)
    one = lambda a, dt: np.array([a], dt)
    out = _sample(logits, one(0, np.float32), one(0, np.int32), one(1, np.float32),
                  seed_words([0]), one(0, np.uint32), one(0, np.int32))  # fmt: skip
    assert int(out[0]) == 1  # ties: the lowest id


def test_top_k_and_top_p_cut_the_tail():
    assert set(_draws(2, 1.0).tolist()) == {0, 1}
    assert set(_draws(1, 1.0).tolist()) == {0}
    # Mass before token 1 is 0.5 < 0.6, before token 2 it is 0.8: tokens 0 and 1 remain.
    freq = np.bincount(_draws(0, 0.6), minlength=4) / 4000
    assert freq[2:].sum() == 0
    np.testing.assert_allclose(freq[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)


def test_low_temperature_sharpens():
    freq = np.bincount(_draws(0, 1.0, temperature=0.25), minlength=4) / 4000
    sharp = PROBS**4 / (PROBS**4).sum()
    np.testing.assert_allclose(freq, sharp, atol=0.03)


def test_a_row_depends_on_its_seed_and_position_only():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 32)).astype(np.float32)
    args = lambda seeds, pos, stream=0: (
        logits, np.ones(8, np.float32), np.zeros(8, np.int32), np.ones(8, np.float32),
        seed_words(seeds), np.full(8, stream, np.uint32), np.asarray(pos, np.int32),
    )  # fmt: skip
    a = np.asarray(_sample(*args([5] * 8, [3] * 8)))
    b = np.asarray(_sample(*args([5] * 8, [3] * 8)))
    np.testing.assert_array_equal(a, b)
    shifted = np.asarray(_sample(*args([5] * 8, [4] * 8)))
    other = np.asarray(_sample(*args([6] * 8, [3] * 8)))
    other_stream = np.asarray(_sample(*args([5] * 8, [3] * 8, stream=1)))
    assert (shifted != a).any() and (other != a).any() and (other_stream != a).any()


def test_sampling_rows_follow_each_batch_order_and_size():
    # The arrays of a previous batch are reused only for the same requests in the same
    # order at the same size; each other call builds its own.
    rows = SamplingRows()
    reqs = [Request(str(i), [1, 2], SamplingParams(temperature=0.5 + i, seed=i)) for i in range(3)]
    for r in reqs:
        rows.add(r.request_id, r.sampling_params, default_seed=0)
    temperature = lambda order, n: rows.arrays(reqs, order, n)[0].tolist()
    assert temperature(None, 4) == [0.5, 1.5, 2.5, 0.0]
    assert temperature(np.array([2, 0, 1]), 4) == [2.5, 0.5, 1.5, 0.0]
    assert temperature(np.array([2, 0, 1]), 8) == [2.5, 0.5, 1.5] + [0.0] * 5
    seeds = rows.arrays(reqs, np.array([1, 2, 0]), 4)[3]
    assert seeds.tolist() == [[0, 1], [0, 2], [0, 0], [0, 0]]


def test_sampling_rows_of_a_reused_id_or_a_list_changed_in_place_are_rebuilt():
    # A reused id is a new Request object: the previous batch's arrays (same ids, order
    # and size) must not carry the finished request's parameters over to it. Nor may a
    # batch list the caller changes in place afterwards still match the previous batch.
    rows = SamplingRows()
    old = Request("a", [1, 2], SamplingParams(temperature=0.5))
    rows.add("a", old.sampling_params, default_seed=0)
    assert rows.arrays([old], None, 4)[0].tolist() == [0.5, 0, 0, 0]
    rows.discard("a")
    new = Request("a", [1, 2], SamplingParams(temperature=1.5))
    rows.add("a", new.sampling_params, default_seed=0)
    assert rows.arrays([new], None, 4)[0].tolist() == [1.5, 0, 0, 0]
    other = Request("b", [3], SamplingParams(temperature=2.5))
    rows.add("b", other.sampling_params, default_seed=0)
    batch = [new]
    assert rows.arrays(batch, None, 2)[0].tolist() == [1.5, 0]  # a new size: rebuilt
    batch[0] = other
    assert rows.arrays(batch, None, 2)[0].tolist() == [2.5, 0]


def test_sampling_rows_keep_every_row_through_growth_reuse_and_a_second_add():
    # The first 64 requests fill the first 64 rows exactly; 100 outgrow them (the table
    # doubles); discarded rows are reused by later adds (no further growth); adding a
    # queued id again replaces its row.
    params = {i: SamplingParams(temperature=0.5 + i, top_k=i, seed=i) for i in range(150)}
    rows = SamplingRows()
    for i in range(64):
        rows.add(str(i), params[i], default_seed=0)
    assert len(rows._table) == 64
    for i in range(64, 100):
        rows.add(str(i), params[i], default_seed=0)
    assert len(rows._table) == 128
    for i in range(0, 100, 3):
        rows.discard(str(i))
    for i in range(100, 150):
        rows.add(str(i), params[i], default_seed=0)
    params[1] = SamplingParams(temperature=9.0)
    rows.add("1", params[1], default_seed=5)
    live = [i for i in range(150) if i >= 100 or i % 3]
    reqs = [Request(str(i), [1], params[i]) for i in live]
    want = sampling_arrays([sampling_row(params[i], 5 if i == 1 else 0) for i in live], 120)
    for got, expected in zip(rows.arrays(reqs, None, 120), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert len(rows) == len(live) and len(rows._table) == 128


def test_adding_an_id_again_replaces_its_logprobs_request():
    rows = SamplingRows(logprob_width=4)
    rows.add("a", SamplingParams(logprobs=2), default_seed=0)
    a = Request("a", [1])
    assert rows.logprob_width([a]) == 4
    rows.add("a", SamplingParams(), default_seed=0)  # the same id, now without logprobs
    assert rows.logprob_width([a]) is None and "a" not in rows.logprobs


def test_discard_forgets_a_pending_min_tokens_ban():
    rows = SamplingRows()
    rows.add("a", SamplingParams(min_tokens=3, stop_token_ids=[7]), default_seed=0)
    assert len(rows._bans) == 1
    rows.discard("a")  # aborted before it reached min_tokens
    assert len(rows) == 0 and len(rows._bans) == 0


def test_seed_zero_is_the_requests_own_seed():
    """seed=0 is a seed like any other: the request's own stream, not the engine default
    (only None, or vLLM's -1, means no seed)."""
    params = SamplingParams(temperature=1.0, seed=0)
    assert sampling_row(params, 99)[3:] == (0, SEED_STREAM)


def test_seed_words_take_each_seed_modulo_2_64():
    """seed_words splits a negative seed and one past 2**64 modulo 2**64, as documented."""
    got = seed_words([-2, 2**64 + 5])
    assert got.dtype == np.uint32
    assert got.tolist() == [[2**32 - 1, 2**32 - 2], [0, 5]]


def test_an_unseeded_request_draws_from_stream_one_of_the_engine_seed():
    """A request without a seed draws with the engine's default seed in stream 1, one
    with its own seed in stream 0: the key of the seed folded with the stream, then with
    the position of the token."""
    rows = [
        sampling_row(SamplingParams(temperature=1.0), 9),
        sampling_row(SamplingParams(temperature=1.0, seed=9), 0),
    ]
    temperature, top_k, top_p, seeds, streams = sampling_arrays(rows, 2)
    assert streams.tolist() == [1, 0] and seeds.tolist() == [[0, 9], [0, 9]]
    logits = np.zeros((2, 16), np.float32)
    got = _sample(logits, temperature, top_k, top_p, seeds, streams, np.full(2, 5, np.int32))
    key = lambda stream: jax.random.fold_in(jax.random.fold_in(jax.random.key(9), stream), 5)
    draw = lambda stream: int(jax.random.categorical(key(stream), logits[0], mode="high"))
    assert got.tolist() == [draw(1), draw(0)]


def test_logprob_width_is_none_for_a_batch_where_no_request_asked():
    """Another queued request's logprobs do not give a batch without it a logprob width;
    SamplingRows' default width is 0 (the sampled token's logprob alone)."""
    rows = SamplingRows()
    rows.add("a", SamplingParams(logprobs=2), default_seed=0)
    rows.add("b", SamplingParams(), default_seed=0)
    a, b = Request("a", [1]), Request("b", [1])
    assert rows.logprob_width([b]) is None
    assert rows.logprob_width([b, a]) == 0


def test_adding_an_id_again_replaces_its_prompt_logprobs_request():
    rows = SamplingRows(logprob_width=4)
    rows.add_request(Request("a", [1, 2, 3], SamplingParams(prompt_logprobs=2)), 0)
    assert len(rows.prompt_logprobs) == 1
    rows.add("a", SamplingParams(), default_seed=0)  # the same id, now without them
    assert len(rows.prompt_logprobs) == 0
