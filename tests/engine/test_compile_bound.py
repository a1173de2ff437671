"""A long random serving run compiles no more step programs than its config's stated bound.

Chunked prefill, preemption under a small cache, cascade under 1-3 system prompts, aborts
and requests that end exactly at max_model_len, some asking for logprobs (each shape
then has a second program); jax's own compile count of the step
program must equal Engine.num_compiles (no retrace hidden by a Python scalar, dtype or
weak type in the metadata pytree) and stay within EngineConfig.max_step_programs. A second
run adds n > 1, min_tokens, penalties, min_p and prompt logprobs, and two cascade levels:
the variants that bound leaves out take only the widths their docs state.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv import SamplingParams
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxkv.engine import Engine
from jaxkv.step_inputs import program_key
from tests.engine._util import ALWAYS_CASCADE, BLOCK_SIZE, MAX_MODEL_LEN, VOCAB, tiny_model

MAX_TOKENS = 32  # < MAX_MODEL_LEN: long prompts are prefilled in chunks
# A cache size no other test uses, so every program this run needs compiles here.
NUM_BLOCKS = 32
CONFIG = EngineConfig(
    cache=CacheConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
    scheduler=SchedulerConfig(
        max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8, max_model_len=MAX_MODEL_LEN
    ),
    backend="xla",
    cascade_cost_model=ALWAYS_CASCADE,
    max_cascade_groups=2,
    min_num_tokens_bucket=MAX_TOKENS,
    min_num_seqs_bucket=8,
    min_pages_bucket=MAX_MODEL_LEN // BLOCK_SIZE,
    q_len_buckets=(1, MAX_TOKENS),
    pad_cascade_levels=True,
)


def _recorded_program_keys(engine: Engine) -> set[tuple]:
    """The set the program key of each of `engine`'s later steps is added to."""
    keys: set[tuple] = set()
    build = engine._step_inputs

    def recording(out, plan):
        inputs = build(out, plan)
        width = engine._sampling.logprob_width(out.requests)
        keys.add(program_key(inputs[1], inputs[3], width, inputs[4] and inputs[4].rows))
        return inputs

    engine._step_inputs = recording
    return keys


def test_a_long_random_run_stays_within_max_step_programs():
    engine = Engine(tiny_model(), None, CONFIG)
    keys = _recorded_program_keys(engine)
    rng = np.random.default_rng(0)
    logprobs_rng = np.random.default_rng(1)  # apart: the run's schedule stays as it was
    systems = [rng.integers(0, VOCAB, n).tolist() for n in (8, 13, 20)]
    live: list[str] = []
    num_aborts = num_chunked = 0
    before = engine._program._cache_size()
    for _ in range(160):
        if len(live) < 12 and rng.random() < 0.35:
            system = systems[int(rng.integers(3))] if rng.random() < 0.8 else []
            prompt = (system + rng.integers(0, VOCAB, 63).tolist())[: int(rng.integers(1, 64))]
            # Half end exactly at max_model_len, the rest anywhere before it.
            room = MAX_MODEL_LEN - len(prompt)
            max_tokens = room if rng.random() < 0.5 else int(rng.integers(1, room + 1))
            logprobs = int(logprobs_rng.integers(3)) if logprobs_rng.random() < 0.2 else None
            params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs)
            live.append(engine.add_request(prompt, params))
            num_chunked += len(prompt) > MAX_TOKENS
        if live and rng.random() < 0.04:
            num_aborts += engine.abort(live.pop(int(rng.integers(len(live)))))
        for o in engine.step():
            if o.finished:
                live.remove(o.request_id)
    for rid in live:
        engine.abort(rid)

    m = engine.metrics
    assert m.num_preemptions > 0 and m.cascade_steps > 0 and num_aborts > 0 and num_chunked > 0
    assert engine.num_compiles == len(keys) >= 3
    assert engine._program._cache_size() - before == engine.num_compiles
    assert engine.num_compiles <= CONFIG.max_step_programs == 2 * 2 * (1 + 2) ** 2
    assert {key[-1] for key in keys} == {None, CONFIG.max_logprobs}
    b = CONFIG.buckets
    for _, tokens, pages, _, max_q_len, _, _, levels, prompt_rows, _, _ in keys:
        assert prompt_rows is None  # no request asks for prompt logprobs
        assert tokens[0] in b.token_buckets and max_q_len in CONFIG.q_len_buckets
        assert pages[0] in b.seq_buckets and pages[1] in b.page_buckets
        for level_pages, level_q in levels:
            assert level_pages == (b.level_seq_buckets[-1], b.page_buckets[-1])
            assert level_q in CONFIG.q_len_buckets


