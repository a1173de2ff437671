"""Llama refuses inputs of the wrong rank or mismatched shapes with ValueError naming
them, before any work, and returns float32 logits whatever its parameter dtype; the
entry points that take a model refuse anything else."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxkv.models import Llama, LlamaConfig, make_dense_forward, make_paged_forward
from jaxkv.models.hf_checkpoint import from_hf_tensors, load_hf_safetensors, to_hf_tensors
from jaxkv.models.train import Trainer


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


@pytest.mark.parametrize(
    "tokens, match",
    [
        ([[1, 2]], "tokens must be an integer array, got list"),  # AttributeError: .ndim
        (jnp.array([[1.0, 2.0]]), "tokens of dtype float32 must be an integer array"),
        (jnp.array([[True, False]]), "tokens of dtype bool must be an integer array"),
        # An array's shape without a dtype: a memoryview of int32 ids.
        (memoryview(np.array([[1, 2]], np.int32)), "tokens must be an integer array, got memo"),
    ],
)
def test_dense_forward_refuses_tokens_that_are_not_an_integer_array_by_name(tokens, match):
    with pytest.raises(ValueError, match=match):
        _model().dense_forward(tokens)


def test_a_paged_step_refuses_ids_or_positions_that_are_not_integer_arrays():
    # Float positions went into RoPE as given (a fractional rotation, without a word);
    # float ids failed inside flax's Embed naming nothing, a list on .ndim.
    model = _model()
    caches = model.init_kv_caches(4, 4)
    ids, positions = jnp.zeros(8, jnp.int32), jnp.arange(8, dtype=jnp.int32)
    for given, match in [
        ((ids, positions.astype(jnp.float32)), "positions of dtype float32 must be an integer"),
        ((ids.astype(jnp.float32), positions), "input_ids of dtype float32 must be an integer"),
        ((list(range(8)), positions), "input_ids must be an integer array, got list"),
    ]:
        with pytest.raises(ValueError, match=match):
            model(*given, caches, None)


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


@pytest.mark.parametrize("model", [None, "tiny", nnx.Linear(2, 2, rngs=nnx.Rngs(0))])
def test_entry_points_taking_a_model_refuse_one_that_is_not_a_llama(model):
    # nnx.split took None (or any module) as a model: the forwards were built and failed
    # at their first call, to_hf_tensors(None) returned {}, an empty checkpoint, and
    # Trainer.create raised AttributeError from .config.
    for build in (make_paged_forward, make_dense_forward, to_hf_tensors):
        with pytest.raises(ValueError, match=r"model=\w+ must be a jaxkv.models.Llama"):
            build(model)
    with pytest.raises(ValueError, match=r"model=\w+ must be a jaxkv.models.Llama"):
        Trainer.create(model, optax.sgd(0.1))


@pytest.mark.parametrize(
    "tx",
    [None, "adamw", lambda grads: grads, optax.GradientTransformation(optax.sgd(0.1).init, None)],
)
def test_a_trainer_refuses_a_tx_that_is_not_an_optax_transformation(tx):
    with pytest.raises(ValueError, match=r"tx=\w+ must be an optax.GradientTransformation"):
        Trainer.create(_model(), tx)  # AttributeError from tx.init before


def test_builders_taking_a_config_refuse_a_dict_of_its_fields(tmp_path):
    # Llama raised AttributeError from .dtype, from_hf_tensors "unhashable type: 'dict'",
    # and load_hf_safetensors an AttributeError once it had found the files.
    fields = _model().config.to_dict()
    match = r"config=dict must be a jaxkv.models.LlamaConfig \(LlamaConfig.from_dict reads"
    with pytest.raises(ValueError, match=match):
        Llama(fields, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        from_hf_tensors(fields, {})
    with pytest.raises(ValueError, match=match):
        load_hf_safetensors(tmp_path, fields, dtype="float32")


@pytest.mark.parametrize("path", [None, 5, b"ckpt"])
def test_load_hf_safetensors_refuses_a_path_that_is_not_one_by_name(path):
    # Path(None) raised TypeError; load_checkpoint refuses the same with ValueError.
    with pytest.raises(ValueError, match="path=.* must be a str or os.PathLike"):
        load_hf_safetensors(path)
