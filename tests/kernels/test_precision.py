"""kernels_pallas.precision: the dtype and precision of the kernels' two dot products.

The wider of the queries' and a float cache's dtype, the queries' own over a quantized
cache (float8 has no implicit promotion: promote_types refuses it), HIGHEST for float32
dots only.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax import lax

from kernels_pallas.precision import compute_dtype, matmul_precision

F32, BF16, F16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
QUANTIZED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,expected",
    [
        (F32, F32, F32), (BF16, BF16, BF16), (F16, F16, F16),
        (BF16, F32, F32), (F32, BF16, F32), (F16, F32, F32),
        (BF16, F16, F32), (F16, BF16, F32),
    ],
)  # fmt: skip
def test_a_float_cache_computes_in_the_wider_dtype(q_dtype, kv_dtype, expected):
    got = compute_dtype(q_dtype, kv_dtype)
    assert isinstance(got, jnp.dtype) and got == expected


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
@pytest.mark.parametrize("q_dtype", [F32, BF16, F16])
def test_a_quantized_cache_computes_in_the_queries_dtype(q_dtype, kv_dtype):
    got = compute_dtype(q_dtype, kv_dtype)
    assert isinstance(got, jnp.dtype) and got == q_dtype
    # dtype names and scalar types are taken as well as dtypes
    assert compute_dtype(q_dtype.name, kv_dtype.type) == q_dtype


@pytest.mark.parametrize(
    "dtype,expected",
    [
        (F32, lax.Precision.HIGHEST), (jnp.float32, lax.Precision.HIGHEST),
        ("float32", lax.Precision.HIGHEST), (BF16, lax.Precision.DEFAULT),
        (F16, lax.Precision.DEFAULT), (jnp.bfloat16, lax.Precision.DEFAULT),
    ],
)  # fmt: skip
def test_only_float32_dots_run_at_highest_precision(dtype, expected):
    assert matmul_precision(dtype) is expected
