"""Llama refuses inputs of the wrong rank or mismatched shapes with ValueError naming
them, before any work, and returns float32 logits whatever its parameter dtype."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxkv.models import Llama, LlamaConfig


def _model(dtype: str = "float32", tie: bool = False) -> Llama:
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1, max_position_embeddings=16, tie_word_embeddings=tie, dtype=dtype,
    )  # fmt: skip
    return Llama(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("shape", [(4,), (1, 2, 3)])
def test_dense_forward_refuses_tokens_that_are_not_batch_by_length(shape):
    match = re.escape(f"tokens.shape={shape!r} must be [batch, length]")
    with pytest.raises(ValueError, match=match):
        _model().dense_forward(jnp.zeros(shape, jnp.int32))


def test_a_paged_step_refuses_positions_of_another_shape_than_the_input_ids():
    model = _model()
    caches = model.init_kv_caches(4, 4)
    with pytest.raises(ValueError, match="must be equal and 1-D"):
        model(jnp.zeros(8, jnp.int32), jnp.zeros(4, jnp.int32), caches, None)
    with pytest.raises(ValueError, match="must be equal and 1-D"):
        model(jnp.zeros(8, jnp.int32), jnp.zeros((8, 1), jnp.int32), caches, None)


@pytest.mark.parametrize("tie", [False, True])
def test_a_bfloat16_model_returns_float32_logits(tie):
    logits = _model("bfloat16", tie).dense_forward(jnp.array([[1, 2, 3]], jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (1, 3, 32)
