"""Inputs the model side used to misread: Hugging Face configs of other models or newer
transformers, forwards that followed later weight updates, non-integer token ids."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.models import ByteTokenizer, LlamaConfig, RopeScaling, make_dense_forward
from jaxkv.models.train import _greedy_next_token, greedy_generate
from tests.models.conftest import random_model, small_config
from tests.models.reference import hf_llama_forward, random_hf_weights
from tests.models.test_train import _example

REQUIRED = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)
LLAMA3 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)


def llama3(original_max) -> dict:
    return {"rope_type": "llama3", **LLAMA3, "original_max_position_embeddings": original_max}


LLAMA3_SCALING = RopeScaling(32.0, 1.0, 4.0, 8192)


def test_rope_parameters_of_newer_transformers_configs_are_read():
    # They carry rope_theta and the llama3 scaling; both used to be dropped (theta 1e4,
    # no scaling): a different model, loaded without complaint.
    cfg = LlamaConfig.from_hf_dict(
        {**REQUIRED, "rope_parameters": {**llama3(8192), "rope_theta": 500000.0}}
    )
    assert (cfg.rope_theta, cfg.rope_scaling) == (500000.0, LLAMA3_SCALING)
    plain = LlamaConfig.from_hf_dict(
        {**REQUIRED, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    )
    assert (plain.rope_theta, plain.rope_scaling) == (5e5, None)
    agreeing = {**REQUIRED, "rope_theta": 5e5, "rope_parameters": {"rope_theta": 5e5}}
    assert LlamaConfig.from_hf_dict(agreeing).rope_theta == 5e5
    # rope_parameters without a rope_theta keep the top-level one.
    kept = {**REQUIRED, "rope_theta": 5e5, "rope_parameters": llama3(8192)}
    cfg = LlamaConfig.from_hf_dict(kept)
    assert (cfg.rope_theta, cfg.rope_scaling) == (5e5, LLAMA3_SCALING)
    for disagreeing in (
        {"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}},
        {
            "rope_scaling": llama3(4096),
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        },
    ):
        with pytest.raises(ValueError, match="disagree"):
            LlamaConfig.from_hf_dict({**REQUIRED, **disagreeing})


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"model_type": "mistral", "sliding_window": 4096}, "model_type='mistral'"),
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"num_key_value_heads": 0}, "num_key_value_heads=0"),  # used to become full MHA
        # A positive int, but odd: refused as RoPE's pairs need, not as a non-positive one.
        ({"head_dim": 1}, "head_dim=1 must be positive and even"),
        (
            {"rope_scaling": llama3(8192.9)},
            "original_max_position_embeddings=8192.9",  # used to be truncated to 8192
        ),
    ],
)
def test_configs_this_llama_cannot_run_are_refused(extra, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_dict({**REQUIRED, **extra})


def test_what_this_llama_runs_is_still_accepted():
    fine = {
        "model_type": "llama", "sliding_window": None, "attention_bias": False,
        "mlp_bias": False, "num_key_value_heads": 2,
        "rope_scaling": llama3(8192.0),
    }  # fmt: skip
    cfg = LlamaConfig.from_hf_dict({**REQUIRED, **fine})
    assert cfg.num_kv_heads == 2 and cfg.rope_scaling == LLAMA3_SCALING


def test_a_forward_keeps_the_weights_it_was_made_with():
    model, other = random_model(small_config(), seed=1), random_model(small_config(), seed=2)
    forward = make_dense_forward(model)
    tokens = jnp.arange(6)[None]
    before = np.asarray(forward(tokens))
    nnx.update(model, nnx.state(other))  # the model changes; the snapshot must not
    np.testing.assert_array_equal(np.asarray(forward(tokens)), before)
    assert not np.allclose(np.asarray(make_dense_forward(model)(tokens)), before)


@pytest.mark.parametrize("bad", [[72.5], np.array([72.0, 105.0]), ["72"], [True], [np.True_]])
def test_decode_refuses_ids_that_are_not_integers(bad):
    with pytest.raises(ValueError, match="integer token ids"):
        ByteTokenizer().decode(bad)
    assert ByteTokenizer().decode([np.int64(72), 105, 300, -1]) == "Hi"  # others dropped


def test_greedy_generate_refuses_a_pad_or_prompt_id_outside_the_vocabulary():
    # An id past the embedding table embeds as NaN, and NaN * 0 is NaN: every token
    # generated was 0, whatever the prompt.
    model = random_model(small_config())  # vocabulary 64
    for kwargs, match in [({"pad_id": 64}, "pad_id=64"), ({"pad_id": -1}, "pad_id=-1")]:
        with pytest.raises(ValueError, match=match):
            greedy_generate(model, [3, 4], 2, window=8, **kwargs)
    for prompt in ([3, 64], [-1, 3]):  # past the table, or below it
        with pytest.raises(ValueError, match="prompt ids must lie in"):
            greedy_generate(model, prompt, 2, window=8)
    assert greedy_generate(model, np.array([3, 4]), 0, window=8) == []  # numpy ids are ints
    with pytest.raises(ValueError, match="byte tokenizer's 259 ids"):
        _example().tiny_config(["vocab_size=200"])


@pytest.mark.parametrize(
    "prompt, num_new_tokens, window, match",
    [
        ([3.7, 4], 2, 8, "prompt must hold int token ids"),  # was cut to 3 in the buffer
        ([True, 4], 2, 8, "prompt must hold int token ids"),
        ([3, 4], -1, 8, "num_new_tokens=-1 must be an int >= 0"),  # returned [] quietly
        ([3, 4], 2.0, 8, "num_new_tokens=2.0 must be an int"),
        ([3, 4], 2, 0, "window=0 must be an int >= 1"),  # a numpy shape error, later
        ([3, 4], 2, True, "window=True must be an int >= 1"),
        # None and an int raised a bare TypeError from len(); a set or a dict was taken,
        # in no set order.
        (None, 2, 8, "prompt=NoneType must be a sequence or 1-D array of token ids"),
        (5, 2, 8, "prompt=int must be a sequence"),
        ({3, 4}, 2, 8, "prompt=set must be a sequence"),
        ({3: 4}, 2, 8, "prompt=dict must be a sequence"),
        (np.array([[3, 4]]), 2, 8, "prompt=ndarray must be a sequence or 1-D array"),
    ],
)
def test_greedy_generate_refuses_arguments_it_cannot_honour_by_name(
    prompt, num_new_tokens, window, match
):
    model = random_model(small_config())
    with pytest.raises(ValueError, match=match):
        greedy_generate(model, prompt, num_new_tokens, window=window)


@pytest.mark.parametrize("model", [None, "tiny", small_config()])
def test_greedy_generate_refuses_a_model_that_is_not_a_llama(model):
    with pytest.raises(ValueError, match=r"model=\w+ must be a jaxkv.models.Llama"):
        greedy_generate(model, [3, 4], 2)  # AttributeError from .config before


def test_greedy_generate_takes_the_least_prompts_windows_and_vocabularies():
    # Id 0, a prompt of one id, a window of one token (each step sees only the last one),
    # and a vocabulary of one id, whose only id is the default pad.
    cfg = small_config(num_layers=1)
    weights = random_hf_weights(cfg, seed=4, std=0.5)
    model = random_model(cfg, seed=4, std=0.5)
    for prompt in ([0], [7], [0, 0, 5]):
        seq = list(prompt)
        for _ in range(3):
            seq.append(int(np.argmax(hf_llama_forward(weights, cfg, np.array(seq[-1:]))[-1])))
        assert greedy_generate(model, prompt, 3, window=1) == seq[len(prompt) :]
    one = small_config(num_layers=1, vocab_size=1)
    assert greedy_generate(random_model(one), [0, 0], 2, window=4) == [0, 0]


def test_greedy_generates_window_defaults_to_256_tokens():
    # A call naming window=256 runs the program the default compiled (one per window).
    model = random_model(small_config(num_layers=1, vocab_size=40))
    greedy_generate(model, [1, 2], 1)
    compiled = _greedy_next_token(nnx.split(model)[0])._cache_size()
    greedy_generate(model, [3], 1, window=256)
    assert _greedy_next_token(nnx.split(model)[0])._cache_size() == compiled
