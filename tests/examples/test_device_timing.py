"""benchmarks/device_timing.py: median_s times each call to its ready results, after an
untimed warm-up (run here on a fake clock)."""

from __future__ import annotations

import types

import jax.numpy as jnp
import pytest

from benchmarks import device_timing


def test_median_s_is_the_median_of_the_timed_calls_after_an_untimed_warm_up(monkeypatch):
    # The warm-up (compiling) takes 100 s; the three timed calls 5, 1 and 3 s.
    costs, clock = iter([100.0, 5.0, 1.0, 3.0]), [0.0]

    def fn(x):
        clock[0] += next(costs)
        return x + 1

    monkeypatch.setattr(device_timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert device_timing.median_s(fn, jnp.ones(2), reps=3) == 3.0
    assert next(costs, None) is None  # four calls: one warm-up, three timed


@pytest.mark.parametrize("reps", [0, -1, 2.0, True])
def test_median_s_refuses_reps_that_time_no_call(reps):
    # reps=0 timed nothing and returned NaN, the median of no times, with a warning.
    calls = []
    with pytest.raises(ValueError, match=f"reps={reps!r} must be an int >= 1"):
        device_timing.median_s(calls.append, 1, reps=reps)
    assert calls == []
