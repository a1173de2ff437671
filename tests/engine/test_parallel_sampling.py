"""SamplingParams.n: n samples of one prompt, each a request of its own, reported as one.

Greedy samples must each be the dense model's tokens; seeded ones must draw exactly as a
lone request seeded seed + i; the prompt's blocks must be computed once and shared; the
request's outputs carry its id and each sample's index, and `finished` comes once, when
its last sample ends. Aborts, ids in use and bad values leave the engine as it was.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import HostOffloadConnector, Request, SamplingParams
from jaxkv.parallel_sampling import ParallelSamples
from jaxkv.router import PrefixAwareRouter
from jaxkv.sampler import SamplingRows
from tests.engine._util import (
    BLOCK_SIZE,
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    make_engine,
)
from tests.host._sched_util import make_scheduler

PROMPT = np.random.default_rng(11).integers(0, VOCAB, 21).tolist()  # 5 full blocks + 1
HOT = dict(temperature=1.0, top_k=0, top_p=1.0)


def _run(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def _tokens_by_index(outputs, request_id: str, n: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in range(n)]
    for o in outputs:
        if o.request_id == request_id:
            tokens[o.index].extend(o.new_token_ids)
    return tokens


def test_greedy_samples_are_the_dense_tokens_over_the_prompts_blocks_computed_once():
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=6, n=3))
    assert sorted(engine.scheduler.requests) == [f"{i}_{rid}" for i in range(3)]
    outputs = _run(engine)

    (want,) = dense_greedy([PROMPT], 6)
    assert _tokens_by_index(outputs, rid, 3) == [want] * 3
    assert {o.request_id for o in outputs} == {rid}
    # Each sample ends once ("length"); the request is finished on the very last output.
    assert sorted(o.index for o in outputs if o.finish_reason == "length") == [0, 1, 2]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    m = engine.metrics
    # The first sample computes the prompt; the others hit its 5 full blocks in the same
    # step and compute only the last token, and cascade reads those blocks once.
    assert m.num_prompt_tokens == len(PROMPT) + 2
    assert m.cascade_steps > 0
    assert_all_blocks_free(engine)
    assert len(engine._samples) == 0 and len(engine._sampling) == 0


def test_sample_i_of_a_seeded_request_draws_as_a_lone_request_seeded_seed_plus_i():
    seed = 2**64 - 2  # sample 2's seed wraps to 0
    engine = make_engine()
    params = SamplingParams(max_tokens=8, n=3, seed=seed, **HOT)
    outs = engine.generate([PROMPT], params, progress=False)
    assert [o.index for o in outs] == [0, 1, 2] and {o.request_id for o in outs} == {"0"}
    lone = engine.generate(
        [PROMPT] * 3,
        [SamplingParams(max_tokens=8, seed=s, **HOT) for s in (seed, seed + 1, 0)],
        progress=False,
    )
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in lone]
    assert len({o.output_token_ids for o in outs}) == 3  # three different draws


def test_unseeded_samples_differ_and_later_requests_keep_their_default_ids_and_seeds():
    params = SamplingParams(max_tokens=8, **HOT)
    with_n, without = make_engine(), make_engine()
    assert with_n.add_request(PROMPT, SamplingParams(max_tokens=8, n=3, **HOT)) == "0"
    assert without.add_request(PROMPT, params) == "0"
    assert with_n.add_request(PROMPT[:7], params) == without.add_request(PROMPT[:7], params)
    a, b = _run(with_n), _run(without)
    samples = _tokens_by_index(a, "0", 3)
    # Sample 0 draws with the request's own default seed; the others with seeds of their own.
    assert samples[0] == _tokens_by_index(b, "0", 1)[0]
    assert len({tuple(s) for s in samples}) == 3
    assert _tokens_by_index(a, "1", 1) == _tokens_by_index(b, "1", 1)


def test_aborting_the_request_aborts_every_sample_and_frees_its_id():
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=20, n=3))
    engine.step()
    engine.step()
    assert engine.abort(rid)
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert not engine.abort(rid)
    assert_all_blocks_free(engine)
    assert engine.add_request(PROMPT, SamplingParams(max_tokens=2, n=2), request_id=rid) == rid
    assert _run(engine)[-1].finished


def test_aborting_one_sample_leaves_the_others_to_finish_the_request():
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=5, n=3))
    before = engine.step()
    assert engine.abort(f"1_{rid}")
    after = _run(engine)
    assert {o.index for o in after} == {0, 2}
    assert [o.finished for o in after].count(True) == 1 and after[-1].finished
    (want,) = dense_greedy([PROMPT], 5)
    tokens = _tokens_by_index(before + after, rid, 3)
    assert tokens[0] == tokens[2] == want and tokens[1] == want[:1]
    assert_all_blocks_free(engine)


def test_aborting_the_last_running_sample_ends_the_request_without_an_output():
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=5, n=2))
    engine.step()
    assert engine.abort(f"0_{rid}") and engine.abort(f"1_{rid}")
    assert rid not in engine._samples and not engine.has_unfinished_requests()
    assert engine.add_request(PROMPT, SamplingParams(max_tokens=1), request_id=rid) == rid


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (dict(request_id="x", n=2), dict(request_id="x", n=1)),  # a live request's id
        (dict(request_id="x", n=2), dict(request_id="x", n=2)),
        (dict(request_id="x", n=2), dict(request_id="0_x", n=1)),  # a sample's id
        (dict(request_id="1_y", n=1), dict(request_id="y", n=2)),  # its sample's id in use
        (dict(request_id="0_x", n=2), dict(request_id="x", n=2)),  # sample id = a parent's
    ],
)
def test_an_id_in_use_by_a_request_or_a_sample_is_refused_queueing_nothing(first, second):
    engine = make_engine()
    engine.add_request(
        PROMPT, SamplingParams(max_tokens=2, n=first["n"]), request_id=first["request_id"]
    )
    queued, samples = dict(engine.scheduler.requests), len(engine._samples)
    with pytest.raises(ValueError, match=r"request id '.*' is already in use"):
        engine.add_request(
            PROMPT, SamplingParams(max_tokens=2, n=second["n"]), request_id=second["request_id"]
        )
    assert engine.scheduler.requests == queued and len(engine._samples) == samples
    assert engine.add_request(PROMPT[:5]) == "1"  # the refused request took no serial


def test_a_default_id_skips_a_live_request_with_samples():
    engine = make_engine()
    engine.add_request(PROMPT, SamplingParams(max_tokens=2, n=2), request_id="1")  # serial 0
    assert engine.add_request(PROMPT[:5]) == "2"


def test_a_prompt_too_long_for_any_sample_queues_none():
    engine = make_engine()
    with pytest.raises(ValueError, match="room for output"):
        engine.add_request(list(range(64)), SamplingParams(n=3))
    assert engine.scheduler.requests == {} and len(engine._samples) == 0


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        (list(range(64)), SamplingParams(n=2), r"request 'x': 64 prompt tokens leave no room"),
        (PROMPT, SamplingParams(n=2, stop=["a"]), r"request 'x': sampling_params.stop="),
        (PROMPT, SamplingParams(n=2, stream_text=True), r"request 'x': sampling_params.stream"),
    ],
)
def test_a_refused_request_of_n_samples_is_named_by_its_own_id_not_a_samples(prompt, params, match):
    """The refusal used to name sample 0's id "0_x", an id the caller never gave."""
    engine = make_engine()
    with pytest.raises(ValueError, match=match) as refused:
        engine.add_request(prompt, params, request_id="x")
    assert "0_x" not in str(refused.value)
    assert engine.scheduler.requests == {} and len(engine._samples) == 0


