"""paged_attention checks its arguments as given however they are passed.

q, kv_pages and metadata may come by position or by keyword: either way the dtypes are
checked before jit converts a numpy array, and outside jit a Pallas backend the
metadata names (with the metadata's interpret) must run on its own platform.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import paged_attention
from tests.attention.test_attention_argument_checks import H_KV, H_Q, _metadata

D = 16  # any head_dim: a small program


def _inputs():
    md = _metadata()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((md.max_num_tokens, H_Q, D)), jnp.float32)
    pages = jnp.asarray(rng.standard_normal((64, 4, 2 * H_KV, D)), jnp.float32)
    return q, pages, md


def test_arguments_by_keyword_give_the_positional_result():
    q, pages, md = _inputs()
    want = np.asarray(paged_attention(q, pages, md, sm_scale=0.125))
    calls = (
        lambda: paged_attention(q, pages, metadata=md, sm_scale=0.125),
        lambda: paged_attention(q, kv_pages=pages, metadata=md, sm_scale=0.125),
    )
    for call in calls:
        np.testing.assert_array_equal(np.asarray(call()), want)


def test_a_float64_cache_by_keyword_is_refused_before_jit_converts_it():
    q, pages, md = _inputs()
    wide = np.asarray(pages, np.float64)
    match = "kv_pages.dtype=float64 must be one of float32"
    with pytest.raises(ValueError, match=match):
        paged_attention(q, wide, metadata=md, sm_scale=0.125)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, kv_pages=wide, metadata=md, sm_scale=0.125)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_the_metadatas_pallas_backend_and_interpret_are_checked_for_the_platform(backend):
    # Neither backend nor interpret passed: the metadata's are the ones that would run.
    if backend == f"pallas_{jax.default_backend()}":
        pytest.skip("on its own platform the backend compiles")
    q, pages, md = _inputs()
    md = dataclasses.replace(md, backend=backend, interpret=False)
    with pytest.raises(ValueError, match=f"backend='{backend}' compiles only on a "):
        paged_attention(q, pages, md, sm_scale=0.125)
