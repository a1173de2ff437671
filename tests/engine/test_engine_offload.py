"""HostOffloadConnector end to end: finished requests hold blocks while others decode.

The shared-prefix trap run through the whole engine: a finished request still copying
its KV out shares prefix blocks with some running requests and not others.
Outputs must equal the dense model's, cascade must still be used where every scheduled
request shares the prefix, and every block must come back once the copies land.
"""

from __future__ import annotations

import gc
from concurrent.futures import Future
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import Request, RequestStatus, SamplingParams
from jaxkv.engine import Engine
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.engine._util import (
    TIGHT_BLOCKS,
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    engine_config,
    make_engine,
    tiny_model,
)

HOST_BYTES = 1 << 24


def _rand(rng, n):
    return rng.integers(0, VOCAB, n).tolist()


def _run(engine, arrivals, max_steps=200):
    """Steps the engine, adding arrivals[step] = [(id, prompt, max_tokens)] before a step.

    Returns outputs by id and, per step, (ids scheduled-and-running, ids transferring,
    cascade levels used by that step or "").
    """
    tokens: dict[str, list[int]] = {}
    trace = []
    for step in range(max_steps):
        for rid, prompt, max_tokens in arrivals.get(step, []):
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens), request_id=rid)
            tokens[rid] = []
        if not engine.has_unfinished_requests() and step > max(arrivals):
            break
        before = dict(engine.metrics.cascade_steps_by_levels)
        transferring = set(engine.scheduler.transferring)
        outputs = engine.step()
        after = dict(engine.metrics.cascade_steps_by_levels)
        levels = "".join(k for k in after if after[k] != before.get(k, 0))
        trace.append(({o.request_id for o in outputs}, transferring, levels))
        for o in outputs:
            tokens[o.request_id].extend(o.new_token_ids)
    engine.drain_transfers()
    return tokens, trace


def test_offloading_requests_hold_blocks_while_others_decode_with_exact_outputs():
    rng = np.random.default_rng(7)
    p, q = _rand(rng, 20), _rand(rng, 16)
    arrivals = {
        0: [("c", p + _rand(rng, 1), 1), ("d", q + _rand(rng, 2), 2)],
        # a shares p with the saving c, b shares nothing (false-positive scenario).
        1: [("a", p + _rand(rng, 2), 9), ("b", _rand(rng, 10), 3)],
        # e shares p too; once b finishes, a and e share p with the saving c and b
        # (false-negative scenario: cascade must be used).
        2: [("e", p + _rand(rng, 3), 7)],
        6: [("f", q + _rand(rng, 4), 4), ("g", _rand(rng, 6), 3)],
    }
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=6)
    engine = make_engine(connector=connector)
    tokens, trace = _run(engine, arrivals)

    specs = [spec for step in sorted(arrivals) for spec in arrivals[step]]
    expected = dense_greedy([s[1] for s in specs], [s[2] for s in specs])
    assert [tokens[s[0]] for s in specs] == expected

    # Finished requests held blocks while others ran, with and without cascade.
    held_steps = [t for t in trace if t[1] and t[0]]
    assert any("c" in held and {"a", "b"} <= ran for ran, held, _ in held_steps)
    assert any(levels for _, _, levels in held_steps), "cascade never ran next to a held save"
    assert any(levels == "global" and ran == {"a", "e"} and held for ran, held, levels in trace), (
        trace
    )
    m = engine.metrics
    assert m.bytes_offloaded > 0 and connector.stats.num_saves >= 3
    assert m.num_transferring == 0
    assert_all_blocks_free(engine)


def _evict_device_cache(engine, rng, block_hashes):
    """Runs unrelated requests until no block of `block_hashes` is in the device cache."""
    cached = engine.manager.pool.cached_block_hash_to_block
    for _ in range(10):
        if not any(h in cached for h in block_hashes):
            return
        engine.generate([_rand(rng, 40) for _ in range(2)], SamplingParams(max_tokens=2),
                        progress=False)  # fmt: skip
        engine.drain_transfers()
    raise AssertionError("prefix never left the device cache")


def test_prefix_evicted_from_device_comes_back_from_host_store():
    rng = np.random.default_rng(11)
    prefix = _rand(rng, 24)
    first, second = prefix + _rand(rng, 3), prefix + _rand(rng, 2)
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=1)
    engine = make_engine(num_blocks=TIGHT_BLOCKS, connector=connector)
    out1 = engine.generate([first], SamplingParams(max_tokens=6), progress=False)
    engine.drain_transfers()
    probe = Request("probe", second)
    _evict_device_cache(engine, rng, probe.update_block_hashes(engine.manager.block_size)[:6])
    assert engine.manager.get_computed_blocks(probe)[1] == 0  # a device-cache miss now

    rid = engine.add_request(second, SamplingParams(max_tokens=6))
    assert engine.step() == []
    assert engine.scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KV
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    engine.drain_transfers()
    assert [list(out1[0].output_token_ids), tokens] == dense_greedy([first, second], 6)
    assert engine.metrics.bytes_reloaded == 6 * engine.copier.bytes_per_block
    assert connector.stats.num_loaded_tokens == 24
    assert_all_blocks_free(engine)


