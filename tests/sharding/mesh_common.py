"""What the device-mesh checks share: the check registry, the model, the sizes.

Imported by tests/sharding/mesh_checks.py after it has set XLA_FLAGS (8 CPU host
devices); see there for how the checks run.
"""

from __future__ import annotations

import functools

import jax

from jaxkv.cascade import CascadeCostModel
from jaxkv.models import Llama, LlamaConfig

TP_SIZES = (1, 2, 4, 8)
ALWAYS = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0.0)
BLOCK_SIZE = 4
NUM_BLOCKS = 37  # prime: a collective over a cache-shaped array is easy to spot in HLO
CHECKS: dict[str, object] = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def model_config(num_kv_heads: int = 8, **overrides) -> LlamaConfig:
    """1 layer, 8 query heads of dim 8, `num_kv_heads` KV heads: tiny, TP 8 divides all."""
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=8,
        num_kv_heads=num_kv_heads, head_dim=8, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaConfig(**{**base, **overrides})


@functools.cache
def model(num_kv_heads: int = 8) -> Llama:
    """Random weights with std 0.2: decisive logits, so greedy ties cannot flip a token."""
    from jaxkv.models import from_hf_tensors
    from tests.models.reference import random_hf_weights

    cfg = model_config(num_kv_heads)
    return from_hf_tensors(cfg, random_hf_weights(cfg, seed=0, std=0.2))


def shard_shapes(x: jax.Array) -> list[tuple[int, ...]]:
    return [tuple(s.data.shape) for s in x.addressable_shards]
