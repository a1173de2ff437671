"""A long random run compiles at most one attention program per bucket combination."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np

from jaxkv.attention import paged_attention
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlanner
from jaxkv.step_inputs import program_key
from tests.attention import workload

BLOCK_SIZE = 4
MAX_GROUPS = 2
BUCKETS = BucketConfig(
    max_num_tokens=256, max_num_seqs=64, max_pages_per_seq=32, max_cascade_groups=MAX_GROUPS,
    min_num_tokens=128, min_num_seqs=64, min_pages_per_seq=32,
)  # fmt: skip
SHAPE = AttentionShape(num_q_heads=2, num_kv_heads=1, head_dim=8, kv_itemsize=4)


def signature(md) -> tuple:
    shapes = lambda tree: tuple(np.shape(x) for x in tree)
    levels = tuple((shapes((lv.cu_q_lens, lv.page_indices)), lv.max_q_len) for lv in md.levels)
    return (md.max_num_tokens, md.max_num_seqs, md.page_indices.shape, md.max_q_len, levels)


def test_300_random_steps_stay_within_bucket_combinations():
    rng = np.random.default_rng(0)
    planners = [
        CascadePlanner(SHAPE, cost_model=CascadeCostModel(0, 0), max_groups=MAX_GROUPS),
        CascadePlanner(SHAPE, cost_model=CascadeCostModel(0, 0), enable_groups=False),
        CascadePlanner(SHAPE, enable_cascade=False),
    ]
    kv = jnp.asarray(rng.standard_normal((1024, BLOCK_SIZE, 2, 8)), jnp.float32)
    before = paged_attention._cache_size()
    signatures, keys, levels_seen = set(), set(), set()
    for seed, planner in zip(range(300), itertools.cycle(planners)):
        step = workload.random_step(
            seed, block_size=BLOCK_SIZE, max_requests=64, max_prompt_blocks=12,
            num_blocks=1024, max_model_len=128, common_root_blocks=4 * (seed % 2),
        )  # fmt: skip
        m = step.manager
        plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, m)
        md = step.metadata(plan, BUCKETS)
        signatures.add(signature(md))
        keys.add(program_key(md))
        levels_seen.add(tuple(lv.name for lv in plan.levels))
        q = jnp.zeros((md.max_num_tokens, 2, 8), jnp.float32)
        out = paged_attention(q, kv, md, sm_scale=0.3)
        assert not np.isnan(np.asarray(out)).any()
    compiled = paged_attention._cache_size() - before
    # Shapes and static fields alone decide the program: one compile per signature, and
    # program_key (what Engine.num_compiles counts) tells exactly those apart.
    assert compiled == len(signatures) == len(keys)
    assert compiled <= BUCKETS.max_programs()
    # main (2 token x 1 seq x 1 page x 3 query bounds) x (1 + 3 level seqs x 1 x 3) ** 2
    assert BUCKETS.max_programs() == 6 * (1 + 9) ** 2
    # The run exercised flat, one-level and two-level plans.
    assert {(), ("global",), ("groups",), ("global", "groups")} <= levels_seen
