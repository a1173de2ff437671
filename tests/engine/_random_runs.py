"""Random serving runs for the end-to-end tests: a drawn workload, served step by step.

`draw_run(seed)` draws requests arriving over several steps (most of them under one of a
few shared prefixes, some of those cut short inside a block, a few under a cache salt),
aborts at random steps (in whatever state the request is then), a tight or roomy cache,
a token budget from 8 to 64 tokens, and with or without an asynchronous host offload
whose copies land a random number of steps late. The configurations stay within
tests.engine._util's bucket sizes, so the runs share their step programs with the other
engine tests.

`serve` runs one on an engine, or on a router over engines, and checks every engine's
bookkeeping after every step; `assert_dense_tokens` checks that every request generated
exactly the dense model's greedy tokens (an aborted one, those it had before the abort).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxkv import SamplingParams
from jaxkv.engine import Engine
from jaxkv.kv_transfer import HostOffloadConnector
from tests.engine._util import (
    MAX_MODEL_LEN,
    ROOMY_BLOCKS,
    TIGHT_BLOCKS,
    VOCAB,
    dense_greedy,
    make_engine,
)

WALL_LIMIT_S = 120.0  # a run that has not finished by then is stuck


@dataclasses.dataclass(frozen=True)
class Arrival:
    request_id: str
    prompt: list[int]
    max_tokens: int
    cache_salt: str | None
    step: int  # added before this step


@dataclasses.dataclass(frozen=True)
class RandomRun:
    arrivals: list[Arrival]
    abort_at: dict[str, int]  # request id -> step before which it is aborted
    num_blocks: int
    max_num_batched_tokens: int
    copy_delay_steps: int | None  # None: no connector


@dataclasses.dataclass
class Served:
    engines: list[Engine]
    tokens: dict[str, list[int]]  # generated, by request id
    aborted: set[str]


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


def make_engines(run: RandomRun, count: int = 1) -> list[Engine]:
    """`count` engines configured as `run` draws, each with a connector of its own."""
    engines = []
    for _ in range(count):
        connector = None
        if run.copy_delay_steps is not None:
            connector = HostOffloadConnector(1 << 24, copy_delay_steps=run.copy_delay_steps)
        engines.append(
            make_engine(
                connector=connector,
                num_blocks=run.num_blocks,
                max_num_batched_tokens=run.max_num_batched_tokens,
            )
        )
    return engines


def serve(run: RandomRun, engines: list[Engine], driver=None) -> Served:
    """Runs `run` through `driver` (default: the one engine), which steps `engines`."""
    driver = engines[0] if driver is None else driver
    served = Served(engines, {}, set())
    finished = set()
    last_event = max([a.step for a in run.arrivals] + list(run.abort_at.values()))
    start = time.monotonic()
    step = 0
    while step <= last_event or driver.has_unfinished_requests():
        for a in run.arrivals:
            if a.step == step:
                params = SamplingParams(max_tokens=a.max_tokens)
                driver.add_request(
                    a.prompt, params, request_id=a.request_id, cache_salt=a.cache_salt
                )
                served.tokens[a.request_id] = []
        for request_id, at in run.abort_at.items():
            if at == step and request_id in served.tokens and request_id not in finished:
                if driver.abort(request_id):
                    served.aborted.add(request_id)
        outputs = driver.step()
        for engine in engines:
            engine.manager.check_integrity()
        for o in outputs:
            served.tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finished.add(o.request_id)
        if not outputs:  # waiting on KV copies: let the copy thread run
            time.sleep(0.001)
        assert time.monotonic() - start < WALL_LIMIT_S, f"no end after {step} steps"
        step += 1
    driver.drain_transfers()
    return served


def assert_dense_tokens(run: RandomRun, served: Served) -> None:
    """Every request of `run` generated the dense model's greedy tokens: all of them when
    it was not aborted, a leading part of them (possibly none) when it was."""
    arrivals = run.arrivals
    expected = dense_greedy([a.prompt for a in arrivals], [a.max_tokens for a in arrivals])
    for a, want in zip(arrivals, expected, strict=True):
        got = served.tokens[a.request_id]
        if a.request_id in served.aborted:
            assert got == want[: len(got)], a.request_id
        else:
            assert got == want, a.request_id
