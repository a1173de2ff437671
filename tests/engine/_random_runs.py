"""Random serving runs for the end-to-end tests: a drawn workload, served step by step.

`draw_run(seed)` draws requests arriving over several steps (most of them under one of a
few shared prefixes, some of those cut short inside a block, a few under a cache salt),
aborts at random steps (in whatever state the request is then), a tight or roomy cache,
a token budget from 8 to 64 tokens, and with or without an asynchronous host offload
whose copies land a random number of steps late; about half the runs with an offload
draw copies that fail at random (CopyFailures): saves whose copy fails, loads whose copy
fails after writing noise into the blocks, and loads whose start fails, which makes that
step() raise. Some requests stop at a token of their greedy continuation, some of those
only after min_tokens (the ban changes their path), some ask for logprobs, some for
prompt logprobs (they then read no cached KV), and some for 2 or 3 samples
(SamplingParams.n). The configurations stay within tests.engine._util's bucket sizes, so
the runs share their step programs with the other engine tests.

`serve` runs one on an engine, or on a router over engines, steps again after a step()
that raised from an injected load failure (as a serving loop would, counting them), and
checks every engine's bookkeeping after every step; `assert_dense_tokens` checks that
every request generated exactly the dense model's greedy tokens (an aborted one, those
it had before the abort) under its stop tokens and min_tokens, in each of its samples,
and the logprobs and prompt logprobs of the dense model's logits.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future

import numpy as np

from jaxkv import SamplingParams
from jaxkv.engine import Engine
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.engine._util import (
    MAX_MODEL_LEN,
    ROOMY_BLOCKS,
    TIGHT_BLOCKS,
    VOCAB,
    dense_decode,
    dense_greedy,
    dense_logits,
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
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    n: int = 1
    prompt_logprobs: int | None = None

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            stop_token_ids=self.stop_token_ids,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            n=self.n,
            prompt_logprobs=self.prompt_logprobs,
        )


class InjectedCopyFailure(RuntimeError):
    """A KV copy failure that CopyFailures injected."""


@dataclasses.dataclass(frozen=True)
class CopyFailures:
    """Copies of a run's host offload that fail at random: each save's Future fails with
    probability `p` (once the copy ran); each load's start_load raises with probability
    `p`, and with probability `p` writes noise into its blocks and its Future fails. Each
    engine draws them from Generators of (`seed`, ..., its index), in its copy order."""

    p: float
    seed: int


@dataclasses.dataclass(frozen=True)
class RandomRun:
    arrivals: list[Arrival]
    abort_at: dict[str, int]  # request id -> step before which it is aborted
    num_blocks: int
    max_num_batched_tokens: int
    copy_delay_steps: int | None  # None: no connector
    copy_failures: CopyFailures | None = None  # None: every copy succeeds


@dataclasses.dataclass
class Served:
    engines: list[Engine]
    tokens: dict[tuple[str, int], list[int]]  # generated, by (request id, sample index)
    aborted: set[str]
    # By (request id, sample index): the logprobs of those that asked, each finish_reason.
    logprobs: dict[tuple[str, int], list[dict]] = dataclasses.field(default_factory=dict)
    # By request id: the prompt logprobs of those that asked and got them.
    prompt_logprobs: dict[str, object] = dataclasses.field(default_factory=dict)
    finish_reasons: dict[tuple[str, int], str] = dataclasses.field(default_factory=dict)
    num_step_errors: int = 0  # steps that raised InjectedCopyFailure (a load's start)


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
    arrivals = _with_sampling_params(arrivals, np.random.default_rng((seed, 2)))
    prompt_rng = np.random.default_rng((seed, 3))  # a stream apart: the others stay as drawn
    arrivals = [
        dataclasses.replace(a, prompt_logprobs=int(prompt_rng.choice([0, 3])))
        if prompt_rng.random() < 0.2
        else a
        for a in arrivals
    ]
    failure_rng = np.random.default_rng((seed, 4))  # a stream apart too
    copy_failures = None
    if copy_delay is not None and failure_rng.random() < 0.5:
        copy_failures = CopyFailures(float(failure_rng.choice([0.15, 0.3])), seed)
    return RandomRun(
        arrivals,
        abort_at,
        num_blocks,
        int(rng.choice([8, 16, 32, 64])),
        copy_delay,
        copy_failures,
    )


def _with_sampling_params(arrivals: list[Arrival], rng: np.random.Generator) -> list[Arrival]:
    """`arrivals` with stop tokens, min_tokens, logprobs and n drawn by `rng` (a stream apart
    from the run's, which stays as it was drawn). A stop token is one of the request's
    own greedy tokens, so it is met; with min_tokens past it, the ban must steer around
    it."""
    plain = dense_greedy([a.prompt for a in arrivals], [a.max_tokens for a in arrivals])
    out = []
    for a, greedy in zip(arrivals, plain, strict=True):
        stop, min_tokens = (), 0
        if rng.random() < 0.4:
            at = int(rng.integers(len(greedy)))
            stop = (greedy[at], int(rng.integers(VOCAB)))
            if rng.random() < 0.5:
                min_tokens = int(rng.integers(at + 1, a.max_tokens + 1))
        logprobs = int(rng.choice([0, 2, 5])) if rng.random() < 0.3 else None
        n = int(rng.choice([1, 1, 1, 1, 2, 3]))
        out.append(
            dataclasses.replace(
                a, stop_token_ids=stop, min_tokens=min_tokens, logprobs=logprobs, n=n
            )
        )
    return out


def make_engines(run: RandomRun, count: int = 1) -> list[Engine]:
    """`count` engines configured as `run` draws, each with a connector of its own (whose
    copies fail as run.copy_failures draws)."""
    engines = []
    for index in range(count):
        connector = None
        if run.copy_delay_steps is not None:
            connector = HostOffloadConnector(1 << 24, copy_delay_steps=run.copy_delay_steps)
        engine = make_engine(
            connector=connector,
            num_blocks=run.num_blocks,
            max_num_batched_tokens=run.max_num_batched_tokens,
        )
        if run.copy_failures is not None:
            fail_copies(engine, run.copy_failures, index)
        engines.append(engine)
    return engines


def fail_copies(engine: Engine, failures: CopyFailures, index: int) -> None:
    """Makes `engine`'s KV copies fail as `failures` draws, by patching its copier's
    start_save and start_load (the connector calls them through the copier it holds)."""
    # Streams apart, so that how many saves a run makes leaves its loads' draws as they are.
    save_rng, load_rng, noise_rng = (
        np.random.default_rng((failures.seed, stream, index)) for stream in (5, 6, 7)
    )
    copier = engine.copier
    real_save, real_load = copier.start_save, copier.start_load

    def start_save(block_ids):
        future = real_save(block_ids)
        return _failed_once_done(future, "save") if save_rng.random() < failures.p else future

    def start_load(block_ids, blocks):
        draw = load_rng.random()
        if draw < failures.p:
            raise InjectedCopyFailure("injected: the load's copy failed to start")
        if draw < 2 * failures.p:  # a copy that fails part way: its blocks hold garbage
            noise = noise_rng.standard_normal(blocks.shape).astype(blocks.dtype)
            return _failed_once_done(real_load(block_ids, noise), "load")
        return real_load(block_ids, blocks)

    copier.start_save, copier.start_load = start_save, start_load


def _failed_once_done(future: Future, what: str) -> Future:
    """A Future that fails once `future` is done, as a copy that failed on the copy thread."""
    failed: Future = Future()
    error = InjectedCopyFailure(f"injected: the {what}'s copy failed")
    future.add_done_callback(lambda _: failed.set_exception(error))
    return failed


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
                driver.add_request(
                    a.prompt, a.params, request_id=a.request_id, cache_salt=a.cache_salt
                )
                for k in range(a.n):
                    served.tokens[(a.request_id, k)] = []
                    if a.logprobs is not None:
                        served.logprobs[(a.request_id, k)] = []
        for request_id, at in run.abort_at.items():
            if at == step and (request_id, 0) in served.tokens and request_id not in finished:
                if driver.abort(request_id):
                    served.aborted.add(request_id)
        try:
            outputs = driver.step()
        except InjectedCopyFailure:  # a load failed to start: step again, as a loop would
            served.num_step_errors += 1
            outputs = []
        for engine in engines:
            engine.manager.check_integrity()
        for o in outputs:
            sample = (o.request_id, o.index)
            assert o.request_id not in finished, f"{o} after the request finished"
            served.tokens[sample].extend(o.new_token_ids)
            if sample in served.logprobs:
                assert len(o.logprobs) == len(o.new_token_ids), o
                served.logprobs[sample].extend(o.logprobs)
            else:
                assert o.logprobs is None, o
            if o.prompt_logprobs is not None:
                assert o.index == 0 and o.request_id not in served.prompt_logprobs, o
                served.prompt_logprobs[o.request_id] = o.prompt_logprobs
            if o.finish_reason is not None:
                assert sample not in served.finish_reasons, f"{o}: that sample had ended"
                served.finish_reasons[sample] = o.finish_reason
            if o.finished:
                finished.add(o.request_id)
        if not outputs:  # waiting on KV copies: let the copy thread run
            time.sleep(0.001)
        assert time.monotonic() - start < WALL_LIMIT_S, f"no end after {step} steps"
        step += 1
    driver.drain_transfers()
    return served


def assert_dense_tokens(run: RandomRun, served: Served) -> None:
    """Every request of `run` generated the dense model's greedy tokens under its stop
    tokens and min_tokens: all of them when it was not aborted, a leading part of them
    (possibly none) when it was; it finished for the oracle's reason; and the logprobs
    and prompt logprobs of a request that asked are the dense model's
    (assert_dense_logprobs); an aborted request may have got no prompt logprobs."""
    arrivals = run.arrivals
    expected, rows = dense_decode(
        [a.prompt for a in arrivals],
        [a.max_tokens for a in arrivals],
        [a.stop_token_ids for a in arrivals],
        [a.min_tokens for a in arrivals],
    )
    for a, want, want_rows in zip(arrivals, expected, rows, strict=True):
        for sample in [(a.request_id, k) for k in range(a.n)]:  # greedy: all alike
            got = served.tokens[sample]
            if a.request_id in served.aborted:
                assert got == want[: len(got)], sample
            else:
                assert got == want, sample
                # A stop token first, as vLLM's (also as the last allowed token).
                stopped = a.min_tokens < len(want) <= a.max_tokens and want[-1] in a.stop_token_ids
                assert served.finish_reasons[sample] == ("stop" if stopped else "length")
            if a.logprobs is not None:
                assert len(served.logprobs[sample]) == len(got), sample
                for token, entry, row in zip(got, served.logprobs[sample], want_rows, strict=False):
                    assert_dense_logprobs(entry, token, a.logprobs, row)
        entries = served.prompt_logprobs.get(a.request_id)
        if a.prompt_logprobs is None or (entries is None and a.request_id in served.aborted):
            assert entries is None, a.request_id
            continue
        assert entries is not None and len(entries) == len(a.prompt) and entries[0] is None
        rows = _log_softmax(dense_logits([a.prompt[: p + 1] for p in range(len(a.prompt) - 1)]))
        for token, entry, row in zip(a.prompt[1:], entries[1:], rows, strict=True):
            assert_dense_logprobs(entry, token, a.prompt_logprobs, row)


LOGPROB_TOL = 1e-4  # the paged and dense forward passes differ by float rounding


def _log_softmax(logits: np.ndarray) -> np.ndarray:  # f64 rows
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def assert_dense_logprobs(entry: dict, token: int, k: int, row: np.ndarray) -> None:
    """`entry` ({token id: Logprob}) is the sampled `token` first, then k most likely
    tokens of the dense log_softmax `row`, with its values and ranks up to rounding."""
    ids = list(entry)
    assert ids[0] == token and len(entry) in (k, k + 1), (ids, token, k)
    for t, lp in entry.items():
        logprob, rank = lp.logprob, lp.rank
        assert abs(logprob - row[t]) < LOGPROB_TOL, (t, logprob, row[t])
        # 1 + the tokens strictly above it, whichever way rounding breaks a near-tie.
        above_surely = int(np.sum(row > row[t] + LOGPROB_TOL))
        above_maybe = int(np.sum(row > row[t] - LOGPROB_TOL)) - 1
        assert 1 + above_surely <= rank <= 1 + above_maybe, (t, rank)
    if k:
        top = ids[1:] if len(entry) == k + 1 else ids  # k entries: the sampled one is a top one
        floor = min(row[t] for t in top)
        missed = set(np.flatnonzero(row > floor + LOGPROB_TOL).tolist()) - set(top)
        assert not missed, f"{missed} are more likely than a top token of {entry}"
