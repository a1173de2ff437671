"""benchmarks/stop_strings.py end to end at a tiny size: its table and JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks.stop_strings import CASES, MAX_BLOCKS, main, manager_sizes, parse_args


def test_a_tiny_run_times_every_case_against_the_baseline(tmp_path, capsys):
    out = tmp_path / "stop_strings.json"
    argv = ["--num-requests", "4", "--steps", "3", "--warmup-tokens", "2", "--out", str(out),
            "--text-lengths", "4"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert [r["case"] for r in results] == list(CASES)
    assert results[0]["ratio_to_none"] == 1.0 and all(r["step_s"] > 0 for r in results)
    assert [(t["tokens"], t["cut"]) for t in report["text"]] == [(4, False), (4, True)]
    assert all(t["text_us"] > 0 and t["ratio_to_decode"] > 0 for t in report["text"])
    assert "us/request" in capsys.readouterr().out


def test_no_warmup_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--warmup-tokens", "0"])
    assert "--warmup-tokens 0 must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", str(2**31)], "max_model_len=2147483789 must be an int in"),
        (["--num-requests", str(2**26)], "max_num_batched_tokens=2684354560 must be"),
        # 2**22 requests of 256 blocks of 16 tokens: 2**34 KV slots.
        (["--num-requests", str(2**22), "--steps", "4000"], "must be at most 2**31 token"),
    ],
)
def test_sizes_past_the_schedulers_int32_bounds_are_refused_by_flag(argv, message, capsys):
    # Each was accepted; the scheduler's ValueError, naming a field and no flag, came in
    # a traceback once the run began.
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert "--num-requests, --warmup-tokens and --steps size a run past int32" in err
    assert message in err


@pytest.mark.parametrize(
    "argv, blocks",
    [
        (["--num-requests", "100000"], 2_200_001),  # 22 blocks each
        (["--num-requests", "1", "--steps", str(2**24)], 1_048_586),
        # Within int32: almost 2**27 blocks of about 130 bytes each, built once per case.
        (["--num-requests", "2047", "--steps", str(2**20 - 142)], 2047 * 2**16 + 1),
    ],
)
def test_a_run_needing_more_host_blocks_than_the_bound_is_refused_by_flag(argv, blocks, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    err = capsys.readouterr().err
    assert f"need {blocks} KV blocks of 16 tokens, past the {MAX_BLOCKS}" in err
    assert "--num-requests" in err and "--warmup-tokens 100 + --steps" in err


def test_the_largest_run_within_the_bound_is_taken():
    # Requests of 16 blocks, 256 tokens (40 + 100 warmup tokens + 115 steps + 1), and
    # the null block.
    args = parse_args(["--num-requests", str(2**16 - 1), "--steps", "115"])
    assert manager_sizes(args)[0] == MAX_BLOCKS - 15
    with pytest.raises(SystemExit):
        parse_args(["--num-requests", str(2**16), "--steps", "115"])


def test_a_text_past_the_bound_is_refused_by_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--text-lengths", "16", str(2**20 + 1)])
    assert f"--text-lengths [{2**20 + 1}]: each must be at most {2**20}" in capsys.readouterr().err
    assert parse_args(["--text-lengths", str(2**20)]).text_lengths == [2**20]
