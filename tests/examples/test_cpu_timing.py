"""benchmarks/cpu_timing.py: best_us_per_call reports the fastest of 21 timed loops, in
microseconds per call, CPU first and wall second (run here on a fake clock)."""

from __future__ import annotations

import types

import pytest

from benchmarks import cpu_timing


class _FakeClock:
    """Each call of fn costs `delta` seconds of CPU and 3 * delta of wall time; timed loop
    j (perf_counter is read only by those) costs 1 + (5 * (j + 1)) % 21 microseconds a call:
    every whole number from 1 to 21 once, the fastest being loop 3, not the first."""

    def __init__(self, delta: float = 1e-6):
        self.cpu = self.wall = 0.0
        self.delta, self.wall_reads, self.calls = delta, 0, []

    def process_time(self) -> float:
        return self.cpu

    def perf_counter(self) -> float:
        if self.wall_reads % 2 == 0:  # the start of a timed loop
            self.delta = (1 + (5 * (self.wall_reads // 2 + 1)) % 21) * 1e-6
        self.wall_reads += 1
        return self.wall

    def fn(self, arg) -> None:
        self.calls.append(arg)
        if len(self.calls) > 10**6:
            raise RuntimeError("the loop size never settled")
        self.cpu += self.delta
        self.wall += 3 * self.delta


def _patch(monkeypatch, clock: _FakeClock) -> None:
    fake = types.SimpleNamespace(process_time=clock.process_time, perf_counter=clock.perf_counter)
    monkeypatch.setattr(cpu_timing, "time", fake)


def test_the_best_of_21_loops_is_reported_cpu_first_in_microseconds(monkeypatch):
    clock = _FakeClock()
    _patch(monkeypatch, clock)
    cpu_us, wall_us = cpu_timing.best_us_per_call(clock.fn, ["a", "b"])
    assert cpu_us == pytest.approx(1.0) and wall_us == pytest.approx(3.0)
    assert clock.wall_reads == 2 * 21
    # Calibration doubles 8 calls until a loop passes 4 ms: 4096 calls of 1 us.
    calibration = sum(8 << k for k in range(10))
    assert len(clock.calls) == calibration + 21 * 4096
    assert clock.calls[:4] == clock.calls[-4:] == ["a", "b", "a", "b"]  # cycled throughout


def test_a_call_too_fast_to_time_stops_doubling_at_16384_calls_a_loop(monkeypatch):
    clock = _FakeClock(delta=0.0)
    _patch(monkeypatch, clock)
    cpu_timing.best_us_per_call(clock.fn, [None])
    calibration = sum(8 << k for k in range(12))  # 8 .. 16384
    assert len(clock.calls) == calibration + 21 * (1 << 14)