def test_an_id_whose_sample_id_is_in_use_is_refused_by_its_own_id():
    engine = make_engine()
    engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="1_y")
    match = r"^request id 'y' is already in use \(its sample id '1_y' is\)"
    with pytest.raises(ValueError, match=match):
        engine.add_request(PROMPT, SamplingParams(max_tokens=2, n=2), request_id="y")


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_a_bad_n_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=rf"n={value!r} must be an int >= 1"):
        SamplingParams(n=value)


def test_n_is_stored_as_a_python_int():
    params = SamplingParams(n=np.int64(4))
    assert params.n == 4 and type(params.n) is int


def test_a_scheduler_takes_one_sample_per_request():
    engine = make_engine()
    request = Request("r", PROMPT, SamplingParams(n=2))
    with pytest.raises(ValueError, match="sampling_params.n=2 must be 1"):
        engine.scheduler.add_request(request)
    assert engine.scheduler.requests == {}


def test_only_sample_0_computes_prompt_logprobs_and_the_others_hit_its_blocks():
    """Prompt logprobs come once per request, on sample 0's first output; the other
    samples do not ask for them, so they read sample 0's cached prompt blocks."""
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=2, n=3, prompt_logprobs=1))
    outputs = _run(engine)
    assert [o.index for o in outputs if o.prompt_logprobs is not None] == [0]
    assert {o.request_id for o in outputs} == {rid}
    assert engine.metrics.num_prompt_tokens == len(PROMPT) + 2
    assert_all_blocks_free(engine)


