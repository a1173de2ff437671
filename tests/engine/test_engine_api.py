"""The engine as a serving loop drives it: refused input, interrupted calls, stop edges."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams
from tests.engine._util import (
    MAX_MODEL_LEN,
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    make_engine,
)

HOT = SamplingParams(max_tokens=6, temperature=1.5)  # no seed: the engine's default one


def _run(engine) -> dict[str, list[tuple[tuple[int, ...], bool, str | None]]]:
    """Steps until idle; every RequestOutput by request id, in step order."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append((o.new_token_ids, o.finished, o.finish_reason))
    return seen


def test_a_refused_request_leaves_later_ids_and_seeds_as_they_were():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    clean = make_engine()
    expected = clean.generate([prompt, prompt], HOT, progress=False)
    engine = make_engine()
    for bad in (
        lambda: engine.add_request(list(range(MAX_MODEL_LEN)), HOT),  # no room for output
        lambda: engine.add_request(prompt, HOT, request_id=7),  # not a str
        lambda: engine.add_request([VOCAB], HOT),
    ):
        with pytest.raises(ValueError):
            bad()
    got = engine.generate([prompt, prompt], HOT, progress=False)
    assert [o.request_id for o in got] == [o.request_id for o in expected] == ["0", "1"]
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected]
    assert got[0].output_token_ids != got[1].output_token_ids  # the seeds do differ


def test_an_interrupted_generate_aborts_its_requests_and_the_engine_serves_on():
    prompts = [[7, 3, 9, 11, 200], [5, 6, 7]]
    engine = make_engine()
    other = engine.add_request([9, 9, 9], SamplingParams(max_tokens=4))
    step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, SamplingParams(max_tokens=5), progress=False)
    del engine.step
    # Only the request the caller added itself is left; generate's own are aborted.
    assert list(engine.scheduler.requests) == [other]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5), progress=False)
    assert [list(o.output_token_ids) for o in outs] == dense_greedy(prompts, 5)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_stop_and_length_edges_end_to_end_with_complete_incremental_outputs():
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, 9).tolist()
    greedy = dense_greedy([prompt], 4)[0]
    near_full = rng.integers(0, VOCAB, MAX_MODEL_LEN - 3).tolist()
    last_slot = rng.integers(0, VOCAB, MAX_MODEL_LEN - 1).tolist()
    engine = make_engine()
    cases = {
        engine.add_request(prompt, SamplingParams(max_tokens=5, stop_token_ids=(greedy[0],))): (
            greedy[:1],
            "stop",
        ),
        engine.add_request(prompt, SamplingParams(max_tokens=5, stop_token_ids=(greedy[2],))): (
            greedy[: greedy.index(greedy[2]) + 1],  # its first occurrence
            "stop",
        ),
        engine.add_request(prompt, SamplingParams(max_tokens=1)): (greedy[:1], "length"),
        engine.add_request(near_full, SamplingParams(max_tokens=10)): (
            dense_greedy([near_full], 3)[0],
            "length",  # max_model_len: 3 tokens, not 10
        ),
        engine.add_request(last_slot, SamplingParams(max_tokens=10)): (
            dense_greedy([last_slot], 1)[0],
            "length",
        ),
    }
    seen = _run(engine)
    for rid, (tokens, reason) in cases.items():
        outs = seen[rid]
        # One token per output, exactly one final output, and it is the last one.
        assert all(len(t) == 1 for t, _, _ in outs)
        assert [f for _, f, _ in outs] == [False] * (len(outs) - 1) + [True]
        assert [r for _, _, r in outs] == [None] * (len(outs) - 1) + [reason]
        assert [t[0] for t, _, _ in outs] == tokens
    assert engine.metrics.num_generated_tokens == sum(len(o) for o in seen.values())
    assert_all_blocks_free(engine)


def test_aborted_requests_get_no_further_output():
    engine = make_engine()
    gone = engine.add_request([4, 4, 4, 4, 4], SamplingParams(max_tokens=8))
    kept = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    first = engine.step()
    assert [o.request_id for o in first] == [gone, kept]
    assert engine.abort(gone) and not engine.abort(gone)
    seen = _run(engine)
    assert list(seen) == [kept] and seen[kept][-1][1:] == (True, "length")
    assert_all_blocks_free(engine)


def _fail_next_step(engine) -> None:
    """Makes the engine's next model call raise, as an interrupt during a compile would."""
    program = engine._program

    def interrupted(*args, **static):  # static: the logprob width
        engine._program = program
        raise KeyboardInterrupt

    engine._program = interrupted


