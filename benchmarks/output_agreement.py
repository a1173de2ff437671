"""Whether two methods timed against each other computed the same attention output.

A benchmark that reports one method's speedup over another checks, on the inputs it
timed, that both computed the same thing: a faster method that computes something else
is no speedup. The check is per entry and relative, as benchmarks/reference_errors.py's:
|got - want| <= tolerance * (1 + |want|), the tolerance set by the queries' dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# float32: both sides sum the same products in another order (cascade through its LSE
# merge), about 1e-6 apart; bfloat16 rounds K, V and the probabilities inside the
# kernels, as benchmarks.reference_errors.OUT_TOLERANCE allows.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def agreement(got, want, dtype) -> dict:
    """{"max_abs_diff": worst |got - want|, "agrees": every entry within tolerance}.

    `got` and `want` are outputs of the same shape (only the valid rows: the caller
    slices off padding); a NaN on either side is an infinite difference, never within
    tolerance. Raises KeyError for a dtype without a stated tolerance."""
    tolerance = TOLERANCE[jnp.dtype(dtype).name]
    got, want = (np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64) for x in (got, want))
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {got.shape} and {want.shape}")
    diff = np.abs(got - want)
    diff = np.where(np.isnan(diff), np.inf, diff)
    return {
        "max_abs_diff": float(np.max(diff, initial=0.0)),
        "agrees": bool(np.all(diff <= tolerance * (1 + np.abs(want)))),
    }
