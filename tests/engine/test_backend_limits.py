"""An Engine whose backend cannot take its cache's block size or KV dtype is refused when
it is built, by the config field's name (the kernel's own message named only its
page_size and kv_pages.dtype), before it allocates its KV cache."""

from __future__ import annotations

import functools

import pytest
from flax import nnx

from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxkv.engine import Engine
from jaxkv.models import Llama, LlamaConfig


@functools.cache
def _head_dim_64_model() -> Llama:  # the TPU kernel takes head_dim 64, 128 or 256 only
    config = LlamaConfig.preset(
        "tiny", vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=1,
        num_heads=2, num_kv_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    return Llama(config, rngs=nnx.Rngs(0))


def _config(block_size: int, kv_dtype: str | None = None) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(num_blocks=80, block_size=block_size, kv_dtype=kv_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64),
        backend="pallas_tpu",
        interpret=True,
    )


@pytest.mark.parametrize(
    "block_size, kv_dtype, match",
    [
        (8, None, r"cache\.block_size=8.*\(page_size\) must be in \[16, 256\]"),
        (16, "float16", r"cache\.kv_dtype='float16'.*kv_pages\.dtype=dtype\('float16'\)"),
    ],
)
def test_a_block_size_or_kv_dtype_the_backend_cannot_take_is_named(block_size, kv_dtype, match):
    with pytest.raises(ValueError, match=rf"backend='pallas_tpu' cannot serve .*{match}"):
        Engine(_head_dim_64_model(), None, _config(block_size, kv_dtype))


def test_a_block_size_the_backend_takes_builds():
    assert Engine(_head_dim_64_model(), None, _config(16)).backend == "pallas_tpu"
