"""Opt-in: the TPU kernel through Mosaic's real compiler, ahead of time, on a CPU host.

Lowering (test_tpu_lowering.py) stops at the Mosaic MLIR; Mosaic's own passes (layouts,
tiling of every load, store and DMA, VMEM allocation) run in libtpu. With libtpu
importable, jax can build a TPU topology without a TPU and compile for it, which catches
what only the TPU compiler sees (unaligned tiled offsets, scoped VMEM overflow).

Off by default (libtpu is a 700 MB wheel outside the project's dependencies, and each
compile takes 5 to 90 s). To run, with the libtpu that matches jax (jax[tpu] pins it):

    pip install --target /tmp/libtpu "libtpu==0.0.42.*"
    JAXKV_TPU_AOT=1 PYTHONPATH=/tmp/libtpu .venv/bin/python -m pytest \\
        tests/kernels/test_tpu_aot_compile.py -q
"""

from __future__ import annotations

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.tpu import ragged_paged_attention

pytestmark = pytest.mark.skipif(
    os.environ.get("JAXKV_TPU_AOT") != "1" or importlib.util.find_spec("libtpu") is None,
    reason="opt-in: set JAXKV_TPU_AOT=1 with libtpu importable",
)

F32, BF16, I8, FP8 = jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn
# Generation key -> the smallest topology jax builds for it without hardware.
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


@functools.cache
def _device(generation: str):
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(TOPOLOGIES[generation], platform="tpu")
    return topology.devices[0]


def _compile(generation, q_dtype, kv_dtype, head_dim, page_size, num_q_heads, num_kv_heads,
             *, tokens=64, max_num_seqs=8, pages_per_seq=8, num_pages=64, **kw):  # fmt: skip
    sharding = jax.sharding.SingleDeviceSharding(_device(generation))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    i32 = lambda *shape: spec(shape, jnp.int32)
    args = (
        spec((tokens, num_q_heads, head_dim), q_dtype),
        spec((num_pages, page_size, 2 * num_kv_heads, head_dim), kv_dtype),
        i32(max_num_seqs),
        i32(max_num_seqs, pages_per_seq),
        i32(max_num_seqs + 1),
        i32(1),
    )
    if jnp.dtype(kv_dtype).itemsize == 1:
        kw = dict(k_scale=0.5, v_scale=0.25, **kw)
    f = functools.partial(ragged_paged_attention, sm_scale=0.125, **kw)
    jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).compile()


GRID = [
    # q, kv, head_dim, page_size, num_q_heads, num_kv_heads
    (F32, F32, 128, 16, 8, 8),
    (F32, F32, 64, 256, 32, 8),
    (BF16, BF16, 256, 16, 16, 2),
    (BF16, BF16, 64, 32, 4, 4),
    (BF16, BF16, 128, 16, 28, 4),
    (BF16, I8, 256, 256, 4, 1),
    (BF16, FP8, 128, 32, 16, 16),
    (F32, I8, 64, 128, 12, 4),
    (F32, FP8, 256, 16, 8, 1),
    (BF16, F32, 128, 32, 32, 8),  # float32 dots (the cache's dtype), bfloat16 out
]


@pytest.mark.parametrize("spec", GRID, ids=lambda s: "-".join(map(str, s[2:])))
@pytest.mark.parametrize("options", [{}, {"causal": False}], ids=["causal", "non_causal"])
def test_compiles_for_v5e_with_default_knobs(spec, options):
    _compile("v5e", *spec, **options)


LLAMA = (BF16, BF16, 128, 16, 32, 8)
LLAMA_CALLS = {
    # 128 decode tokens over 5120-key contexts.
    "decode": dict(tokens=128, max_num_seqs=128, pages_per_seq=320, num_pages=4096),
    # The cascade prefix pass: one sequence holding 128 query tokens, 4096 prefix keys.
    "prefix": dict(tokens=128, max_num_seqs=1, pages_per_seq=256, num_pages=4096, causal=False),
    "prefill": dict(tokens=512, max_num_seqs=8, pages_per_seq=320, num_pages=4096),
    "window_soft_cap": dict(tokens=128, sliding_window=1024, soft_cap=50.0),
}


@pytest.mark.parametrize("call", sorted(LLAMA_CALLS))
@pytest.mark.parametrize("generation", ["default", *TOPOLOGIES])
def test_llama_3_8b_compiles_with_each_generation_row(generation, call):
    target = "v5e" if generation == "default" else generation
    _compile(target, *LLAMA, tpu_generation=generation, **LLAMA_CALLS[call])
