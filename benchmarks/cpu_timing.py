"""CPU time per call of a fast host function, as the benchmarks measure it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def best_us_per_call(
    fn: Callable, args_cycle: Sequence, loop_seconds: float = 0.004
) -> tuple[float, float]:
    """(CPU, wall) microseconds per call of fn(args_cycle[i % len]): the best of 21 short
    timed loops, each long enough (about loop_seconds) for the clock to resolve.

    CPU time (time.process_time) is the headline figure: this machine's cores are shared,
    and CPU time leaves out the time the process waits for a core; the minimum over many
    short loops keeps the ones that ran undisturbed.
    """
    n = 8
    while True:
        t0 = time.process_time()
        for i in range(n):
            fn(args_cycle[i % len(args_cycle)])
        if time.process_time() - t0 > loop_seconds or n >= 1 << 14:
            break
        n *= 2
    cpu, wall = [], []
    for _ in range(21):
        c0, w0 = time.process_time(), time.perf_counter()
        for i in range(n):
            fn(args_cycle[i % len(args_cycle)])
        cpu.append((time.process_time() - c0) / n * 1e6)
        wall.append((time.perf_counter() - w0) / n * 1e6)
    return min(cpu), min(wall)
