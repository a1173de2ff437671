"""The merged (out, lse) of cascade attention against a float64 oracle, row by row.

The oracle (workload.dense_attention) rebuilds each request's whole context key by key
from the KV written at the positions the manager's block ids give, and runs plain
causal softmax in float64: no LSE merge, no paging logic shared with jaxkv. The cache
is float32; every element of every valid token row must lie within 1e-5 (out: atol plus
rtol times |want|; lse: times 1 + |want|), on the 'xla' backend and on the Pallas TPU
and GPU kernels in interpret mode, with float32 queries and with bfloat16 ones (their
dots run in the cache's float32: the out, in bfloat16, is within its one rounding,
2**-8 relative). Padded token rows must give out 0 (paged_attention's docstring).
Dropping one key of a shared prefix must fail exactly the rows that read it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import paged_attention
from jaxkv.batch import AttentionMetadata
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlan, CascadePlanner
from tests.attention import workload
from tests.attention.test_level_metadata_reference import with_gaps
from tests.attention.test_paged_attention import (
    ALWAYS,
    SHAPE,
    SM_SCALE,
    buckets_for,
    planned_inputs,
)
from tests.kernels import test_tpu_dispatch as tpu
from tests.kernels.harness import INTERPRET_GPU, INTERPRET_TPU

ATOL = RTOL = LSE_ATOL = 1e-5


def bad_rows(
    step: workload.Step,
    plan: CascadePlan,
    q: np.ndarray,  # f32[max_num_tokens, Hq, D]
    kv: np.ndarray,  # f32[num_blocks, block_size, 2 * Hkv, D]
    out: np.ndarray,  # [max_num_tokens, Hq, D]
    lse: np.ndarray,  # f32[max_num_tokens, Hq]
    sm_scale: float,
    out_rtol: float = RTOL,
) -> np.ndarray:
    """Valid token rows where any element of out or lse is off the oracle by more than its
    bound (per element: a single wrong head or lane fails its row). Also asserts that
    padded rows give out 0."""
    want_out, want_lse = workload.dense_attention(step, plan.order, q, kv, sm_scale)
    n = len(want_out)
    assert np.all(np.asarray(out)[n:] == 0), "padded token rows must give 0"
    got_out = np.asarray(out, np.float64)[:n]
    got_lse = np.asarray(lse, np.float64)[:n]
    out_ok = np.abs(got_out - want_out) <= ATOL + out_rtol * np.abs(want_out)
    lse_ok = np.abs(got_lse - want_lse) <= LSE_ATOL * (1 + np.abs(want_lse))
    return np.flatnonzero(~(out_ok.all(axis=(1, 2)) & lse_ok.all(axis=1)))


def drop_last_prefix_key(md: AttentionMetadata) -> AttentionMetadata:
    """md with the last key of the innermost level's first group dropped."""
    level = md.levels[-1]
    kv_lens = level.kv_lens.copy()
    kv_lens[np.flatnonzero(kv_lens)[0]] -= 1  # sequences before the first group are empty
    levels = (*md.levels[:-1], dataclasses.replace(level, kv_lens=kv_lens))
    return dataclasses.replace(md, levels=levels)


def first_group_rows(step: workload.Step, plan: CascadePlan) -> np.ndarray:
    """Token rows of the innermost level's first group: the rows that read its keys."""
    lens = step.query_lens[plan.order]
    starts = np.concatenate([[0], np.cumsum(lens)])
    level = plan.levels[-1]
    return np.arange(starts[level.group_starts[0]], starts[level.group_ends[0]])


def _xla(q, kv, md):
    return paged_attention(
        jnp.asarray(q), jnp.asarray(kv), md, sm_scale=SM_SCALE, backend="xla", return_lse=True
    )


# (seed, common root blocks, gaps): each half shares one compiled program (same shapes
# and static bounds). First half: a global level and a groups level with two groups and
# a request in neither (planner's layout), or with a gap before its group (with_gaps).
# Second half: three groups (planner's), or two groups with gaps before and between.
XLA_CASES = [(22, 2, False), (26, 2, False), (2, 2, True), (4, 2, True)]
XLA_CASES += [(8, 0, False), (18, 0, False), (6, 0, True), (16, 0, True)]


def _xla_case(seed: int, root: int, gaps: bool) -> tuple[workload.Step, CascadePlan]:
    step = workload.random_step(seed, block_size=(4, 8)[seed % 2], common_root_blocks=root)
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    assert plan.num_levels == 1 + (root > 0) and plan.levels[-1].name == "groups"
    if gaps:
        plan = with_gaps(plan)
        assert plan.levels[-1].group_starts[0] > 0
    return step, plan


def test_cascade_lse_on_xla_equals_the_float64_oracle():
    for i, case in enumerate(XLA_CASES):
        step, plan = _xla_case(*case)
        md, q, kv = planned_inputs(step, plan, buckets_for(step.manager.block_size), q_seed=i)
        out, lse = _xla(q, kv, md)
        assert bad_rows(step, plan, q, kv, out, lse, SM_SCALE).tolist() == [], case
        out, lse = _xla(q, kv, drop_last_prefix_key(md))
        broken = bad_rows(step, plan, q, kv, out, lse, SM_SCALE)
        assert broken.tolist() == first_group_rows(step, plan).tolist(), case


def _tpu_case() -> tuple[workload.Step, CascadePlan]:
    """Seed 20 at the TPU kernel's smallest shapes: a global level, then two groups and
    a request in neither group."""
    shape = AttentionShape(tpu.NUM_Q_HEADS, tpu.NUM_KV_HEADS, tpu.HEAD_DIM, kv_itemsize=4)
    step = workload.random_step(
        20, block_size=tpu.BLOCK_SIZE, max_requests=5, max_prompt_blocks=3,
        num_blocks=64, max_model_len=128, common_root_blocks=2,
    )  # fmt: skip
    planner = CascadePlanner(shape, cost_model=tpu.ALWAYS)
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    groups = plan.levels[-1]
    assert plan.num_levels == 2 and groups.num_groups == 2
    assert groups.group_ends.max() < len(plan.order)
    return step, plan


@pytest.mark.parametrize(
    "backend, q_dtype",
    [
        ("pallas_tpu", jnp.float32),
        # bfloat16 queries over the float32 cache: the kernels rounded K, V and the
        # softmax weights to bfloat16 (lse 2e-3 off); now every pass and merge is float32.
        ("pallas_tpu", jnp.bfloat16),
        ("pallas_gpu", jnp.bfloat16),
        ("xla", jnp.bfloat16),
    ],
)
def test_cascade_lse_on_interpreted_kernels_equals_the_float64_oracle(backend, q_dtype):
    step, plan = _tpu_case()
    heads = (tpu.NUM_Q_HEADS, tpu.NUM_KV_HEADS, tpu.HEAD_DIM)
    md, q, kv = planned_inputs(step, plan, tpu.BUCKETS, heads=heads)
    q = np.asarray(jnp.asarray(q, q_dtype).astype(jnp.float32))  # the oracle's queries
    interpret = {"pallas_tpu": INTERPRET_TPU, "pallas_gpu": INTERPRET_GPU}.get(backend, False)
    # A bfloat16 out is rounded once from the float32 result: at most 2**-8 relative.
    out_rtol = RTOL if q_dtype == jnp.float32 else 2**-8

    def run(md):
        args = (jnp.asarray(q, q_dtype), jnp.asarray(kv), md)
        options = dict(sm_scale=tpu.SM_SCALE, backend=backend, interpret=interpret, return_lse=True)
        out, lse = tpu._attention(*args, **options)
        assert out.dtype == q_dtype
        return np.asarray(out.astype(jnp.float32)), lse

    out, lse = run(md)
    assert bad_rows(step, plan, q, kv, out, lse, tpu.SM_SCALE, out_rtol).tolist() == []
    out, lse = run(drop_last_prefix_key(md))
    broken = bad_rows(step, plan, q, kv, out, lse, tpu.SM_SCALE, out_rtol)
    assert broken.tolist() == first_group_rows(step, plan).tolist()


def test_a_plan_leaving_a_request_out_of_cascade_equals_the_float64_oracle_on_xla():
    # Seed 7: every request shares 2 root blocks, but one request's chunk merges more
    # (merge_cost_factor 0.5) than reading its shared blocks saves: the planner drops
    # the global level and plans groups from block 0 without it (cascade_left_out); it
    # reads its whole context in its own pass.
    step = workload.random_step(7, block_size=4, common_root_blocks=2)
    planner = CascadePlanner(SHAPE, cost_model=CascadeCostModel(0, 0.5))
    plan = planner.plan(step.request_ids, step.num_computed_tokens, step.query_lens, step.manager)
    assert [lv.name for lv in plan.levels] == ["groups"]
    computed_blocks = step.num_computed_tokens[plan.order] // step.manager.block_size
    alone = (plan.suffix_start_blocks == 0) & (computed_blocks >= 2)
    assert alone.any() and plan.levels[0].group_ends[-1] <= np.flatnonzero(alone)[0]
    md, q, kv = planned_inputs(step, plan, buckets_for(step.manager.block_size), q_seed=7)
    out, lse = _xla(q, kv, md)
    assert bad_rows(step, plan, q, kv, out, lse, SM_SCALE).tolist() == []
    out, lse = _xla(q, kv, drop_last_prefix_key(md))
    broken = bad_rows(step, plan, q, kv, out, lse, SM_SCALE)
    assert broken.tolist() == first_group_rows(step, plan).tolist()
