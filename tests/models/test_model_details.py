"""Details of the model and its inputs that the end-to-end oracles do not reach, each
checked against values computed here by hand or with numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from jaxkv.models import LlamaConfig, RopeScaling
from jaxkv.models.llama import Llama, RMSNorm, apply_rope, causal_attention, rope_inv_freq
from jaxkv.models.train import Trainer, greedy_generate
from tests.models.conftest import hf_config_dict, random_model, small_config
from tests.models.reference import hf_llama_forward, random_hf_weights

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


def test_hf_llama3_scaling_under_the_older_type_key_is_read():
    # Configs written before transformers renamed the key say "type", not "rope_type".
    scaling = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    hf = hf_config_dict(small_config(), rope_theta=5e5, rope_scaling=scaling)
    assert LlamaConfig.from_hf_dict(hf).rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    # Where both are given they must agree: transformers 4.x reads "type" over "rope_type",
    # 5.x "rope_type" over "type" (tests/models/test_hf_rope_keys.py).
    both = {**scaling, "rope_type": "llama3"}
    assert LlamaConfig.from_hf_dict({**hf, "rope_scaling": both}).rope_scaling is not None
    with pytest.raises(ValueError, match="rope_type='default' and type='llama3'"):
        LlamaConfig.from_hf_dict({**hf, "rope_scaling": {**scaling, "rope_type": "default"}})


def test_hf_dtype_keys_are_read_as_transformers_reads_them():
    # transformers >= 4.56 reads "dtype" first; "torch_dtype" is its fallback.
    hf = hf_config_dict(small_config(), dtype="bfloat16", torch_dtype="float16")
    assert LlamaConfig.from_hf_dict(hf).dtype == "bfloat16"
    # A null "dtype" is not given there, so "torch_dtype" applies (it computed in float32).
    null = hf_config_dict(small_config(), dtype=None, torch_dtype="bfloat16")
    assert LlamaConfig.from_hf_dict(null).dtype == "bfloat16"
    # A dtype this Llama does not run (float64) falls back to float32, the widest it runs.
    wide = hf_config_dict(small_config(), torch_dtype="float64")
    assert LlamaConfig.from_hf_dict(wide).dtype == "float32"


def test_greedy_generate_reads_the_last_prompt_token_of_a_context_shorter_than_the_window():
    # The context sits at the start of the window and padding follows it: the next token is
    # the argmax at the context's last position, not at the window's last (a pad's).
    weights = random_hf_weights(ONE_LAYER, seed=7, std=0.5)
    prompt, seq = [5, 9, 2], [5, 9, 2]
    for _ in range(3):
        logits = hf_llama_forward(weights, ONE_LAYER, np.array(seq))[-1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3, "near-tie: pick another seed"
        seq.append(int(np.argmax(logits)))
    model = random_model(ONE_LAYER, seed=7, std=0.5)
    assert greedy_generate(model, prompt, 3, window=8) == seq[len(prompt) :]


def test_trainer_step_returns_the_loss_before_its_update():
    tokens = np.random.default_rng(8).integers(0, ONE_LAYER.vocab_size, (2, 7)).astype(np.int32)
    trainer = Trainer.create(random_model(ONE_LAYER, seed=8), optax.sgd(0.5))
    before = trainer.eval_loss(tokens)
    assert np.isclose(float(trainer.step(tokens)), before, rtol=1e-6)
    assert trainer.eval_loss(tokens) < before - 1e-3  # the update did move the loss


def test_the_trainer_leaves_the_given_model_and_earlier_snapshots_usable_after_steps():
    """Trainer.step donates the trainer's own buffers: the model given to `create` and a
    model() taken earlier keep their weights (not deleted, not overwritten)."""
    tokens = np.random.default_rng(8).integers(0, ONE_LAYER.vocab_size, (2, 7)).astype(np.int32)
    model = random_model(ONE_LAYER, seed=8)
    want = np.asarray(model.embed_tokens.embedding[...]).copy()
    trainer = Trainer.create(model, optax.sgd(0.5))
    early = trainer.model()
    for _ in range(2):
        trainer.step(tokens)
    for m in (model, early):
        np.testing.assert_array_equal(np.asarray(m.embed_tokens.embedding[...]), want)


def test_bf16_rope_and_attention_return_bf16_as_hugging_face():
    # Hugging Face rotates in the input dtype and casts the float32 softmax to V's dtype
    # before multiplying by V; float32 results here would drift from a bf16 HF run.
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(0, 1, (1, 5, 2, 8)).astype(BF16)) for _ in range(3))
    rotated = apply_rope(q, jnp.arange(5, dtype=jnp.int32)[None], rope_inv_freq(ONE_LAYER))
    assert rotated.dtype == jnp.bfloat16
    out = causal_attention(q, k, v, 8**-0.5)
    assert out.dtype == jnp.bfloat16
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q64, k64) * 8**-0.5
    scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(BF16).astype(np.float64)
    want = np.einsum("bhqk,bkhd->bqhd", probs, v64)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-2, atol=1e-2)


def test_weights_are_initialised_with_hugging_faces_std_of_0_02():
    model = Llama(small_config(num_layers=1), rngs=nnx.Rngs(0))
    kernel = np.asarray(model.layers[0].mlp.gate_proj.kernel[...], np.float64)
    assert abs(kernel.std() - 0.02) < 0.002
    assert abs(np.asarray(model.embed_tokens.embedding[...], np.float64).std() - 0.02) < 0.002


def test_a_trainer_step_donates_the_trainers_previous_weights_and_optimizer_state():
    tokens = np.zeros((1, 3), np.int32)
    trainer = Trainer.create(random_model(ONE_LAYER, seed=8), optax.adam(0.1))
    params = jax.tree.leaves(trainer.params)
    state = [x for x in jax.tree.leaves(trainer.opt_state) if x.ndim > 0]  # Adam's mu, nu
    trainer.step(tokens)
    assert all(x.is_deleted() for x in params) and all(x.is_deleted() for x in state)
    assert not any(x.is_deleted() for x in jax.tree.leaves(trainer.params))