def test_a_step_that_raises_before_the_model_ran_hands_its_batch_back_and_caches_nothing():
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, VOCAB, 24).tolist()
    kept_prompt, gone_prompt = prefix + [1, 2, 3, 4, 5], prefix + [6, 7, 8, 9, 10, 11]
    engine = make_engine()
    kept = engine.add_request(kept_prompt, SamplingParams(max_tokens=8))
    gone = engine.add_request(gone_prompt, SamplingParams(max_tokens=8))
    _fail_next_step(engine)  # the first step: both prompts' blocks are allocated and cached
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.abort(gone)
    tokens = {rid: [t for o in outs for t in o[0]] for rid, outs in _run(engine).items()}
    assert tokens[kept] == dense_greedy([kept_prompt], 8)[0]
    # No block of the failed step may be a cache hit: it holds KV that was never written.
    again = engine.generate([gone_prompt], SamplingParams(max_tokens=8), progress=False)
    assert list(again[0].output_token_ids) == dense_greedy([gone_prompt], 8)[0]

    # The same mid-decode (the decode carry path), with a request admitted next to it.
    late = rng.integers(0, VOCAB, 7).tolist()
    first = engine.add_request(kept_prompt, SamplingParams(max_tokens=8))
    seen: dict[str, list[int]] = {}
    for o in engine.step() + engine.step():
        seen.setdefault(o.request_id, []).extend(o.new_token_ids)
    second = engine.add_request(late, SamplingParams(max_tokens=4))
    _fail_next_step(engine)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.scheduler.running == [engine.scheduler.requests[first]]  # kept its place
    for rid, outs in _run(engine).items():
        seen.setdefault(rid, []).extend(t for o in outs for t in o[0])
    assert seen[first] == dense_greedy([kept_prompt], 8)[0]
    assert seen[second] == dense_greedy([late], 4)[0]
    assert_all_blocks_free(engine)


def test_generate_reports_a_stop_with_the_stop_token_as_the_last_output():
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, VOCAB, 9).tolist()
    greedy = dense_greedy([prompt], 4)[0]
    stop = greedy[1]
    params = [SamplingParams(max_tokens=5, stop_token_ids=(stop,)), SamplingParams(max_tokens=2)]
    outs = make_engine().generate([prompt, prompt], params, progress=False)
    assert [o.finish_reason for o in outs] == ["stop", "length"]
    assert list(outs[0].output_token_ids) == greedy[: greedy.index(stop) + 1]
    assert list(outs[1].output_token_ids) == greedy[:2]


def test_an_id_holding_a_lone_surrogate_is_refused_by_add_request_and_abort():
    """As cache_salt is: ids go into logs, JSON outputs and routers' maps."""
    engine = make_engine()
    held = engine.add_request([1, 2], request_id="é")
    for n in (1, 2):
        with pytest.raises(ValueError, match=r"^request_id='a\\ud800' must be a non-empty str"):
            engine.add_request([1, 2], SamplingParams(n=n), request_id="a\ud800")
    with pytest.raises(ValueError, match=r"holds '\\udc00' \(str\): each must be a request id"):
        engine.abort([held, "\udc00"])
    assert list(engine.scheduler.requests) == [held]  # nothing queued, nothing aborted
    assert engine.add_request([3]) == "1"  # serial 1, as if the refused ones never came
    assert engine.abort(held) and engine.abort("1")


class _OwnHash(str):
    def __hash__(self) -> int:
        return 12345  # equal to its text, hashed apart from it


class _NoHash(str):
    __hash__ = None


def test_an_id_given_as_a_str_subclass_is_the_str_it_holds():
    # _OwnHash("a") let add_request(request_id="a") queue a second request "a" (both ran,
    # each reported as "a"); _NoHash raised TypeError "unhashable type" naming nothing.
    engine = make_engine()
    params = SamplingParams(max_tokens=2)
    rid = engine.add_request([1, 2], params, request_id=_OwnHash("a"))
    assert type(rid) is str and rid == "a" and _OwnHash("a") in engine.ids_in_use
    with pytest.raises(ValueError, match="'a'"):
        engine.add_request([3, 4], params, request_id="a")
    assert engine.add_request([5, 6], params, request_id=_NoHash("b")) == "b"
    assert engine.abort(_OwnHash("a")) and engine.abort([_NoHash("b")])
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)
