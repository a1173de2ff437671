"""benchmarks/gpu_kernel.py over a cache of another dtype than its bfloat16 queries: the
cell's bytes, the methods' agreement, the device checks and the CUDA lowering, on the CPU
(interpret mode)."""

from __future__ import annotations

import jax.numpy as jnp

from benchmarks import gpu_kernel
from benchmarks.attention_bytes import decode_bytes
from benchmarks.gpu_kernel_checks import device_checks
from benchmarks.gpu_kernel_methods import lower_full_size


def test_a_cell_over_a_float32_cache_counts_its_bytes_and_agrees_with_flat():
    # bench_config timed queries and cache in one dtype and counted the KV at q's
    # itemsize; JAX's kernel, whose dots take one dtype, refuses bfloat16 queries over
    # float32 pages ("a and b must have the same element type").
    row = gpu_kernel.bench_config(
        2, 32, 16, page_size=16, reps=1, repeats=1, interpret=True, heads=(4, 2, 64),
        dtype=jnp.bfloat16, kv_dtype=jnp.float32, jax_k_splits=2,
    )  # fmt: skip
    assert row["kv_dtype"] == "float32"
    assert row["flat_kv_bytes"] == 2 * (32 + 16) * 2 * 2 * 64 * 4
    assert row["cascade_kv_bytes"] == (32 + 2 * 16) * 2 * 2 * 64 * 4
    sizes = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, kv_itemsize=4, q_itemsize=2)
    assert row["flat_total_bytes"] == decode_bytes(2, 32, 16, **sizes, cascade=False)
    assert row["cascade_total_bytes"] == decode_bytes(2, 32, 16, **sizes, cascade=True)
    assert row["cascade_agrees"] and row["jax_agrees"]


def test_the_device_checks_run_the_float_cases_over_each_cache_dtype():
    checks = device_checks(interpret=True, small=True, kv_dtypes=("bfloat16", "float32"))
    names = [c["check"] for c in checks]
    for tag in ("bf16", "bf16/f32"):
        for case in ("mixed_{}_causal", "mixed_{}_softcap_window", "prefix_pass_{}_noncausal"):
            assert case.format(tag) in names
    assert "int8_kv" in names and "float8_e4m3_kv" in names and len(names) == 8
    assert all(c["ok"] for c in checks), checks


def test_every_method_lowers_for_cuda_over_a_float32_cache(capsys):
    lowered = lower_full_size(b=8, p=1024, s=128, kv_dtype="float32")
    assert lowered == {"flat": 1, "cascade": 2, "jax_paged": 1}
    assert "pages of 16 (float32)" in capsys.readouterr().out
