"""What the device-mesh checks share: the check registry, the model, the sizes, batches.

Imported by tests/sharding/mesh_checks.py after it has set XLA_FLAGS (8 CPU host
devices); see there for how the checks run.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlanner
from jaxkv.models import Llama, LlamaConfig
from tests.attention import workload

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


BUCKETS = BucketConfig(
    max_num_tokens=64, max_num_seqs=8, max_pages_per_seq=16,
    min_num_tokens=64, min_num_seqs=8, min_pages_per_seq=16, max_cascade_groups=2,
)  # fmt: skip


def planned_step(seed: int, *, cascade: bool, num_kv_heads: int = 8, block_size: int = BLOCK_SIZE):
    """(step, metadata) of a random scheduled batch; cascade planned whenever possible."""
    for s in range(seed, seed + 50):
        step = workload.random_step(
            s, block_size=block_size, max_requests=6, max_prompt_blocks=3,
            num_blocks=NUM_BLOCKS, max_model_len=64 * block_size // BLOCK_SIZE,
        )  # fmt: skip
        if int(step.query_lens.sum()) > BUCKETS.max_num_tokens:
            continue
        planner = CascadePlanner(
            AttentionShape(8, num_kv_heads, 8, 4), cost_model=ALWAYS, enable_cascade=cascade,
            max_groups=2,
        )  # fmt: skip
        plan = planner.plan(
            step.request_ids, step.num_computed_tokens, step.query_lens, step.manager
        )
        if cascade and not plan.uses_cascade:
            continue
        md = build_attention_metadata(
            block_table=step.manager.block_table, plan=plan,
            query_lens=step.query_lens[plan.order],
            num_computed_tokens=step.num_computed_tokens[plan.order],
            block_size=block_size, buckets=BUCKETS,
        )  # fmt: skip
        return step, md
    raise AssertionError("no suitable random step")


def max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