def _failed_future() -> Future:
    f: Future = Future()
    f.set_exception(OSError("injected copy failure"))
    return f


def test_failed_save_and_failed_load_free_blocks_and_keep_outputs_exact():
    rng = np.random.default_rng(5)
    prefix = _rand(rng, 16)
    first, second = prefix + _rand(rng, 2), prefix + _rand(rng, 3)
    connector = HostOffloadConnector(HOST_BYTES)
    engine = make_engine(connector=connector)
    real_save, real_load = engine.copier.start_save, engine.copier.start_load

    engine.copier.start_save = lambda ids: _failed_future()
    engine.generate([first], SamplingParams(max_tokens=3), progress=False)
    engine.drain_transfers()
    assert connector.stats.num_failed_saves == 1 and connector.stats.num_stored_blocks == 0
    assert_all_blocks_free(engine)

    engine.copier.start_save = real_save
    out1 = engine.generate([first], SamplingParams(max_tokens=3), progress=False)
    engine.drain_transfers()
    assert connector.stats.num_stored_blocks > 0
    assert engine.manager.reset_prefix_cache()  # the device cache forgets the prefix
    engine.copier.start_load = lambda ids, blocks: (real_load(ids, blocks), _failed_future())[1]
    out2 = engine.generate([second], SamplingParams(max_tokens=3), progress=False)
    engine.drain_transfers()
    assert connector.stats.num_failed_loads == 1 and connector.stats.num_loads == 0
    expected = dense_greedy([first, second], 3)
    assert [list(out1[0].output_token_ids), list(out2[0].output_token_ids)] == expected
    assert_all_blocks_free(engine)


def test_a_load_that_fails_to_start_raises_once_and_its_request_recomputes():
    # The copier's start_load raising left the store as it was: every later step claimed
    # the same blocks, started the same load and raised, serving no request again.
    rng = np.random.default_rng(7)
    prefix = _rand(rng, 16)
    first, second, other = prefix + _rand(rng, 2), prefix + _rand(rng, 3), _rand(rng, 6)
    connector = HostOffloadConnector(HOST_BYTES)
    engine = make_engine(connector=connector)
    out1 = engine.generate([first], SamplingParams(max_tokens=3), progress=False)
    engine.drain_transfers()
    assert engine.manager.reset_prefix_cache()  # the device cache forgets the prefix

    def refused(ids, blocks):
        raise RuntimeError("the load's copy program failed to build")

    engine.copier.start_load = refused  # for good: a retry would fail the same way
    ids = [engine.add_request(p, SamplingParams(max_tokens=3)) for p in (second, other)]
    with pytest.raises(RuntimeError, match="failed to build"):
        engine.step()
    assert connector.stats.num_failed_loads == 1 and not connector.has_pending()
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    engine.drain_transfers()
    expected = dense_greedy([first, second, other], 3)
    assert [list(out1[0].output_token_ids), *tokens.values()] == expected
    assert connector.stats.num_failed_loads == 1 and connector.stats.num_loads == 0
    assert_all_blocks_free(engine)


def test_only_an_engine_over_the_same_weights_reloads_the_store():
    """Engines sharing a connector in turn under one hash seed: equal tokens hash equal,
    so only the model fingerprint keeps one model's KV out of another model's cache."""
    rng = np.random.default_rng(13)
    prefix = _rand(rng, 24)
    first, second = prefix + _rand(rng, 3), prefix + _rand(rng, 2)
    params = SamplingParams(max_tokens=4)
    connector = HostOffloadConnector(HOST_BYTES)
    config = engine_config()
    with Engine(tiny_model(), None, config, connector=connector) as engine:
        engine.generate([first], params, progress=False)
        engine.drain_transfers()
    # 27 prompt tokens and 3 of the 4 outputs computed: 7 full blocks.
    assert connector.stats.num_stored_blocks == 7

    state = nnx.split(tiny_model())[1]
    copied = jax.tree.map(jnp.copy, state)  # the same bits in other arrays
    with Engine(tiny_model(), copied, config, connector=connector) as same:
        out = same.generate([second], params, progress=False)
        same.drain_transfers()
        assert same.metrics.bytes_reloaded == 6 * same.copier.bytes_per_block
    assert [list(out[0].output_token_ids)] == dense_greedy([second], 4)

    leaves, treedef = jax.tree.flatten(state)
    leaves[0] = leaves[0].at[0].multiply(1.5)  # other weights, the same shapes
    other = jax.tree.unflatten(treedef, leaves)
    with Engine(tiny_model(), other, config) as alone:
        want = alone.generate([second], params, progress=False)
    with Engine(tiny_model(), other, config, connector=connector) as engine:
        assert connector.stats.num_stored_blocks == 0  # another model's KV: dropped
        got = engine.generate([second], params, progress=False)
        engine.drain_transfers()
        assert engine.metrics.bytes_reloaded == 0
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]


