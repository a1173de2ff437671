"""The serving example's record of one run and its report: a table comparing runs.

Used by examples/serve_shared_prefix.py (which puts examples/ on sys.path).
"""

from __future__ import annotations

import dataclasses
import math

from rich.console import Console
from rich.table import Table
from shared_prefix_workload import Prompt

from jaxkv import EngineMetrics
from jaxkv.models import ByteTokenizer


@dataclasses.dataclass
class RunResult:
    """One serving run of the whole workload."""

    name: str
    outputs: list[tuple[int, ...]] = dataclasses.field(default_factory=list)  # per prompt
    wall_s: float = 0.0
    # Per step that ran the model: (needed a program not run before, tokens generated,
    # seconds, decode only: every scheduled request computed one token).
    step_log: list[tuple[bool, int, float, bool]] = dataclasses.field(default_factory=list)
    peak_blocks: int = 0  # KV blocks held at once, at most
    metrics: EngineMetrics | None = None


def blocks_without_sharing(prompts: list[Prompt], run: RunResult, block_size: int) -> int:
    """KV blocks the workload holds in `run` when no request shares a block with
    another: each request's KV covers its prompt and its output in that run (runs whose
    tokens differ stop at other lengths) but the last token, which is sampled and never
    fed back."""
    lengths = [len(p.token_ids) + len(o) for p, o in zip(prompts, run.outputs, strict=True)]
    return sum(math.ceil((n - 1) / block_size) for n in lengths)


def warm_steps(runs: list[RunResult]) -> list[list[tuple[bool, int, float, bool]]]:
    """Each run's steps that compiled nothing in any run (warm in all).

    Runs of one workload schedule the same steps (scheduling does not depend on
    attention), so each is timed over the same steps; each run leaving out only its own
    compiles would compare different mixes of prefill and decode. Runs whose step counts
    differ are timed over their own warm steps."""
    if _same_steps(runs):
        warm = [not any(r.step_log[i][0] for r in runs) for i in range(len(runs[0].step_log))]
    else:
        warm = None
    return [[s for i, s in enumerate(r.step_log) if (warm[i] if warm else not s[0])] for r in runs]


def _same_steps(runs: list[RunResult]) -> bool:
    return len({len(r.step_log) for r in runs}) == 1


def warm_tokens_per_s(runs: list[RunResult], *, decode_only: bool = False) -> list[float | None]:
    """Generated tokens/s of each run over its warm steps (warm_steps), or over those of
    them that only decoded; None where there are none."""
    rates = []
    for steps in warm_steps(runs):
        steps = [s for s in steps if s[3]] if decode_only else steps
        seconds = sum(s[2] for s in steps)
        rates.append(sum(s[1] for s in steps) / seconds if seconds else None)
    return rates


def warm_prefill_ms(runs: list[RunResult]) -> list[float | None]:
    """Mean milliseconds of each run's warm steps that computed prefill chunks (their
    tokens/s would say little: most of their work generates no token)."""
    times = [[s[2] for s in steps if not s[3]] for steps in warm_steps(runs)]
    return [1e3 * sum(t) / len(t) if t else None for t in times]


