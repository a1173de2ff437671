"""Device-mesh checks on 8 CPU host devices, run in their own process.

XLA_FLAGS must hold --xla_force_host_platform_device_count=8 before jax is imported, and
the rest of the test suite imports jax in the pytest process, so tests/sharding/test_mesh.py
runs `python -m tests.sharding.mesh_checks --json PATH` and asserts each check's result.
Run it by hand the same way; `--only NAME` runs one check. Every check prints what it
compared; a failure prints its traceback and the process exits 1. The attention and
model checks are here; the attention options per shard in mesh_option_checks.py; the
KV copier's in mesh_copy_checks.py; TPU lowering in mesh_lowering_checks.py; the engine
and router checks in mesh_serving_checks.py; what all use (the registry, the model, the
sizes, random batches) in mesh_common.py.
"""

from __future__ import annotations

import os

FLAGS = (
    "--xla_force_host_platform_device_count=8",
    # Compile time dominates these checks; LLVM's optimisations do not change their results.
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
for _flag in FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv import sharding  # noqa: E402
from jaxkv.attention import paged_attention, write_kv  # noqa: E402
from jaxkv.config import EngineConfig, SchedulerConfig  # noqa: E402
from jaxkv.models import Llama, make_paged_forward  # noqa: E402
from jaxkv.models.llama import _paged_step  # noqa: E402
from tests.sharding import (  # noqa: E402, F401 - register their checks
    mesh_copy_checks,
    mesh_lowering_checks,
    mesh_option_checks,
    mesh_serving_checks,
)
from tests.sharding.mesh_common import (  # noqa: E402
    BLOCK_SIZE,
    BUCKETS,
    CHECKS,
    NUM_BLOCKS,
    check,
    max_diff,
    model,
    model_config,
    planned_step,
    shard_shapes,
)

# ------------------------------------------------------------------------- checks


@check
def attention_flat_and_cascade():
    """sharded_paged_attention (out and lse) and sharded_write_kv equal the unsharded ones."""
    rng = np.random.default_rng(0)
    for cascade in (False, True):
        step, md = planned_step(1, cascade=cascade)
        q = jnp.asarray(rng.standard_normal((md.max_num_tokens, 16, 8)), jnp.float32)
        kv = rng.standard_normal((NUM_BLOCKS, BLOCK_SIZE, 16, 8)).astype(np.float32)
        k = jnp.asarray(rng.standard_normal((md.max_num_tokens, 8, 8)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((md.max_num_tokens, 8, 8)), jnp.float32)
        want_kv = write_kv(jnp.asarray(kv), k, v, md.slot_mapping)
        want, want_lse = paged_attention(q, want_kv, md, sm_scale=0.3, return_lse=True)
        valid = int(step.query_lens.sum())
        for tp in (1, 8):  # engine_greedy_tp runs TP 2 and 4
            mesh = sharding.make_mesh(tp)
            cache = jax.device_put(kv, sharding.kv_cache_sharding(mesh))
            cache = sharding.sharded_write_kv(cache, k, v, md.slot_mapping, mesh=mesh)
            out, lse = sharding.sharded_paged_attention(
                q, cache, md, mesh=mesh, sm_scale=0.3, return_lse=True
            )
            d = (max_diff(cache, want_kv), max_diff(out[:valid], want[:valid]))
            d_lse = max_diff(lse[:valid], want_lse[:valid])
            print(
                f"  cascade={cascade} levels={md.num_levels} TP={tp}: diff kv/out/lse {d} {d_lse}"
            )
            assert d[0] == 0.0 and d[1] < 1e-5 and d_lse < 1e-5, (cascade, tp, d, d_lse)
            heads = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
            assert out.sharding.is_equivalent_to(heads, out.ndim), out.sharding
            assert shard_shapes(out) == [(md.max_num_tokens, 16 // tp, 8)] * tp
            assert shard_shapes(cache) == [(NUM_BLOCKS, BLOCK_SIZE, 16 // tp, 8)] * tp
        # The check can fail: swapping one shard's K and V changes the result.
        bad = np.asarray(want_kv).copy()
        bad[:, :, [0, 1]] = bad[:, :, [1, 0]]
        mesh = sharding.make_mesh(8)
        out = sharding.sharded_paged_attention(
            q, jax.device_put(bad, sharding.kv_cache_sharding(mesh)), md, mesh=mesh, sm_scale=0.3
        )
        assert max_diff(out[:valid], want[:valid]) > 1e-3, "swapped K/V went unnoticed"


@check
def pallas_backends_per_shard():
    """The Pallas GPU and TPU kernels (interpret mode) run per shard under shard_map at TP 2
    on a cascade batch (causal main pass and non-causal prefix pass) and equal the xla
    backend unsharded. 4 query heads over 2 KV heads (one per device); head dim 64 and, for
    the TPU kernel, 16-token pages: the kernels' minima."""
    rng = np.random.default_rng(2)
    mesh = sharding.make_mesh(2)
    for backend, block_size in (("pallas_gpu", BLOCK_SIZE), ("pallas_tpu", 16)):
        step, md = planned_step(1, cascade=True, block_size=block_size)
        q = jnp.asarray(rng.standard_normal((md.max_num_tokens, 4, 64)), jnp.float32)
        kv = rng.standard_normal((NUM_BLOCKS, block_size, 4, 64)).astype(np.float32)
        want = paged_attention(q, jnp.asarray(kv), md, sm_scale=0.1)
        cache = jax.device_put(kv, sharding.kv_cache_sharding(mesh))
        out = sharding.sharded_paged_attention(
            q, cache, md, mesh=mesh, sm_scale=0.1, backend=backend, interpret=True
        )
        valid = int(step.query_lens.sum())
        d = max_diff(out[:valid], want[:valid])
        print(f"  {backend} levels={md.num_levels} TP=2: diff out {d}")
        assert d < 1e-4, (backend, d)


def _model_step(num_kv_heads: int, seed: int = 3):
    """Logits and caches of one forward of the unsharded model on a random cascade batch."""
    step, md = planned_step(seed, cascade=True, num_kv_heads=num_kv_heads)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128, md.max_num_tokens).astype(np.int32)
    shape = (NUM_BLOCKS, BLOCK_SIZE, 2 * num_kv_heads, 8)
    num_layers = model_config().num_layers
    base = [rng.standard_normal(shape).astype(np.float32) for _ in range(num_layers)]
    want_logits, want_caches = make_paged_forward(model(num_kv_heads))(
        ids, md.positions, [jnp.asarray(c) for c in base], md
    )
    return md, ids, base, np.asarray(want_logits), [np.asarray(c) for c in want_caches]


@check
def model_logits_and_shard_shapes():
    """The Megatron-sharded model's logits and caches equal the unsharded model's at TP 8
    (engine_greedy_tp runs TP 2 and 4); split weights and cache shards hold 1/TP each."""
    md, ids, base, want_logits, want_caches = _model_step(8)
    for tp in (8,):
        mesh = sharding.make_mesh(tp)
        sharded = sharding.shard_model(model(8), mesh)
        caches = [jax.device_put(c, sharding.kv_cache_sharding(mesh)) for c in base]
        logits, caches = make_paged_forward(sharded)(ids, md.positions, caches, md)
        d = (max_diff(logits, want_logits), max(map(max_diff, caches, want_caches)))
        print(f"  TP={tp}: diff logits/caches {d}; cache shards {shard_shapes(caches[0])[0]}")
        assert d[0] < 1e-4 and d[1] < 1e-5, (tp, d)
        for c in caches:
            assert shard_shapes(c) == [(NUM_BLOCKS, BLOCK_SIZE, 16 // tp, 8)] * tp
            assert {s.device for s in c.addressable_shards} == set(mesh.devices.flat)
        attn = sharded.layers[0].self_attn
        assert shard_shapes(attn.q_proj.kernel[...]) == [(64, 64 // tp)] * tp
        assert shard_shapes(attn.o_proj.kernel[...]) == [(64 // tp, 64)] * tp
        assert shard_shapes(sharded.layers[0].mlp.down_proj.kernel[...]) == [(64 // tp, 64)] * tp
        assert shard_shapes(sharded.embed_tokens.embedding[...]) == [(128, 64)] * tp
        fresh = sharded.init_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
        assert shard_shapes(fresh[-1]) == [(NUM_BLOCKS, BLOCK_SIZE, 16 // tp, 8)] * tp
    assert model(8).layers[0].self_attn.tensor_parallel is None, "shard_model changed its input"


@check
def kv_heads_replicated_when_tp_exceeds_them():
    """2 KV heads, TP 8: each KV head lives on 4 devices; logits equal the unsharded model's."""
    md, ids, base, want_logits, _ = _model_step(2)
    for tp in (8,):
        mesh = sharding.make_mesh(tp)
        sharded = sharding.shard_model(model(2), mesh)
        assert sharding.tensor_parallel_of(sharded).kv_replicas == tp // 2
        caches = sharded.init_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
        assert caches[0].shape == (NUM_BLOCKS, BLOCK_SIZE, 2 * tp, 8)
        assert shard_shapes(caches[0]) == [(NUM_BLOCKS, BLOCK_SIZE, 2, 8)] * tp
        # Replicate the reference cache contents the same way: KV head h -> heads h*r..h*r+r-1.
        r = tp // 2
        rep = [
            np.repeat(c.reshape(*c.shape[:2], 2, 2, 8), r, axis=2).reshape(*c.shape[:2], 2 * tp, 8)
            for c in base
        ]
        caches = [jax.device_put(c, sharding.kv_cache_sharding(mesh)) for c in rep]
        logits, caches = make_paged_forward(sharded)(ids, md.positions, caches, md)
        d = max_diff(logits, want_logits)
        print(f"  TP={tp} over 2 KV heads (x{r}): diff logits {d}")
        assert d < 1e-4, (tp, d)


@check
def model_on_a_mesh_axis_of_another_name():
    """shard_model(axis_name="tp") on a mesh whose one axis is "tp" (not DEFAULT_AXIS):
    weights, caches and attention split along it, logits and caches equal the unsharded
    model's (every other check uses DEFAULT_AXIS, which hides a dropped axis_name); fresh
    caches take the dtype asked for."""
    md, ids, base, want_logits, want_caches = _model_step(8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tp",))
    sharded = sharding.shard_model(model(8), mesh, axis_name="tp")
    tp = sharding.tensor_parallel_of(sharded)
    assert (tp.axis_name, tp.size, tp.kv_replicas) == ("tp", 4, 1), tp
    caches = [jax.device_put(c, sharding.kv_cache_sharding(mesh, "tp")) for c in base]
    logits, caches = make_paged_forward(sharded)(ids, md.positions, caches, md)
    d = (max_diff(logits, want_logits), max(map(max_diff, caches, want_caches)))
    print(f"  TP=4 along 'tp': diff logits/caches {d}")
    assert d[0] < 1e-4 and d[1] < 1e-5, d
    split = jax.sharding.PartitionSpec(None, None, "tp")  # as the step program returns them
    fresh = sharded.init_kv_caches(NUM_BLOCKS, BLOCK_SIZE, jnp.bfloat16)
    assert [(c.sharding.spec, c.dtype) for c in fresh] == [(split, jnp.bfloat16)], fresh
    attn = sharded.layers[0].self_attn
    assert attn.q_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert attn.o_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec("tp", None)


_COLLECTIVE = re.compile(
    r"=\s*(\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)


@check
def tp8_collectives():
    """The compiled TP=8 forward has one all-reduce per attention and per MLP block (of the
    [tokens, hidden] activations) and no collective over a cache-shaped array."""
    md, ids, _, _, _ = _model_step(8)
    sharded = sharding.shard_model(model(8), sharding.make_mesh(8))
    graphdef, state = nnx.split(sharded)
    caches = sharded.init_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    hlo = _paged_step.lower(graphdef, state, ids, md.positions, caches, md).compile().as_text()
    found = _COLLECTIVE.findall(hlo)
    print("  collectives:", found)
    all_reduces = [shape for shape, op in found if op == "all-reduce"]
    layers = model_config().num_layers
    assert len(all_reduces) == 2 * layers, found
    assert all(s.startswith(f"f32[{md.max_num_tokens},64]") for s in all_reduces), found
    assert not [s for s, _ in found if s.startswith(f"f32[{NUM_BLOCKS},")], "cache collective"
    assert not [op for _, op in found if op == "all-gather"], found


@check
def bad_tp_sizes():
    """TP sizes that divide neither the devices nor the KV heads raise ValueError naming both."""

    def raises(fn, *numbers):
        try:
            fn()
        except ValueError as e:
            print(f"  ValueError: {e}")
            for n in numbers:
                assert re.search(rf"\b{n}\b", str(e)), (n, str(e))
            return
        raise AssertionError(f"no ValueError; expected one naming {numbers}")

    raises(lambda: sharding.make_mesh(9), 9, 8)
    raises(lambda: sharding.replica_meshes(3), 3, 8)
    # As vLLM's tensor_parallel_size: the first 3 devices, though 3 does not divide 8.
    assert [d.id for d in sharding.make_mesh(3).devices.flat] == [0, 1, 2]
    raises(lambda: sharding.replica_meshes(5), 5, 8)
    raises(lambda: sharding.make_mesh(2, devices=[]))
    mesh4 = sharding.make_mesh(4)
    raises(lambda: sharding.plan_tensor_parallel(24, 6, mesh4), 4, 6)  # 4 does not divide 6
    raises(lambda: sharding.plan_tensor_parallel(24, 6, sharding.make_mesh(8)), 8, 6)
    raises(lambda: sharding.plan_tensor_parallel(12, 12, sharding.make_mesh(8)), 8, 12)
    # 8 is a multiple of the 2 KV heads, but 4 query heads cannot be split 8 ways.
    raises(lambda: sharding.plan_tensor_parallel(4, 2, sharding.make_mesh(8)), 8, 4)
    for cfg, numbers in (
        (model_config(num_kv_heads=6, num_heads=12), (4, 6)),
        (model_config(intermediate_size=66), (4, 66)),
    ):
        abstract = nnx.eval_shape(lambda c=cfg: Llama(c, rngs=nnx.Rngs(0)))  # no weights computed
        raises(lambda m=abstract: sharding.shard_model(m, mesh4), *numbers)
    # shard_params on its own names the split parameter that TP does not divide, and leaves
    # a replicated one of an indivisible size (here 6) alone.
    tp4 = sharding.TensorParallel(mesh4)
    norm = {"norm": {"scale": jnp.zeros(6)}}
    scale = sharding.shard_params(norm, tp4)["norm"]["scale"]
    assert scale.sharding.spec == jax.sharding.PartitionSpec(), scale.sharding
    up = {"mlp": {"up_proj": {"kernel": jnp.zeros((8, 6))}}}
    raises(lambda: sharding.shard_params(up, tp4), "tensor_parallel_size=4", "dimension 1",
           "size 6", "mlp.up_proj.kernel")  # fmt: skip
    # On a mesh with another axis beside "model", TP is the model axis (4), not all 8 devices.
    mesh2x4 = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    assert sharding.TensorParallel(mesh2x4).size == 4
    q = jnp.zeros((BUCKETS.max_num_tokens, 12, 8))
    kv = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, 12, 8))
    _, md = planned_step(1, cascade=False)
    raises(lambda: sharding.sharded_paged_attention(q, kv, md, mesh=mesh4, sm_scale=1.0), 4, 6)
    # Head counts that do not match each other are named as the caller gave them (12 query
    # heads, 8 KV heads), not as one shard sees them (3 and 2).
    kv8 = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, 16, 8))
    raises(lambda: sharding.sharded_paged_attention(q, kv8, md, mesh=mesh4, sm_scale=1.0), 12, 8)
    odd = jnp.zeros((NUM_BLOCKS, BLOCK_SIZE, 6, 8))[:, :, :5]
    q8 = jnp.zeros((BUCKETS.max_num_tokens, 8, 8))
    mesh2 = sharding.make_mesh(2)
    raises(
        lambda: sharding.sharded_paged_attention(q8, odd, md, mesh=mesh2, sm_scale=1.0),
        "kv_pages.shape",
    )
    k2 = jnp.zeros((BUCKETS.max_num_tokens, 2, 8))
    raises(
        lambda: sharding.sharded_write_kv(kv8, k2, k2, md.slot_mapping, mesh=mesh4),
        "max_num_tokens, 8",
    )
    # Named by the caller's parameters, not by shard_map's message about array axes.
    k6 = jnp.zeros((BUCKETS.max_num_tokens, 6, 8))
    raises(
        lambda: sharding.sharded_write_kv(kv, k6, k6, md.slot_mapping, mesh=mesh4),
        "tensor_parallel_size=4", "num_kv_heads=6",
    )  # fmt: skip
    # A device listed twice makes a Mesh that jit later rejects with an unrelated error.
    d = jax.devices()
    raises(lambda: sharding.make_mesh(2, devices=[d[0], d[0]]), "distinct")
    raises(lambda: sharding.replica_meshes(2, devices=[d[0], d[1], d[0], d[1]]), "distinct")
    engine_config = EngineConfig(scheduler=SchedulerConfig(max_model_len=64))
    from jaxkv.engine import Engine

    raises(lambda: Engine(model(8), None, engine_config, tensor_parallel_size=3), 3, 8)
    raises(lambda: Engine(model(8), None, engine_config, mesh=mesh4, tensor_parallel_size=2), 2, 4)
    # jax's Mesh takes an axis named twice; the engine's placement failed in XLA on it.
    twice = jax.sharding.Mesh(np.array(d[:4]).reshape(2, 2), ("model", "model"))
    raises(lambda: Engine(model(8), None, engine_config, mesh=twice), "axis_names")
    from jaxkv.router import engine_replicas

    raises(lambda: engine_replicas(model(8), engine_config, num_replicas=1.5), "num_replicas")


@check
def replica_meshes_are_consecutive_device_groups():
    """Replicas take consecutive groups of devices in device order (neighbours on real
    hardware), and a mesh of the first devices."""
    groups = [[d.id for d in m.devices.flat] for m in sharding.replica_meshes(2)]
    assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]], groups
    assert [d.id for d in sharding.make_mesh(4).devices.flat] == [0, 1, 2, 3]


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", action="append", choices=sorted(CHECKS))
    parser.add_argument("--json", help="write {check: {ok, seconds, error}} here")
    args = parser.parse_args(argv)
    assert len(jax.devices()) == 8, f"{jax.devices()=}: XLA_FLAGS was set too late"
    results = {}
    for name, fn in CHECKS.items():
        if args.only and name not in args.only:
            continue
        print(f"== {name}", flush=True)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            fn()
            error = None
        except Exception:
            error = traceback.format_exc()
            print(error, flush=True)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        status = "FAIL" if error else "ok"
        print(f"== {name}: {status} in {seconds:.1f}s ({cpu:.1f}s CPU)", flush=True)
        results[name] = {"ok": error is None, "seconds": seconds, "cpu_s": cpu, "error": error}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
