"""Both kernels under jax_enable_x64: the same programs, and results that match the oracle.

With x64 on, a Python int in a kernel's index arithmetic becomes int64: Mosaic refused
the TPU kernel's memref slices ("operand must be 32-bit signless integer, got i64") and
the GPU kernel did its index arithmetic in 64 bits. Both wrappers now trace their kernel
with 32-bit types whatever the flag says. The cases are built before x64 is switched on,
so their arrays keep the dtypes the kernels take (float32, int32).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.gpu import ragged_paged_attention as gpu_attention
from kernels_pallas.gpu.aot import lower_kernel_call
from kernels_pallas.tpu import ragged_paged_attention as tpu_attention
from tests.kernels import harness
from tests.kernels.test_tpu_lowering import _lower, _specs

SM_SCALE = 128**-0.5
MIXED = [(1, 17), (7, 7), (3, 40), (12, 29), (1, 96)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_dtype,kv_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.int8)])
def test_the_tpu_kernel_lowers_to_the_same_module_under_x64(q_dtype, kv_dtype, causal):
    specs = _specs(q_dtype, kv_dtype, 128, 16, 8, 2)
    plain = _mosaic_calls(_lower(specs, causal=causal))
    with jax.enable_x64(True):
        under_x64 = _mosaic_calls(_lower(specs, causal=causal))
    assert len(plain) == 1 and under_x64 == plain


def _mosaic_calls(stablehlo: str) -> list[str]:
    # The serialized kernel; the wrapper's reshapes around it may use 64-bit indices.
    return re.findall(r"@tpu_custom_call\(.*?backend_config = (\"[^\"]*)", stablehlo)


@pytest.mark.parametrize("max_q_len", [1, None])
def test_the_gpu_kernel_lowers_to_the_same_triton_module_under_x64(max_q_len):
    lower = functools.partial(
        lower_kernel_call, 90, num_tokens=64, num_seqs=8, num_q_heads=8, num_kv_heads=2,
        head_dim=128, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, max_q_len=max_q_len,
    )  # fmt: skip
    plain = lower()
    with jax.enable_x64(True):
        under_x64 = lower()
    assert "i64" not in under_x64.ir
    assert under_x64 == plain


@pytest.mark.parametrize(
    "kernel,interpret",
    [(tpu_attention, harness.INTERPRET_TPU), (gpu_attention, harness.INTERPRET_GPU)],
    ids=["tpu", "gpu"],
)
def test_both_kernels_run_under_x64_and_match_the_oracle(kernel, interpret):
    case = harness.make_case(
        3, MIXED, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, max_num_seqs=8
    )
    with jax.enable_x64(True):
        out, lse = kernel(*case.args(), sm_scale=SM_SCALE, interpret=interpret)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    harness.assert_close_to_oracle(case, out, lse, harness.dense_oracle(case, sm_scale=SM_SCALE))
    harness.assert_padding_is_empty(case, out, lse)
