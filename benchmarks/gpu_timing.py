"""Timing on the GPU for benchmarks/gpu_kernel.py: a program's median time with L2
flushed before each run, and the device's copy bandwidth, the reference its kernels'
bandwidths are fractions of."""

from __future__ import annotations

import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp

L2_BYTES = 64 * 2**20  # a little above the 50 MiB L2 of an H100/H200


def cache_copies(kv_bytes: int, reps: int) -> int:
    """How many copies of a cache of `kv_bytes` the `reps` calls of one timed program
    cycle through: enough that together they hold 4 L2s (a call never reads what an
    earlier one left in L2), one when one copy is that large, at most `reps`."""
    return max(1, min(reps, math.ceil(4 * L2_BYTES / max(kv_bytes, 1))))


def time_call(fn, args, repeats: int, *, flush_l2: bool = False) -> tuple[float, object]:
    """Median seconds of `repeats` runs of fn(*args) after a warm-up, and its output.

    flush_l2: before each timed run, untimed, write a buffer twice the size of L2, so no
    run reads what the previous one left in L2."""
    out = jax.block_until_ready(fn(*args))  # compile and warm up
    flush = _l2_flush() if flush_l2 else None
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@functools.cache
def _l2_flush():
    buffer = jnp.zeros((L2_BYTES,), jnp.bfloat16)  # 2 * L2_BYTES bytes
    touch = jax.jit(lambda x: x + 1)
    return lambda: jax.block_until_ready(touch(buffer))


def copy_bandwidth(nbytes: int, repeats: int = 10, reps: int = 4) -> dict[str, float]:
    """Bytes per second (read + write) of x + 1 over nbytes, by dtype name.

    Each timed program runs `reps` of them on distinct arrays, as the kernels are timed,
    so one dispatch is spread over several. XLA's bfloat16 elementwise loop is slower
    than its float32 one, so the best of the two stands for what the device can copy."""
    measured = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        n = nbytes // jnp.dtype(dtype).itemsize
        xs = [jnp.full((n,), i, dtype) for i in range(reps)]
        f = jax.jit(lambda xs: [x + 1 for x in xs])
        t, _ = time_call(f, (xs,), repeats)
        measured[jnp.dtype(dtype).name] = 2 * nbytes * reps / t
        del xs
    return measured
