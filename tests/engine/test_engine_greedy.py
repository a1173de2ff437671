"""Greedy outputs equal, token for token: cascade on, cascade off, dense recomputation."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from tests.engine._util import assert_all_blocks_free, dense_greedy, make_engine, prompts_for

MAX_TOKENS = 8


@pytest.mark.parametrize("workload", ["shared", "two_groups", "none"])
def test_cascade_on_off_and_dense_agree(workload):
    prompts = prompts_for(workload)
    expected = dense_greedy(prompts, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    results = {}
    for cascade in (True, False):
        engine = make_engine(cascade=cascade)
        outs = engine.generate(prompts, params, progress=False)
        results[cascade] = [list(o.output_token_ids) for o in outs]
        assert all(o.finish_reason == "length" for o in outs)
        m = engine.metrics
        if cascade and workload != "none":
            assert m.cascade_steps > 0 and m.cascade_tokens > 0
        else:
            assert m.cascade_steps == 0
        assert m.num_generated_tokens == MAX_TOKENS * len(prompts)
        assert_all_blocks_free(engine)
    assert results[True] == expected
    assert results[False] == expected


def test_chunked_prefill_under_a_small_token_budget_agrees_with_dense():
    # 8 tokens per step: prompts of 14 to 25 tokens are prefilled in chunks next to other
    # requests' decodes and chunks, cascade on and off.
    prompts = prompts_for("two_groups", seed=2) + prompts_for("shared", seed=2)[:2]
    assert min(map(len, prompts)) > 8  # each group's first prompt (no cache hit) is chunked
    expected = dense_greedy(prompts, 4)
    for cascade in (True, False):
        engine = make_engine(cascade=cascade, max_num_batched_tokens=8)
        outs = engine.generate(prompts, SamplingParams(max_tokens=4), progress=False)
        assert [list(o.output_token_ids) for o in outs] == expected, cascade
        assert (engine.metrics.cascade_steps > 0) == cascade
        assert_all_blocks_free(engine)


def test_prefills_capped_by_long_prefill_token_threshold_agree_with_dense():
    # At most 5 tokens per request and step: every prompt is prefilled in chunks, several
    # prompts' chunks side by side in one step, cascade levels over the cached prefix.
    prompts = prompts_for("two_groups", seed=3)
    expected = dense_greedy(prompts, 4)
    engine = make_engine(long_prefill_token_threshold=5)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4), progress=False)
    assert [list(o.output_token_ids) for o in outs] == expected
    assert engine.metrics.cascade_steps > 0
    assert_all_blocks_free(engine)


def test_two_groups_use_the_groups_level_and_shared_uses_global():
    for workload, level in (("shared", "global"), ("two_groups", "groups")):
        engine = make_engine()
        engine.generate(prompts_for(workload), SamplingParams(max_tokens=4), progress=False)
        levels = dict(engine.metrics.cascade_steps_by_levels)
        assert levels.get(level, 0) > 0, (workload, levels)
        if workload == "two_groups":
            assert "global" not in levels and "global+groups" not in levels


def test_program_count_is_bounded():
    engine = make_engine()
    for workload in ("shared", "two_groups", "none"):
        engine.generate(prompts_for(workload, seed=3), SamplingParams(max_tokens=4), progress=False)
    assert 1 <= engine.num_compiles <= 4
