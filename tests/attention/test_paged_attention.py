"""Planner + metadata + dispatch end to end: flat == cascade == dense oracle, per row."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KVCacheManager, Request
from jaxkv.attention import paged_attention, write_kv
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlan, CascadePlanner
from tests.attention import workload

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
SM_SCALE = HEAD_DIM**-0.5
ALWAYS = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0)
SHAPE = AttentionShape(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, kv_itemsize=4)


def buckets_for(block_size: int) -> BucketConfig:
    return BucketConfig(
        max_num_tokens=512, max_num_seqs=16, max_pages_per_seq=256 // block_size,
        min_num_tokens=32, min_num_seqs=16, min_pages_per_seq=256 // block_size,
    )  # fmt: skip


def planned_inputs(
    step: workload.Step,
    plan: CascadePlan,
    buckets: BucketConfig,
    q_seed: int = 0,
    *,
    heads: tuple[int, int, int] = (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM),
):
    """(metadata, q f32[max_num_tokens, Hq, D], kv f32[num_blocks, bs, 2 * Hkv, D]) of a
    planned step; heads = (Hq, Hkv, D). Padding rows of q and the null block hold NaN."""
    num_q_heads, num_kv_heads, head_dim = heads
    manager = step.manager
    md = step.metadata(plan, buckets)
    rng = np.random.default_rng(q_seed)
    num_blocks = manager.pool.num_blocks if hasattr(manager.pool, "num_blocks") else 512
    kv = rng.standard_normal((num_blocks, manager.block_size, 2 * num_kv_heads, head_dim))
    kv[0] = np.nan  # the null block: a valid row that reads it turns NaN
    q = rng.standard_normal((md.max_num_tokens, num_q_heads, head_dim))
    q[int(step.query_lens.sum()) :] = np.nan
    return md, q.astype(np.float32), kv.astype(np.float32)


def run_step(step: workload.Step, planner: CascadePlanner, q_seed: int = 0):
    """(plan, out f32[num_valid_tokens, Hq, D], q, kv_pages) for one planned step."""
    manager = step.manager
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, manager)
    md, q, kv = planned_inputs(step, plan, buckets_for(manager.block_size), q_seed)
    out = paged_attention(jnp.asarray(q), jnp.asarray(kv), md, sm_scale=SM_SCALE)
    return plan, np.asarray(out)[: int(step.query_lens.sum())], q, kv


@pytest.mark.parametrize("seed", range(12))
def test_flat_equals_cascade_equals_oracle(seed):
    block_size = (4, 8)[seed % 2]
    # Every third batch has a root shared by all (global level) under its system prompts.
    step = workload.random_step(seed, block_size=block_size, common_root_blocks=2 * (seed % 3 == 0))
    cascade = CascadePlanner(SHAPE, cost_model=ALWAYS)
    flat = CascadePlanner(SHAPE, enable_cascade=False)
    plan_c, out_c, q, kv = run_step(step, cascade, q_seed=seed)
    # The flat run uses the cascade plan's batch order, so rows line up.
    plan_f = flat.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    assert not plan_f.uses_cascade
    reordered = dataclasses.replace(step)
    perm = plan_c.order
    reordered = workload.Step(
        step.manager,
        [step.request_ids[i] for i in perm],
        step.num_computed_tokens[perm],
        step.query_lens[perm],
    )
    _, out_f, _, _ = run_step(reordered, flat, q_seed=seed)
    want = workload.dense_oracle(step, plan_c.order, q, kv, SM_SCALE)
    np.testing.assert_allclose(out_c, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(out_f, want, atol=2e-5, rtol=2e-5)


def _group_only_step() -> workload.Step:
    """r1 and r2 hold the same five blocks (block_size 1) but have computed only 3 and 4
    tokens of them; r3 shares nothing, so the only level is a group level."""
    manager = KVCacheManager(64, 1, max_model_len=64)
    for rid, tokens in (("r2", [1, 2, 3, 4, 5, 7, 9, 9]), ("r1", [1, 2, 3, 4, 5, 6, 8, 8])):
        request = Request(rid, tokens)
        hit, n = manager.get_computed_blocks(request)
        manager.allocate_slots(
            request, len(tokens) - n, num_new_computed_tokens=n, new_computed_blocks=hit
        )
    manager.allocate_slots(Request("r3", [50, 51, 52, 53, 54, 55]), 6)
    return workload.Step(manager, ["r1", "r2", "r3"], np.array([3, 4, 5]), np.array([3, 2, 1]))


def test_group_level_stops_before_its_members_queries_and_a_longer_one_is_caught():
    # The non-causal group pass may only cover keys every member has computed before its
    # first query: 3 blocks here, although r1 and r2 hold 5 identical ones.
    step = _group_only_step()
    plan, out, q, kv = run_step(step, CascadePlanner(SHAPE, cost_model=ALWAYS))
    (level,) = plan.levels
    assert level.name == "groups" and level.block_ends.tolist() == [3]
    want = workload.dense_oracle(step, plan.order, q, kv, SM_SCALE)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    # The plan an uncapped planner would make (queries of r1 and r2 would see their own
    # and later keys without the causal mask) is refused by the metadata builder.
    group = np.zeros(len(plan.order), bool)
    group[level.group_starts[0] : level.group_ends[0]] = True
    uncapped = dataclasses.replace(
        plan,
        levels=(dataclasses.replace(level, block_ends=np.array([5], np.int32)),),
        suffix_start_blocks=np.where(group, 5, plan.suffix_start_blocks).astype(np.int32),
    )
    with pytest.raises(ValueError, match="the cascade levels read 5 blocks, past its"):
        build_attention_metadata(
            block_table=step.manager.block_table,
            plan=uncapped,
            query_lens=step.query_lens[plan.order],
            num_computed_tokens=step.num_computed_tokens[plan.order],
            block_size=1,
            buckets=buckets_for(1),
        )


def test_random_batches_use_cascade_often():
    plans = []
    for seed in range(12):
        root = 2 * (seed % 3 == 0)
        step = workload.random_step(seed, block_size=(4, 8)[seed % 2], common_root_blocks=root)
        planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
        plans.append(
            planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
        )
    assert sum(p.uses_cascade for p in plans) >= 4
    assert any(p.num_levels == 2 for p in plans)
    assert any(p.levels and p.levels[-1].num_groups > 1 for p in plans)


def test_write_kv_writes_slots_and_padding_only_touches_null_block():
    block_size, num_blocks = 4, 6
    kv = jnp.zeros((num_blocks, block_size, 2 * NUM_KV_HEADS, HEAD_DIM))
    k = jnp.arange(3 * NUM_KV_HEADS * HEAD_DIM, dtype=jnp.float32).reshape(
        3, NUM_KV_HEADS, HEAD_DIM
    )
    v = -k - 1
    slots = jnp.array([2 * block_size + 1, 5 * block_size + 3, 0], jnp.int32)  # last: padding
    out = np.asarray(write_kv(kv, k, v, slots))
    np.testing.assert_array_equal(out[2, 1, 0::2], np.asarray(k[0]))
    np.testing.assert_array_equal(out[2, 1, 1::2], np.asarray(v[0]))
    np.testing.assert_array_equal(out[5, 3, 0::2], np.asarray(k[1]))
    touched = np.argwhere(np.any(out != 0, axis=(2, 3)))
    assert sorted(map(tuple, touched.tolist())) == [(0, 0), (2, 1), (5, 3)]


def test_write_kv_writes_nothing_for_a_negative_or_too_large_slot():
    # vLLM pads with slot -1: indexing wrapped it round to the last block's last slot,
    # a live block's KV overwritten; one past the cache was dropped already.
    kv = jnp.zeros((6, 4, 2 * NUM_KV_HEADS, HEAD_DIM))
    k = jnp.ones((3, NUM_KV_HEADS, HEAD_DIM))
    out = np.asarray(write_kv(kv, k, k, jnp.array([9, -1, 6 * 4], jnp.int32)))
    touched = np.argwhere(np.any(out != 0, axis=(2, 3)))
    assert touched.tolist() == [[2, 1]]


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_write_kv_writes_nothing_for_a_64_bit_slot_past_int32(dtype):
    # numpy int64 slots (torch's slot_mapping dtype) reached jit's conversion to int32,
    # which wraps: 2**32 + 6 became slot 6 and overwrote a live block's KV.
    kv = jnp.zeros((6, 4, 2 * NUM_KV_HEADS, HEAD_DIM))
    k = jnp.ones((4, NUM_KV_HEADS, HEAD_DIM))
    slots = np.array([9, 2**32 + 6, 2**33 + 13, 2**31], dtype)
    out = np.asarray(write_kv(kv, k, k, slots))
    touched = np.argwhere(np.any(out != 0, axis=(2, 3)))
    assert touched.tolist() == [[2, 1]]
    # Given by keyword, slot_mapping is narrowed the same way.
    out = np.asarray(write_kv(jnp.zeros_like(kv), k=k, v=k, slot_mapping=slots))
    assert np.argwhere(np.any(out != 0, axis=(2, 3))).tolist() == [[2, 1]]


def test_write_kv_quantized_round_trip():
    kv = jnp.zeros((3, 4, 2, 8), jnp.int8)
    k = jnp.full((1, 1, 8), 0.5)
    v = jnp.full((1, 1, 8), -0.25)
    out = write_kv(kv, k, v, jnp.array([5], jnp.int32), k_scale=0.01, v_scale=0.01)
    assert int(out[1, 1, 0, 0]) == 50 and int(out[1, 1, 1, 0]) == -25


def test_write_kv_divides_k_and_v_each_by_its_own_scale():
    kv = jnp.zeros((3, 4, 2, 8), jnp.int8)
    k = jnp.full((1, 1, 8), 0.5)
    out = write_kv(kv, k, k, jnp.array([5], jnp.int32), k_scale=0.01, v_scale=0.02)
    assert int(out[1, 1, 0, 0]) == 50 and int(out[1, 1, 1, 0]) == 25


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("scale", [None, 0.01])
def test_write_kv_saturates_out_of_range_values(dtype, scale):
    # 1000 (or 10 / 0.01) lies beyond int8 and float8_e4m3fn: stored as the largest value
    # of the right sign, never as NaN (which attention would spread to every query).
    kv = jnp.zeros((3, 4, 2, 8), dtype)
    big = 1000.0 if scale is None else 10.0
    k, v = jnp.full((1, 1, 8), big), jnp.full((1, 1, 8), -big)
    out = np.asarray(write_kv(kv, k, v, jnp.array([5], jnp.int32), k_scale=scale, v_scale=scale))
    limit = float(jnp.iinfo(dtype).max if dtype == jnp.int8 else jnp.finfo(dtype).max)
    assert out[1, 1, 0, 0].astype(np.float32) == limit
    assert out[1, 1, 1, 0].astype(np.float32) == -limit - (dtype == jnp.int8)


def test_write_kv_saturates_float16_but_keeps_nan_and_inf_visible():
    # 1e5 overflows float16 (max 65504): stored as inf, attention over it would be NaN.
    kv = jnp.zeros((3, 4, 2, 8), jnp.float16)
    k = jnp.array([1e5, -1e5, jnp.inf, jnp.nan, 1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 8)
    out = np.asarray(write_kv(kv, k, k, jnp.array([5], jnp.int32)))[1, 1, 0].astype(np.float32)
    assert out[:2].tolist() == [65504.0, -65504.0] and np.isposinf(out[2]) and np.isnan(out[3])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn])
def test_write_kv_saturates_a_finite_value_whose_scaled_value_overflows(dtype):
    # 3e38 / 0.5 is inf in float32: it used to be stored as inf (float8: NaN), as if the
    # input itself were not finite.
    kv = jnp.zeros((3, 4, 2, 8), dtype)
    k = jnp.array([3e38, -3e38, jnp.inf, jnp.nan, 1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 8)
    out = write_kv(kv, k, k, jnp.array([5], jnp.int32), k_scale=0.5, v_scale=0.5)
    out = np.asarray(out)[1, 1, 0].astype(np.float32)
    limit = float(jnp.finfo(dtype).max)
    assert out[:2].tolist() == [limit, -limit] and np.isnan(out[3])
    assert out[4:].tolist() == [2.0, 4.0, 6.0, 8.0]
    assert np.isposinf(out[2]) if dtype == jnp.float16 else np.isnan(out[2])  # no inf in fp8


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_saturates_a_scaled_overflow_in_a_cache_of_float32_range(dtype):
    # 3e38 / 0.5 overflows float32: a float32 cache stored inf (NaN rows in attention)
    # where a bfloat16 one saturated, though the value itself was finite.
    kv = jnp.zeros((3, 4, 2, 8), dtype)
    k = jnp.array([3e38, -3e38, jnp.inf, jnp.nan, 1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 8)
    out = write_kv(kv, k, k, jnp.array([5], jnp.int32), k_scale=0.5, v_scale=0.5)
    out = np.asarray(np.asarray(out)[1, 1, 0], np.float32)
    limit = float(jnp.finfo(dtype).max)
    assert out[:2].tolist() == [limit, -limit] and np.isposinf(out[2]) and np.isnan(out[3])
    assert out[4:].tolist() == [2.0, 4.0, 6.0, 8.0]


def test_write_kv_saturates_bfloat16_values_past_float16s_range_in_a_float16_cache():
    # Clipped in bfloat16, 65504 rounds up to 65536, which float16 stores as inf.
    kv = jnp.zeros((3, 4, 2, 8), jnp.float16)
    k = jnp.array([1e5, -1e5, 65504.0, 1.0, 2.0, 3.0, 4.0, 5.0], jnp.bfloat16).reshape(1, 1, 8)
    out = np.asarray(write_kv(kv, k, k, jnp.array([5], jnp.int32)))[1, 1, 0].astype(np.float32)
    assert out[:2].tolist() == [65504.0, -65504.0] and np.isfinite(out).all()


@pytest.mark.parametrize(
    "dtype, scales, match",
    [
        (jnp.int8, {"k_scale": 0.0}, "k_scale=0.0 must be a finite number > 0"),
        (jnp.int8, {"v_scale": -0.01}, "v_scale=-0.01 must be a finite number > 0"),
        (jnp.float32, {"k_scale": float("nan")}, "k_scale=nan must be a finite number > 0"),
        # inf in float32: every value stored as x / inf = 0, silently.
        (jnp.int8, {"k_scale": 1e39}, r"k_scale=1e\+39 must be a finite number > 0 in float32"),
        # An int past float64's range: was OverflowError from math.isfinite, naming nothing.
        (jnp.int8, {"v_scale": 10**400}, "v_scale=10+ must be a finite number > 0 in float32"),
        (jnp.uint8, {}, "kv_pages.dtype=.*uint8.* must be float32, bfloat16"),
        (jnp.int32, {}, "kv_pages.dtype=.*int32.* must be float32, bfloat16"),
    ],
)
def test_write_kv_refuses_what_attention_cannot_read(dtype, scales, match):
    kv = jnp.zeros((3, 4, 2, 8), dtype)
    k = jnp.ones((1, 1, 8))
    with pytest.raises(ValueError, match=match):
        write_kv(kv, k, k, jnp.array([5], jnp.int32), **scales)


def test_sliding_window_with_levels_is_rejected():
    step = workload.random_step(3, block_size=4)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    if not plan.uses_cascade:
        pytest.skip("seed gave no cascade")
    md = step.metadata(plan, buckets_for(4))
    q = jnp.zeros((md.max_num_tokens, NUM_Q_HEADS, HEAD_DIM))
    kv = jnp.zeros((512, 4, 2 * NUM_KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match="sliding_window"):
        jax.eval_shape(
            lambda q, kv: paged_attention(q, kv, md, sm_scale=1.0, sliding_window=8), q, kv
        )


@pytest.mark.parametrize("seed", [0, 3])
def test_bfloat16_cascade_rounds_once_like_flat_attention(seed):
    # Every pass returns float32 partials and the merge rounds to bfloat16 once: the
    # result is the oracle rounded to bfloat16 almost everywhere. Rounding each pass to
    # bfloat16 first misses it in up to 40% of the elements of a step.
    step = workload.random_step(seed, block_size=4, common_root_blocks=2)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    assert plan.uses_cascade
    md, q, kv = planned_inputs(step, plan, buckets_for(4), seed)
    q16, kv16 = jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.bfloat16)
    out = paged_attention(q16, kv16, md, sm_scale=SM_SCALE)
    n = int(step.query_lens.sum())
    got = np.asarray(out[:n].astype(jnp.float32))
    want = workload.dense_oracle(
        step, plan.order, np.asarray(q16.astype(jnp.float32)), np.asarray(kv16.astype(jnp.float32)),
        SM_SCALE,
    )  # fmt: skip
    want16 = np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))
    assert np.mean(got != want16) < 0.01


def test_write_kv_rounds_to_the_nearest_integer_in_int8():
    kv = jnp.zeros((3, 4, 2, 4), jnp.int8)
    k = jnp.array([0.6, -0.6, 1.4, 2.5]).reshape(1, 1, 4)
    out = np.asarray(write_kv(kv, k, k, jnp.array([5], jnp.int32), k_scale=1.0, v_scale=1.0))
    assert out[1, 1, 0].tolist() == [1, -1, 1, 2]  # round half to even, not truncation


def test_paged_attention_refuses_q_with_other_than_the_padded_token_count():
    step = workload.random_step(1, block_size=4)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    md, q, kv = planned_inputs(step, plan, buckets_for(4))
    with pytest.raises(ValueError, match="padded"):
        paged_attention(jnp.asarray(q[:-1]), jnp.asarray(kv), md, sm_scale=SM_SCALE)


def test_paged_attention_refuses_a_scalar_q_by_its_shape():
    # It read q.shape[0] for the token count first: IndexError, naming nothing.
    step = workload.random_step(1, block_size=4)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    md, q, kv = planned_inputs(step, plan, buckets_for(4))
    with pytest.raises(ValueError, match=r"q.shape=\(\) must be \[max_num_tokens, num_q_heads"):
        paged_attention(jnp.float32(1.0), jnp.asarray(kv), md, sm_scale=SM_SCALE)
