"""Random serving runs, step by step, against the dense model.

Each seed draws a workload (requests arriving over several steps, most of them under one
of a few shared prefixes, some of those cut short inside a block, a few under a cache
salt) and events (aborts at random steps, in whatever state the request is then), and
runs it on an engine with a tight or roomy cache, a token budget from 8 to 64 tokens,
and with or without an asynchronous host offload whose copies land a random number of
steps late. The configurations stay within tests.engine._util's bucket sizes, so the
runs share their step programs with the other engine tests.

After every step the manager's bookkeeping must be intact; at the end every request
that was not aborted must have generated exactly the dense model's greedy tokens, and
every block must be back in the pool. The seeds were picked so that, between them,
the runs preempt, reload offloaded KV, abort requests and plan cascade levels; the last
test checks that they still do.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.kv_transfer import HostOffloadConnector
from tests.engine._util import (
    MAX_MODEL_LEN,
    ROOMY_BLOCKS,
    TIGHT_BLOCKS,
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    make_engine,
)

SEEDS = (5005, 5008, 5020, 5026, 5034, 5037)
WALL_LIMIT_S = 120.0  # a run that has not finished by then is stuck


@dataclasses.dataclass(frozen=True)
class Arrival:
    request_id: str
    prompt: list[int]
    max_tokens: int
    cache_salt: str | None
    step: int


@dataclasses.dataclass(frozen=True)
class RandomRun:
    arrivals: list[Arrival]
    abort_at: dict[str, int]  # request id -> step before which it is aborted
    num_blocks: int
    max_num_batched_tokens: int
    copy_delay_steps: int | None  # None: no connector


def draw_run(seed: int) -> RandomRun:
    rng = np.random.default_rng(seed)

    def rand(n) -> list[int]:
        return rng.integers(0, VOCAB, int(n)).tolist()

    prefixes = [rand(rng.integers(1, 44)) for _ in range(rng.integers(1, 4))]
    arrivals = []
    for i in range(int(rng.integers(2, 26))):
        base = prefixes[rng.integers(len(prefixes))] if rng.random() < 0.8 else []
        if base and rng.random() < 0.2:
            base = base[: rng.integers(1, len(base) + 1)]
        prompt = (base + rand(rng.integers(1, 10)))[: MAX_MODEL_LEN - 12]
        salt = "tenant" if rng.random() < 0.15 else None
        arrivals.append(
            Arrival(f"r{i}", prompt, int(rng.integers(1, 10)), salt, int(rng.integers(0, 12)))
        )
    abort_at = {a.request_id: int(rng.integers(0, 30)) for a in arrivals if rng.random() < 0.3}
    num_blocks = TIGHT_BLOCKS if rng.random() < 0.4 else ROOMY_BLOCKS
    copy_delay = int(rng.integers(0, 6)) if rng.random() < 0.5 else None
    return RandomRun(arrivals, abort_at, num_blocks, int(rng.choice([8, 16, 32, 64])), copy_delay)


def serve(run: RandomRun):
    """Runs `run`; returns (engine, tokens by request id, ids aborted)."""
    connector = None
    if run.copy_delay_steps is not None:
        connector = HostOffloadConnector(1 << 24, copy_delay_steps=run.copy_delay_steps)
    engine = make_engine(
        connector=connector,
        num_blocks=run.num_blocks,
        max_num_batched_tokens=run.max_num_batched_tokens,
    )
    tokens: dict[str, list[int]] = {}
    finished, aborted = set(), set()
    last_event = max([a.step for a in run.arrivals] + list(run.abort_at.values()))
    start = time.monotonic()
    step = 0
    while step <= last_event or engine.has_unfinished_requests():
        for a in run.arrivals:
            if a.step == step:
                params = SamplingParams(max_tokens=a.max_tokens)
                engine.add_request(
                    a.prompt, params, request_id=a.request_id, cache_salt=a.cache_salt
                )
                tokens[a.request_id] = []
        for request_id, at in run.abort_at.items():
            if at == step and request_id in tokens and request_id not in finished:
                if engine.abort(request_id):
                    aborted.add(request_id)
        outputs = engine.step()
        engine.manager.check_integrity()
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)
        if not outputs:  # waiting on KV copies: let the copy thread run
            time.sleep(0.001)
        assert time.monotonic() - start < WALL_LIMIT_S, f"no end after {step} steps"
        step += 1
    engine.drain_transfers()
    return engine, tokens, aborted


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_run_generates_the_dense_models_tokens_and_frees_every_block(seed):
    run = draw_run(seed)
    engine, tokens, aborted = serve(run)
    kept = [a for a in run.arrivals if a.request_id not in aborted]
    expected = dense_greedy([a.prompt for a in kept], [a.max_tokens for a in kept])
    for a, want in zip(kept, expected, strict=True):
        assert tokens[a.request_id] == want, a.request_id
    assert_all_blocks_free(engine)
    engine.close()


def test_the_seeds_between_them_preempt_reload_abort_and_cascade():
    seen = {"preempt": 0, "reload": 0, "abort": 0, "cascade": 0}
    for seed in SEEDS:
        engine, _, aborted = serve(draw_run(seed))
        m = engine.metrics
        seen["preempt"] += m.num_preemptions
        seen["reload"] += m.bytes_reloaded
        seen["abort"] += len(aborted)
        seen["cascade"] += m.cascade_steps
        engine.close()
    assert all(seen.values()), seen
