"""Per-request state of the engine (default ids and seeds, sampling rows), the model's
position limit, and the KV caches the engine builds and hands to each step."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import SamplingParams
from jaxkv.attention import default_backend
from jaxkv.config import EngineConfig, SchedulerConfig
from jaxkv.engine import Engine
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.models import ByteTokenizer, Llama
from jaxkv.sampler import sample, sampling_arrays, sampling_row
from tests.engine._util import (
    MAX_MODEL_LEN,
    VOCAB,
    _dense_logits,
    engine_config,
    make_engine,
    prompts_for,
    tiny_model,
)

HOT = SamplingParams(max_tokens=6, temperature=1.5)


def test_default_ids_skip_every_id_a_caller_holds():
    engine = make_engine()
    # Every queued request takes a serial: these two take 0 and 1, and hold ids "2" and "3".
    engine.add_request([1, 2], request_id="2")
    engine.add_request([1, 2], request_id="3")
    assert engine.add_request([3, 4]) == "4"
    assert engine.add_request([3, 4]) == "5"


def test_ids_and_default_seeds_are_not_reused_after_requests_finish():
    engine = make_engine()
    prompt = [3, 1, 4, 1, 5]
    first = engine.generate([prompt], HOT, progress=False)[0]
    second = engine.generate([prompt], HOT, progress=False)[0]
    assert (first.request_id, second.request_id) == ("0", "1")
    assert first.output_token_ids != second.output_token_ids  # a new default seed


def test_no_explicit_seed_replays_an_unseeded_request():
    # The first unseeded request's default seed is 0 (EngineConfig.seed 0, serial 0); an
    # explicit seed=0 draws in the other stream, not the same tokens.
    prompt = [3, 1, 4, 1, 5]
    params = [HOT, dataclasses.replace(HOT, seed=0)]
    outs = make_engine().generate([prompt, prompt], params, progress=False)
    unseeded, seeded = (list(o.output_token_ids) for o in outs)
    assert [unseeded, seeded] == _sampled_by_the_dense_model([prompt, prompt], params)
    assert unseeded != seeded


def test_finished_and_aborted_requests_release_their_sampling_rows():
    engine = make_engine()
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2), progress=False)
    waiting = engine.add_request([1, 2, 3])
    assert engine.abort(waiting)
    assert len(engine._sampling) == 0


def test_max_model_len_beyond_the_models_positions_is_refused():
    config = EngineConfig(scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN + 1))
    with pytest.raises(ValueError, match="max_model_len=65 exceeds"):
        Engine(tiny_model(), None, config)


def _sampled_by_the_dense_model(prompts, params) -> list[list[int]]:
    """Oracle: the dense model's logits of each whole sequence so far (up to 8 at once),
    sampled by jaxkv.sampler with each request's seed folded with the new token's position."""
    n = len(prompts)
    rows = sampling_arrays([sampling_row(p, 0) for p in params], 8)
    seqs = [list(p) for p in prompts]
    for _ in range(max(p.max_tokens for p in params)):
        tokens = np.zeros((8, MAX_MODEL_LEN), np.int32)
        lengths = np.ones(8, np.int32)
        for i, seq in enumerate(seqs):
            tokens[i, : len(seq)] = seq
            lengths[i] = len(seq)
        logits = np.asarray(_dense_logits()(tokens, lengths))
        drawn = np.asarray(_sample(logits, *rows, lengths))
        for i in range(n):
            if len(seqs[i]) < len(prompts[i]) + params[i].max_tokens:
                seqs[i].append(int(drawn[i]))
    return [seq[len(prompt) :] for seq, prompt in zip(seqs, prompts, strict=True)]


_sample = jax.jit(sample)


def test_a_seeded_request_draws_each_token_at_its_own_position():
    params = dataclasses.replace(HOT, max_tokens=8, seed=4321)
    prompt = [7, 7, 2, 9, 100, 31]
    got = make_engine().generate([prompt], params, progress=False)[0].output_token_ids
    assert [list(got)] == _sampled_by_the_dense_model([prompt], [params])


def test_each_request_samples_with_its_own_params_when_cascade_reorders_the_batch():
    # Schedule order alternates two system prompts; the groups plan puts each group's
    # requests together, so batch rows and schedule order differ.
    prompts = prompts_for("two_groups", seed=2)
    prompts = [prompts[i] for i in (0, 3, 1, 4, 2, 5)]
    params = [
        dataclasses.replace(HOT, seed=10 + i) if i % 2 else SamplingParams(max_tokens=6)
        for i in range(6)
    ]
    engine = make_engine()
    got = [list(o.output_token_ids) for o in engine.generate(prompts, params, progress=False)]
    assert dict(engine.metrics.cascade_steps_by_levels).get("groups", 0) > 0
    assert got == _sampled_by_the_dense_model(prompts, params)


def test_the_configured_backend_is_used_and_none_picks_the_platforms():
    base = make_engine().config
    if default_backend() == "pallas_tpu":  # the tiny model's head_dim 16 is below its kernel's
        with pytest.raises(ValueError, match="head_dim"):
            Engine(tiny_model(), None, dataclasses.replace(base, backend=None))
    else:
        none = Engine(tiny_model(), None, dataclasses.replace(base, backend=None))
        assert none.backend == default_backend()
    gpu = dataclasses.replace(base, backend="pallas_gpu", interpret=True)
    assert Engine(tiny_model(), None, gpu).backend == "pallas_gpu"


@pytest.mark.parametrize("platform", [None, "gpu", "tpu"])
def test_a_backend_that_cannot_run_the_model_here_is_refused_at_construction(monkeypatch, platform):
    if platform is not None:  # as on that machine (None: this one's platform)
        monkeypatch.setattr(jax, "default_backend", lambda: platform)
    base = make_engine().config
    connector = HostOffloadConnector(1 << 20)
    # A compiled Pallas backend of another platform (on a GPU, pallas_gpu builds).
    other = "pallas_gpu" if jax.default_backend() == "tpu" else "pallas_tpu"
    cases = (
        (dataclasses.replace(base, backend="pallas_tpu", interpret=True), "head_dim"),
        (dataclasses.replace(base, backend=other), "pass interpret=True"),
    )
    for config, match in cases:
        with pytest.raises(ValueError, match=match):  # was: every step raised
            Engine(tiny_model(), None, config, connector=connector)
    # The refused engines bound nothing: the connector serves the next engine.
    make_engine(connector=connector).close()


def test_kv_dtype_sets_the_cache_dtype():
    base = make_engine().config
    config = dataclasses.replace(base, cache=dataclasses.replace(base.cache, kv_dtype="bfloat16"))
    caches = Engine(tiny_model(), None, config).kv_caches
    assert len(caches) == 2 and {c.dtype for c in caches} == {jnp.dtype("bfloat16")}


def test_a_step_donates_the_kv_caches_to_the_program():
    engine = make_engine()
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=2))
    given = engine.kv_caches
    assert engine.step()
    # Updated in place, not copied: a copy would hold the whole KV cache twice.
    assert all(c.is_deleted() for c in given)
    assert not any(c.is_deleted() for c in engine.kv_caches)


def test_a_stop_token_id_equal_to_the_vocab_size_is_refused():
    engine = make_engine()
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(VOCAB,)))
    assert not engine.has_unfinished_requests()


def test_default_ids_never_repeat_after_skipping_a_callers_id():
    # The next default id follows the one actually used: a later request never gets the
    # id (and so the default seed) of an earlier one.
    engine = make_engine()
    engine.add_request([1, 2], request_id="1")  # holds id "1"
    first = engine.add_request([1, 2])  # id "1" is taken: skips to "2"
    assert first == "2"
    assert engine.abort(first)
    assert engine.add_request([1, 2]) == "3"


def test_seed_zero_is_a_seed_of_its_own_whatever_the_request_index():
    assert sampling_row(SamplingParams(temperature=1.0, seed=0), 7)[3] == 0
    assert sampling_row(SamplingParams(temperature=1.0), 7)[3] == 7  # no seed: the index
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=8)
    alone = make_engine().generate([[5, 6, 7]], params, progress=False)[0].output_token_ids
    engine = make_engine()
    engine.add_request([9, 9, 9], SamplingParams(max_tokens=1))  # takes index 0
    second = engine.generate([[5, 6, 7]], params, progress=False)[0].output_token_ids
    assert alone == second


def test_vllm_spellings_of_no_limit_and_no_top_k_cut():
    # max_tokens=None (generate until a stop token or max_model_len) and top_k=-1 (no
    # cut) were refused; vLLM takes both.
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    engine = make_engine()
    prompt = [5, 6, 7]
    unlimited = SamplingParams(max_tokens=None, temperature=1.0, top_k=-1, seed=3)
    out = engine.generate([prompt], unlimited, progress=False)[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == MAX_MODEL_LEN - 3
    same = SamplingParams(max_tokens=MAX_MODEL_LEN - 3, temperature=1.0, seed=3)
    assert engine.generate([prompt], same, progress=False)[0].output_token_ids == (
        out.output_token_ids
    )
    first = engine.generate([prompt], SamplingParams(max_tokens=1), progress=False)[0]
    stopped = SamplingParams(max_tokens=None, stop_token_ids=tuple(first.output_token_ids))
    got = engine.generate([prompt], stopped, progress=False)[0]
    assert got.finish_reason == "stop" and got.output_token_ids == first.output_token_ids


def test_a_request_stops_at_the_models_eos_unless_it_ignores_eos():
    # vLLM stops at the model's EOS by default; a forgotten stop_token_ids=(eos,) used to
    # run every request to max_tokens. The model here is tiny_model() with its first
    # greedy token after the prompt named EOS.
    prompt = [5, 6, 7]
    params = SamplingParams(max_tokens=4)
    free_run = make_engine().generate([prompt], params, progress=False)[0].output_token_ids
    eos = free_run[1]
    model = tiny_model()
    config = dataclasses.replace(model.config, eos_token_ids=(eos,))
    with_eos = Llama(config, rngs=nnx.Rngs(0))  # tiny_model's weights, by its seed
    engine = Engine(with_eos, None, engine_config())
    out = engine.generate([prompt], params, progress=False)[0]
    assert out.finish_reason == "stop" and out.output_token_ids == free_run[:2]
    # As vLLM: the tokenizer's EOS gives stop_reason None, any other stop token its id
    # (so does the model's EOS with no tokenizer, or a tokenizer with another EOS).
    assert out.stop_reason == eos
    tokenizer = type("T", (ByteTokenizer,), {"eos_token_id": eos})()
    engine = Engine(with_eos, None, engine_config(), tokenizer=tokenizer)
    assert engine.generate([prompt], params, progress=False)[0].stop_reason is None
    listed = SamplingParams(max_tokens=4, stop_token_ids=[eos])
    assert engine.generate([prompt], listed, progress=False)[0].stop_reason is None
    ignoring = SamplingParams(max_tokens=4, ignore_eos=True)
    out = engine.generate([prompt], ignoring, progress=False)[0]
    assert out.finish_reason == "length" and out.output_token_ids == free_run
    ignoring_but_listed = dataclasses.replace(ignoring, stop_token_ids=(eos,))
    out = engine.generate([prompt], ignoring_but_listed, progress=False)[0]
    assert out.output_token_ids == free_run[:2] and out.stop_reason == eos
    with pytest.raises(ValueError, match="ignore_eos='no' must be a bool"):
        SamplingParams(ignore_eos="no")


def test_seeds_are_64_bit_for_requests_and_the_engine_default():
    # Seeds used to be folded into 32 bits: seed 1 sampled as 2**32 + 1 did, and so did
    # engines with default seeds 0 and 2**32.
    prompt = [[5, 6, 7]]

    def drawn(seed=None, engine_seed=0):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12)
        engine = Engine(tiny_model(), None, dataclasses.replace(engine_config(), seed=engine_seed))
        return engine.generate(prompt, params, progress=False)[0].output_token_ids

    assert drawn(1) != drawn(2**32 + 1) and drawn(2**32 - 2) != drawn(-2)
    assert drawn(-2) == drawn(2**64 - 2)  # a negative seed counts modulo 2**64
    assert drawn(-1) == drawn(None)  # but -1 is vLLM's "no seed"
    assert drawn(engine_seed=0) != drawn(engine_seed=2**32)


def _serve(engine, prompt, **kw) -> list[int]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2), **kw)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    return tokens


def test_requests_share_cached_kv_only_under_the_same_cache_salt():
    prompt = prompts_for("shared")[0]  # 20 shared tokens and more: several full blocks
    engine = make_engine()
    first = _serve(engine, prompt, cache_salt="tenant-a")
    hits = lambda: engine.metrics.prefix_cache_hits
    for salt in (None, "tenant-b"):
        assert _serve(engine, prompt, cache_salt=salt) == first
        assert hits() == 0, salt
    assert _serve(engine, prompt, cache_salt="tenant-a") == first
    assert hits() > 0
    for bad in (7, "tenant-\ud800"):  # not a str; not encodable as UTF-8
        with pytest.raises(ValueError, match="cache_salt") as refused:
            engine.add_request(prompt, cache_salt=bad)
        assert "of '" not in str(refused.value)  # no default id was given out to name
    assert not engine.has_unfinished_requests()


def test_the_engine_seed_sets_the_draws_of_unseeded_requests():
    # Replicas get seeds config.seed + i (engine_replicas) so that their unseeded
    # requests draw differently: the engine must mix its seed into every default seed.
    prompt = [3, 1, 4, 1, 5]
    base = make_engine().config
    draws = {}
    for seed in (0, 1, 0):
        engine = Engine(tiny_model(), None, dataclasses.replace(base, seed=seed))
        outs = engine.generate([prompt, prompt], HOT, progress=False)
        got = tuple(o.output_token_ids for o in outs)
        assert draws.setdefault(seed, got) == got  # reproducible
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1]


def test_engines_of_adjacent_seeds_do_not_replay_each_others_requests_one_later():
    # engine_replicas gives replica i the seed config.seed + i. Were the engine seed only
    # added to the request serial (engine_requests' seed mixing), replica 1's n-th unseeded
    # request would draw as replica 0's (n+1)-th: every draw here must be its own.
    prompt = [3, 1, 4, 1, 5]
    base = make_engine().config
    draws = []
    for seed in (0, 1):
        engine = Engine(tiny_model(), None, dataclasses.replace(base, seed=seed))
        draws += [
            tuple(o.output_token_ids) for o in engine.generate([prompt] * 3, HOT, progress=False)
        ]
    assert len(set(draws)) == len(draws) == 6


def test_engines_over_one_model_share_its_step_program():
    # Compiles are per model graph, not per engine: a second engine reuses them.
    first, second = make_engine(), make_engine(cascade=False)
    assert first._program is second._program


@pytest.mark.parametrize("n", [1, 3])
def test_an_add_request_interrupted_as_it_queues_queues_nothing(n):
    # A Ctrl-C after the scheduler queued a request but before its sampling row existed
    # left it queued without one: every later step raised KeyError, and the caller never
    # got the id to abort it.
    engine = make_engine()
    add, calls = engine._sampling.add_request, []

    def interrupted(request, seed):
        calls.append(request.request_id)
        if len(calls) == n:  # the last one: under n > 1 after the others were queued
            raise KeyboardInterrupt
        add(request, seed)

    engine._sampling.add_request = interrupted
    prompt = prompts_for("none", seed=4)[0]
    with pytest.raises(KeyboardInterrupt):
        engine.add_request(prompt, SamplingParams(max_tokens=3, n=n))
    del engine._sampling.add_request
    assert engine.scheduler.requests == {} and len(engine._sampling) == 0
    assert len(engine._samples) == 0 and not engine.has_unfinished_requests()
    got = engine.generate([prompt], SamplingParams(max_tokens=3, n=n), progress=False)
    assert [o.request_id for o in got] == ["0"] * n  # the interrupted call took no id
    engine.close()
