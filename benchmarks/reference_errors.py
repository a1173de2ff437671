"""How far a kernel's (out, lse) lie from the reference's, judged by stated tolerances.

Shared by the GPU and TPU kernel benchmarks, which check the kernel on the device before
timing it and exit nonzero when a check fails.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# bf16 queries: K, V and probabilities are rounded to bf16 inside the kernels.
OUT_TOLERANCE = 2e-2  # |out - want| <= OUT_TOLERANCE * (1 + |want|)
LSE_TOLERANCE = 5e-3  # |lse - want| <= LSE_TOLERANCE * (1 + |want|)


def errors_against_reference(got, want, valid_rows: int | None = None) -> dict:
    """Worst absolute errors of (out, lse) over the first `valid_rows` rows (all if None)
    and whether every entry is within tolerance. Rows whose reference lse is -inf (no
    keys) must also have lse -inf. A NaN in the output counts as an infinite error (it
    is never within tolerance) and is counted in `nan_outputs`."""
    rows = slice(None) if valid_rows is None else slice(0, valid_rows)
    out_g, lse_g = (np.asarray(jnp.asarray(x)[rows].astype(jnp.float32), np.float64) for x in got)
    out_w, lse_w = (np.asarray(jnp.asarray(x)[rows].astype(jnp.float32), np.float64) for x in want)
    finite = np.isfinite(lse_w)
    out_excess = np.abs(out_g - out_w) - OUT_TOLERANCE * (1 + np.abs(out_w))
    lse_excess = np.abs(lse_g - lse_w) - LSE_TOLERANCE * (1 + np.abs(np.where(finite, lse_w, 0)))
    lse_excess = np.where(finite, lse_excess, np.where(np.isneginf(lse_g), -1.0, np.inf))
    out_err = np.abs(out_g - out_w)
    return {
        "max_abs_out_err": float(np.max(np.where(np.isnan(out_err), np.inf, out_err), initial=0.0)),
        "nan_outputs": int(np.isnan(out_g).sum()),
        "max_abs_lse_err": float(np.max(np.abs(np.where(finite, lse_g - lse_w, 0)), initial=0.0)),
        "ok": bool(np.all(out_excess <= 0) and np.all(lse_excess <= 0)),
    }
