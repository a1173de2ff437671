"""benchmarks/serve.py's paired cascade/flat ratio (the rest is exercised by running it)."""

from __future__ import annotations

import pytest

from benchmarks.serve import paired


def _run(steps):
    return {"step_log": steps}  # (compiled, tokens computed, generated, seconds)


def test_the_ratio_is_over_the_steps_in_which_neither_run_compiled():
    cascade = _run([(True, 64, 0, 9.0), (False, 8, 8, 1.0), (False, 8, 8, 1.0)])
    flat = _run([(False, 64, 0, 0.5), (True, 8, 8, 7.0), (False, 8, 8, 3.0)])
    pair = paired(cascade, flat)
    assert pair["steps"] == 1 and pair["generated_tokens"] == 8
    assert pair["speedup"] == pytest.approx(3.0)
    assert pair["cascade_generated_tokens_per_s"] == pytest.approx(8.0)


def test_no_ratio_without_a_common_schedule_or_a_step_to_compare():
    base = [(False, 8, 8, 1.0)]
    assert paired(_run(base), _run([(False, 9, 8, 1.0)])) is None  # other tokens scheduled
    assert paired(_run(base), _run([(True, 8, 8, 1.0)])) is None  # every step compiled once
