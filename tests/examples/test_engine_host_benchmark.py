"""benchmarks/engine_host.py end to end at its smallest size: every workload is what its
row says (requests, tokens per step, cascade planned), and its table and JSON."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.engine_host import SPLIT, WORKLOADS, main, parse_args
from benchmarks.json_report import machine_fields


def test_a_tiny_run_times_every_workload_with_the_shared_prefix_planned(tmp_path, capsys):
    out = tmp_path / "engine_host.json"
    argv = ["--batch-sizes", "4", "--steps", "2", "--system-len", "256", "--question-len", "5",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report.items() >= machine_fields().items()
    rows = report["results"]
    assert [(r["workload"], r["num_requests"]) for r in rows] == [(w, 4) for w in WORKLOADS]
    for row in rows:
        assert row["timed_steps"] >= 1, row["workload"]
        assert 0 < row["host_us_best"] <= row["host_us_median"]
        assert all(math.isfinite(row[k]) and row[k] >= 0 for k in SPLIT), row
        assert row["program_us_median"] > 0 and 0 < row["host_share"] < 1
        want_share = row["host_us_median"] / (row["host_us_median"] + row["program_us_median"])
        assert row["host_share"] == pytest.approx(want_share)
        greedy = rows[list(WORKLOADS).index("greedy")]
        assert row["x_greedy"] == pytest.approx(row["host_us_best"] / greedy["host_us_best"])
        assert "global" in row["cascade_levels"], row["workload"]  # the prefix read once
        # Steady decode: every request one token a step; mixed has a new request's prompt
        # (its system prompt's 16 blocks read from the prefix cache, its 5 question
        # tokens computed) beside 3 decodes.
        want = [[4, 3 + 5]] if row["workload"] == "mixed" else [[4, 4]]
        assert row["requests_and_tokens"] == want, row["workload"]
    printed = capsys.readouterr().out
    assert all(f"{w:>11}    4 " in printed for w in WORKLOADS)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--workloads", "greedy,beam"], "['beam'] not of greedy,"),
        (["--workloads", "n4", "--batch-sizes", "4,6"], "the n4 workload needs multiples of 4"),
        (["--batch-sizes", "4,0"], "--batch-sizes"),
    ],
)
def test_bad_flags_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
