"""Device-mesh checks of the engine and router (registered into mesh_common.CHECKS).

Imported by tests/sharding/mesh_checks.py after it has set XLA_FLAGS (8 CPU host
devices); see there for how the checks run.
"""

from __future__ import annotations

import functools

import numpy as np
from flax import nnx

from jaxkv import SamplingParams
from jaxkv.cascade import AttentionShape
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxkv.models import Llama
from tests.sharding.mesh_common import ALWAYS, BLOCK_SIZE, TP_SIZES, check, model, shard_shapes

MAX_TOKENS = 6


def engine_config(cascade: bool = True) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(num_blocks=64, block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
        backend="xla", enable_cascade=cascade, cascade_cost_model=ALWAYS,
        max_cascade_groups=2, min_num_tokens_bucket=64, min_num_seqs_bucket=8,
        min_pages_bucket=16, q_len_buckets=(64,), pad_cascade_levels=True,
    )  # fmt: skip


def prompts(seed: int = 1) -> list[list[int]]:
    """Two groups of three requests under a shared 10- or 13-token prefix, and three loners."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, 128, n).tolist()
    pa, pb = rand(10), rand(13)
    grouped = [p + rand(int(n)) for p in (pa, pb) for n in rng.integers(1, 6, 3)]
    return grouped + [rand(int(n)) for n in rng.integers(3, 14, 3)]


def greedy(engine, ps) -> list[list[int]]:
    outs = engine.generate(ps, SamplingParams(max_tokens=MAX_TOKENS), progress=False)
    return [list(o.output_token_ids) for o in outs]


@functools.cache
def unsharded_greedy() -> tuple[list[list[int]], int]:
    """Greedy outputs of prompts() on an engine without a mesh, and its cascade steps."""
    from jaxkv.engine import Engine

    engine = Engine(model(8), None, engine_config())
    return greedy(engine, prompts()), engine.metrics.cascade_steps


def other_weights() -> Llama:
    """model(8)'s architecture with other random weights."""
    from jaxkv.models import from_hf_tensors
    from tests.models.reference import random_hf_weights

    cfg = model(8).config
    return from_hf_tensors(cfg, random_hf_weights(cfg, seed=1, std=0.2))


