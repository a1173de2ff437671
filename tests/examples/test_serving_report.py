"""examples/serving_report.py: each row of the serving example's table shows its own
run's figure, computed as its label says."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import serving_report
        import shared_prefix_workload
    finally:
        sys.path.remove(str(EXAMPLES))
    return serving_report, shared_prefix_workload.Prompt


def _metrics(cascade_steps, by_levels, compiles):
    return SimpleNamespace(
        num_generated_tokens=8, num_prompt_tokens=50, prefix_cache_hit_rate=0.25,
        num_steps=2, cascade_steps=cascade_steps, cascade_steps_by_levels=by_levels,
        num_compiles=compiles,
    )  # fmt: skip


def _runs(report, outputs_off=((1,) * 5, (2,) * 3)):
    on = report.RunResult(
        "on", outputs=[(1,) * 5, (2,) * 3], wall_s=2.0, peak_blocks=3,
        step_log=[(True, 4, 1.0, False), (False, 4, 0.5, True), (False, 0, 0.25, False)],
        metrics=_metrics(1, {"global+groups": 1}, 1),
    )  # fmt: skip
    off = report.RunResult(
        "off", outputs=list(outputs_off), wall_s=4.0, peak_blocks=4,
        step_log=[(False, 4, 2.0, False), (False, 4, 1.0, True), (False, 0, 0.5, False)],
        metrics=_metrics(0, {}, 0),
    )  # fmt: skip
    return [on, off]


def _prompts(Prompt):
    return [Prompt(0, "a", [7] * 20), Prompt(1, "b", [8] * 30)]


def test_every_row_shows_its_own_runs_figure(report):
    module, Prompt = report
    rows = dict((r[0], r[1:]) for r in module.summary_rows(_prompts(Prompt), _runs(module), 16))
    assert rows == {
        "requests": ("2", "2"),
        "tokens generated": ("8", "8"),
        "prompt tokens computed": ("50", "50"),
        "wall time": ("2.0 s", "4.0 s"),
        "tokens/s (wall, with compiles)": ("4.0", "2.0"),  # generated tokens over wall time
        # Steps 1 and 2, warm in both: 4 tokens in 0.75 s and in 1.5 s; of them, step 1
        # decodes (4 tokens in 0.5 s and 1.0 s), step 2 computes prefill.
        "tokens/s (2 steps warm in both runs)": ("5.3", "2.7"),
        "  tokens/s (1 decode-only)": ("8.0", "4.0"),
        "  ms/step (1 with prefill)": ("250.0", "500.0"),
        "prefix-cache hit rate": ("25.0%", "25.0%"),
        "steps": ("2", "2"),
        "steps using cascade": ("50%", "0%"),
        "  levels (names): steps": ("2 (global+groups): 1", "-"),
        # Contexts 20 + 5 - 1 and 30 + 3 - 1 tokens (the last output's KV is never
        # computed): 2 + 2 blocks of 16 without sharing.
        "KV blocks held at peak / unshared": ("3 / 4 (75%)", "4 / 4 (100%)"),
        "step programs compiled": ("1", "0"),
    }


def test_the_report_says_whether_the_two_runs_generated_the_same_tokens(report):
    module, Prompt = report
    for outputs_off, same, line in (
        (((1,) * 5, (2,) * 3), True, "cascade on and off: yes"),
        (((1,) * 5, (2, 2, 9)), False, "cascade on and off: NO (1 of 2 requests differ)"),
    ):
        console = Console(file=io.StringIO(), width=200)
        assert (
            module.print_report(console, _prompts(Prompt), _runs(module, outputs_off), 16) is same
        )
        assert line in console.file.getvalue()


def test_each_run_is_held_against_its_own_unshared_blocks(report):
    # Both runs were held against the first run's outputs: a second run whose tokens
    # differ stops at other lengths, and needs other blocks without sharing.
    module, Prompt = report
    runs = _runs(module, outputs_off=((1,) * 5, (2,) * 20))
    rows = dict((r[0], r[1:]) for r in module.summary_rows(_prompts(Prompt), runs, 16))
    # Off: contexts 20 + 5 - 1 and 30 + 20 - 1 tokens, 2 + 4 blocks of 16.
    assert rows["KV blocks held at peak / unshared"] == ("3 / 4 (75%)", "4 / 6 (67%)")
    assert [module.blocks_without_sharing(_prompts(Prompt), r, 16) for r in runs] == [4, 6]


def test_one_run_compares_nothing_and_says_neither_yes_nor_no(report):
    # With --no-cascade the example's summary said outputs_identical False, as if the
    # runs had differed, for a run compared with nothing.
    module, Prompt = report
    console = Console(file=io.StringIO(), width=200)
    assert module.print_report(console, _prompts(Prompt), _runs(module)[:1], 16) is None
    assert "identical" not in console.file.getvalue()


def test_runs_of_other_step_counts_are_labelled_with_each_runs_own_steps(report):
    # Runs whose outputs differ can stop after other numbers of steps; each is then timed
    # over its own warm steps, but the labels gave the first run's counts as "warm in both
    # runs" (2 steps, 1 decode-only), under the second run's figure over 4 steps (2 of them
    # decode-only) too.
    module, Prompt = report
    on, off = _runs(module, outputs_off=((1,) * 5, (2,) * 4))
    off.step_log.append((False, 1, 0.125, True))
    rows = dict((r[0], r[1:]) for r in module.summary_rows(_prompts(Prompt), [on, off], 16))
    # On: steps 1 and 2 (4 tokens in 0.75 s); off: steps 0 to 3 (9 tokens in 3.625 s).
    assert rows["tokens/s (2 / 4 steps warm, each run's own)"] == ("5.3", "2.5")
    # Decode-only: on's step 1 (4 in 0.5 s), off's steps 1 and 3 (5 in 1.125 s).
    assert rows["  tokens/s (1 / 2 decode-only)"] == ("8.0", "4.4")
    # With prefill: on's step 2 (0.25 s), off's steps 0 and 2 (2.5 s over 2).
    assert rows["  ms/step (1 / 2 with prefill)"] == ("250.0", "1250.0")
    assert not [label for label in rows if "in both runs" in label]