def test_generate_returns_each_sample_in_prompt_then_index_order_with_its_logprobs():
    engine = make_engine()
    prompts = [PROMPT, PROMPT[:9]]
    params = [SamplingParams(max_tokens=3, n=2, logprobs=1), SamplingParams(max_tokens=4)]
    outs = engine.generate(prompts, params, progress=False)
    assert [(o.request_id, o.index) for o in outs] == [("0", 0), ("0", 1), ("1", 0)]
    want = dense_greedy(prompts, [3, 4])
    assert [o.output_token_ids for o in outs] == [tuple(want[0])] * 2 + [tuple(want[1])]
    for o in outs[:2]:
        assert len(o.logprobs) == 3 and o.finish_reason == "length"
        total = sum(
            entry[t].logprob for t, entry in zip(o.output_token_ids, o.logprobs, strict=True)
        )
        assert o.cumulative_logprob == pytest.approx(total)
    assert outs[2].logprobs is None and outs[2].cumulative_logprob is None
    assert_all_blocks_free(engine)


def test_samples_run_on_one_replica_through_the_router():
    engines = [make_engine(), make_engine()]
    router = PrefixAwareRouter(engines, block_size=BLOCK_SIZE)
    outs = router.generate([PROMPT], SamplingParams(max_tokens=4, n=3), progress=False)
    (want,) = dense_greedy([PROMPT], 4)
    assert [o.output_token_ids for o in outs] == [tuple(want)] * 3
    assert sorted(e.metrics.num_prompt_tokens for e in engines) == [0, len(PROMPT) + 2]
    assert router.num_outstanding == (0, 0)
    router.close()


def test_a_step_whose_outputs_are_lost_forgets_the_samples_it_finished():
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=1, n=2))
    update = engine.scheduler.update_from_output

    def update_then_raise(*args):
        update(*args)
        raise KeyboardInterrupt

    engine.scheduler.update_from_output = update_then_raise
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    del engine.scheduler.update_from_output
    assert rid not in engine._samples and not engine.has_unfinished_requests()
    assert engine.add_request(PROMPT, SamplingParams(max_tokens=1, n=2), request_id=rid) == rid
    assert _run(engine)[-1].finished


def test_generate_refusing_a_later_prompt_aborts_the_samples_queued_and_rewinds_ids():
    engine = make_engine()
    with pytest.raises(ValueError, match="must lie in"):
        engine.generate([PROMPT, [VOCAB]], SamplingParams(max_tokens=2, n=3), progress=False)
    assert engine.scheduler.requests == {} and len(engine._samples) == 0
    assert engine.add_request(PROMPT) == "0"  # the id (and seed) the first prompt had


def test_the_router_counts_a_request_of_n_samples_as_n_sequences():
    router = PrefixAwareRouter(
        [make_engine(), make_engine()], block_size=BLOCK_SIZE, max_imbalance=2
    )
    first = router.add_request(PROMPT, SamplingParams(max_tokens=2, n=4))
    assert sorted(router.num_outstanding) == [0, 4]
    # The same prefix leaves its replica: 4 sequences there against 0 is over 2 (as
    # requests it would be 1 against 0, and stay).
    second = router.add_request(PROMPT, SamplingParams(max_tokens=2))
    assert router.replica_of(second) != router.replica_of(first)
    assert router.abort(first) and router.num_outstanding.count(0) == 1
    router.generate([PROMPT], SamplingParams(max_tokens=2, n=3), progress=False)
    while router.has_unfinished_requests():
        router.step()
    assert router.num_outstanding == (0, 0)
    router.close()


