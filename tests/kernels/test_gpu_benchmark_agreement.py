"""benchmarks/gpu_kernel.py judges the outputs of what it times: a method that computes
something else than flat attention on the timed inputs fails the run."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks import gpu_kernel
from benchmarks.gpu_kernel_checks import disagreeing_cells, outputs_agreement


def _outs(cascade_shift=0.0, jax_shift=0.0):
    """bench_config's outputs: per method a list over the timed calls, of (out, lse) for
    the flat kernels and cascade, of out alone for JAX's kernel."""
    out = jnp.asarray(np.linspace(-1, 1, 2 * 4 * 8).reshape(2, 4, 8), jnp.bfloat16)
    lse = jnp.zeros((2, 4), jnp.float32)
    return {
        "flat_unique": [(out, lse)],
        "flat_shared": [(out, lse)],
        "cascade": [(out + cascade_shift, lse)],
        "jax_paged": [out + jax_shift],
    }


def test_each_method_is_judged_against_flat_on_its_own_inputs():
    ok = outputs_agreement(_outs(), jnp.bfloat16)
    assert ok == {"cascade_vs_flat_max_abs": 0.0, "cascade_agrees": True,
                  "jax_vs_flat_max_abs": 0.0, "jax_agrees": True}  # fmt: skip
    assert not outputs_agreement(_outs(cascade_shift=0.5), jnp.bfloat16)["cascade_agrees"]
    assert not outputs_agreement(_outs(jax_shift=0.5), jnp.bfloat16)["jax_agrees"]
    row = dict(B=2, P=32, S=16)
    assert disagreeing_cells([row | ok]) == []
    assert disagreeing_cells([row | ok, row | ok | {"jax_agrees": False}]) == [(2, 32, 16)]


def test_a_run_whose_cascade_and_jax_outputs_are_wrong_reports_both(monkeypatch):
    # The differences were printed and written, but the exit status read the kernel's
    # own checks only: a wrong cascade composition still exited 0 with its speedup.
    cascade, jax_paged = gpu_kernel.cascade_fn, gpu_kernel.jax_paged_fn
    shift = lambda pair: (pair[0] + 1, pair[1])
    monkeypatch.setattr(gpu_kernel, "cascade_fn", lambda *a, **kw: shift(cascade(*a, **kw)))
    monkeypatch.setattr(gpu_kernel, "jax_paged_fn", lambda *a, **kw: jax_paged(*a, **kw) + 1)
    row = gpu_kernel.bench_config(
        2, 32, 16, page_size=16, reps=1, repeats=1, interpret=True, heads=(4, 2, 64),
        dtype=jnp.bfloat16, jax_k_splits=2,
    )  # fmt: skip
    assert not row["cascade_agrees"] and not row["jax_agrees"]
    assert row["cascade_vs_flat_max_abs"] >= 0.5 and row["jax_vs_flat_max_abs"] >= 0.5
    assert disagreeing_cells([row]) == [(2, 32, 16)]
