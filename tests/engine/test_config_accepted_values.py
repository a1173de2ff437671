"""Engine configs accept every value their checks name as valid, up to the exact bounds.

CacheConfig takes each listed kv_dtype (a numpy or JAX dtype of one, kept as its name) and
a hash_seed anywhere in signed 64 bits (and nothing past it); EngineConfig takes each
named attention backend and a seed anywhere from -2**63 to 2**64 - 1, and an engine
serves under any max_cascade_groups.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.config import CacheConfig, EngineConfig
from jaxkv.engine import Engine
from tests.engine._util import MAX_SEQS, dense_greedy, engine_config, tiny_model


@pytest.mark.parametrize("kv_dtype", [None, "float32", "bfloat16", "float16"])
def test_every_listed_kv_dtype_is_accepted(kv_dtype):
    assert CacheConfig(kv_dtype=kv_dtype).kv_dtype == kv_dtype


def test_hash_seed_takes_exactly_the_signed_64_bit_range():
    assert CacheConfig(hash_seed=2**63 - 1).hash_seed == 2**63 - 1
    assert CacheConfig(hash_seed=-(2**63)).hash_seed == -(2**63)
    for bad in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match=f"hash_seed={bad} must be an int in"):
            CacheConfig(hash_seed=bad)


def test_engine_seed_takes_signed_and_unsigned_64_bit_seeds_and_nothing_past_them():
    for seed in (-(2**63), 2**64 - 1):
        assert EngineConfig(seed=seed).seed == seed
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match=f"seed={bad} must be an int in"):
            EngineConfig(seed=bad)


@pytest.mark.parametrize("backend", [None, "xla", "pallas_tpu", "pallas_gpu"])
def test_every_named_backend_is_accepted(backend):
    assert EngineConfig(backend=backend).backend == backend


@pytest.mark.parametrize(
    "kv_dtype, name",
    [
        (np.dtype("float16"), "float16"),
        (np.float32, "float32"),
        (jnp.bfloat16, "bfloat16"),
        (np.str_("bfloat16"), "bfloat16"),
    ],
)
def test_a_kv_dtype_given_as_a_dtype_is_stored_as_its_name(kv_dtype, name):
    """np.dtype("float16") used to be kept as given: its config compared equal to the one
    with "float16" but hashed apart (a set held both), while np.float32 and jnp.bfloat16,
    the same dtypes, were refused."""
    config = CacheConfig(kv_dtype=kv_dtype)
    assert type(config.kv_dtype) is str and config.kv_dtype == name
    assert config == CacheConfig(kv_dtype=name) and hash(config) == hash(CacheConfig(kv_dtype=name))


@pytest.mark.parametrize(
    "bad",
    # numpy raises ValueError, not TypeError, for the last one: the message still names kv_dtype.
    ["f2", "float", float, np.float64, np.int8, np.zeros(2), 1, True, [("a", "f4", -1)]],
)
def test_a_kv_dtype_of_another_dtype_or_spelling_is_refused(bad):
    with pytest.raises(ValueError, match="kv_dtype=.* must be None or one of"):
        CacheConfig(kv_dtype=bad)


@pytest.mark.parametrize(
    "bad",
    [np.float16(1.0), np.zeros(2, np.float16), jnp.zeros(2, jnp.bfloat16), jnp.float32(2.0)],
)
def test_a_value_of_a_listed_dtype_is_no_kv_dtype(bad):
    """A numpy scalar and a JAX array were taken for their dtype (np.dtype reads a value's),
    where a numpy array of the same dtype was refused."""
    with pytest.raises(ValueError, match="kv_dtype=.* must be None or one of"):
        CacheConfig(kv_dtype=bad)


def test_an_engine_serves_under_any_max_cascade_groups():
    # A level holds at most max_num_seqs sequences; pad_cascade_levels padded each to
    # 2 * max_cascade_groups (numpy's TypeError "pad_width must be of integral type"
    # past int64, and a step as slow as that many sequences below it).
    config = dataclasses.replace(engine_config(), max_cascade_groups=2**63)
    engine = Engine(tiny_model(), None, config)
    prompts = [[7, 1, 8, 2, 8, 1, 8, 2, 8, i] for i in range(3)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=3), progress=False)
    assert engine.last_step.cascade_levels  # the shared prefix ran as a cascade level
    assert [list(o.output_token_ids) for o in outs] == dense_greedy(prompts, 3)
    assert config.pad_cascade_levels and config.buckets.level_seq_buckets[-1] == MAX_SEQS