def test_a_default_id_skips_one_whose_sample_ids_are_in_use():
    engine = make_engine()
    engine.add_request(PROMPT[:5], request_id="0_1")  # takes serial 0
    assert engine.add_request(PROMPT, SamplingParams(max_tokens=2, n=2)) == "2"
    router = PrefixAwareRouter([make_engine(), make_engine()], block_size=BLOCK_SIZE)
    router.add_request(PROMPT[:5], request_id="0_dp-0")
    assert router.add_request(PROMPT, SamplingParams(max_tokens=2, n=2)) == "dp-1"
    router.close()


def test_an_abort_interrupted_between_samples_can_be_repeated():
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=20, n=3))
    engine.step()
    abort, calls = engine.scheduler.abort, []

    def abort_then_interrupt(request_id):
        calls.append(request_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return abort(request_id)

    engine.scheduler.abort = abort_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        engine.abort(rid)
    del engine.scheduler.abort
    assert engine.abort(rid)  # the two samples left
    assert not engine.has_unfinished_requests() and len(engine._samples) == 0
    assert_all_blocks_free(engine)


def test_the_router_counts_each_sample_until_it_ends():
    router = PrefixAwareRouter([make_engine(), make_engine()], block_size=BLOCK_SIZE)
    stop = tuple(range(VOCAB // 8))  # each sampled token stops its sample with p ~ 1/8
    router.add_request(
        PROMPT, SamplingParams(max_tokens=12, n=4, seed=5, stop_token_ids=stop, **HOT)
    )
    running, seen = 4, []
    while router.has_unfinished_requests():
        running -= sum(o.finish_reason is not None for o in router.step())
        assert max(router.num_outstanding) == running
        seen.append(running)
    assert len(set(seen)) > 2  # the samples ended at different steps
    router.close()


def test_samples_of_a_prompt_only_the_host_holds_share_one_load():
    connector = HostOffloadConnector(1 << 24, copy_delay_steps=2)
    first = make_engine(connector=connector)
    first.generate([PROMPT], SamplingParams(max_tokens=2), progress=False)
    first.close()  # its copies landed: the prompt's 5 full blocks are on the host only
    engine = make_engine(connector=connector)
    outs = engine.generate([PROMPT], SamplingParams(max_tokens=4, n=3), progress=False)
    (want,) = dense_greedy([PROMPT], 4)
    assert [o.output_token_ids for o in outs] == [tuple(want)] * 3
    # One load of the 5 blocks; then each sample computes only its last prompt token.
    assert connector.stats.num_loads == 1 and engine.metrics.bytes_reloaded > 0
    assert engine.metrics.num_prompt_tokens == 3
    engine.close()


def test_a_parents_samples_are_aborted_in_index_order():
    sched, rows, samples = make_scheduler(), SamplingRows(), ParallelSamples()
    parent = Request("p", [1, 2, 3], SamplingParams(n=12, max_tokens=2))
    samples.queue(sched, rows, parent, default_seed=5)
    assert samples.ids_to_abort("p") == [f"{i}_p" for i in range(12)]


@pytest.mark.parametrize("n", [1, 3])
def test_an_abort_interrupted_once_the_request_ended_forgets_its_sampling_row(n):
    # Scheduler.abort raises a Ctrl-C once the request is released: the engine skipped
    # discarding its sampling row (and, under n > 1, its sample), and a repeated abort
    # found the request finished and left the row behind for good.
    engine = make_engine()
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=20, n=n))
    engine.step()
    abort = engine.scheduler.abort

    def abort_then_interrupt(request_id):
        del engine.scheduler.abort  # once
        abort(request_id)
        raise KeyboardInterrupt

    engine.scheduler.abort = abort_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        engine.abort(rid)
    assert len(engine._sampling) == n - 1
    assert engine.abort(rid) == (n > 1)  # the samples left, if any
    assert len(engine._sampling) == 0 and len(engine._samples) == 0
    assert not engine.has_unfinished_requests() and rid not in engine.ids_in_use
    assert_all_blocks_free(engine)
