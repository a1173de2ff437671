"""model_fingerprint is 16 bytes, and sub-byte float weights count by their exact value
(a fraction lost in widening would make 0.5 and 0 collide)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.model_fingerprint import model_fingerprint

CONFIG = {"hidden_size": 8}


def test_the_fingerprint_is_16_bytes():
    fp = model_fingerprint(CONFIG, [jnp.arange(6, dtype=jnp.float32)])
    assert isinstance(fp, bytes) and len(fp) == 16


def test_float4_weights_that_differ_by_a_fraction_give_different_fingerprints():
    base = jnp.array([[0.5, 1.0, -1.5]], jnp.float4_e2m1fn)
    fp = model_fingerprint(CONFIG, [base])
    assert model_fingerprint(CONFIG, [jnp.array([[0.5, 1.0, -1.5]], jnp.float4_e2m1fn)]) == fp
    for other in ([[0.0, 1.0, -1.5]], [[0.5, 1.0, -1.0]], [[-0.5, 1.0, -1.5]]):
        assert model_fingerprint(CONFIG, [jnp.array(other, jnp.float4_e2m1fn)]) != fp, other


def test_the_fingerprint_of_a_fixed_model_is_pinned():
    """Pins the checksum and digest layout: a change must be deliberate, as it makes
    KV saved under the old fingerprints unmatched."""
    weights = [jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.array([3, -1], jnp.int8)]
    assert model_fingerprint(CONFIG, weights).hex() == "10f3b1ed786a6efc80320e06094468c8"


def test_64_bit_weights_that_differ_only_in_their_high_word_differ():
    with jax.enable_x64(True):
        low = jnp.array([1, 2], jnp.int64)
        high = jnp.array([1, 2 + 2**40], jnp.int64)
        assert model_fingerprint(CONFIG, [low]) != model_fingerprint(CONFIG, [high])
