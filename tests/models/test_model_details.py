"""Details of the model and its inputs that the end-to-end oracles do not reach, each
checked against values computed here by hand or with numpy."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxkv.models.llama import RMSNorm
from tests.models.conftest import small_config

BF16 = ml_dtypes.bfloat16
ONE_LAYER = small_config(num_layers=1)


def test_bf16_rmsnorm_rounds_the_normalised_input_before_the_weight_as_hugging_face():
    # LlamaRMSNorm returns weight * x_normalised.to(input_dtype): two bf16 roundings, the
    # normalised activations and then the product. Rounding the float32 product once gives
    # other bf16 values, so a bf16 model would not reproduce a bf16 Hugging Face run.
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (64, 32)).astype(BF16)
    w = rng.uniform(0.5, 1.5, 32).astype(BF16)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5)
    want = (w.astype(np.float64) * normed.astype(BF16).astype(np.float64)).astype(BF16)
    rounded_once = (w.astype(np.float64) * normed).astype(BF16)
    assert (want != rounded_once).sum() > 10  # the two orders differ on this input
    norm = RMSNorm(32, eps=1e-5, dtype=jnp.bfloat16)
    norm.weight[...] = jnp.asarray(w)
    got = np.asarray(norm(jnp.asarray(x)))
    assert got.dtype == BF16
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
