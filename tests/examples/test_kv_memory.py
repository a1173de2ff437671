"""benchmarks/kv_memory.py: the bytes an engine's KV cache takes, and the memory it is
weighed against; examples/demo_cascade.py weighs its flat attention's KV likewise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from benchmarks import attention, kv_memory
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


def test_a_cache_fits_beside_the_weights_up_to_the_devices_memory_and_not_past_it(monkeypatch):
    config = _config(9, 16)
    assert kv_memory.weights_bytes(TINY) == TINY.num_params * 4  # float32
    total = 9 * 16 * 2048 + kv_memory.weights_bytes(TINY)
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: total)
    assert kv_memory.kv_cache_overflow(config, TINY, "--flag") is None
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: total - 1)
    assert kv_memory.kv_cache_overflow(config, TINY, "--flag").endswith("; lower --flag")
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: None)  # unknown: no refusal
    assert kv_memory.kv_cache_overflow(config, TINY, "--flag") is None


class _Device:
    """A jax device of `platform` whose memory_stats returns `stats`, or raises it."""

    def __init__(self, platform: str, stats) -> None:
        self.platform, self._stats = platform, stats

    def memory_stats(self):
        if isinstance(self._stats, Exception):
            raise self._stats
        return self._stats


@pytest.mark.parametrize(
    "stats", [None, {}, NotImplementedError("no statistics"), RuntimeError("no statistics")]
)
def test_an_accelerator_without_memory_statistics_is_weighed_against_nothing(monkeypatch, stats):
    # Its host's memory says nothing of the accelerator's: no refusal rather than one
    # against the wrong memory.
    monkeypatch.setattr(kv_memory.jax, "devices", lambda: [_Device("gpu", stats)])
    assert kv_memory.device_memory_bytes() is None


def test_an_accelerators_memory_is_its_allocators_limit(monkeypatch):
    device = _Device("tpu", {"bytes_limit": 16 << 30, "bytes_in_use": 1 << 30})
    monkeypatch.setattr(kv_memory.jax, "devices", lambda: [device])
    assert kv_memory.device_memory_bytes() == 16 << 30


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's arrays lie in host memory")
def test_on_the_cpu_the_memory_is_the_machines():
    assert kv_memory.device_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES"
    )


def test_flat_attentions_gathered_kv_fits_up_to_the_devices_memory_and_not_past_it(monkeypatch):
    need = 8 * 80 * 1024  # 8 requests of 80 tokens, 1 KiB of K and V a token: 640 KiB
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: need)
    assert kv_memory.gathered_kv_overflow(8, 80, 1024) is None
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: need - 1)
    message = kv_memory.gathered_kv_overflow(8, 80, 1024)
    assert message.startswith("8 requests of 80 tokens: flat attention gathers 640.0 KiB")
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: None)  # unknown: no refusal
    assert kv_memory.gathered_kv_overflow(8, 80, 1024) is None


def test_the_demo_refuses_a_batch_whose_flat_attention_cannot_fit_in_memory():
    # A million requests of 16M tokens each: numpy failed, in a traceback, to allocate
    # their 7 TiB page table.
    argv = ["--batch", "1000000", "--prefix-pages", "1000000"]
    run = subprocess.run(
        [sys.executable, "examples/demo_cascade.py", *argv],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    message = "--suffix-len: 1000000 requests of 16000024 tokens: flat attention gathers"
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]


def test_the_attention_grid_is_refused_before_its_first_point_if_its_largest_cannot_fit(
    tmp_path, monkeypatch, capsys
):
    # The point past the device's memory failed mid-grid, losing the points before it.
    # Its largest: 8 requests of 64 + 16 tokens, at 2 KV heads of 64 float32s: 640 KiB.
    def no_run(*_):
        raise AssertionError("the grid began")

    monkeypatch.setattr(attention, "read_bandwidth", no_run)
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: 512 << 10)
    argv = ["--batch", "2", "8", "--prefix", "16", "64", "--suffix", "3", "16"]
    with pytest.raises(SystemExit):
        attention.main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--batch, --prefix and --suffix: 8 requests of 80 tokens: flat attention" in err
    assert "gathers 640.0 KiB of KV, more than the 512.0 KiB of" in err
