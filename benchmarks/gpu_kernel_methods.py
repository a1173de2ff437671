"""The methods benchmarks/gpu_kernel.py compares, and their lowering for CUDA.

- flat: the Pallas GPU ragged paged attention kernel, one pass over each request's pages;
- cascade: prefix pass + suffix pass + LSE merge
  (`kernels_pallas.reference.cascade_attention(attention_fn=kernel)`);
- jax_paged: `jax.experimental.pallas.ops.gpu.paged_attention`, JAX's own kernel, with
  queries in the dtype this kernel's dots take (kernels_pallas.precision), as its dots
  take one dtype for both operands.

`lower_full_size` lowers each at a full-size configuration from abstract shapes, so the
CPU-only smoke run proves every method compiles to Triton without a GPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from kernels_pallas import reference
from kernels_pallas.gpu import cuda_lowering_target, ragged_paged_attention
from kernels_pallas.precision import compute_dtype

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B


def flat_fn(q, kv, kv_lens, table, cu, num_seqs, *, sm_scale, interpret, **knobs):
    return ragged_paged_attention(
        q, kv, kv_lens, table, cu, num_seqs, sm_scale=sm_scale, max_q_len=1,
        interpret=interpret, **knobs,
    )  # fmt: skip


def cascade_fn(q, kv, kv_lens, table, cu, num_seqs, *, num_prefix_pages, sm_scale, interpret):
    kernel = functools.partial(ragged_paged_attention, interpret=interpret)
    return reference.cascade_attention(
        q, kv, kv_lens, table, cu, num_seqs, num_prefix_pages, sm_scale=sm_scale,
        attention_fn=kernel,
    )  # fmt: skip


def jax_paged_fn(q, k_pages, v_pages, table, lengths, *, sm_scale, interpret, k_splits):
    # JAX's kernel applies no softmax scale: fold it into q. Its pages_per_sequence must
    # be a multiple of k_splits * pages_per_compute_block; padded columns read page 0,
    # masked by `lengths`. Its dots refuse two dtypes (bfloat16 q, float32 pages): q
    # takes the dtype ours compute in, the output q's.
    block = k_splits * 8
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % block)))
    scaled = (q.astype(jnp.float32) * sm_scale).astype(compute_dtype(q.dtype, k_pages.dtype))
    out = jax_paged.paged_attention(
        scaled, k_pages, v_pages, table, lengths, k_splits=k_splits, interpret=interpret
    )
    return out.astype(q.dtype)


def split_kv(kv):
    """[N, ps, 2H, D] combined pages -> JAX's ([H, N, ps, D] keys, [H, N, ps, D] values)."""
    return kv[:, :, 0::2].transpose(2, 0, 1, 3), kv[:, :, 1::2].transpose(2, 0, 1, 3)


def lower_full_size(b=64, p=8192, s=128, page_size=16, k_splits=16, kv_dtype="bfloat16") -> dict:
    """Lowers every method at one full-size configuration for CUDA from abstract shapes:
    bfloat16 queries over pages of `page_size` tokens of `kv_dtype`, JAX's kernel with
    `k_splits`."""
    pps = p // page_size + math.ceil(s / page_size)
    num_pages = b * pps + 1
    sds = jax.ShapeDtypeStruct
    q = sds((b, NUM_Q_HEADS, HEAD_DIM), jnp.bfloat16)
    kv = sds((num_pages, page_size, 2 * NUM_KV_HEADS, HEAD_DIM), kv_dtype)
    i32 = lambda *shape: sds(shape, jnp.int32)
    kvh = sds((NUM_KV_HEADS, num_pages, page_size, HEAD_DIM), kv_dtype)
    sm = HEAD_DIM**-0.5
    fns = {
        "flat": (
            functools.partial(flat_fn, sm_scale=sm, interpret=False),
            (q, kv, i32(b), i32(b, pps), i32(b + 1), i32(1)),
        ),
        "cascade": (
            functools.partial(
                cascade_fn, num_prefix_pages=p // page_size, sm_scale=sm, interpret=False
            ),
            (q, kv, i32(b), i32(b, pps), i32(b + 1), i32(1)),
        ),
        "jax_paged": (
            functools.partial(jax_paged_fn, sm_scale=sm, interpret=False, k_splits=k_splits),
            (q, kvh, kvh, i32(b, pps), i32(b)),
        ),
    }
    out = {}
    for name, (fn, args) in fns.items():
        with cuda_lowering_target():
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        out[name] = text.count("__gpu$xla.gpu.triton")
        print(
            f"lowered {name} for cuda at B={b} P={p} S={s}, pages of {page_size} "
            f"({jnp.dtype(kv_dtype).name}): "
            f"{out[name]} Triton call(s)"
        )
    return out
