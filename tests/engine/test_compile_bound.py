"""A long random serving run compiles no more step programs than its config's stated bound.

Chunked prefill, preemption under a small cache, cascade under 1-3 system prompts, aborts
and requests that end exactly at max_model_len, some asking for logprobs (each shape
then has a second program); jax's own compile count of the step
program must equal Engine.num_compiles (no retrace hidden by a Python scalar, dtype or
weak type in the metadata pytree) and stay within EngineConfig.max_step_programs.
"""

from __future__ import annotations

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


def test_a_long_random_run_stays_within_max_step_programs():
    engine = Engine(tiny_model(), None, CONFIG)
    keys: set[tuple] = set()
    build = engine._step_inputs

    def recording(out, plan):
        inputs = build(out, plan)
        width = engine._sampling.logprob_width(out.requests)
        keys.add(program_key(inputs[1], inputs[3], width, inputs[4] and inputs[4].rows))
        return inputs

    engine._step_inputs = recording
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
    for _, tokens, pages, _, max_q_len, _, _, levels, prompt_rows, _ in keys:
        assert prompt_rows is None  # no request asks for prompt logprobs
        assert tokens[0] in b.token_buckets and max_q_len in CONFIG.q_len_buckets
        assert pages[0] in b.seq_buckets and pages[1] in b.page_buckets
        for level_pages, level_q in levels:
            assert level_pages == (b.level_seq_buckets[-1], b.page_buckets[-1])
            assert level_q in CONFIG.q_len_buckets
