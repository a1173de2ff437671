"""benchmarks/kv_memory.py: the bytes an engine's KV cache takes, and the memory it is
weighed against."""

from __future__ import annotations

import os

import jax
import pytest

from benchmarks import kv_memory
from jaxkv import CacheConfig, EngineConfig, SchedulerConfig
from jaxkv.models import LlamaConfig

TINY = LlamaConfig.preset("tiny")  # float32, 2 KiB of K and V a token over its layers


def _config(num_blocks: int, block_size: int, kv_dtype: str | None = None) -> EngineConfig:
    cache = CacheConfig(num_blocks=num_blocks, block_size=block_size, kv_dtype=kv_dtype)
    return EngineConfig(cache=cache, scheduler=SchedulerConfig(max_model_len=16))


def test_the_cache_counts_every_block_at_the_kv_dtypes_size():
    assert TINY.kv_cache_bytes_per_token(4) == 2048
    assert kv_memory.kv_cache_bytes(_config(9, 16), TINY) == 9 * 16 * 2048  # the null block too
    assert kv_memory.kv_cache_bytes(_config(9, 16, "bfloat16"), TINY) == 9 * 16 * 1024


def test_a_cache_fits_up_to_the_devices_memory_and_not_past_it(monkeypatch):
    config = _config(9, 16)
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: 9 * 16 * 2048)
    assert kv_memory.kv_cache_overflow(config, TINY, "--flag") is None
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: 9 * 16 * 2048 - 1)
    assert kv_memory.kv_cache_overflow(config, TINY, "--flag").endswith(": lower --flag")
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: None)  # unknown: no refusal
    assert kv_memory.kv_cache_overflow(config, TINY, "--flag") is None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's arrays lie in host memory")
def test_on_the_cpu_the_memory_is_the_machines():
    assert kv_memory.device_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES"
    )
