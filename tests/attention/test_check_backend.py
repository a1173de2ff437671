"""check_backend: the limits an engine checks once, before its first step, by name.

It refuses a Pallas backend off its own platform without interpret=True, takes every
size from 1 up, and traces both passes of the kernel (the main, causal one and a cascade
level's non-causal one) on the layout paged_attention gives it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxkv.attention as attention
from jaxkv.attention import check_backend
from kernels_pallas.reference import ragged_paged_attention

F32 = dict(q_dtype=jnp.float32, kv_dtype=jnp.float32)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_a_pallas_backend_off_its_platform_is_refused_unless_interpreted(backend):
    if backend == f"pallas_{jax.default_backend()}":
        pytest.skip("on its own platform the backend compiles")
    sizes = dict(num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16)
    with pytest.raises(ValueError, match=f"backend='{backend}' compiles only on a .*interpret"):
        check_backend(backend, interpret=False, **sizes, **F32)


def test_sizes_of_one_are_accepted():
    ones = dict(num_q_heads=1, num_kv_heads=1, head_dim=1, block_size=1)
    check_backend("xla", interpret=False, **ones, **F32)


def test_query_heads_that_are_no_multiple_of_the_kv_heads_are_refused():
    # The probe's cache holds K and V of each KV head: 2 * num_kv_heads combined heads.
    sizes = dict(num_q_heads=3, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match=r"must be a multiple of num_kv_heads=2"):
        check_backend("xla", interpret=False, **sizes, **F32)


def test_the_causal_main_pass_is_probed(monkeypatch):
    # A limit only the main pass hits is named here, not when the first step runs.
    def non_causal_only(*args, causal, **options):
        if causal:
            raise ValueError("no causal pass for these shapes")
        return ragged_paged_attention(*args, causal=causal, **options)

    monkeypatch.setattr(attention, "kernel_for", lambda *a, **kw: non_causal_only)
    attention._probe_kernel.cache_clear()  # a combination accepted earlier is not probed
    sizes = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="no causal pass"):
        check_backend("xla", interpret=False, **sizes, **F32)
    attention._probe_kernel.cache_clear()
