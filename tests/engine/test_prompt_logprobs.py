"""Prompt logprobs (SamplingParams.prompt_logprobs) against the dense model.

The reference recomputes every prefix of the prompt with the dense forward (no paging,
no cache, no chunks) and takes numpy's log_softmax of its float32 logits in float64: it
shares no code with the step program's gather of prompt rows. Each prompt token after
the first gets a dict: the prompt token first, then the reference's top k.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.engine import Engine
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import (
    BLOCK_SIZE,
    TIGHT_BLOCKS,
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    dense_logits,
    engine_config,
    make_engine,
    prompts_for,
    tiny_model,
)

K = 3
NOISE = 1e-5  # paged and dense logits differ by ~1e-6
GREEDY = SamplingParams(max_tokens=4)


def _reference(prompt) -> np.ndarray:  # f64[len(prompt) - 1, VOCAB]: row p predicts p + 1
    logits = dense_logits([prompt[: p + 1] for p in range(len(prompt) - 1)]).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def check_prompt_logprobs(prompt, entries, k) -> None:
    """None, then per prompt token a dict: the token first, then k top tokens by
    descending logprob, the token not twice; values within 1e-4 of the reference and
    ranks as its own. Tokens within float noise of the k-th may stand for each other;
    any token clearly inside the reference's top k must be there, any clearly outside not.
    """
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    if len(prompt) == 1:
        return
    ref = _reference(prompt)
    if hasattr(entries, "token_logprobs"):  # the scoring view: the prompt tokens' own
        own = ref[np.arange(len(prompt) - 1), prompt[1:]]
        assert np.abs(entries.token_logprobs() - own).max() < 1e-4
    for row, token, entry in zip(ref, prompt[1:], entries[1:], strict=True):
        ids = list(entry)
        assert ids[0] == token
        top = ids[1:]
        kth = np.sort(row)[::-1][k - 1] if k else np.inf
        in_top = row > kth + NOISE  # clearly inside the top k
        assert len(top) + (row[token] >= kth - NOISE) >= k  # the token stands for one
        assert len(top) <= k and len(top) + (row[token] > kth + NOISE) <= k
        assert set(np.flatnonzero(in_top).tolist()) - {token} <= set(top)
        assert all(row[t] >= kth - NOISE for t in top)
        values = [entry[t].logprob for t in top]
        assert values == sorted(values, reverse=True)
        for t, lp in entry.items():
            assert type(t) is int and type(lp.logprob) is float and type(lp.rank) is int
            assert abs(lp.logprob - row[t]) < 1e-4, (t, lp, row[t])
            assert 1 + (row > row[t] + NOISE).sum() <= lp.rank <= 1 + (row > row[t] - NOISE).sum()


def test_the_check_rejects_entries_moved_by_one_position():
    prompt = prompts_for("none", seed=3)[0]
    engine = make_engine()
    (out,) = engine.generate(
        [prompt], dataclasses.replace(GREEDY, prompt_logprobs=K), progress=False
    )
    check_prompt_logprobs(prompt, out.prompt_logprobs, K)
    shifted = (None, *out.prompt_logprobs[2:], out.prompt_logprobs[1])  # off by one token
    with pytest.raises(AssertionError):
        check_prompt_logprobs(prompt, shifted, K)


@pytest.mark.parametrize(
    "config",
    [
        {},  # whole prompts in one step
        {"max_num_batched_tokens": 8},  # chunked prefill: rows from several steps
        # chunked and preempted: prompts owed logprobs are preempted mid-prefill and
        # computed again from their first token
        {"max_num_batched_tokens": 8, "num_blocks": TIGHT_BLOCKS},
    ],
    ids=["whole", "chunked", "preempted"],
)
def test_prompt_logprobs_match_the_dense_model_with_others_sharing_the_prefix(config):
    # Requests without prompt logprobs share the system prompt through the prefix cache
    # (and cascade over it); those with them compute it again and the whole of theirs.
    prompts = prompts_for("shared", seed=4) + prompts_for("two_groups", seed=4)
    params = [
        SamplingParams(max_tokens=10, prompt_logprobs=(None, K, 0)[i % 3])
        for i in range(len(prompts))
    ]
    engine = make_engine(**config)
    preempted_owing = []
    preempt = engine.scheduler._preempt

    def spy(request):
        if request.skips_prefix_cache_reads:
            preempted_owing.append(request.request_id)
        preempt(request)

    engine.scheduler._preempt = spy
    outs = engine.generate(prompts, params, progress=False)
    for prompt, p, o in zip(prompts, params, outs, strict=True):
        if p.prompt_logprobs is None:
            assert o.prompt_logprobs is None
        else:
            check_prompt_logprobs(prompt, o.prompt_logprobs, p.prompt_logprobs)
    # Prompt logprobs change no token: every request generates what the dense model does.
    assert [list(o.output_token_ids) for o in outs] == dense_greedy(prompts, 10)
    assert bool(preempted_owing) == ("num_blocks" in config)
    assert engine.manager.prefix_cache_stats.hits > 0  # the others still share
    assert_all_blocks_free(engine)


def test_only_the_first_output_carries_them_and_a_one_token_prompt_gets_none_entries():
    engine = make_engine()
    engine.add_request([5], dataclasses.replace(GREEDY, prompt_logprobs=2), request_id="one")
    engine.add_request(
        [5, 6, 7], dataclasses.replace(GREEDY, prompt_logprobs=0), request_id="three"
    )
    engine.add_request([5, 6, 7], GREEDY, request_id="plain")
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o.prompt_logprobs)
    assert seen["one"][0] == (None,)
    check_prompt_logprobs([5, 6, 7], seen["three"][0], 0)
    assert all(p is None for rid in seen for p in seen[rid][1:])
    assert all(p is None for p in seen["plain"])
    assert len(engine._sampling.prompt_logprobs) == 0  # nothing kept once handed out


def test_a_request_asking_reads_no_cached_blocks_but_caches_its_own():
    prompt = list(range(1, 22))
    engine = make_engine()
    engine.generate([prompt], GREEDY, progress=False)  # caches 5 full blocks
    stats = engine.manager.prefix_cache_stats
    queries, hits = stats.queries, stats.hits
    (out,) = engine.generate(
        [prompt], dataclasses.replace(GREEDY, prompt_logprobs=1), progress=False
    )
    check_prompt_logprobs(prompt, out.prompt_logprobs, 1)
    after = engine.manager.prefix_cache_stats
    assert (after.queries, after.hits) == (queries, hits)  # no lookup made, none counted
    assert engine.metrics.num_prompt_tokens == 2 * len(prompt)
    (again,) = engine.generate([prompt], GREEDY, progress=False)
    assert engine.manager.prefix_cache_stats.hits > hits
    assert again.output_token_ids == out.output_token_ids


def test_samples_share_sample_zeros_prompt_logprobs():
    prompt = prompts_for("none", seed=5)[1]
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=7, n=3, prompt_logprobs=K)
    engine = make_engine()
    request_id = engine.add_request(prompt, params)
    carried = []
    while engine.has_unfinished_requests():
        carried += [o for o in engine.step() if o.prompt_logprobs is not None]
    assert [(o.request_id, o.index) for o in carried] == [(request_id, 0)]
    check_prompt_logprobs(prompt, carried[0].prompt_logprobs, K)
    outs = engine.generate([prompt], params, progress=False)
    assert len(outs) == 3 and all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)
    check_prompt_logprobs(prompt, outs[0].prompt_logprobs, K)


def test_prompt_logprobs_pass_through_the_router():
    prompts = prompts_for("two_groups", seed=6)
    router = PrefixAwareRouter([make_engine(), make_engine()], block_size=BLOCK_SIZE)
    params = dataclasses.replace(GREEDY, prompt_logprobs=K)
    for prompt, out in zip(prompts, router.generate(prompts, params, progress=False), strict=True):
        check_prompt_logprobs(prompt, out.prompt_logprobs, K)


def test_an_aborted_request_leaves_nothing_behind():
    engine = make_engine(max_num_batched_tokens=8)
    prompt = prompts_for("none", seed=7)[2] * 2
    request_id = engine.add_request(prompt, dataclasses.replace(GREEDY, prompt_logprobs=K))
    engine.step()  # a first chunk of its prompt
    assert engine._sampling.prompt_logprobs._pending
    engine.abort(request_id)
    assert len(engine._sampling.prompt_logprobs) == 0
    assert not engine._sampling.prompt_logprobs._pending
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("value", "match"),
    [(-1, "prompt_logprobs=-1"), (1.5, "prompt_logprobs=1.5"), (True, "prompt_logprobs=True"),
     ("2", "prompt_logprobs='2'")],
)  # fmt: skip
def test_bad_prompt_logprobs_are_refused_naming_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_are_stored_as_python_ints():
    assert type(SamplingParams(prompt_logprobs=np.int64(3)).prompt_logprobs) is int


def test_the_engine_refuses_more_than_max_logprobs_queueing_nothing():
    engine = make_engine()
    too_many = SamplingParams(prompt_logprobs=engine.config.max_logprobs + 1)
    with pytest.raises(ValueError, match="prompt_logprobs=21 exceeds max_logprobs=20"):
        engine.add_request([1, 2, 3], too_many)
    assert not engine.has_unfinished_requests()
    assert len(engine._sampling.prompt_logprobs) == 0


def test_a_width_of_the_whole_vocabulary_ranks_every_token():
    config = dataclasses.replace(engine_config(), max_logprobs=VOCAB + 5)
    engine = Engine(tiny_model(), None, config)
    prompt = [3, 1, 4, 1, 5]
    params = dataclasses.replace(GREEDY, prompt_logprobs=VOCAB + 5)
    (out,) = engine.generate([prompt], params, progress=False)
    ref = _reference(prompt)
    for row, entry in zip(ref, out.prompt_logprobs[1:], strict=True):
        assert len(entry) == VOCAB  # capped at the vocabulary
        assert max(abs(lp.logprob - row[t]) for t, lp in entry.items()) < 1e-4
