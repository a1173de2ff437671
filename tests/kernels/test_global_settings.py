"""Both kernels under JAX's global settings: the same programs, and results that match the oracle.

- jax_enable_x64: a Python int in a kernel's index arithmetic became int64. Mosaic
  refused the TPU kernel's memref slices ("operand must be 32-bit signless integer, got
  i64") and the GPU kernel did its index arithmetic in 64 bits. Both wrappers trace their
  kernel with 32-bit types whatever the flag says. The cases are built before x64 is
  switched on, so their arrays keep the dtypes the kernels take (float32, int32).
- jax.default_matmul_precision: the kernels' bfloat16 matmuls took the global default,
  and Mosaic refused "tensorfloat32" ("Unsupported dot precision: HIGH"). Every matmul
  now names its precision (HIGHEST for float32, DEFAULT otherwise).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.gpu import ragged_paged_attention as gpu_attention
from kernels_pallas.gpu.aot import lower_kernel_call
from kernels_pallas.tpu import ragged_paged_attention as tpu_attention
from tests.kernels import harness
from tests.kernels.test_tpu_kernel import MIXED
from tests.kernels.test_tpu_lowering import _lower, _specs

SM_SCALE = 128**-0.5
PRECISIONS = ["bfloat16", "tensorfloat32", "float32", "highest"]
DTYPE_PAIRS = [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.int8)]
DTYPE_PAIRS += [(jnp.bfloat16, jnp.float32)]  # float32 dots at HIGHEST: the cache's dtype


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_dtype,kv_dtype", [DTYPE_PAIRS[0], DTYPE_PAIRS[2]])
def test_the_tpu_kernel_lowers_to_the_same_module_under_x64(q_dtype, kv_dtype, causal):
    specs = _specs(q_dtype, kv_dtype, 128, 16, 8, 2)
    plain = _mosaic_calls(_lower(specs, causal=causal))
    with jax.enable_x64(True):
        under_x64 = _mosaic_calls(_lower(specs, causal=causal))
    assert len(plain) == 1 and under_x64 == plain


def _mosaic_calls(stablehlo: str) -> list[str]:
    # The serialized kernel; the wrapper's reshapes around it may use 64-bit indices.
    return re.findall(r"@tpu_custom_call\(.*?backend_config = (\"[^\"]*)", stablehlo)


def _gpu_module(q_dtype, kv_dtype, **kernel_kw) -> str:
    return lower_kernel_call(
        90, num_tokens=64, num_seqs=8, num_q_heads=8, num_kv_heads=2, head_dim=128,
        q_dtype=q_dtype, kv_dtype=kv_dtype, **kernel_kw,
    ).ir  # fmt: skip


@pytest.mark.parametrize("max_q_len", [1, None])
def test_the_gpu_kernel_lowers_to_the_same_triton_module_under_x64(max_q_len):
    plain = _gpu_module(jnp.bfloat16, jnp.bfloat16, max_q_len=max_q_len)
    with jax.enable_x64(True):
        under_x64 = _gpu_module(jnp.bfloat16, jnp.bfloat16, max_q_len=max_q_len)
    assert "i64" not in under_x64
    assert under_x64 == plain


@pytest.mark.parametrize("q_dtype,kv_dtype", DTYPE_PAIRS)
def test_a_global_matmul_precision_leaves_both_kernels_programs_unchanged(q_dtype, kv_dtype):
    specs = _specs(q_dtype, kv_dtype, 128, 16, 8, 2)
    tpu_plain, gpu_plain = _mosaic_calls(_lower(specs)), _gpu_module(q_dtype, kv_dtype)
    for precision in PRECISIONS:
        with jax.default_matmul_precision(precision):
            assert _mosaic_calls(_lower(specs)) == tpu_plain, precision
            assert _gpu_module(q_dtype, kv_dtype) == gpu_plain, precision


# (enter the setting, q and KV dtype) for the run test: "tensorfloat32" with the bfloat16
# inputs whose matmuls it used to reach.
RUN_SETTINGS = {
    "x64": (lambda: jax.enable_x64(True), jnp.float32),
    "tensorfloat32": (lambda: jax.default_matmul_precision("tensorfloat32"), jnp.bfloat16),
}


@pytest.mark.parametrize("setting", sorted(RUN_SETTINGS))
@pytest.mark.parametrize(
    "kernel,interpret",
    [(tpu_attention, harness.INTERPRET_TPU), (gpu_attention, harness.INTERPRET_GPU)],
    ids=["tpu", "gpu"],
)
def test_both_kernels_run_under_the_setting_and_match_the_oracle(kernel, interpret, setting):
    enter, dtype = RUN_SETTINGS[setting]
    case = harness.make_case(
        3, MIXED, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, max_num_seqs=8,
        dtype=dtype,
    )  # fmt: skip
    with enter():
        out, lse = kernel(*case.args(), sm_scale=SM_SCALE, interpret=interpret)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=SM_SCALE))
    harness.assert_padding_is_empty(case, out, lse)
