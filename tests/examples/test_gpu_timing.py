"""benchmarks/gpu_timing.py: time_call's median over its timed runs (an L2 flush before
each, untimed, when asked), and copy_bandwidth's bytes per second, the figure every
fraction of the GPU kernel benchmark is taken of; on a fake clock."""

from __future__ import annotations

import types

import pytest

from benchmarks import gpu_timing


def _fake_clock(monkeypatch, durations):
    """perf_counter advances only inside fn, by the next of `durations` per call."""
    clock, calls = [0.0], []

    def fn(x):
        calls.append(x)
        clock[0] += durations[len(calls) - 1]
        return x * 2

    monkeypatch.setattr(gpu_timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock, calls, fn


def test_time_call_is_the_median_of_the_timed_runs_after_a_warm_up(monkeypatch):
    # The warm-up (compile) takes 100 s and is not timed; without flush_l2 no flush runs.
    monkeypatch.setattr(gpu_timing, "_l2_flush", lambda: pytest.fail("flush_l2 was not asked"))
    _, calls, fn = _fake_clock(monkeypatch, [100.0, 3.0, 1.0, 2.0, 9.0, 4.0])
    t, out = gpu_timing.time_call(fn, (21,), 5)
    assert t == pytest.approx(3.0) and out == 42
    assert calls == [21] * 6


def test_time_call_flushes_l2_before_each_timed_run_outside_its_time(monkeypatch):
    clock, calls, fn = _fake_clock(monkeypatch, [100.0, 1.0, 2.0, 3.0])
    flushes = []

    def flush():
        flushes.append(len(calls))
        clock[0] += 50.0  # writing twice the L2 takes time too: not the program's

    monkeypatch.setattr(gpu_timing, "_l2_flush", lambda: flush)
    t, _ = gpu_timing.time_call(fn, (1,), 3, flush_l2=True)
    assert t == pytest.approx(2.0)
    assert flushes == [1, 2, 3]  # after the warm-up, before each timed run


def test_copy_bandwidth_counts_read_and_write_of_every_array_per_dtype(monkeypatch):
    timed = {}

    def time_call(fn, args, repeats):
        (xs,) = args
        outs = fn(xs)
        dtype = xs[0].dtype.name
        timed[dtype] = ([x.size for x in xs], [int(o[0]) for o in outs], repeats)
        return {"bfloat16": 4e-3, "float32": 2e-3}[dtype], outs

    monkeypatch.setattr(gpu_timing, "time_call", time_call)
    measured = gpu_timing.copy_bandwidth(4096, repeats=7, reps=3)
    # Each program reads and writes 3 arrays of 4096 bytes: 24576 bytes.
    assert measured == {
        "bfloat16": pytest.approx(24576 / 4e-3),
        "float32": pytest.approx(24576 / 2e-3),
    }
    assert timed == {
        "bfloat16": ([2048] * 3, [1, 2, 3], 7),  # distinct arrays, each x + 1
        "float32": ([1024] * 3, [1, 2, 3], 7),
    }