# CONFIG's buckets over another cache size of its own.
VARIED = dataclasses.replace(
    CONFIG, cache=CacheConfig(num_blocks=NUM_BLOCKS + 8, block_size=BLOCK_SIZE)
)


def _variant_free(key: tuple) -> tuple:
    """A program key without the variants max_step_programs leaves out: the min_tokens ban
    width, the penalty table and the prompt-logprob rows."""
    sampling = key[0][:6] + key[0][8:]
    return (sampling, *key[1:8], *key[9:])


def test_a_long_random_run_with_every_sampling_variant_compiles_what_it_counts():
    # Levels 0, 1 and 2 (a root every grouped prompt shares, then one of two group
    # prefixes), n > 1, logprobs, min_tokens, penalties, min_p and prompt logprobs.
    engine = Engine(tiny_model(), None, VARIED)
    keys = _recorded_program_keys(engine)
    rng = np.random.default_rng(2)
    root = rng.integers(0, VOCAB, 8).tolist()  # two blocks
    systems = [root + rng.integers(0, VOCAB, n).tolist() for n in (6, 11)]
    live: set[str] = set()
    before = engine._program._cache_size()
    for _ in range(70):
        if len(live) < 10 and rng.random() < 0.4:
            system = systems[int(rng.integers(2))] if rng.random() < 0.85 else []
            prompt = (system + rng.integers(0, VOCAB, 63).tolist())[: int(rng.integers(1, 64))]
            room = MAX_MODEL_LEN - len(prompt)
            max_tokens = int(rng.integers(1, min(room, 12) + 1))
            u = rng.random(6)
            params = SamplingParams(
                max_tokens=max_tokens,
                n=2 if u[0] < 0.1 else 1,
                logprobs=2 if u[1] < 0.15 else None,
                min_tokens=max_tokens if u[2] < 0.15 else 0,
                stop_token_ids=[int(rng.integers(VOCAB))],
                presence_penalty=0.5 if u[3] < 0.15 else 0.0,
                prompt_logprobs=1 if u[4] < 0.1 else None,
                min_p=0.1 if u[5] < 0.1 else 0.0,
                temperature=0.8,
            )
            live.add(engine.add_request(prompt, params))
        for o in engine.step():
            if o.finished:  # under n > 1: one of the samples (abort takes the rest)
                live.discard(o.request_id)
    engine.abort(list(live))

    m = engine.metrics
    levels = {len(key[7]) for key in keys}
    samplers = {(key[0][6][1] > 0, key[0][7] is not None, key[8] is not None) for key in keys}
    assert levels == {0, 1, 2} and m.num_preemptions > 0
    assert {True} == {any(flags[i] for flags in samplers) for i in range(3)}
    # jax compiled exactly the programs the engine counts: no retrace hidden in a value
    assert engine._program._cache_size() - before == engine.num_compiles == len(keys)
    assert len({_variant_free(key) for key in keys}) <= VARIED.max_step_programs
    b = VARIED.buckets
    for key in keys:
        sampling, tokens, pages, _, max_q_len, _, _, levels, prompt_rows, _, _ = key
        assert tokens[0] in b.token_buckets and max_q_len in b.q_len_buckets
        assert pages[0] in b.seq_buckets and pages[1] in b.page_buckets
        assert all(shape[0] == pages[0] for shape in sampling[:6])
        assert sampling[6][1] in (0, 1)  # one stop token: a ban of width 1
        assert sampling[7] is None or sampling[7][0] == (pages[0], 64)
        assert prompt_rows is None or prompt_rows == (min(64, tokens[0]),)
        for level_pages, level_q in levels:
            assert level_pages == (b.level_seq_buckets[-1], b.page_buckets[-1])
            assert level_q in b.q_len_buckets and level_q <= tokens[0]
