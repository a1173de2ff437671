"""The dtype and precision of the Pallas kernels' two dot products (q . k and p . v).

The rule, which both kernels follow and kernels_pallas.reference states: the products
run in the wider of the queries' dtype and a float cache's (jnp.promote_types), so no
operand is rounded below the dtype it came in. bfloat16 queries over a float32 cache
compute in float32 (K, V and the softmax weights stay float32); so do float16 queries
over a bfloat16 cache and the reverse (float16 has the narrower range: a float16
model's keys reach 65536 in a bfloat16 cache by rounding, inf in float16; bfloat16 the
shorter mantissa). Over a quantized cache (int8, float8_e4m3fn) they run in the
queries' dtype, which holds every int8 and float8_e4m3fn value exactly (the scales
apply to the scores and the output, in float32). Equal float dtypes compute in their
own: bfloat16 queries over a bfloat16 cache keep bfloat16 dots.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels_pallas.validation import QUANTIZED_KV_DTYPES


def compute_dtype(q_dtype, kv_dtype) -> jnp.dtype:
    """The dtype both dot products take for queries of `q_dtype` over a cache of
    `kv_dtype`: jnp.promote_types of the two for a float cache, q_dtype for a quantized
    one (whose values q_dtype holds exactly)."""
    if jnp.dtype(kv_dtype) in QUANTIZED_KV_DTYPES:
        return jnp.dtype(q_dtype)
    return jnp.dtype(jnp.promote_types(q_dtype, kv_dtype))


def matmul_precision(dtype) -> lax.Precision:
    """The precision of a dot product in `dtype`, explicit either way, so a global
    jax.default_matmul_precision does not change the program (Mosaic takes only DEFAULT
    and HIGHEST): HIGHEST for float32 (at DEFAULT a TPU multiplies in bfloat16 passes
    and a GPU in tf32), DEFAULT for bfloat16 and float16, whose products are exact in
    the float32 accumulator."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT
