"""The attention dispatch the model calls: which backend runs, and cascade rounding.

jaxkv.attention.paged_attention picks the kernel from the metadata unless the caller names
a backend, refuses queries that do not fit the metadata, and merges cascade levels on
unrounded float32 partial results, so a bfloat16 output is rounded once, from values that
equal a float64 oracle up to float32 noise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxkv.attention import default_backend, paged_attention
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadePlanner
from tests.attention import workload
from tests.attention.test_paged_attention import (
    ALWAYS,
    SHAPE,
    SM_SCALE,
    planned_inputs,
)

# One size per axis, just above the batch below (27 tokens, 10 requests): a small program.
BUCKETS = BucketConfig(
    max_num_tokens=32, max_num_seqs=16, max_pages_per_seq=64,
    min_num_tokens=32, min_num_seqs=16, min_pages_per_seq=64,
)  # fmt: skip


def _cascade_step():
    """A batch under one root prompt and two system prompts: a global and a groups level."""
    step = workload.random_step(3, block_size=4, common_root_blocks=2)
    plan = CascadePlanner(SHAPE, cost_model=ALWAYS).plan(
        step.request_ids, step.num_computed_tokens, step.query_lens, step.manager
    )
    assert [level.name for level in plan.levels] == ["global", "groups"]
    return step, plan


def test_default_backend_of_each_platform():
    assert default_backend("cpu") == "xla"
    assert default_backend("tpu") == "pallas_tpu"
    assert default_backend("gpu") == default_backend("cuda") == "pallas_gpu"
    assert default_backend() == default_backend(jax.default_backend())


@pytest.mark.parametrize("platform", [b"tpu", 5, ["tpu"]])
def test_default_backend_refuses_a_platform_that_is_no_str(platform):
    # b"tpu" and 5 answered "xla"; ["tpu"] raised TypeError "unhashable type".
    with pytest.raises(ValueError, match="^platform=.* must be None or a JAX platform name"):
        default_backend(platform)


def test_default_backend_without_a_platform_follows_jaxs(monkeypatch):
    for platform, backend in (("tpu", "pallas_tpu"), ("gpu", "pallas_gpu"), ("cpu", "xla")):
        monkeypatch.setattr(jax, "default_backend", lambda platform=platform: platform)
        assert default_backend() == default_backend(None) == backend


def test_an_explicit_backend_overrides_the_metadatas():
    step, plan = _cascade_step()
    md, q, kv = planned_inputs(step, plan, BUCKETS)
    assert md.backend == "xla"

    def program(backend):
        run = lambda q, kv: paged_attention(q, kv, md, sm_scale=SM_SCALE, backend=backend)
        return str(jax.make_jaxpr(run)(q, kv))

    assert "pallas_call" not in program(None)
    # The main pass and both cascade levels run the named kernel (traced, not compiled).
    assert program("pallas_gpu").count("pallas_call") == 3


def test_bf16_cascade_output_is_rounded_once_from_the_exact_result():
    step, plan = _cascade_step()
    md, q, kv = planned_inputs(step, plan, BUCKETS)
    q, kv = q.astype(ml_dtypes.bfloat16), kv.astype(ml_dtypes.bfloat16)
    out = np.asarray(paged_attention(jnp.asarray(q), jnp.asarray(kv), md, sm_scale=SM_SCALE))
    want = workload.dense_oracle(step, plan.order, q, kv, SM_SCALE)  # float64
    got = out[: len(want)].astype(np.float64)
    correctly_rounded = want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    # float32 noise flips a rounding only next to a tie (observed: none of 3456 elements);
    # rounding each level's partial result before the merge flips about 40%.
    assert np.mean(got != correctly_rounded) < 0.02
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=1e-6)


def test_queries_of_another_token_count_than_the_metadatas_are_refused():
    step, plan = _cascade_step()
    md, q, kv = planned_inputs(step, plan, BUCKETS)
    with pytest.raises(ValueError, match=r"q.shape=\(31, 4, 16\) must have 32 \(padded\) tokens"):
        jax.eval_shape(lambda q, kv: paged_attention(q, kv, md, sm_scale=SM_SCALE), q[:-1], kv)
