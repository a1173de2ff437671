"""One planned engine step through jaxkv's dispatch on the TPU kernel (interpreted), with
cascade on: equal to the XLA backend and to the dense oracle over each whole context."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import paged_attention
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlanner
from tests.attention import workload
from tests.kernels.harness import INTERPRET_TPU

# The smallest shapes the TPU kernel takes: head_dim 64, pages of 16 keys.
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 1, 64, 16
SM_SCALE = HEAD_DIM**-0.5
ALWAYS = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0)
BUCKETS = BucketConfig(
    max_num_tokens=64, max_num_seqs=8, max_pages_per_seq=8,
    min_num_tokens=64, min_num_seqs=8, min_pages_per_seq=8,
)  # fmt: skip
# The interpreter's XLA program is large; the cheapest CPU pipeline compiles it faster.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_attention = jax.jit(
    paged_attention,
    static_argnames=("sm_scale", "backend", "interpret", "return_lse"),
    compiler_options=_FAST_COMPILE,
)


def _cascade_step():
    """The first small random step whose plan uses cascade, with its metadata."""
    shape = AttentionShape(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, kv_itemsize=4)
    for seed in range(50):
        step = workload.random_step(
            seed, block_size=BLOCK_SIZE, max_requests=5, max_prompt_blocks=3,
            num_blocks=64, max_model_len=128,
        )  # fmt: skip
        if int(step.query_lens.sum()) > BUCKETS.max_num_tokens:
            continue
        planner = CascadePlanner(shape, cost_model=ALWAYS)
        plan = planner.plan(
            step.request_ids, step.num_computed_tokens, step.query_lens, step.manager
        )
        if plan.uses_cascade and len(step.request_ids) >= 3:
            return step, plan
    raise AssertionError("no cascade step among the seeds")


def test_cascade_step_on_tpu_kernel_equals_xla_backend():
    step, plan = _cascade_step()
    manager = step.manager
    md = build_attention_metadata(
        block_table=manager.block_table,
        plan=plan,
        query_lens=step.query_lens[plan.order],
        num_computed_tokens=step.num_computed_tokens[plan.order],
        block_size=BLOCK_SIZE,
        buckets=BUCKETS,
    )
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((64, BLOCK_SIZE, 2 * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    kv[0] = np.nan  # the null block: a valid row that reads it turns NaN
    q = rng.standard_normal((md.max_num_tokens, NUM_Q_HEADS, HEAD_DIM)).astype(np.float32)
    total = int(step.query_lens.sum())
    q[total:] = np.nan
    args = (jnp.asarray(q), jnp.asarray(kv), md)

    out_tpu, lse_tpu = _attention(
        *args, sm_scale=SM_SCALE, backend="pallas_tpu", interpret=INTERPRET_TPU, return_lse=True
    )
    out_xla, lse_xla = _attention(*args, sm_scale=SM_SCALE, backend="xla", return_lse=True)
    want = workload.dense_oracle(step, plan.order, q, kv, SM_SCALE)

    out_tpu, lse_tpu = np.asarray(out_tpu), np.asarray(lse_tpu)
    assert np.all(np.isfinite(out_tpu[:total]))
    np.testing.assert_allclose(out_tpu[:total], np.asarray(out_xla)[:total], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse_tpu[:total], np.asarray(lse_xla)[:total], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out_tpu[:total], want, atol=2e-5, rtol=2e-5)
