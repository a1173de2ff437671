"""The paged KV caches of a model: layout and dtype, donation to a step, quantized writes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import write_kv
from tests.models.conftest import random_model, small_config
from tests.models.test_paged import CONFIG, MODEL, PagedRun, _sequences, _shuffled_table


def test_init_kv_caches_layout_and_dtype():
    caches = MODEL.init_kv_caches(5, 4)
    shape = (5, 4, 2 * CONFIG.num_kv_heads, CONFIG.head_dim)
    assert len(caches) == CONFIG.num_layers
    assert all(c.shape == shape and c.dtype == jnp.float32 and not c.any() for c in caches)
    # A cache dtype other than the model's (EngineConfig's CacheConfig.kv_dtype).
    assert {c.dtype for c in MODEL.init_kv_caches(5, 4, "bfloat16")} == {jnp.dtype("bfloat16")}


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1, 4), "num_blocks=-1 must be an int >= 1"),  # a TypeError from jax
        ((2.0, 4), "num_blocks=2.0 must be an int >= 1"),  # a TypeError from jax
        ((0, 4), "num_blocks=0 must be an int >= 1"),  # an empty cache: every write dropped
        ((4, 0), "block_size=0 must be an int >= 1"),
        ((4, True), "block_size=True must be an int >= 1"),
        ((4, 4, "floot"), "dtype='floot' must be None, float32, bfloat16"),  # a TypeError
        ((4, 4, "int32"), "dtype='int32' must be None"),  # refused only at the first write
        # values of a cache dtype, taken for their dtype (jnp.dtype reads a value's)
        ((4, 4, np.float16(1.0)), r"dtype=np.float16\(1.0\) must be None, float32"),
        ((4, 4, jnp.zeros(2, jnp.bfloat16)), "dtype=Array.* must be None, float32"),
    ],
)
def test_init_kv_caches_refuses_sizes_and_dtypes_it_cannot_build_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        MODEL.init_kv_caches(*args)
    assert MODEL.init_kv_caches(1, 1, "float16")[0].dtype == jnp.float16


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", jnp.int8, jnp.float8_e4m3fn])
def test_init_kv_caches_refuses_a_quantized_dtype_the_forward_cannot_write(dtype):
    # The kernels read int8 and float8 caches, but only given k_scale and v_scale, which
    # Llama's forward does not pass: such caches were made, and the first step failed
    # while tracing, naming kv_pages rather than this argument.
    with pytest.raises(
        ValueError,
        match=rf"^dtype={dtype!r} must be None, float32, bfloat16 or float16 \(the "
        r"cache dtypes Llama's forward writes: a quantized cache needs k_scale and v_scale",
    ):
        MODEL.init_kv_caches(1, 1, dtype)


def test_a_paged_step_donates_the_caches_it_is_given():
    run = PagedRun(_shuffled_table(1))
    given = run.caches
    (logits,) = run.step([(0, _sequences([3])[0], 0)])
    assert np.isfinite(logits).all()
    # Donated: updated in place, not copied (a copy would hold the KV cache twice).
    assert all(c.is_deleted() for c in given)
    assert not any(c.is_deleted() for c in run.caches)


def test_quantized_writes_round_to_the_nearest_step():
    kv = jnp.zeros((2, 2, 2, 4), jnp.int8)
    k = jnp.array([[[0.037, -0.037, 1.234, 0.5]]])  # [1 token, 1 KV head, head_dim 4]
    out = write_kv(kv, k, -k, jnp.array([3], jnp.int32), k_scale=0.01, v_scale=0.02)
    assert np.asarray(out)[1, 1].tolist() == [[4, -4, 123, 50], [-2, 2, -62, -25]]


def test_a_slot_mapping_of_another_length_is_refused():
    kv = jnp.zeros((2, 2, 2, 4))
    k = jnp.ones((3, 1, 4))
    with pytest.raises(ValueError, match=r"slot_mapping.shape=\(1,\) must be \(3,\)"):
        write_kv(kv, k, k, jnp.array([3], jnp.int32))


def test_a_one_layer_model_gets_one_cache():
    caches = random_model(small_config(num_layers=1)).init_kv_caches(3, 2)
    assert [c.shape for c in caches] == [(3, 2, 2 * CONFIG.num_kv_heads, CONFIG.head_dim)]
