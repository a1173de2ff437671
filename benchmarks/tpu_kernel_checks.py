"""Correctness checks of the Pallas TPU kernel against `kernels_pallas.reference`.

Run on the device by benchmarks/tpu_kernel.py before it times anything (in the TPU
interpreter in its --smoke run): mixed prefill and decode with GQA over shuffled page
tables, int8 KV, and the non-causal prefix pass of cascade attention.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks.reference_errors import errors_against_reference
from kernels_pallas import reference


def check(kernel, *, heads, dtype, kv_dtype, page_size, interpret: bool) -> dict:
    """Worst |kernel - reference| over valid rows of a few small cases, on this device,
    and whether each is within benchmarks.reference_errors' tolerances: queries of
    `dtype`, float pages of `kv_dtype` (the int8 case's pages are int8)."""
    num_q_heads, num_kv_heads, head_dim = heads
    rng = np.random.default_rng(1)
    seq_lens = [(1, 300), (17, 17), (5, 100), (1, 33)] if not interpret else [(1, 40), (7, 7)]
    max_kv = max(kv for _, kv in seq_lens)
    pages_per_seq = -(-max_kv // page_size)
    num_pages = 1 + len(seq_lens) * pages_per_seq
    table = 1 + rng.permutation(num_pages - 1).reshape(len(seq_lens), pages_per_seq)
    kv_f32 = rng.standard_normal((num_pages, page_size, 2 * num_kv_heads, head_dim))
    num_tokens = sum(ql for ql, _ in seq_lens)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, head_dim)), dtype)
    cu = jnp.asarray(np.cumsum([0] + [ql for ql, _ in seq_lens]), jnp.int32)
    kv_lens = jnp.asarray([kv for _, kv in seq_lens], jnp.int32)
    n = jnp.array([len(seq_lens)], jnp.int32)
    sm_scale = head_dim**-0.5
    int8 = np.clip(np.round(kv_f32 * 40), -127, 127)
    cases = {
        "mixed": (jnp.asarray(kv_f32, kv_dtype), {}, True, (kv_lens, table, cu, n)),
        "int8": (jnp.asarray(int8, jnp.int8), dict(k_scale=0.025, v_scale=0.025), True, None),
        "prefix_pass": (
            jnp.asarray(kv_f32, kv_dtype),
            {},
            False,
            (kv_lens[:1], table[:1], jnp.array([0, num_tokens], jnp.int32), jnp.ones(1, jnp.int32)),
        ),
    }
    errors = {}
    for name, (kv, scales, causal, meta) in cases.items():
        meta = (kv_lens, table, cu, n) if meta is None else meta
        meta = tuple(jnp.asarray(m, jnp.int32) for m in meta)
        opts = dict(sm_scale=sm_scale, causal=causal, **scales)
        got = kernel(q, kv, *meta, **opts)
        want = reference.ragged_paged_attention(q, kv, *meta, **opts)
        errors[name] = errors_against_reference(got, want, valid_rows=int(meta[2][-1]))
    return errors
