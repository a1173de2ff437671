"""Device-mesh checks that lower the sharded step for TPU on the CPU host (registered into
mesh_common.CHECKS).

Imported by tests/sharding/mesh_checks.py after it has set XLA_FLAGS (8 CPU host
devices); see there for how the checks run. Lowering runs Pallas' Mosaic lowering of
the kernel inside each shard (tests/kernels/test_tpu_lowering.py lowers it alone); it
needs no TPU.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
from flax import nnx

from jaxkv import sharding
from jaxkv.models import Llama
from jaxkv.models.llama import _paged_step
from tests.sharding.mesh_common import BUCKETS, NUM_BLOCKS, check, model_config, planned_step

TPU_BLOCK_SIZE = 16  # the TPU kernel's smallest tuned page size


@check
def sharded_step_lowers_for_tpu():
    """The model's paged step, tensor-parallel with the pallas_tpu backend, lowers for TPU
    with its shardings: KV heads split (TP 2 over 8 KV heads) and replicated (TP 4 and 8
    over 2), flat and cascade steps. Each kernel call lies inside the per-shard (manual)
    computation, one per attention pass, and the (donated) caches come in split along
    their combined heads over the "model" axis."""
    for num_kv_heads, tps in ((8, (2,)), (2, (4, 8))):
        cfg = model_config(num_kv_heads, head_dim=128, dtype="bfloat16")
        whole = Llama(cfg, rngs=nnx.Rngs(0))
        for cascade in (False, True):
            _, md = planned_step(
                2, cascade=cascade, num_kv_heads=num_kv_heads, block_size=TPU_BLOCK_SIZE
            )
            md = dataclasses.replace(md, backend="pallas_tpu")
            passes = 1 + len(md.levels)
            assert passes == (2 if cascade else 1), md.levels
            for tp in tps:
                model = sharding.shard_model(whole, sharding.make_mesh(tp))
                placed = sharding.tensor_parallel_of(model)
                caches = sharding.init_kv_caches(cfg, placed, NUM_BLOCKS, TPU_BLOCK_SIZE)
                graphdef, state = nnx.split(model)
                tokens = jnp.zeros((BUCKETS.max_num_tokens,), jnp.int32)
                traced = _paged_step.trace(graphdef, state, tokens, tokens, caches, md)
                text = traced.lower(lowering_platforms=("tpu",)).as_text()
                kernels = text.count("tpu_custom_call")
                manual = text.split("sdy.manual_computation")
                print(f"  {num_kv_heads} KV heads, TP={tp}, cascade={cascade}: {kernels} kernels")
                assert kernels == passes, kernels
                assert len(manual) == 3, "one shard_map for write_kv, one for the attention"
                assert "tpu_custom_call" in manual[2] and "tpu_custom_call" not in manual[0]
                heads = 2 * num_kv_heads * placed.kv_replicas
                cache = re.escape(
                    f"tensor<{NUM_BLOCKS}x{TPU_BLOCK_SIZE}x{heads}x128xbf16> {{jax.buffer_donor"
                    ' = true, sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {"model"}, {}]>'
                )
                assert len(re.findall(cache, text)) == cfg.num_layers, "caches not split by heads"
