"""paged_attention hands each option to every pass it runs, checked against the float64
dense oracle (tests/attention/workload.py), which shares no paging logic with it.

The other single-device tests of the dispatch run without a soft cap, K/V scales or a
sliding window (the device-mesh checks compare sharded with unsharded calls, which share
any such mistake): a pass that dropped, swapped or mis-routed one of them passed them all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv.attention as attention
from jaxkv.attention import paged_attention
from jaxkv.cascade import CascadePlanner
from tests.attention import workload
from tests.attention.test_paged_attention import ALWAYS, SHAPE, buckets_for, planned_inputs

K_SCALE, V_SCALE = 0.03, 0.05  # unequal: swapping them changes the result
OPTIONS = dict(sm_scale=0.5, soft_cap=1.5, k_scale=K_SCALE, v_scale=V_SCALE)


def _int8_step(seed: int, *, cascade: bool):
    """(step, plan, metadata, q f32, int8 cache, its dequantized float64 copy)."""
    step = workload.random_step(seed, block_size=4, common_root_blocks=2)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS, enable_cascade=cascade)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    assert plan.uses_cascade == cascade
    md, q, kv = planned_inputs(step, plan, buckets_for(4), seed)
    cache = np.random.default_rng(seed).integers(-100, 101, kv.shape).astype(np.int8)
    dense = cache.astype(np.float64)
    dense[:, :, 0::2] *= K_SCALE
    dense[:, :, 1::2] *= V_SCALE
    return step, plan, md, q, cache, dense


def test_cascade_levels_get_the_soft_cap_and_each_kv_scale():
    # Every level (non-causal prefix passes) and the main pass read the int8 cache with
    # its own K and V scales and cap their logits; the merged lse is the oracle's.
    step, plan, md, q, cache, dense = _int8_step(0, cascade=True)
    assert md.levels
    out, lse = paged_attention(jnp.asarray(q), jnp.asarray(cache), md, **OPTIONS, return_lse=True)
    want_out, want_lse = workload.dense_attention(
        step, plan.order, q, dense, OPTIONS["sm_scale"], soft_cap=OPTIONS["soft_cap"]
    )
    n = int(step.query_lens.sum())
    np.testing.assert_allclose(np.asarray(out)[:n], want_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[:n], want_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 3])
def test_flat_attention_gets_the_sliding_window_soft_cap_and_scales(window):
    step, plan, md, q, cache, dense = _int8_step(1, cascade=False)
    out = paged_attention(jnp.asarray(q), jnp.asarray(cache), md, **OPTIONS, sliding_window=window)
    want, _ = workload.dense_attention(
        step, plan.order, q, dense, OPTIONS["sm_scale"], soft_cap=OPTIONS["soft_cap"],
        sliding_window=window,
    )  # fmt: skip
    n = int(step.query_lens.sum())
    np.testing.assert_allclose(np.asarray(out)[:n], want, atol=2e-5, rtol=2e-5)


def test_each_pass_gets_the_backend_interpret_flag_and_its_own_query_bound(monkeypatch):
    # The explicit backend and interpret override the metadata's; the main pass is laid
    # out for the metadata's max_q_len and each level for its own (a level holding a
    # whole group as one sequence needs its longer bound, a shorter one is refused).
    _, _, md, q, cache, _ = _int8_step(0, cascade=True)
    calls = []

    def recording_kernel_for(backend, *, interpret=False, max_q_len=None):
        calls.append((backend, interpret, max_q_len))
        return attention.reference.ragged_paged_attention

    monkeypatch.setattr(attention, "kernel_for", recording_kernel_for)
    unjitted = paged_attention.__wrapped__.__wrapped__  # no jit cache: every call traces
    spec = jax.ShapeDtypeStruct
    args = (spec(q.shape, jnp.float32), spec(cache.shape, jnp.float32))
    jax.eval_shape(
        lambda q, kv: unjitted(q, kv, md, sm_scale=0.5, backend="pallas_gpu", interpret=True),
        *args,
    )
    want = [("pallas_gpu", True, md.max_q_len)]
    want += [("pallas_gpu", True, level.max_q_len) for level in md.levels]
    assert calls == want
    assert any(level.max_q_len != md.max_q_len for level in md.levels)
