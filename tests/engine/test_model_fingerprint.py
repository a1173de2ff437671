"""model_fingerprint names a model's config and weights' bits, wherever the weights live."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.model_fingerprint import FINGERPRINT_NUM_BYTES, model_fingerprint

CONFIG = {"hidden_size": 8, "rope_theta": 10000.0}


def _weights():
    rng = np.random.default_rng(0)
    return [
        jnp.asarray(rng.standard_normal((6, 8)), jnp.float32),
        jnp.asarray(rng.standard_normal((5, 3)), jnp.bfloat16),
        jnp.asarray(rng.integers(-128, 128, 7), jnp.int8),
        jnp.asarray([True, False, True]),
    ]


def test_equal_bits_in_other_arrays_give_the_same_fingerprint():
    weights = _weights()
    fp = model_fingerprint(CONFIG, weights)
    assert len(fp) == FINGERPRINT_NUM_BYTES
    copies = [jnp.array(np.asarray(w)) for w in weights]
    assert all(c is not w for c, w in zip(copies, weights, strict=True))
    assert model_fingerprint(dict(reversed(CONFIG.items())), copies) == fp
    host = [np.asarray(w) for w in weights]  # numpy weights are read as jax would run them
    assert model_fingerprint(CONFIG, host) == fp


def test_a_64_bit_numpy_weight_counts_as_its_32_bit_conversion():
    # As documented: without jax_enable_x64 the digest names float32 / int32, as jax runs it.
    assert not jax.config.jax_enable_x64
    rng = np.random.default_rng(1)
    host = [rng.standard_normal((3, 4)), rng.integers(-(2**20), 2**20, 5)]
    assert [w.dtype for w in host] == [np.float64, np.int64]
    converted = [jnp.asarray(w) for w in host]
    assert model_fingerprint(CONFIG, host) == model_fingerprint(CONFIG, converted)


def test_the_four_checksums_of_a_weight_are_distinct_lanes():
    # Each lane mixes the words under its own salt; lanes sharing one salt would all be
    # equal, leaving 32 bits of the promised 128 against a collision.
    from jaxkv.model_fingerprint import _checksums

    for w in _weights():
        sums = np.asarray(_checksums(w))
        assert sums.shape == (4,) and len(set(sums.tolist())) == 4, sums


def _changed(weights, i, change):
    out = list(weights)
    out[i] = change(weights[i])
    return out


@pytest.mark.parametrize(
    "change",
    [
        lambda w: _changed(w, 0, lambda x: x.at[2, 5].set(jnp.nextafter(x[2, 5], jnp.inf))),
        lambda w: _changed(w, 1, lambda x: x.at[4, 2].set(-x[4, 2])),  # a bf16 sign bit
        lambda w: _changed(w, 0, lambda x: x.at[jnp.array([0, 1])].set(x[jnp.array([1, 0])])),
        # x[0, 1] and x[1, 0] swapped: a position index that ignored the row stride
        # (row + column) would give both the same index.
        lambda w: _changed(w, 0, lambda x: x.at[0, 1].set(x[1, 0]).at[1, 0].set(x[0, 1])),
        lambda w: _changed(w, 2, lambda x: x.at[6].add(1)),
        lambda w: _changed(w, 3, lambda x: ~x),
        lambda w: _changed(w, 0, lambda x: x.reshape(8, 6)),  # same bits, other shape
        lambda w: _changed(w, 1, lambda x: x.astype(jnp.float16)),
        # Same bits, other dtype: only the dtype in the digest tells them apart.
        lambda w: _changed(w, 2, lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8)),
        lambda w: _changed(w, 0, lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)),
        lambda w: [w[1], w[0], *w[2:]],  # weights in another order
        lambda w: w[:-1],
    ],
    ids=[
        "ulp",
        "bf16-sign",
        "swap-rows",
        "swap-transposed",
        "int8",
        "bool",
        "shape",
        "dtype",
        "bits-as-uint8",
        "bits-as-int32",
        "order",
        "fewer",
    ],
)
def test_any_change_of_a_weight_changes_the_fingerprint(change):
    weights = _weights()
    assert model_fingerprint(CONFIG, change(weights)) != model_fingerprint(CONFIG, weights)


def test_keys_and_sub_byte_weights_are_read_by_value():
    """A model's state may hold PRNG keys (a Dropout's) and int4 weights: each value counts."""
    extra = [jax.random.key(0), jnp.array([[1, -2, 7]], jnp.int4), jnp.array([3, 15], jnp.uint4)]
    fp = model_fingerprint(CONFIG, extra)
    assert model_fingerprint(CONFIG, [jax.random.key(0), *extra[1:]]) == fp
    for i, other in enumerate(
        [jax.random.key(1), jnp.array([[1, -2, 6]], jnp.int4), jnp.array([3, 14], jnp.uint4)]
    ):
        changed = list(extra)
        changed[i] = other
        assert model_fingerprint(CONFIG, changed) != fp, i


def test_a_config_field_changes_the_fingerprint():
    weights = _weights()
    other = {**CONFIG, "rope_theta": 500000.0}
    assert model_fingerprint(other, weights) != model_fingerprint(CONFIG, weights)


def test_many_single_element_changes_give_distinct_fingerprints():
    """Each element of a weight, bumped by one ulp in turn: all 48 differ from each other
    and from the original (a checksum that ignores position or bits would repeat)."""
    weights = _weights()
    x = weights[0]
    seen = {model_fingerprint(CONFIG, weights)}
    for i in range(x.size):
        bumped = x.ravel().at[i].set(jnp.nextafter(x.ravel()[i], jnp.inf)).reshape(x.shape)
        seen.add(model_fingerprint(CONFIG, [bumped, *weights[1:]]))
    assert len(seen) == x.size + 1


@pytest.mark.parametrize("bad", [3, "w", jnp.ones(2, jnp.complex64), None])
def test_a_weight_that_is_not_a_real_array_is_refused_by_position(bad):
    with pytest.raises(ValueError, match=r"weights\[1\] must be an array of bool, int, float or"):
        model_fingerprint(CONFIG, [_weights()[0], bad])


def test_an_engines_fingerprint_leaves_out_eos_but_not_the_weights():
    # EOS changes no KV: KV a connector stored under one EOS stays valid under another,
    # so binding an engine that differs only there must not empty the store.
    import dataclasses

    from flax import nnx

    from jaxkv.engine import Engine
    from jaxkv.models import Llama
    from tests.engine._util import engine_config, tiny_model

    def fingerprint(cfg, seed=0) -> bytes:
        engine = Engine(Llama(cfg, rngs=nnx.Rngs(seed)), None, engine_config())
        return engine.copier.model_fingerprint

    config = tiny_model().config
    plain = fingerprint(config)
    assert fingerprint(dataclasses.replace(config, eos_token_ids=(3,))) == plain
    assert fingerprint(config, seed=1) != plain