def summary_rows(
    prompts: list[Prompt], runs: list[RunResult], block_size: int
) -> list[tuple[str, ...]]:
    unshared = {r.name: blocks_without_sharing(prompts, r, block_size) for r in runs}
    names = [r.name for r in runs]
    warm_rates = dict(zip(names, warm_tokens_per_s(runs), strict=True))
    decode_rates = dict(zip(names, warm_tokens_per_s(runs, decode_only=True), strict=True))
    prefill_ms = dict(zip(names, warm_prefill_ms(runs), strict=True))
    warm = warm_steps(runs)
    num_warm = [len(steps) for steps in warm]
    num_decode = [sum(s[3] for s in steps) for steps in warm]
    num_prefill = [w - d for w, d in zip(num_warm, num_decode, strict=True)]
    if _same_steps(runs):  # every run timed over the same steps: one count for all
        scope = "both runs" if len(runs) == 2 else "every run" if len(runs) > 2 else "the run"
        warm_label = f"{num_warm[0]} steps warm in {scope}"
        decode_label, prefill_label = f"{num_decode[0]}", f"{num_prefill[0]}"
    else:  # each run over its own warm steps: each run's count, in column order
        warm_label = f"{_counts(num_warm)} steps warm, each run's own"
        decode_label, prefill_label = _counts(num_decode), _counts(num_prefill)
    rows = []

    def row(label: str, fn) -> None:
        rows.append((label, *(fn(r, r.metrics) for r in runs)))

    row("requests", lambda r, m: f"{len(prompts)}")
    row("tokens generated", lambda r, m: f"{m.num_generated_tokens}")
    row("prompt tokens computed", lambda r, m: f"{m.num_prompt_tokens}")
    row("wall time", lambda r, m: f"{r.wall_s:.1f} s")
    row("tokens/s (wall, with compiles)", lambda r, m: f"{m.num_generated_tokens / r.wall_s:.1f}")
    row(f"tokens/s ({warm_label})", lambda r, m: _fmt(warm_rates[r.name]))
    row(f"  tokens/s ({decode_label} decode-only)", lambda r, m: _fmt(decode_rates[r.name]))
    row(f"  ms/step ({prefill_label} with prefill)", lambda r, m: _fmt(prefill_ms[r.name]))
    row("prefix-cache hit rate", lambda r, m: f"{m.prefix_cache_hit_rate:.1%}")
    row("steps", lambda r, m: f"{m.num_steps}")
    row("steps using cascade", lambda r, m: f"{m.cascade_steps / max(m.num_steps, 1):.0%}")
    row("  levels (names): steps", lambda r, m: _levels(m))
    row(
        "KV blocks held at peak / unshared",
        lambda r, m: (
            f"{r.peak_blocks} / {unshared[r.name]} ({r.peak_blocks / unshared[r.name]:.0%})"
        ),
    )
    row("step programs compiled", lambda r, m: f"{m.num_compiles}")
    return rows


def _counts(counts: list[int]) -> str:
    return " / ".join(str(n) for n in counts)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _levels(m) -> str:
    """Steps per cascade structure, e.g. "2 (global+groups): 35"."""
    by = dict(m.cascade_steps_by_levels)
    if not by:
        return "-"
    return ", ".join(f"{k.count('+') + 1} ({k}): {v}" for k, v in sorted(by.items()))


def print_samples(console: Console, prompts: list[Prompt], run: RunResult, n: int) -> None:
    tok = ByteTokenizer()
    by_group = [[i for i, p in enumerate(prompts) if p.group == g] for g in (0, 1)]
    shown = sorted(by_group[0][: (n + 1) // 2] + by_group[1][: n // 2])
    for i in shown:
        p = prompts[i]
        console.print(f"[{'AB'[p.group]}] Q: {p.question}")
        console.print(f"    A:{tok.decode(list(run.outputs[i]))}", markup=False, highlight=False)


def print_report(
    console: Console, prompts: list[Prompt], runs: list[RunResult], block_size: int
) -> bool | None:
    """Prints the runs side by side; returns whether two runs generated identical tokens,
    None for any other number of runs (nothing was compared)."""
    table = Table(title="\nshared-prefix serving")
    table.add_column("")
    for r in runs:
        table.add_column(r.name, justify="right")
    for row in summary_rows(prompts, runs, block_size):
        table.add_row(*row)
    console.print(table)
    console.print(
        "unshared: the blocks these requests hold without prefix sharing,\n"
        "  sum of ceil(context / block size); a request's context is its prompt and\n"
        "  its output but the last token, whose KV is never computed."
    )
    if len(runs) != 2:
        return None
    console.print(
        "step programs compile once per model and shapes; the second run reuses\n"
        "  those the first compiled."
    )
    differ = sum(a != b for a, b in zip(runs[0].outputs, runs[1].outputs, strict=True))
    console.print(
        "generated tokens identical with cascade on and off: "
        + ("yes" if not differ else f"NO ({differ} of {len(prompts)} requests differ)")
    )
    return not differ
