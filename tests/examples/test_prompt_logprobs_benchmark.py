"""benchmarks/prompt_logprobs.py end to end at a tiny size: its table and JSON."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_memory
from benchmarks.json_report import machine_fields
from benchmarks.prompt_logprobs import CASES, main, parse_args


def test_a_tiny_run_measures_every_case_against_the_baseline(tmp_path, capsys):
    out = tmp_path / "prompt_logprobs.json"
    argv = ["--num-requests", "2", "--prompt-len", "16", "--max-num-batched-tokens", "64"]
    argv += ["--repeats", "2"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report.items() >= machine_fields().items()
    results = report["results"]
    assert [r["prompt_logprobs"] for r in results] == list(CASES)
    assert results[0]["ratio_to_none"] == 1.0 and results[0]["head_gflop"] == 0.0
    assert all(r["tokens"] == 2 * 16 and r["num_steps"] == 1 for r in results)
    assert all(r["head_gflop"] > 0 for r in results[1:])
    assert "prompt_logprobs" in capsys.readouterr().out


def test_a_prompt_longer_than_the_model_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--prompt-len", "1023"])
    assert "--prompt-len 1023 + 2 exceeds" in capsys.readouterr().err


def test_more_requests_than_tokens_per_step_are_refused_by_name(capsys):
    # It built the model, then SchedulerConfig raised "max_num_seqs=32 must be <=
    # max_num_batched_tokens=8" in a traceback naming neither flag.
    with pytest.raises(SystemExit):
        parse_args(["--num-requests", "32", "--max-num-batched-tokens", "8"])
    assert "--num-requests 32 must be <= --max-num-batched-tokens 8" in capsys.readouterr().err
    assert parse_args(["--num-requests", "8", "--max-num-batched-tokens", "8"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-num-batched-tokens", str(2**31)], "--max-num-batched-tokens 2147483648 must"),
        # 2,200,000 requests of one 1002-token block: 2.2e9 KV slots, past int32.
        (
            ["--num-requests", "2200000", "--max-num-batched-tokens", "2200000"]
            + ["--prompt-len", "1000", "--block-size", "1002"],
            "the engine's config: num_blocks=2200001 times",
        ),
        (["--block-size", str(2**30)], "--block-size 1073741824 must be at most 258, the"),
    ],
)
def test_sizes_past_the_engines_bounds_are_refused_by_flag_before_the_run(argv, message, capsys):
    # EngineConfig's ValueError came as a traceback once the model was built; then it
    # named the config's field, not the flag; a block past any request was accepted.
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_kv_cache_past_the_devices_memory_is_refused_before_the_run(capsys, monkeypatch):
    # 32 requests of 17 blocks of 16 tokens, at 2 KiB a token: 17 MiB.
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: 16 << 20)
    with pytest.raises(SystemExit):
        parse_args([])
    assert "the KV cache, 545 blocks of 16 tokens" in capsys.readouterr().err
