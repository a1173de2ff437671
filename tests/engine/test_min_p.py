"""SamplingParams.min_p, as vLLM's: after temperature, tokens less than min_p times as
likely as the most likely one are cut, before top-k and top-p.

Against the numpy reference of test_sampler_reference (its chi-square test at p = 1e-6
over fixed seeds), a control it must reject, the engine end to end, the batch rows under
a permutation, and bad values.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.request import Request
from jaxkv.sampler import SamplingRows
from tests.engine._util import dense_greedy, make_engine, prompts_for
from tests.engine.test_sampler_reference import N, _chi2_pvalue, _run, reference_probs

LOGITS = np.array([2.0, 1.6, 1.0, 0.3, -0.4, -1.2, -2.0, 0.9], np.float32)


def _reference(logits, temperature, min_p, top_k=0, top_p=1.0) -> np.ndarray:
    """min_p on softmax(logits / T) over the whole vocabulary, then top-k and top-p."""
    z = np.asarray(logits, np.float64) / temperature
    probs = np.exp(z - z.max())
    cut = np.where(probs >= min_p * probs.max(), logits, -np.inf)
    return reference_probs(cut, temperature, top_k, top_p)


def _draws(temperature, min_p, top_k=0, top_p=1.0, logits=LOGITS) -> np.ndarray:
    rows = np.tile(np.asarray(logits, np.float32), (N, 1))
    seeds = np.arange(N, dtype=np.uint64)
    out = _run(rows, temperature, top_k, top_p, seeds=seeds, positions=5, min_p=min_p)
    return np.bincount(out, minlength=len(logits))


@pytest.mark.parametrize(
    "temperature, min_p, top_k, top_p",
    [(1.0, 0.2, 0, 1.0), (0.7, 0.05, 0, 1.0), (1.5, 0.3, 3, 1.0), (1.2, 0.1, 0, 0.8)],
)
def test_min_p_draws_follow_the_reference(temperature, min_p, top_k, top_p):
    want = _reference(LOGITS, temperature, min_p, top_k, top_p)
    assert 0 < (want > 0).sum() < len(LOGITS)  # the cut removes some tokens, not all
    counts = _draws(temperature, min_p, top_k, top_p)
    assert _chi2_pvalue(counts, want) > 1e-6, counts


def test_the_check_rejects_min_p_taken_before_temperature():
    # The cut made on the unscaled logits keeps fewer tokens than T = 2's cut.
    probs = np.exp(LOGITS - LOGITS.max())
    wrong = reference_probs(np.where(probs >= 0.2, LOGITS, -np.inf), 2.0, 0, 1.0)
    right = _reference(LOGITS, 2.0, 0.2)
    assert (wrong > 0).sum() != (right > 0).sum()
    counts = _draws(2.0, 0.2)
    with pytest.raises(AssertionError, match="outside the support"):
        _chi2_pvalue(counts, wrong)
    assert _chi2_pvalue(counts, right) > 1e-6


def test_min_p_zero_is_no_cut_and_one_keeps_the_most_likely_and_its_ties():
    np.testing.assert_array_equal(_draws(1.0, 0.0), _draws(1.0, 0.0))
    assert _chi2_pvalue(_draws(1.0, 0.0), _reference(LOGITS, 1.0, 0.0)) > 1e-6
    assert _draws(1.0, 1.0).tolist() == [N] + [0] * (len(LOGITS) - 1)
    tied = np.array([1.0, 3.0, 3.0, 0.0], np.float32)
    counts = _draws(1.0, 1.0, logits=tied)
    assert counts[0] == counts[3] == 0 and abs(counts[1] - N / 2) < 5 * np.sqrt(N / 4)


def test_the_engine_samples_with_min_p_each_row_its_own():
    prompts = prompts_for("shared", seed=4)[:3]
    free = SamplingParams(max_tokens=5, temperature=1.3, seed=11)
    with make_engine() as engine:
        alone = engine.generate([prompts[1]], free, progress=False)[0].output_token_ids
    params = [
        SamplingParams(max_tokens=5, temperature=1.3, seed=7, min_p=1.0),  # greedy, sampled
        free,
        SamplingParams(max_tokens=5, temperature=1.3, seed=9, min_p=1.0),
    ]
    with make_engine() as engine:
        outs = engine.generate(prompts, params, progress=False)
    greedy = dense_greedy([prompts[0], prompts[2]], 5)
    assert [list(outs[0].output_token_ids), list(outs[2].output_token_ids)] == greedy
    assert outs[1].output_token_ids == alone  # a row without min_p is not cut


def test_step_arrays_give_each_batch_row_its_min_p():
    rows = SamplingRows()
    requests = [Request(str(i), [1, 2]) for i in range(4)]
    for i, request in enumerate(requests):
        rows.add(request.request_id, SamplingParams(min_p=0.1 * i), 0)
    order = np.array([2, 0, 3, 1])
    min_p = rows.step_arrays(requests, order, 6, np.zeros(6, np.int32))[-1]
    np.testing.assert_allclose(min_p, np.float32([0.2, 0.0, 0.3, 0.1, 0, 0]))
    rows.discard("2")
    rows.add("3", SamplingParams(), 0)  # re-added without: no cut
    min_p = rows.step_arrays(requests[:2], None, 2, np.zeros(2, np.int32))[-1]
    np.testing.assert_allclose(min_p, np.float32([0.0, 0.1]))
    assert list(rows._min_p) == ["1"]


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), "0.1", True, None])
def test_bad_min_p_is_refused_by_name(value):
    with pytest.raises(ValueError, match="^min_p="):
        SamplingParams(min_p=value)


def test_min_p_takes_numpy_numbers_as_floats():
    params = SamplingParams(min_p=np.float32(0.25))
    assert type(params.min_p) is float and params.min_p == 0.25
