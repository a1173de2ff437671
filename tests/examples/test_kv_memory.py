"""benchmarks/kv_memory.py: the bytes an engine's KV cache takes, and the memory it is
weighed against; examples/demo_cascade.py weighs its flat attention's KV likewise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_the_demo_refuses_a_batch_whose_flat_attention_cannot_fit_in_memory():
    # A million requests of 16M tokens each: numpy failed, in a traceback, to allocate
    # their 7 TiB page table.
    argv = ["--batch", "1000000", "--prefix-pages", "1000000"]
    run = subprocess.run(
        [sys.executable, "examples/demo_cascade.py", *argv],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    message = "--batch 1000000 requests of 16000024 tokens: flat attention gathers"
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
