"""Soft caps up to SOFT_CAP_MAX keep ordinary logits on every backend; larger are refused.

soft_cap * tanh(logits / soft_cap) divides first. With a cap of 1e38 (accepted before, as
any cap finite in float32 times log2(e) was) logits / soft_cap was a float32 subnormal
for every logit below 1.2, which XLA flushes to 0 on the CPU as devices do: each key of
a row then weighed alike, on the reference and both kernels, with no error.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from jaxkv.attention import paged_attention
from jaxkv.cascade import CascadePlanner
from kernels_pallas import reference
from kernels_pallas.gpu import ragged_paged_attention as gpu_attention
from kernels_pallas.scales import SOFT_CAP_MAX
from kernels_pallas.tpu import ragged_paged_attention as tpu_attention
from tests.attention import workload
from tests.attention.test_paged_attention import ALWAYS, SHAPE, buckets_for, planned_inputs
from tests.kernels import harness

SM_SCALE = 0.125
BACKENDS = {
    "reference": reference.ragged_paged_attention,
    "pallas_tpu": functools.partial(
        tpu_attention, interpret=harness.INTERPRET_TPU, num_queries_per_block=8
    ),
    "pallas_gpu": functools.partial(gpu_attention, interpret=harness.INTERPRET_GPU),
}


def _case():
    return harness.make_case(
        0, [(1, 20), (3, 17), (0, 4)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16
    )


@pytest.mark.parametrize("soft_cap", [5.0, SOFT_CAP_MAX])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_soft_cap_up_to_the_bound_keeps_ordinary_logits(backend, soft_cap):
    case = _case()
    out, lse = BACKENDS[backend](*case.args(), sm_scale=SM_SCALE, soft_cap=soft_cap)
    expected = harness.dense_oracle(case, sm_scale=SM_SCALE, soft_cap=soft_cap)
    harness.assert_close_to_oracle(case, out, lse, expected)
    harness.assert_padding_is_empty(case, out, lse)


@pytest.mark.parametrize("soft_cap", [SOFT_CAP_MAX * 1.0001, 3e37, 1e38])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_soft_cap_past_the_bound_is_refused_by_name(backend, soft_cap):
    case = _case()
    with pytest.raises(ValueError, match=r"soft_cap=.* must be at most 2\*\*100"):
        BACKENDS[backend](*case.args(), sm_scale=SM_SCALE, soft_cap=soft_cap)


@pytest.mark.parametrize("cascade", [False, True])
def test_paged_attention_refuses_a_soft_cap_past_the_bound(cascade):
    step = workload.random_step(0, block_size=4, common_root_blocks=2)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS, enable_cascade=cascade)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    md, q, kv = planned_inputs(step, plan, buckets_for(4), 0)
    with pytest.raises(ValueError, match=r"soft_cap=1e\+38 must be at most 2\*\*100"):
        paged_attention(jnp.asarray(q), jnp.asarray(kv), md, sm_scale=SM_SCALE, soft_cap=1e38)
