"""Preemption, abort in every state, bad input, seeded sampling: the engine keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import RequestStatus, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.router import PrefixAwareRouter
from tests.engine._util import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    TIGHT_BLOCKS,
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    make_engine,
    prompts_for,
)


def _collect(engine, tokens, outputs):
    for o in outputs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)


def test_preemption_under_a_tiny_block_budget_gives_identical_outputs():
    prompts = prompts_for("shared", seed=2) + prompts_for("none", seed=2)[:2]
    engine = make_engine(num_blocks=TIGHT_BLOCKS)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10), progress=False)
    assert engine.metrics.num_preemptions > 0
    assert engine.metrics.cascade_steps > 0
    assert [list(o.output_token_ids) for o in outs] == dense_greedy(prompts, 10)
    assert_all_blocks_free(engine)


def test_abort_in_every_state_frees_everything_and_others_stay_exact():
    rng = np.random.default_rng(3)
    rand = lambda n: rng.integers(0, VOCAB, n).tolist()
    prefix = rand(16)
    connector = HostOffloadConnector(1 << 24, copy_delay_steps=3)
    engine = make_engine(num_blocks=TIGHT_BLOCKS, connector=connector)
    sched = engine.scheduler
    tokens: dict[str, list[int]] = {}

    # A prefix in the host store only, then a request that must load it.
    engine.generate([prefix + rand(2)], SamplingParams(max_tokens=1), progress=False)
    engine.drain_transfers()
    assert engine.manager.reset_prefix_cache()
    loading = engine.add_request(prefix + rand(3), SamplingParams(max_tokens=4))
    keep_prompts = [rand(9), rand(14)]
    keepers = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in keep_prompts]
    _collect(engine, tokens, engine.step())
    assert sched.requests[loading].status == RequestStatus.WAITING_FOR_REMOTE_KV
    held = engine.manager.block_ids(loading)
    assert engine.abort(loading)
    assert engine.manager.block_ids(loading) == held  # its load may still write them

    waiting = engine.add_request(rand(5), SamplingParams(max_tokens=3))
    assert sched.requests[waiting].status == RequestStatus.WAITING
    assert engine.abort(waiting)

    running = engine.add_request(rand(7), SamplingParams(max_tokens=30))
    _collect(engine, tokens, engine.step())
    assert sched.requests[running].status == RequestStatus.RUNNING
    assert engine.abort(running)

    finisher = engine.add_request(rand(9), SamplingParams(max_tokens=1))
    _collect(engine, tokens, engine.step())
    assert sched.requests[finisher].status == RequestStatus.FINISHED_TRANSFERRING
    assert not engine.abort(finisher)

    # Two long requests overflow the 23 usable blocks: the later one is preempted.
    hogs = [engine.add_request(rand(20), SamplingParams(max_tokens=40)) for _ in range(2)]
    preempted = None
    for _ in range(60):
        _collect(engine, tokens, engine.step())
        preempted = next(
            (r for r in hogs if sched.requests[r].status == RequestStatus.PREEMPTED), None
        )
        if preempted:
            break
    assert preempted is not None
    assert engine.abort(preempted)
    for rid in hogs:
        engine.abort(rid)
    assert not engine.abort("no-such-request")

    while engine.has_unfinished_requests():
        _collect(engine, tokens, engine.step())
    engine.drain_transfers()
    assert [tokens[k] for k in keepers] == dense_greedy(keep_prompts, 12)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], None, "non-empty"),
        (list(range(MAX_MODEL_LEN)), None, "no room"),
        ([1, 2, VOCAB], None, r"\[0, 256\)"),
        ([1, -2, 3], None, r"\[0, 256\)"),
        ([1.5, 2.0], None, "integers"),
        ([[1, 2]], None, "1-D"),
        ("abc", None, "token ids, not str"),
        (b"hi", None, "token ids, not bytes"),
        (bytearray(b"hi"), None, "token ids, not bytearray"),  # was queued as [104, 105]
        ([5, True, 2], None, "a bool at index 1"),  # numpy would read it as [5, 1, 2]
        ([5, np.True_], None, "a bool at index 1"),
        ([[1, 2], [3]], None, "prompt_token_ids must be a 1-D"),  # numpy's own error before
        ([1, 2], {"max_tokens": 3}, "SamplingParams"),
        ([1, 2], SamplingParams(stop_token_ids=(VOCAB + 1,)), "stop_token_ids"),
    ],
)
def test_bad_input_raises_and_the_engine_keeps_serving(prompt, params, match):
    engine = make_engine()
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert list(engine.scheduler.requests) == [good]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        _collect(engine, tokens, engine.step())
    assert tokens[good] == dense_greedy([[5, 6, 7]], 3)[0]


def test_invalid_sampling_params_and_duplicate_ids_raise_value_error():
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": 0}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    engine = make_engine()
    engine.add_request([1, 2], request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([3, 4], request_id="x")
    with pytest.raises(ValueError, match="request_id='' must be a non-empty str"):
        engine.add_request([3, 4], request_id="")
    assert list(engine.scheduler.requests) == ["x"]


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    hot = SamplingParams(max_tokens=12, temperature=1.5, seed=1234)
    alone = make_engine().generate([prompt], hot, progress=False)[0].output_token_ids
    others = prompts_for("none")
    batch = make_engine().generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(max_tokens=5)] * 3 + [hot] + [SamplingParams(max_tokens=5)] * 3,
        progress=False,
    )
    assert batch[3].output_token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.5, seed=99)
    assert make_engine().generate([prompt], other_seed, progress=False)[0].output_token_ids != alone
    greedy = dense_greedy([prompt], 12)[0]
    assert list(alone) != greedy
    top1 = SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=5)
    assert (
        list(make_engine().generate([prompt], top1, progress=False)[0].output_token_ids) == greedy
    )


def test_a_reused_id_samples_with_its_own_params():
    # The second "a" arrives after the first finished, in a batch of the same ids: it
    # must sample with its own parameters, not the arrays built for the first "a".
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    hot = SamplingParams(max_tokens=12, temperature=1.5, seed=1234)
    alone = make_engine().generate([prompt], hot, progress=False)[0].output_token_ids
    engine = make_engine()
    tokens: dict[str, list[int]] = {}
    engine.add_request(prompt, SamplingParams(max_tokens=2), request_id="a")
    while engine.has_unfinished_requests():
        _collect(engine, tokens, engine.step())
    assert tokens.pop("a") == dense_greedy([prompt], 2)[0]
    engine.add_request(prompt, hot, request_id="a")
    while engine.has_unfinished_requests():
        _collect(engine, tokens, engine.step())
    assert tuple(tokens["a"]) == tuple(alone)


def test_generate_with_a_bad_prompt_queues_nothing():
    engine = make_engine()
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        engine.generate([[1, 2, 3], [4, 5], [1, VOCAB]], SamplingParams(max_tokens=2))
    assert not engine.scheduler.requests and not engine.has_unfinished_requests()
    assert len(engine._sampling) == 0
    outs = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), progress=False)
    assert [list(o.output_token_ids) for o in outs] == dense_greedy([[1, 2, 3]], 2)


def test_generated_ids_skip_ids_callers_chose():
    engine = make_engine()
    ids = [engine.add_request([1, 2], request_id="1"), engine.add_request([3, 4])]
    ids.append(engine.add_request([5, 6]))
    assert ids[0] == "1" and len(set(ids)) == 3
    assert sorted(engine.scheduler.requests) == sorted(ids)


def test_generate_with_progress_bar_returns_outputs_in_prompt_order(capsys):
    prompts = prompts_for("none", seed=4)[:3]
    lengths = [5, 2, 4]
    params = [SamplingParams(max_tokens=n) for n in lengths]
    outs = make_engine().generate(prompts, params, progress=True)
    assert [o.prompt_token_ids for o in outs] == [tuple(p) for p in prompts]
    assert [list(o.output_token_ids) for o in outs] == dense_greedy(prompts, lengths)
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert "generate" in capsys.readouterr().err  # the tqdm bar


def test_reset_prefix_cache_is_refused_while_a_request_holds_blocks_then_empties_it():
    prompt = prompts_for("none", seed=4)[0]
    engine = make_engine()
    params = SamplingParams(max_tokens=3)
    [first] = engine.generate([prompt], params, progress=False)
    running = engine.add_request(prompt, SamplingParams(max_tokens=6))
    engine.step()
    hits_of_one_lookup = engine.manager.prefix_cache_stats.hits
    assert hits_of_one_lookup > 0  # the running request hit the first one's blocks
    assert not engine.reset_prefix_cache()  # it holds them: refused, nothing changed
    engine.abort(running)
    engine.manager.reset_prefix_cache_stats()
    [again] = engine.generate([prompt], params, progress=False)
    assert engine.manager.prefix_cache_stats.hits == hits_of_one_lookup  # still cached
    assert engine.reset_prefix_cache()
    [cold] = engine.generate([prompt], params, progress=False)
    assert engine.manager.prefix_cache_stats.hits == hits_of_one_lookup  # no hit since
    assert first.output_token_ids == again.output_token_ids == cold.output_token_ids
    assert first.output_token_ids == tuple(dense_greedy([prompt], 3)[0])
    assert_all_blocks_free(engine)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.reset_prefix_cache()


def test_a_router_reset_empties_each_engines_prefix_cache_and_forgets_its_routes():
    prompt = prompts_for("none", seed=5)[0]
    engines = [make_engine(), make_engine()]
    router = PrefixAwareRouter(engines, block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=2)
    [first] = router.generate([prompt], params, progress=False)
    assert router.route(prompt).matched_blocks > 0
    assert router.reset_prefix_cache()
    assert router.route(prompt).matched_blocks == 0
    for e in engines:
        e.manager.reset_prefix_cache_stats()
    [cold] = router.generate([prompt], params, progress=False)
    assert sum(e.manager.prefix_cache_stats.hits for e in engines) == 0
    assert cold.output_token_ids == first.output_token_ids
    router.close()


def test_finished_requests_leave_no_sampling_rows_behind():
    """Each step drops the sampling rows of the requests it finished (no per-request leak)."""
    engine = make_engine()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request([4, 5], SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine._sampling) == 0


def test_a_step_whose_planner_raises_is_handed_back_and_the_next_runs_it_again(monkeypatch):
    """The failed step's batch is discarded: the request still gets the greedy tokens."""
    prompt, sampling = [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True)
    want = make_engine().generate([prompt], sampling, progress=False)[0].output_token_ids
    engine = make_engine()
    plan = engine.planner.plan

    def failing_plan(*args, **kwargs):
        raise KeyError("planner bug")

    monkeypatch.setattr(engine.planner, "plan", failing_plan)
    engine.add_request(prompt, sampling, request_id="r")
    with pytest.raises(KeyError):
        engine.step()
    monkeypatch.setattr(engine.planner, "plan", plan)
    got = []
    while engine.has_unfinished_requests():
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert got == list(want)


@pytest.mark.parametrize("where", ["schedule", "update_from_output"])
def test_an_interrupt_between_the_scheduler_and_the_step_leaves_the_engine_serving(where):
    """A Ctrl-C as schedule() returned (the batch never reached the step) or as the update
    began left the batch neither applied nor handed back: every later step raised
    RuntimeError ("neither applied ... nor handed back"), the engine wedged for good."""
    prompts = [np.random.default_rng(9).integers(0, VOCAB, 10).tolist()]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = make_engine()
    real = getattr(engine.scheduler, where)

    def interrupted(*args):
        delattr(engine.scheduler, where)  # once: the class's method from now on
        if where == "schedule":
            real(*args)  # its output lost with the interrupt
        raise KeyboardInterrupt

    setattr(engine.scheduler, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, sampling, progress=False)
    assert not engine.has_unfinished_requests()  # generate aborted its request
    got = engine.generate(prompts, sampling, progress=False)[0].output_token_ids
    assert list(got) == dense_greedy(prompts, 4)[0]
    assert_all_blocks_free(engine)
    engine.close()
