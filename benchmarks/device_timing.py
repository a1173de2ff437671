"""Wall time of a JAX call on its device, as benchmarks/attention.py and
benchmarks/tpu_kernel.py measure it."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from jaxkv.field_checks import checked_int


def median_s(fn: Callable, *args, reps: int) -> float:
    """Median wall seconds of `reps` calls of fn(*args), each waited for until its
    results are ready, after one untimed call that compiles and warms up. ValueError
    unless reps is an int >= 1 (the median of no call was NaN)."""
    checked_int("reps", reps, minimum=1)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))
