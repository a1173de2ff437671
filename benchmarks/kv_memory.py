"""Whether what a script allocates (a KV cache, a model to train) fits its device, asked
before anything is allocated.

An Engine allocates all of its KV blocks up front. Sized by flags past the device's
memory, that allocation failed only after the model was built, or on the CPU took the
machine's memory from everything else first.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxkv import EngineConfig
from jaxkv.models import LlamaConfig


def device_memory_bytes() -> int | None:
    """The memory of JAX's default device: its allocator's limit where JAX reports one
    (GPU, TPU), the machine's physical memory on the CPU (its arrays lie there); None
    when neither is known."""
    device = jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except (RuntimeError, NotImplementedError):  # a backend that keeps no statistics
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform != "cpu":  # the host's memory says nothing of an accelerator's
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf, or no such name here
        return None


def kv_cache_bytes(config: EngineConfig, model: LlamaConfig) -> int:
    """Bytes of the KV caches an Engine with `config` allocates for a model of config
    `model`: every block of every layer, the null block too."""
    itemsize = jnp.dtype(config.cache.kv_dtype or model.dtype).itemsize
    per_token = model.kv_cache_bytes_per_token(itemsize)
    return config.cache.num_blocks * config.cache.block_size * per_token


def gathered_kv_overflow(batch: int, context: int, kv_bytes_per_token: int) -> str | None:
    """None if the KV of `batch` requests of `context` tokens each (`kv_bytes_per_token`
    bytes a token) fits the default device's memory (an unknown memory is taken to fit),
    else a message saying how much it needs. Flat attention on the xla backend, and the
    reference, gather every request's pages at once: this much, at the least."""
    need, have = batch * context * kv_bytes_per_token, device_memory_bytes()
    if have is None or need <= have:
        return None
    return (
        f"{batch} requests of {context} tokens: flat attention gathers {_size(need)} of KV, "
        f"more than the {_size(have)} of {jax.devices()[0].platform}"
    )


def weights_bytes(model: LlamaConfig) -> int:
    """Bytes of the weights of a Llama of config `model`, in its dtype."""
    return model.num_params * jnp.dtype(model.dtype).itemsize


def training_overflow(model: LlamaConfig, batch_size: int, seq_len: int) -> str | None:
    """None if a Llama of config `model` can train on batches of `batch_size` windows of
    `seq_len` tokens on the default device (an unknown memory is taken to fit), else a
    message saying how much it needs, at the least: its weights, their gradients and
    Adam's two moments, each as large as the weights, and one batch's logits."""
    itemsize = jnp.dtype(model.dtype).itemsize
    state = 4 * weights_bytes(model)
    logits = batch_size * seq_len * model.vocab_size * itemsize
    have = device_memory_bytes()
    if have is None or state + logits <= have:
        return None
    return (
        f"the model's {model.num_params:,} parameters need {_size(state)} with their "
        f"gradients and Adam's two moments, and a batch's logits {_size(logits)}: more "
        f"than the {_size(have)} of {jax.devices()[0].platform}"
    )


def kv_cache_overflow(config: EngineConfig, model: LlamaConfig, flags: str) -> str | None:
    """None if the KV caches of `config` for `model`, beside the model's weights, fit the
    default device's memory (device_memory_bytes; an unknown memory is taken to fit),
    else a message saying how much they need and naming `flags`, the flags that size
    the caches."""
    kv, weights, have = kv_cache_bytes(config, model), weights_bytes(model), device_memory_bytes()
    if have is None or kv + weights <= have:
        return None
    return (
        f"the KV cache, {config.cache.num_blocks} blocks of {config.cache.block_size} tokens, "
        f"needs {_size(kv)}, and the weights {_size(weights)}: more than the {_size(have)} "
        f"of {jax.devices()[0].platform}; lower {flags}"
    )


def _size(num_bytes: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):,.1f} {unit}"
    return f"{num_bytes} bytes"
