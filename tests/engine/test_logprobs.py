"""Sample logprobs (SamplingParams.logprobs) against the dense model's raw log_softmax.

The reference recomputes every prefix of prompt + output with the dense forward (no
paging, no cache) and takes numpy's log_softmax of its float32 logits in float64: it
shares no code with the sampler. Entries must be the raw model's, before temperature,
top-k and top-p, in the order vLLM gives them: the sampled token, then the top k.
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
    MIN_MARGIN,
    TIGHT_BLOCKS,
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    dense_logits,
    engine_config,
    make_engine,
    prompts_for,
    recording_orders,
    tiny_model,
)

K = 5
HOT = SamplingParams(max_tokens=6, temperature=0.7, top_k=50, top_p=0.9)
NOISE = 1e-5  # paged and dense logits differ by ~1e-6


def _reference(prompt, output_ids) -> np.ndarray:  # f64[len(output_ids), VOCAB]
    seqs = [list(prompt) + list(output_ids[:j]) for j in range(len(output_ids))]
    logits = dense_logits(seqs).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def _check(prompt, output_ids, logprobs, k) -> None:
    """One dict per output token: the sampled token first, then the reference's top k
    (ids exactly, lowest id first on ties), values within 1e-4, ranks as the reference."""
    ref = _reference(prompt, output_ids)
    assert logprobs is not None and len(logprobs) == len(output_ids)
    for row, token, entry in zip(ref, output_ids, logprobs, strict=True):
        order = np.argsort(-row, kind="stable")
        if k:  # well apart in the reference: a mismatch is a bug, not float noise
            assert np.diff(row[order[: k + 1]]).max() < -MIN_MARGIN, "near-tie: pick a new seed"
        top = order[:k].tolist()
        ids = list(entry)
        assert ids[0] == token
        assert ids[1:] == [t for t in top if t != token]
        for t, lp in entry.items():
            assert type(t) is int and type(lp.logprob) is float and type(lp.rank) is int
            assert abs(lp.logprob - row[t]) < 1e-4, (t, lp, row[t])
            # 1 + tokens strictly above it, up to pairs closer than the float noise
            assert 1 + (row > row[t] + NOISE).sum() <= lp.rank <= 1 + (row > row[t] - NOISE).sum()
        for j, t in enumerate(top):
            assert entry[t].rank == j + 1  # the top ones are apart: ranks 1..k


def test_greedy_and_sampled_logprobs_match_the_dense_model_in_a_reordered_batch():
    # Schedule order alternates two system prompts; the groups plan puts each group's
    # requests together, so batch rows and schedule order differ.
    prompts = prompts_for("two_groups", seed=2)
    prompts = [prompts[i] for i in (0, 3, 1, 4, 2, 5)]
    greedy = SamplingParams(max_tokens=6)
    params = [
        dataclasses.replace(greedy, logprobs=K),
        dataclasses.replace(HOT, seed=11, logprobs=K),
        greedy,
        dataclasses.replace(HOT, seed=13, logprobs=0),
        dataclasses.replace(greedy, logprobs=0),
        dataclasses.replace(HOT, seed=15, logprobs=2),
    ]
    engine = make_engine()
    orders = recording_orders(engine)
    outs = engine.generate(prompts, params, progress=False)
    assert any(o is not None and (o != np.arange(len(o))).any() for o in orders)
    assert dict(engine.metrics.cascade_steps_by_levels).get("groups", 0) > 0
    for prompt, p, o in zip(prompts, params, outs, strict=True):
        assert len(o.output_token_ids) == 6
        if p.logprobs is None:
            assert o.logprobs is None and o.cumulative_logprob is None
            continue
        _check(prompt, o.output_token_ids, o.logprobs, p.logprobs)
        ref = _reference(prompt, o.output_token_ids)
        expected = sum(row[t] for row, t in zip(ref, o.output_token_ids, strict=True))
        assert abs(o.cumulative_logprob - expected) < 1e-3
    # The hot requests drew tokens the greedy model would not have: sampled, not argmax.
    hot = [(prompt, o) for prompt, p, o in zip(prompts, params, outs, strict=True) if p.top_k]
    assert any(
        list(o.output_token_ids) != g
        for (_, o), g in zip(hot, dense_greedy([p for p, _ in hot], 6), strict=True)
    )
    assert_all_blocks_free(engine)


def test_step_outputs_carry_logprobs_only_for_the_requests_that_asked():
    engine = make_engine()
    prompts = prompts_for("shared", seed=4)
    asking = set()
    for i, p in enumerate(prompts):
        rid = engine.add_request(p, SamplingParams(max_tokens=3, logprobs=1 if i % 2 else None))
        if i % 2:
            asking.add(rid)
    seen = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen += 1
            if o.request_id in asking:
                assert len(o.logprobs) == len(o.new_token_ids) == 1
                assert next(iter(o.logprobs[0])) == o.new_token_ids[0]
            else:
                assert o.logprobs is None
    assert asking and seen == 3 * len(prompts)


def test_a_batch_without_logprobs_runs_the_program_it_ran_before():
    engine = make_engine()
    prompts = prompts_for("shared", seed=5)
    engine.generate(prompts, SamplingParams(max_tokens=3), progress=False)
    plain = set(engine._programs)
    # The key is program_key's as it was, with no logprob width: the same programs.
    assert plain and all(key[-1] is None for key in plain)
    engine.generate(prompts, SamplingParams(max_tokens=3, logprobs=1), progress=False)
    with_logprobs = set(engine._programs) - plain
    # The same shapes again, each once more with the width of max_logprobs (20 < VOCAB).
    assert {key[:-1] for key in with_logprobs} == {key[:-1] for key in plain}
    assert {key[-1] for key in with_logprobs} == {min(20, VOCAB)}
    assert engine.num_compiles == 2 * len(plain)
    outs = engine.generate(prompts, SamplingParams(max_tokens=3), progress=False)
    assert engine.num_compiles == 2 * len(plain)  # nothing new compiled
    assert all(o.logprobs is None and o.cumulative_logprob is None for o in outs)


def test_preempted_requests_keep_one_entry_per_output_token():
    prompts = prompts_for("shared", seed=2) + prompts_for("none", seed=2)[:2]
    engine = make_engine(num_blocks=TIGHT_BLOCKS)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, logprobs=3), progress=False)
    assert engine.metrics.num_preemptions > 0
    assert [list(o.output_token_ids) for o in outs] == dense_greedy(prompts, 10)
    for prompt, o in zip(prompts, outs, strict=True):
        _check(prompt, o.output_token_ids, o.logprobs, 3)
    assert_all_blocks_free(engine)


def test_the_stop_token_gets_its_logprobs_too():
    prompt = prompts_for("none", seed=6)[0]
    expected = dense_greedy([prompt], 8)[0]
    j = next(j for j in range(2, 8) if expected[j] not in expected[:j])
    params = SamplingParams(max_tokens=8, stop_token_ids=(expected[j],), logprobs=2)
    out = make_engine().generate([prompt], params, progress=False)[0]
    assert out.finish_reason == "stop"
    assert list(out.output_token_ids) == expected[: j + 1]
    _check(prompt, out.output_token_ids, out.logprobs, 2)


def test_logprobs_pass_through_the_router():
    prompts = prompts_for("two_groups", seed=3)
    params = [SamplingParams(max_tokens=4, logprobs=2 if i % 3 else None) for i in range(6)]
    router = PrefixAwareRouter([make_engine(), make_engine()], block_size=BLOCK_SIZE)
    outs = router.generate(prompts, params, progress=False)
    for prompt, p, o in zip(prompts, params, outs, strict=True):
        if p.logprobs is None:
            assert o.logprobs is None
        else:
            _check(prompt, o.output_token_ids, o.logprobs, 2)


def test_max_logprobs_zero_still_gives_the_sampled_tokens_logprobs():
    config = dataclasses.replace(engine_config(), max_logprobs=0)
    engine = Engine(tiny_model(), None, config)
    with pytest.raises(ValueError, match="logprobs=1 exceeds max_logprobs=0"):
        engine.add_request([1, 2, 3], SamplingParams(logprobs=1))
    prompt = prompts_for("none", seed=7)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=3, logprobs=0), progress=False)[0]
    assert {key[-1] for key in engine._programs} == {0}
    assert all(len(entry) == 1 for entry in out.logprobs)
    _check(prompt, out.output_token_ids, out.logprobs, 0)


def test_logprobs_are_taken_before_min_tokens_bans_the_stop_token():
    # The greedy first token is made a stop token that min_tokens bans for two steps:
    # the engine samples something else, yet the raw logprobs still rank the banned
    # token first, with its finite logprob (vLLM's raw logprobs precede its logits
    # processors, min_tokens among them).
    prompt = prompts_for("none", seed=8)[1]
    stop = dense_greedy([prompt], 1)[0][0]
    params = SamplingParams(max_tokens=4, stop_token_ids=(stop,), min_tokens=2, logprobs=2)
    out = make_engine().generate([prompt], params, progress=False)[0]
    assert out.output_token_ids[0] != stop
    assert list(out.logprobs[0])[1] == stop and out.logprobs[0][stop].rank == 1
    _check(prompt, out.output_token_ids, out.logprobs, 2)


def test_logprobs_follow_their_request_past_a_prefill_chunk_scheduled_before_it():
    # A long prompt admitted first runs in chunks of 4 while the short ones decode: each
    # step schedules its chunk, which gets no output, ahead of theirs, so an output's
    # place among the step's outputs is not its request's row; each request must still
    # get its own sampled token's logprob and rank.
    rng = np.random.default_rng(9)
    long_prompt = rng.integers(0, VOCAB, 40).tolist()
    short = prompts_for("none", seed=9)[:2]
    engine = make_engine(long_prefill_token_threshold=4)
    engine.add_request(long_prompt, SamplingParams(max_tokens=2))
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, logprobs=K)) for p in short]
    got: dict[str, list] = {rid: [] for rid in ids}
    tokens: dict[str, list] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id in got:
                tokens[o.request_id].extend(o.new_token_ids)
                got[o.request_id].extend(o.logprobs)
    for prompt, rid in zip(short, ids, strict=True):
        assert len(tokens[rid]) == 6
        _check(prompt, tokens[rid], got[rid], K)
    assert_all_blocks_free(engine)
