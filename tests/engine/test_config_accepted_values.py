"""Engine configs accept every value their checks name as valid, up to the exact bounds.

CacheConfig takes each listed kv_dtype and a hash_seed anywhere in signed 64 bits (and
nothing past it); EngineConfig takes each named attention backend.
"""

from __future__ import annotations

import pytest

from jaxkv.config import CacheConfig, EngineConfig


@pytest.mark.parametrize("kv_dtype", [None, "float32", "bfloat16", "float16"])
def test_every_listed_kv_dtype_is_accepted(kv_dtype):
    assert CacheConfig(kv_dtype=kv_dtype).kv_dtype == kv_dtype


def test_hash_seed_takes_exactly_the_signed_64_bit_range():
    assert CacheConfig(hash_seed=2**63 - 1).hash_seed == 2**63 - 1
    assert CacheConfig(hash_seed=-(2**63)).hash_seed == -(2**63)
    for bad in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match=f"hash_seed={bad} must be an int in"):
            CacheConfig(hash_seed=bad)


@pytest.mark.parametrize("backend", [None, "xla", "pallas_tpu", "pallas_gpu"])
def test_every_named_backend_is_accepted(backend):
    assert EngineConfig(backend=backend).backend == backend