@check
def engine_greedy_tp():
    """Greedy outputs with TP 2, 4, 8 equal TP 1's (the engine without a mesh; the TP=1 mesh
    path runs in attention_flat_and_cascade), token for token, over runs with both flat and
    cascade steps; the caches hold 1/TP per device. At TP 2 the weights come as `params`
    over a model holding other weights: the engine shards and runs those params."""
    from jaxkv import engine_args as engine_module
    from jaxkv.engine import Engine

    want, want_cascade_steps = unsharded_greedy()
    print(f"  unsharded: {want}")
    assert want_cascade_steps > 0
    probed = []  # (num_q_heads, num_kv_heads) each engine checks its backend with
    real_check = engine_module.check_backend

    def check_backend(backend, **kw):
        probed.append((kw["num_q_heads"], kw["num_kv_heads"]))
        return real_check(backend, **kw)

    for tp in TP_SIZES[1:]:
        m, params = (other_weights(), nnx.state(model(8))) if tp == 2 else (model(8), None)
        engine_module.check_backend = check_backend
        try:
            engine = Engine(m, params, engine_config(), tensor_parallel_size=tp)
        finally:
            engine_module.check_backend = real_check
        # The kernel runs on one device's heads: those are what the backend must accept.
        assert probed[-1] == (8 // tp, 8 // tp), (tp, probed)
        devices = set(engine.mesh.devices.flat)
        assert all(leaf.sharding.device_set == devices for leaf in engine._state_leaves)
        initial = engine.kv_caches[0].sharding
        cached = engine._program._cache_size()
        got = greedy(engine, prompts())
        m = engine.metrics
        # The caches the program returns keep the sharding they were made with: a spec
        # that differed only in form (a trailing None) retraced the first step's program.
        assert engine.kv_caches[0].sharding == initial, (initial, engine.kv_caches[0].sharding)
        assert engine._program._cache_size() - cached <= m.num_compiles, tp
        print(
            f"  TP={tp}: {m.num_steps} steps, {m.cascade_steps} cascade, {m.num_compiles} programs"
        )
        assert got == want, (tp, got)
        assert 0 < m.cascade_steps < m.num_steps, "need flat and cascade steps"
        c = engine.kv_caches[0]
        # The cost model weighs one device's KV reads: each device attends with 8 // tp heads.
        assert engine.planner.shape == AttentionShape(8 // tp, 8 // tp, 8, c.dtype.itemsize)
        assert shard_shapes(c) == [(64, BLOCK_SIZE, 16 // tp, 8)] * tp
    # A model shard_model placed already, given without a mesh: the engine takes its mesh
    # (it used to run tensor-parallel but plan cascade with the whole model's heads), and
    # places params given with it as the model's weights are (it used to keep them whole
    # on their device, copied to the mesh at every step).
    from jaxkv.sharding import make_mesh, shard_model

    placed_model = shard_model(other_weights(), make_mesh(4))
    placed = Engine(placed_model, nnx.state(model(8)), engine_config())
    assert placed.mesh is not None and placed.mesh.devices.size == 4
    devices = set(placed.mesh.devices.flat)
    assert all(leaf.sharding.device_set == devices for leaf in placed._state_leaves)
    assert placed.planner.shape == AttentionShape(2, 2, 8, c.dtype.itemsize)
    assert greedy(placed, prompts()) == want


@functools.cache
def tp4_replicas() -> tuple:
    """Two TP=4 engines from engine_replicas (shared by the router checks: one compile)."""
    from jaxkv.router import engine_replicas

    return tuple(engine_replicas(model(8), engine_config(), tensor_parallel_size=4))


@check
def router_over_engine_replicas():
    """Two TP=4 engine replicas on disjoint device groups behind the router: outputs equal
    one unsharded engine's; each prefix group stays on one replica; loners spread."""
    from jaxkv.router import PrefixAwareRouter

    ps = prompts()
    want, _ = unsharded_greedy()
    replicas = tp4_replicas()
    assert len(replicas) == 2
    device_sets = [frozenset(r.mesh.devices.flat) for r in replicas]
    assert len(set().union(*device_sets)) == 8, "replicas share devices"
    router = PrefixAwareRouter(replicas, block_size=BLOCK_SIZE)
    ids = [router.add_request(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in ps]
    where = [router.replica_of(i) for i in ids]
    print(f"  replica of each request: {where}")
    assert len(set(where[0:3])) == 1 and len(set(where[3:6])) == 1, where
    assert where[0] != where[3], where
    assert len(set(where[6:])) == 2, f"loners did not spread over both replicas: {where}"
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while router.has_unfinished_requests():
        for o in router.step():
            tokens[o.request_id].extend(o.new_token_ids)
    assert [tokens[i] for i in ids] == want
    assert router.num_outstanding == (0, 0)
    hits = [r.metrics.prefix_cache_hits for r in replicas]
    print(f"  prefix-cache hits per replica: {hits}")


@check
def router_replicas_sample_independently():
    """Four sampled requests (no seed of their own) for one prompt shorter than a block
    spread over both replicas, two each, and draw four different outputs, as on one engine:
    the replicas do not share a sampling seed."""
    from jaxkv.router import PrefixAwareRouter

    replicas = tp4_replicas()
    router = PrefixAwareRouter(replicas, block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)
    ids = [router.add_request([5, 6, 7], params) for _ in range(4)]
    where = [router.replica_of(i) for i in ids]
    assert sorted(where) == [0, 0, 1, 1], where
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while router.has_unfinished_requests():
        for o in router.step():
            tokens[o.request_id].extend(o.new_token_ids)
    outs = [tuple(tokens[i]) for i in ids]
    print(f"  replicas {where}: {outs}")
    assert all(len(o) == MAX_TOKENS for o in outs), outs
    assert len(set(outs)) == 4, f"replicas drew the same samples: {outs}"


@check
def offload_stores_replicated_kv_heads_once():
    """2 KV heads: a TP=4 engine (each head on 2 devices) offloads to a host connector that
    holds each head once; an engine without a mesh and then a TP=8 one (each head on 4
    devices) reload those blocks, and all three give the unsharded engine's outputs. The
    three engines' weights are distinct arrays, placed three ways: the model fingerprint
    that lets them share the store reads the same bits in each."""
    from jaxkv.engine import Engine
    from jaxkv.host_offload_connector import HostOffloadConnector
    from jaxkv.model_fingerprint import _checksums

    ps = prompts()
    unsharded = Engine(model(2), None, engine_config())
    want = greedy(unsharded, ps)
    connector = HostOffloadConnector(1 << 24)
    # A block of 1 layer, BLOCK_SIZE tokens, K and V of 2 heads of dim 8, float32.
    logical_bytes = BLOCK_SIZE * 2 * 2 * 8 * 4
    for tp in (4, None, 8):
        with Engine(model(2), None, engine_config(), tensor_parallel_size=tp,
                    connector=connector) as engine:  # fmt: skip
            assert engine.copier.bytes_per_block == logical_bytes
            assert engine.copier.model_fingerprint == unsharded.copier.model_fingerprint
            if tp is not None:  # and it reads each shard where it lies, gathering nothing
                for w in engine._state_leaves:  # split by rows or by columns
                    if not w.sharding.is_fully_replicated:
                        program = _checksums.lower(w).compile().as_text()
                        assert "all-reduce" in program and "all-gather" not in program
            got = greedy(engine, ps)
            engine.drain_transfers()
            m = engine.metrics
        print(f"  TP={tp}: offloaded {m.bytes_offloaded} B, reloaded {m.bytes_reloaded} B")
        assert got == want, (tp, got)
        if tp == 4:
            assert m.bytes_offloaded > 0 and m.bytes_reloaded == 0
        else:
            assert m.bytes_reloaded > 0, f"TP={tp} reloaded nothing"
    assert connector.stats.stored_bytes % logical_bytes == 0


@check
def prompt_logprobs_tp():
    """Prompt logprobs at TP 4 equal those of the engine without a mesh: the last layer's
    output at the prompt rows, through the LM head (replicated on every device, as
    shard_params places it), gives the same values (compared as sorted top values, which
    ties between ids cannot reorder)."""
    from jaxkv.engine import Engine

    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    ps = prompts()[:5]

    def run(tp):
        engine = Engine(model(8), None, engine_config(), tensor_parallel_size=tp)
        return [o.prompt_logprobs for o in engine.generate(ps, params, progress=False)]

    want, got = run(None), run(4)
    for prompt, w, g in zip(ps, want, got, strict=True):
        assert len(w) == len(g) == len(prompt) and w[0] is None and g[0] is None
        for token, w_entry, g_entry in zip(prompt[1:], w[1:], g[1:], strict=True):
            assert next(iter(g_entry)) == token
            assert abs(g_entry[token].logprob - w_entry[token].logprob) < 1e-4
            w_top, g_top = (sorted(lp.logprob for lp in e.values()) for e in (w_entry, g_entry))
            assert len(w_top) == len(g_top)
            assert np.allclose(w_top, g_top, atol=1e-4), (w_top, g_top)


@check
def kv_caches_made_where_the_weights_lie():
    """An engine without a mesh whose weights lie on device 5 (given as params, or held by
    the model) makes its KV caches there, and serves as the engine on the default device
    does: they used to be made on device 0 (another replica's, say), whole, and moved at
    the first step."""
    import jax

    from jaxkv.engine import Engine

    want, _ = unsharded_greedy()
    device = jax.devices()[5]
    on_device = jax.device_put(nnx.state(model(8)), device)
    graphdef = nnx.graphdef(model(8))
    for m, params in ((other_weights(), on_device), (nnx.merge(graphdef, on_device), None)):
        engine = Engine(m, params, engine_config())
        where = [c.devices() for c in engine.kv_caches]
        print(f"  params given: {params is not None}; caches on {where[0]}")
        assert where == [{device}] * len(where), where
        assert greedy(engine, prompts()) == want
        assert engine.kv_caches[0].devices() == {device}
        engine.close()


@check
def weights_on_different_devices_are_refused_by_name():
    """Without a mesh, weights left on devices 5 and 6 (given as params, or held by the
    model), or replicated over 5 and 6 in both orders, are refused at construction by
    name: they used to be taken, and every step() then raised jit's error about
    incompatible devices. Weights on one set of devices (each leaf replicated over 5 and
    6) are still taken."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxkv.engine import Engine

    devices = jax.devices()[5:7]
    leaves, treedef = jax.tree.flatten(nnx.state(model(8)))
    split = [jax.device_put(leaf, devices[i % 2]) for i, leaf in enumerate(leaves)]
    split_state = jax.tree.unflatten(treedef, split)
    orders = [NamedSharding(Mesh(order, ("d",)), P()) for order in (devices, devices[::-1])]
    reordered = [jax.device_put(leaf, orders[i % 2]) for i, leaf in enumerate(leaves)]
    reordered_state = jax.tree.unflatten(treedef, reordered)
    graphdef = nnx.graphdef(model(8))
    for m, params, name, ids in (
        (other_weights(), split_state, "params", ("[5]", "[6]")),
        (nnx.merge(graphdef, split_state), None, "model", ("[5]", "[6]")),
        (other_weights(), reordered_state, "params", ("[5, 6]", "[6, 5]")),
    ):
        try:
            Engine(m, params, engine_config())
        except ValueError as e:
            print(f"  ValueError: {e}")
            assert str(e).startswith(f"{name}: the weights lie on different devices"), e
            assert all(where in str(e) for where in ids), e
        else:
            raise AssertionError(f"weights on two devices taken as {name}")
    both = jax.device_put(nnx.state(model(8)), NamedSharding(Mesh(devices, ("d",)), P()))
    with Engine(other_weights(), both, engine_config()) as engine:
        assert engine.mesh is None


@check
def weights_replicated_over_devices_serve_there():
    """An engine without a mesh whose weights are replicated over devices 6 and 5 (in that
    order) makes its KV caches replicated over them, in their order, and serves as the
    engine on the default device does, through a KV load too, compiling each step shape
    once. Its caches, committed on device 0, made every step() raise jit's error about
    incompatible devices; uncommitted, they lay whole on device 0 until the first step."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxkv.engine import Engine
    from jaxkv.host_offload_connector import HostOffloadConnector

    want, _ = unsharded_greedy()
    devices = np.array(jax.devices())[[6, 5]]
    both = jax.device_put(nnx.state(model(8)), NamedSharding(Mesh(devices, ("d",)), P()))
    connector = HostOffloadConnector(1 << 22)
    with Engine(other_weights(), both, engine_config(), connector=connector) as engine:
        weight = jax.tree.leaves(both)[0]
        assert all(c.sharding.is_equivalent_to(weight.sharding, 4) for c in engine.kv_caches)
        compiled = engine._program._cache_size()
        assert greedy(engine, prompts()) == want
        engine.drain_transfers()
        assert engine.reset_prefix_cache()
        assert greedy(engine, prompts()) == want
        assert connector.stats.num_loads > 0
        assert engine._program._cache_size() - compiled == engine.num_compiles
        assert engine.kv_caches[0].devices() == set(devices)