def test_an_interrupt_while_a_save_starts_loses_no_block_and_the_engine_serves_on():
    """Ctrl-C while a finished request's save starts (its copy program compiling): the
    step raises, but that request's blocks are freed and the others finishing with it
    are still saved; the engine keeps no sampler row of them and serves on."""
    rng = np.random.default_rng(17)
    prompts = [_rand(rng, 10), _rand(rng, 12)]
    connector = HostOffloadConnector(HOST_BYTES)
    engine = make_engine(connector=connector)
    real_save = engine.copier.start_save

    def interrupted_save(ids):
        engine.copier.start_save = real_save
        raise KeyboardInterrupt("during the save's compile")

    engine.copier.start_save = interrupted_save
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=1))
    with pytest.raises(KeyboardInterrupt):
        engine.step()  # both finish in their first step
    assert not engine.has_unfinished_requests() and len(engine._sampling) == 0
    engine.drain_transfers()
    assert connector.stats.num_saves == 1 and engine.scheduler.requests == {}
    assert_all_blocks_free(engine)
    out = engine.generate(prompts, SamplingParams(max_tokens=3), progress=False)
    engine.drain_transfers()
    assert [list(o.output_token_ids) for o in out] == dense_greedy(prompts, 3)
    assert_all_blocks_free(engine)


@contextmanager
def _one_prompt_stored(seed: int):
    """(connector, prompt): an engine served a 9-token prompt and its saves landed."""
    prompt = _rand(np.random.default_rng(seed), 9)
    connector = HostOffloadConnector(HOST_BYTES)
    with make_engine(connector=connector) as engine:
        engine.generate([prompt], SamplingParams(max_tokens=2), progress=False)
        engine.drain_transfers()
        yield connector, prompt


@pytest.mark.parametrize(
    "block_ids",
    [[0], [10**5], [1.5], [5, 5], np.array([5, 5]), None, "ab", [5, None]],
    ids=["null", "past-pool", "float", "twice", "twice-numpy", "none", "str", "none-item"],
)
def test_a_load_into_blocks_the_cache_lacks_or_given_twice_is_refused_starting_nothing(
    block_ids,
):
    # The null block 0 or one past the pool used to be accepted: the scatter dropped the
    # load (or wrote where every pad writes), and close() then waited on it for good. A
    # block id given twice got both blocks' KV, whichever the scatter wrote last, under
    # two hashes; None or a numpy array raised errors naming no argument.
    with _one_prompt_stored(3) as (connector, prompt):
        order = list(connector._store)
        with pytest.raises(ValueError, match="block_ids=.* must be block ids in"):
            connector.start_load(Request("q", prompt), block_ids)
        assert list(connector._store) == order and not connector.has_pending()


def test_a_load_takes_a_numpy_array_of_block_ids():
    # It raised numpy's "truth value of an array is ambiguous".
    with _one_prompt_stored(4) as (connector, prompt):
        connector.start_load(Request("q", prompt), np.array([5, 6]))
        while connector.has_pending():
            connector.poll()
        assert connector.stats.num_loads == 1


def test_a_save_names_block_ids_given_twice_or_not_as_ids():
    # A block id given twice was saved under two hashes: one of them held the KV of
    # another block, which a later request would then load.
    connector = HostOffloadConnector(HOST_BYTES)
    with make_engine(connector=connector) as engine:
        bs = engine.manager.block_size
        req = Request("f", _rand(np.random.default_rng(5), 2 * bs + 1))
        req.num_computed_tokens = 2 * bs  # two full blocks to save
        for block_ids in ([5, 5, 6], np.array([5, 5, 6]), None, "abc", [5, None, 6]):
            with pytest.raises(ValueError, match="on_finish.*block_ids=.* must be block ids"):
                connector.on_finish(req, block_ids)
            assert not connector._store and not connector.has_pending()
        assert connector.on_finish(req, np.array([5, 6, 7]))
        while connector.has_pending():
            connector.poll()
        assert connector.stats.num_saves == 1 and len(connector._store) == 2


def test_an_engine_dropped_with_a_save_in_flight_leaves_its_connector_nothing_pending():
    # The connector went on reporting the dropped engine's save as pending, and not
    # failed, until another engine was bound to it.
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=10**9)
    engine = make_engine(connector=connector)
    prompt = np.random.default_rng(3).integers(0, VOCAB, 20).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=2), progress=False)
    assert connector.has_pending() and connector.stats.num_failed_saves == 0
    del engine
    gc.collect()
    assert not connector.has_pending() and connector.stats.num_failed_saves == 1
