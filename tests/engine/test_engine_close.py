"""Engine.close: requests aborted, KV copies landed, device memory freed, use refused."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import SamplingParams, engine_device
from jaxkv.engine import Engine
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.kv_transfer import KVConnector
from jaxkv.router import PrefixAwareRouter
from jaxkv.sharding import place_model
from tests.engine._util import (
    VOCAB,
    assert_all_blocks_free,
    dense_greedy,
    engine_config,
    make_engine,
    tiny_model,
)

HOST_BYTES = 1 << 24


def _prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(n)]


def test_close_hands_back_a_batch_an_interrupt_kept_from_its_step():
    # A Ctrl-C as schedule() returned left its batch neither applied nor handed back:
    # close() aborted its request, and the blocks that batch was to write stayed in the
    # prefix cache with their KV never written (a discard of the batch takes them out).
    engine = make_engine()
    engine.add_request(_prompts(1, 1, 20)[0], SamplingParams(max_tokens=4), request_id="r")
    real = engine.scheduler.schedule

    def interrupted():
        del engine.scheduler.schedule  # once: the class's method from now on
        real()  # its output lost with the interrupt
        raise KeyboardInterrupt

    engine.scheduler.schedule = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.manager.pool.cached_block_hash_to_block  # entered by the lost batch
    engine.close()
    assert not engine.manager.pool.cached_block_hash_to_block
    assert_all_blocks_free(engine)


def test_close_aborts_requests_lands_copies_and_frees_the_kv_cache():
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=5)
    engine = make_engine(connector=connector)
    done, running, waiting = _prompts(0, 3, 20)
    engine.generate([done], SamplingParams(max_tokens=2), progress=False)
    assert engine.has_pending_transfers()  # its KV is still being copied out
    engine.add_request(running, SamplingParams(max_tokens=50), request_id="running")
    engine.step()
    engine.add_request(waiting, SamplingParams(max_tokens=50), request_id="waiting")
    caches = engine.kv_caches

    engine.close()

    assert engine.closed and not engine.has_unfinished_requests()
    assert not engine.has_pending_transfers()
    assert connector.stats.num_stored_blocks > 0  # the copy landed in the host store
    assert_all_blocks_free(engine)
    assert all(cache.is_deleted() for cache in caches) and engine.kv_caches == []
    assert engine.metrics.num_steps > 0  # still readable
    calls = {
        "add_request": lambda: engine.add_request(done),
        "step": engine.step,
        "generate": lambda: engine.generate([done], progress=False),
        "generate of no prompts": lambda: engine.generate([], progress=False),
        "drain_transfers": engine.drain_transfers,
        "reset_prefix_cache": engine.reset_prefix_cache,
        "queue_checkpoint": engine.queue_checkpoint,  # it returned a rewind
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="the Engine is closed"):
            call()
            pytest.fail(f"{name} ran on a closed engine")
    # Not refused, as the router's: close aborted every request, and a caller's cleanup
    # (or a router closing its replicas' requests) may abort ids after it.
    assert engine.abort(["running", "waiting"]) is False
    with pytest.raises(ValueError, match="must be a request id"):
        engine.abort(7)  # its argument is still checked
    engine.close()  # again: nothing to do


def test_an_engine_whose_step_program_failed_after_donating_its_caches_says_to_rebuild_it():
    # Later calls used to fail in jax ("Buffer has been deleted or donated", "Array has
    # been deleted"), or queue requests that could never run; close must still free all.
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=5)
    engine = make_engine(connector=connector)
    done, running = _prompts(3, 2, 20)
    engine.generate([done], SamplingParams(max_tokens=2), progress=False)
    assert engine.has_pending_transfers()  # a save begun before the failure
    program = engine._program

    def fails_after_donation(*args, **kwargs):
        program(*args, **kwargs)  # the caches given are donated: deleted now
        raise RuntimeError("device lost")

    engine._program = fails_after_donation
    engine.add_request(running, SamplingParams(max_tokens=8), request_id="running")
    caches = engine.kv_caches
    with pytest.raises(RuntimeError, match="device lost") as raised:
        engine.step()
    assert "Build a new Engine" in "".join(raised.value.__notes__)
    engine._program = program
    lost = "KV caches were lost.*Build a new Engine"
    calls = {
        "add_request": lambda: engine.add_request(done),
        "step": engine.step,
        "generate": lambda: engine.generate([done], progress=False),
        "drain_transfers": engine.drain_transfers,
        "reset_prefix_cache": engine.reset_prefix_cache,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=lost):
            call()
            pytest.fail(f"{name} ran on lost caches")
    assert engine.has_unfinished_requests() and engine.metrics.num_steps > 0  # reads work
    assert engine.abort("running") and engine.step() == []  # idle: it only polls copies
    with pytest.raises(RuntimeError, match=lost):
        engine.add_request(done)
    engine.close()  # lands the save, frees the rest
    assert engine.closed and not engine.has_unfinished_requests()
    assert not engine.has_pending_transfers() and connector.stats.num_stored_blocks > 0
    assert_all_blocks_free(engine)
    assert all(cache.is_deleted() for cache in caches) and engine.kv_caches == []
    with pytest.raises(RuntimeError, match="the Engine is closed"):
        engine.step()
    engine.close()  # again: nothing to do


def test_a_router_closes_a_replica_whose_caches_were_lost():
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=5)
    engine = make_engine(connector=connector)
    router = PrefixAwareRouter([engine], block_size=4)
    done, running = _prompts(4, 2, 20)
    router.generate([done], SamplingParams(max_tokens=2), progress=False)
    program = engine._program

    def fails_after_donation(*args, **kwargs):
        program(*args, **kwargs)
        raise RuntimeError("device lost")

    engine._program = fails_after_donation
    router.add_request(running, SamplingParams(max_tokens=8))
    with pytest.raises(RuntimeError, match="device lost"):
        router.step()
    with pytest.raises(RuntimeError, match="KV caches were lost"):
        router.step()
    assert engine.has_pending_transfers()
    router.close()  # its steps used to raise, leaving the replica open
    assert router.closed and engine.closed and engine.kv_caches == []
    assert connector.stats.num_stored_blocks > 0 and router.num_outstanding == (0,)


def test_a_connector_keeps_the_closed_engines_kv_for_the_next_engine():
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=3)
    prefix = _prompts(1, 1, 32)[0]
    first, second = prefix + [5, 6], prefix + [7, 8, 9]
    with make_engine(connector=connector) as engine:
        out1 = engine.generate([first], SamplingParams(max_tokens=3), progress=False)
    assert engine.closed and connector.stats.num_stored_blocks > 0

    with make_engine(connector=connector) as successor:
        out2 = successor.generate([second], SamplingParams(max_tokens=3), progress=False)
        assert connector.stats.num_loads > 0 and connector.stats.num_loaded_tokens >= 16
    expected = dense_greedy([first, second], 3)
    assert [list(out1[0].output_token_ids), list(out2[0].output_token_ids)] == expected


def test_close_that_times_out_leaves_the_engine_open_and_can_be_retried():
    connector = HostOffloadConnector(HOST_BYTES, copy_delay_steps=10**9)
    engine = make_engine(connector=connector)
    engine.generate(_prompts(2, 1, 20), SamplingParams(max_tokens=2), progress=False)
    with pytest.raises(TimeoutError, match="still pending"):
        engine.close(timeout_s=0.05)
    assert not engine.closed and engine.has_pending_transfers()
    assert all(not cache.is_deleted() for cache in engine.kv_caches)

    connector.copy_delay_steps = 0
    engine.close()
    assert engine.closed and not engine.has_pending_transfers()
    assert_all_blocks_free(engine)


def test_leaving_a_with_block_by_an_exception_closes_the_engine():
    with pytest.raises(KeyError, match="boom"):
        with make_engine() as engine:
            engine.add_request(_prompts(3, 1, 8)[0], SamplingParams(max_tokens=4))
            engine.step()
            raise KeyError("boom")
    assert engine.closed and not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_a_connector_serving_a_live_engine_is_refused_by_a_second_one(monkeypatch):
    # Built beside the first, the second engine used to take the connector over: the
    # first engine's saves then copied the second one's blocks under its own hashes, and
    # a later reload gave a request another's KV (wrong tokens, no error).
    connector = HostOffloadConnector(HOST_BYTES)
    first = make_engine(connector=connector)
    made = []  # refused before its KV pool, which beside the first one's might not fit
    with monkeypatch.context() as patch:
        patch.setattr(tiny_model(), "init_kv_caches", lambda *args: made.append(args))
        with pytest.raises(RuntimeError, match="serves another engine"):
            Engine(tiny_model(), None, engine_config(), connector=connector)
    assert made == []
    config = engine_config()
    other_seed = dataclasses.replace(config, cache=dataclasses.replace(config.cache, hash_seed=1))
    with pytest.raises(RuntimeError, match="serves another engine"):
        Engine(tiny_model(), None, other_seed, connector=connector)
    prefix = _prompts(4, 1, 32)[0]
    out1 = first.generate([prefix + [1]], SamplingParams(max_tokens=2), progress=False)
    first.close()
    with make_engine(connector=connector) as second:
        out2 = second.generate([prefix + [2, 3]], SamplingParams(max_tokens=4), progress=False)
        assert connector.stats.num_loads == 1
    assert list(out1[0].output_token_ids) == dense_greedy([prefix + [1]], 2)[0]
    assert list(out2[0].output_token_ids) == dense_greedy([prefix + [2, 3]], 4)[0]


def test_an_engine_dropped_without_close_is_collected_and_frees_its_connector():
    # Its connector held the copier, whose callbacks held the engine: the engine, its KV
    # cache and copy thread lived on, and the connector refused every later engine.
    connector = HostOffloadConnector(HOST_BYTES)
    engine = make_engine(connector=connector)
    engine.generate(_prompts(5, 1, 20), SamplingParams(max_tokens=2), progress=False)
    engine.drain_transfers()
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None
    with make_engine(connector=connector) as successor:
        assert successor.metrics.bytes_offloaded == 0


def test_transfer_metrics_count_only_the_engines_own_copies():
    # With a connector used in turn, a new engine reported the old one's copies, and the
    # closed one's figures went on growing with the new one's.
    connector = HostOffloadConnector(HOST_BYTES)
    prefix = _prompts(6, 1, 32)[0]
    with make_engine(connector=connector) as first:
        first.generate([prefix + [1]], SamplingParams(max_tokens=2), progress=False)
    first_saved = first.metrics.bytes_offloaded
    assert first_saved > 0 and first.metrics.bytes_reloaded == 0
    with make_engine(connector=connector) as second:
        assert (second.metrics.bytes_offloaded, second.metrics.bytes_reloaded) == (0, 0)
        second.generate([prefix + [2, 3]], SamplingParams(max_tokens=2), progress=False)
        second.drain_transfers()
        assert second.metrics.bytes_reloaded > 0
    assert (first.metrics.bytes_offloaded, first.metrics.bytes_reloaded) == (first_saved, 0)
    total = connector.stats
    assert total.bytes_offloaded == first_saved + second.metrics.bytes_offloaded
    assert total.bytes_reloaded == second.metrics.bytes_reloaded


@pytest.mark.parametrize("timeout_s", ["60", None, float("nan"), -1.0, True])
def test_close_and_drain_refuse_a_bad_timeout_before_aborting_anything(timeout_s):
    # close("60") used to abort every request and only then raise TypeError from the
    # deadline sum, leaving the engine open with its work gone; NaN never timed out.
    engine = make_engine()
    rid = engine.add_request(_prompts(4, 1, 8)[0], SamplingParams(max_tokens=4))
    for call in (engine.close, engine.drain_transfers):
        with pytest.raises(ValueError, match="timeout_s"):
            call(timeout_s)
    assert not engine.closed and engine.scheduler.requests[rid].status.name == "WAITING"
    engine.close()


@pytest.mark.parametrize("host", [False, True], ids=["no-connector", "host-connector"])
def test_close_lets_the_weights_go_while_the_engine_lives(host):
    """The copier's model fingerprint reads the weights (at once when a host connector
    binds, else never): neither way may it keep them past close."""
    params = jax.tree.map(jnp.copy, nnx.split(tiny_model())[1])
    weight = weakref.ref(jax.tree.leaves(params)[0])
    connector = HostOffloadConnector(HOST_BYTES) if host else None
    engine = Engine(tiny_model(), params, engine_config(), connector=connector)
    del params
    gc.collect()
    assert weight() is not None  # the engine's
    engine.close()
    gc.collect()
    assert weight() is None and engine.closed


@pytest.mark.parametrize("call", ["close", "drain_transfers"])
def test_copies_that_landed_are_collected_under_a_zero_timeout(call):
    """A zero timeout still polls once: copies that landed on the host before it (their
    futures done, not yet collected by a step) free their blocks and raise nothing."""
    connector = HostOffloadConnector(HOST_BYTES)
    engine = make_engine(connector=connector)
    futures = []
    start_save = engine.copier.start_save
    engine.copier.start_save = lambda block_ids: (
        futures.append(start_save(block_ids)) or futures[-1]
    )
    engine.generate(_prompts(7, 1, 20), SamplingParams(max_tokens=2), progress=False)
    assert engine.has_pending_transfers() and futures
    for future in futures:
        future.result()  # landed; the next step's poll collects it

    getattr(engine, call)(timeout_s=0)

    assert not engine.has_pending_transfers() and connector.stats.num_saves == len(futures)
    assert engine.closed == (call == "close")
    assert_all_blocks_free(engine)
    engine.close()


class _StatsFailOnce(HostOffloadConnector):
    """Its stats raise the first time they are read (by the first engine's constructor)."""

    failed = False

    @property
    def stats(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("stats unreadable")
        return super().stats


def test_an_engine_whose_constructor_fails_after_binding_leaves_the_connector_unbound():
    # It stayed bound to the failed engine's copier, which the traceback kept alive: the
    # next engine was refused the connector ("serves another engine").
    connector = _StatsFailOnce(HOST_BYTES)
    with pytest.raises(RuntimeError, match="stats unreadable") as raised:
        make_engine(connector=connector)
    assert connector.hash_layout is None  # unbound, the failed engine still referenced
    engine = make_engine(connector=connector)
    assert connector.hash_layout is not None
    engine.close()
    del raised


class _RefusesToBind(KVConnector):
    """Notes the engine's KV caches (weakly), then refuses to bind: a failure after they
    were made."""

    caches: list = []

    def bind(self, copier, *, block_size: int, hash_seed: int) -> None:
        self.caches = [weakref.ref(cache) for cache in copier._get_caches()]
        raise RuntimeError("refused to bind")


def test_a_failed_constructor_lets_its_kv_caches_go_while_the_error_lives():
    # The traceback's frames held the half-built engine, and it its KV caches: a notebook
    # keeping the error (sys.last_value) and retrying with a smaller config ran out of memory.
    connector = _RefusesToBind()
    with pytest.raises(RuntimeError, match="refused to bind") as raised:
        make_engine(connector=connector)
    gc.collect()
    assert raised.value.__traceback__ is not None and not hasattr(raised.value, "__notes__")
    assert connector.caches and all(cache() is None for cache in connector.caches)
    with make_engine() as engine:  # the model serves on
        engine.generate(_prompts(8, 1, 8), SamplingParams(max_tokens=2), progress=False)


def test_a_backend_refused_after_placing_the_weights_lets_the_placed_copies_go(monkeypatch):
    # The check of the backend runs once the model is placed over its mesh: the placed
    # weights (the engine's own copies) lived on in the traceback's frames.
    placed = []

    def recording_place_model(model, params, mesh):
        model, params = place_model(model, params, mesh)
        placed.extend(weakref.ref(leaf) for leaf in jax.tree.leaves(nnx.state(model)))
        return model, params

    monkeypatch.setattr(engine_device, "place_model", recording_place_model)
    config = dataclasses.replace(engine_config(), backend="pallas_tpu", interpret=False)
    with pytest.raises(ValueError, match="backend='pallas_tpu' cannot serve") as raised:
        Engine(tiny_model(), None, config, tensor_parallel_size=1)
    gc.collect()
    assert raised.value.__traceback__ is not None
    assert placed and all(leaf() is None for leaf in placed)
