"""Checks of the static float options that scale attention: sm_scale, soft_cap, k_scale,
v_scale. Each must be a finite number > 0 in the float32 the kernels scale in, and a
normal one (XLA on the CPU and GPUs flushes float32 subnormals, below 1.2e-38, to 0), and
so must every product of them that a kernel folds into one float32 factor."""

from __future__ import annotations

import math

import numpy as np

LOG2E = math.log2(math.e)  # the GPU kernel's softmax runs in base 2 (exp2)
_F32 = np.finfo(np.float32)
# soft_cap * tanh(logit / soft_cap) divides first. Up to 2**100, only logits below 2**-26
# give a subnormal quotient, flushed to 0: their capped value is below 2**-26, so its
# exp is 1 to float32 rounding either way. A larger cap flushed ordinary logits (1e38
# turned every logit below 1.2 into 0, on every backend).
SOFT_CAP_MAX = 2.0**100


def is_positive_finite(x) -> bool:
    """Whether x is a finite number > 0, also once rounded to the float32 the kernels
    scale in (1e39 is inf there: NaN rows; 1e-50 is 0: every key weighted alike), and
    not a float32 subnormal (below 1.2e-38), which the device flushes to 0: sm_scale=1e-40
    gave NaN rows on the GPU kernel, soft_cap=1e-40 on every backend (0 / 0). x is a
    scalar, static: options never come traced; a bool is no number here (sm_scale=True
    would silently scale by 1)."""
    if isinstance(x, (bool, np.bool_)):
        return False
    try:
        if not (math.isfinite(x) and x > 0):
            return False
    except (TypeError, OverflowError, ValueError):  # an int past float64's range, Decimal sNaN
        return False
    with np.errstate(over="ignore"):
        as_f32 = np.float32(x)
    return bool(np.isfinite(as_f32) and as_f32 >= _F32.tiny)


def check_folded_scales(sm_scale, soft_cap, k_scale) -> None:
    """ValueError naming the options whose product a kernel folds into one float32
    factor, unless that factor is a normal float32 (finite, and not a subnormal flushed
    to 0; see is_positive_finite): sm_scale * k_scale (the logit scale of the Pallas
    kernels, which apply k_scale to the scores), and what the GPU kernel's base-2
    softmax multiplies by: the logit scale times log2(e) or, with a soft cap, soft_cap
    times log2(e) and the logit scale / soft_cap. Each option alone passed
    is_positive_finite while these did not (sm_scale=3e38 times log2(e) is inf, and
    sm_scale = k_scale = 1e-20 a subnormal 1e-40: NaN rows on the GPU kernel where the
    reference was finite), so every backend refuses them alike, here. First refuses a
    soft cap above SOFT_CAP_MAX (see there). The options are static Python numbers, already
    checked one by one: no per-element cost."""
    if soft_cap is not None and float(soft_cap) > SOFT_CAP_MAX:
        raise ValueError(
            f"soft_cap={soft_cap!r} must be at most 2**100 ({SOFT_CAP_MAX:.4g}): over a larger "
            "cap, logits / soft_cap of ordinary logits are float32 subnormals, which the "
            "device flushes to 0 (every key weighted alike); soft_cap=None caps nothing"
        )
    logit_scale = float(sm_scale) * (1.0 if k_scale is None else float(k_scale))
    label = "sm_scale" if k_scale is None else "sm_scale * k_scale"
    folds = {label: logit_scale}
    if soft_cap is None:
        folds[f"{label} * log2(e)"] = logit_scale * LOG2E
    else:
        folds["soft_cap * log2(e)"] = float(soft_cap) * LOG2E
        folds[f"{label} / soft_cap"] = logit_scale / float(soft_cap)
    for name, value in folds.items():
        with np.errstate(over="ignore"):
            normal = math.isfinite(value) and _F32.tiny <= np.float32(value) <= _F32.max
        if not normal:
            raise ValueError(
                f"{name} = {value:.4g} must be finite and normal in float32 (from "
                f"{float(_F32.tiny):.4g} to {float(_F32.max):.4g}): the kernels scale by it in "
                "one factor"
            )
