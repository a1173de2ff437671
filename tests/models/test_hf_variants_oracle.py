"""Each config.json variant this Llama accepts, loaded from a directory as Hugging Face
publishes one, against the float64 numpy reference of tests/models/test_numpy_oracle.py.

The config each dict must read as is written out by hand here (not through from_hf_dict),
so a key read wrongly shows as a config mismatch, and a forward computed wrongly as a
logits mismatch: dense, and paged over a chunked prefill and a decode step.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.batch import build_attention_metadata
from jaxkv.cascade import CascadePlan
from jaxkv.models import (
    LlamaConfig,
    RopeScaling,
    load_hf_safetensors,
    make_dense_forward,
    make_paged_forward,
)
from jaxkv.models.hf_checkpoint import write_safetensors
from tests.models.test_numpy_oracle import BLOCK, BUCKETS, TOL, hf_weights, numpy_llama

SIZES = dict(vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=2)
OURS = dict(vocab_size=48, hidden_size=32, intermediate_size=40, num_layers=2)
LLAMA3 = dict(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
VARIANTS = {
    # Multi-head, head_dim given and unlike hidden_size // heads, untied, eps given.
    "mha-head_dim12-untied": (
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=12,
            rope_theta=300.0,
            rms_norm_eps=1e-3,
        ),
        LlamaConfig(
            **OURS, num_heads=4, num_kv_heads=4, head_dim=12, rope_theta=300.0, rms_norm_eps=1e-3
        ),
    ),
    # One KV head, tied, Llama 3 RoPE under the legacy "type" key, transformers' eps 1e-6.
    "mqa-tied-llama3-type": (
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_scaling={"type": "llama3", **LLAMA3},
        ),
        LlamaConfig(
            **OURS,
            num_heads=4,
            num_kv_heads=1,
            tie_word_embeddings=True,
            rope_scaling=RopeScaling(**LLAMA3),
            rms_norm_eps=1e-6,
        ),
    ),
    # transformers 5.x: theta and scaling in rope_parameters; GQA 2:1, head_dim 16.
    "gqa-rope_parameters": (
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, **LLAMA3},
        ),
        LlamaConfig(
            **OURS,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rope_theta=500.0,
            rope_scaling=RopeScaling(**LLAMA3),
            rms_norm_eps=1e-6,
        ),
    ),
}


@pytest.fixture(params=sorted(VARIANTS))
def loaded(request, tmp_path):
    """(model loaded from a config.json directory, its weights, the config it must have)."""
    hf, want = VARIANTS[request.param]
    w = hf_weights(want, seed=7)
    write_safetensors(tmp_path / "model.safetensors", w)
    (tmp_path / "config.json").write_text(json.dumps({**SIZES, **hf}))
    model = load_hf_safetensors(tmp_path)
    assert model.config == want
    return model, w, want


def test_dense_forward_of_each_variant_equals_numpy_llama(loaded):
    model, w, cfg = loaded
    tokens = np.random.default_rng(8).integers(0, cfg.vocab_size, 24)
    got = np.asarray(make_dense_forward(model)(jnp.asarray(tokens)[None]))[0]
    np.testing.assert_allclose(got, numpy_llama(w, cfg, tokens), **TOL)
    # RoPE matters at these tolerances: unrotated positions give other logits.
    other = dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 4)
    assert not np.allclose(got, numpy_llama(w, other, tokens), **TOL)


def test_paged_prefill_in_chunks_and_decode_of_each_variant_equal_numpy_llama(loaded):
    model, w, cfg = loaded
    seq = np.random.default_rng(9).integers(0, cfg.vocab_size, 14)
    want = numpy_llama(w, cfg, seq)
    table = np.array([[5, 2, 7, 1, 3, 4, 6, 8], [9, 10, 11, 12, 13, 14, 15, 16]], np.int32)
    forward = make_paged_forward(model)
    caches = [c + jnp.nan for c in model.init_kv_caches(17, BLOCK)]  # a read of one: NaN
    for start, end in ((0, 6), (6, 13), (13, 14)):  # chunks across block edges, then decode
        plan = CascadePlan(*[np.zeros(1, np.int32)] * 3, (), 0)  # one request, flat
        md = build_attention_metadata(
            block_table=table,
            plan=plan,
            query_lens=np.array([end - start]),
            num_computed_tokens=np.array([start]),
            block_size=BLOCK,
            buckets=BUCKETS,
        )
        md = dataclasses.replace(md, logits_indices=np.arange(md.max_num_tokens, dtype=np.int32))
        ids = np.zeros(md.max_num_tokens, np.int32)
        ids[: end - start] = seq[start:end]
        logits, caches = forward(ids, md.positions, caches, md)
        np.testing.assert_allclose(np.asarray(logits)[: end - start], want[start:end], **TOL)
