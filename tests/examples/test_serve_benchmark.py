"""benchmarks/serve.py's figures: per-step figures over warm steps, and the paired
cascade/flat ratio (the engine runs are exercised by running it)."""

from __future__ import annotations

import pytest

from benchmarks import kv_memory
from benchmarks.json_report import machine_fields
from benchmarks.serve import engine_config, paired, parse_args, step_figures, workload
from jaxkv.metrics import StepStats


def _run(steps, outputs=((7, 8), (9,))):
    # step_log: (compiled, tokens computed, generated, seconds) per step; outputs: the
    # tokens each request generated.
    return {"step_log": steps, "outputs": [list(o) for o in outputs]}


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
    # A cascade run that planned cascade in no step timed flat attention against itself:
    # its "ratio" (0.83x in one such run) was noise.
    assert paired(_run(base), _run(base))["speedup"] == 1.0
    assert paired(dict(_run(base), cascade_steps=0), _run(base)) is None


def _stats(new_program, num_tokens, num_requests, host, device=0.0, update=0.0):
    return StepStats(
        new_program=new_program, num_tokens=num_tokens, num_requests=num_requests,
        host_s=host, device_s=device, update_s=update, host_cpu_s=host / 2,
        schedule_cpu_s=host / 8, plan_cpu_s=host / 8, prepare_cpu_s=host / 4,
        cascade_levels="",
    )  # fmt: skip


def test_step_figures_leave_out_the_steps_that_compiled():
    steps = [
        _stats(True, 64, 4, 1.0, 8.0, 1.0),  # prefill that compiled: 10 s, 4 generated
        _stats(False, 40, 4, 0.5, 1.0, 0.5),  # prefill chunk and decodes, 2 generated
        _stats(False, 4, 4, 0.1, 0.3, 0.1),  # decode of 4 requests
        _stats(False, 4, 4, 0.3, 0.3, 0.4),
        _stats(False, 3, 3, 0.2, 0.2, 0.1),  # decode of 3: below --decode-batch 4
    ]
    fig = step_figures(steps, [4, 2, 4, 4, 3], decode_batch=4)
    assert fig["num_warm_steps"] == 4 and fig["compile_step_s"] == 10.0
    warm_s = 1.1 + 1.8 + 1.1  # host + device + update of the four warm steps
    assert fig["warm_tokens_per_s"] == pytest.approx((40 + 4 + 4 + 3) / warm_s)
    assert fig["warm_generated_tokens_per_s"] == pytest.approx((2 + 4 + 4 + 3) / warm_s)
    assert fig["host_ms_per_step_p50"] == pytest.approx(250.0)  # median of 500, 100, 300, 200
    assert fig["device_ms_per_step_p50"] == pytest.approx(300.0)
    assert fig["update_ms_per_step_p50"] == pytest.approx(250.0)
    # Decode steps of at least 4 requests, every one a decode: steps 2 and 3.
    assert fig["decode_steps_at_batch"] == 2
    assert fig["decode_host_ms_at_batch_p50"] == pytest.approx(200.0)
    assert fig["decode_host_cpu_ms_at_batch_mean"] == pytest.approx(100.0)
    assert fig["decode_device_ms_at_batch_p50"] == pytest.approx(300.0)
    assert fig["step_log"][0] == (True, 64, 4, 10.0)
    assert [s[:3] for s in fig["step_log"][1:]] == [
        (False, 40, 2),
        (False, 4, 4),
        (False, 4, 4),
        (False, 3, 3),
    ]


def test_the_pair_says_whether_both_runs_generated_the_same_tokens():
    # The ratio was reported without comparing what the two runs generated.
    base = [(False, 8, 8, 1.0)]
    assert paired(_run(base), _run(base))["outputs_identical"]
    other = paired(_run(base), _run(base, outputs=((7, 8), (5,))))
    assert other["outputs_identical"] is False and other["speedup"] == 1.0


def test_the_schedule_must_match_in_generated_tokens_too():
    base = [(False, 8, 8, 1.0)]
    assert paired(_run(base), _run([(False, 8, 7, 1.0)])) is None


def test_steps_pair_by_their_place_in_the_schedule():
    # Cascade compiled at step 0, flat at step 2: steps 1 and 3 are warm in both.
    cascade = _run([(True, 8, 8, 5.0), (False, 8, 8, 1.0), (False, 8, 8, 1.0), (False, 8, 8, 1.0)])
    flat = _run([(False, 8, 8, 1.0), (False, 8, 8, 2.0), (True, 8, 8, 9.0), (False, 8, 8, 2.0)])
    pair = paired(cascade, flat)
    assert (pair["steps"], pair["generated_tokens"]) == (2, 16)
    assert pair["speedup"] == pytest.approx(2.0)
    assert pair["flat_generated_tokens_per_s"] == pytest.approx(4.0)


def test_samples_split_the_requests_into_questions_of_n_samples_each():
    args = parse_args(["--num-requests", "12", "--samples", "4"])
    assert len(workload(args)) == 3
    with pytest.raises(SystemExit):  # argparse's error: 12 is no multiple of 5
        parse_args(["--num-requests", "12", "--samples", "5"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-requests", "4096"], "--num-requests 4096 must be <= --max-num-batched-tokens"),
        (["--system-len", "1100"], "1141 tokens exceed the 1024 positions of --preset tiny"),
        (["--preset", "nope"], "invalid choice: 'nope'"),
        (["--presence-penalty", "3"], "--presence-penalty 3.0 must be a number in [-2, 2]"),
        (["--repetition-penalty", "0"], "--repetition-penalty 0.0 must be a number > 0"),
        (["--prompt-logprobs", "-1"], "--prompt-logprobs -1 must be None or an int >= 0"),
        (["--prompt-logprobs", "21"], "--prompt-logprobs 21 exceeds 20"),
        (["--min-tokens-bucket", "4096"], "--min-tokens-bucket 4096 must be <= --max-num-"),
        (["--long-prefill-token-threshold", "-1"], "-1 must be >= 0"),
        # Past the configs' int32 bounds: EngineConfig's ValueError came mid-run.
        (["--max-num-batched-tokens", str(2**31)], "--max-num-batched-tokens 2147483648 must"),
        (["--long-prefill-token-threshold", str(2**31)], "--long-prefill-token-threshold 2147"),
        (["--block-size", str(2**31)], "--block-size 2147483648 must be at most 169,"),
        # 2,100,000 requests of two 512-token blocks: 2.2e9 KV slots, past int32.
        (
            ["--num-requests", "2100000", "--max-num-batched-tokens", "2100000"]
            + ["--system-len", "900", "--block-size", "512"],
            "the engines' config: num_blocks=4200001 times",
        ),
    ],
)
def test_flags_the_engine_would_refuse_are_refused_by_name(argv, message, capsys):
    # Each used to reach Engine or LlamaConfig and end in a traceback.
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_block_larger_than_the_requests_needs_no_longer_model_length():
    # max_model_len was rounded up to a whole block, past the model's 1024 positions.
    args = parse_args(["--block-size", "600", "--num-requests", "4", "--system-len", "900"])
    config = engine_config(args, cascade=True, prefix_caching=True)
    assert config.scheduler.max_model_len == 900 + 8 + 32 + 1
    assert config.cache.num_blocks == 4 * 2 + 1


def test_a_block_longer_than_any_request_is_refused_by_its_flag(capsys):
    # --block-size 100000 was accepted: 257 blocks of 100,000 tokens, 49 GiB of KV
    # allocated for requests of 169 tokens.
    with pytest.raises(SystemExit):
        parse_args(["--block-size", "100000"])
    err = capsys.readouterr().err
    assert "--block-size 100000 must be at most 169, the tokens of the longest request" in err
    assert parse_args(["--block-size", "169"]).block_size == 169


def test_a_kv_cache_past_the_devices_memory_is_refused_before_the_run(capsys, monkeypatch):
    # The engine allocated it after the model was built, or on the CPU took the machine's
    # memory. 256 requests of 11 blocks of 16 tokens, at 2 KiB a token: 88 MiB, and the
    # tiny model's 3.1 MiB of weights beside them.
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: 64 << 20)
    with pytest.raises(SystemExit):
        parse_args([])
    err = capsys.readouterr().err
    assert "the KV cache, 2817 blocks of 16 tokens, needs 88.0 MiB, and the weights 3.1" in err
    assert "3.1 MiB: more than the 64.0 MiB" in err
    assert "lower --num-requests" in err
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: 2817 * 16 * 2048 + 3282944)
    assert parse_args([]).num_requests == 256


def test_the_token_bucket_floor_is_the_batch_budget_unless_given():
    # Every step padded to --max-num-batched-tokens slots hid attention behind the model's
    # matmuls on a GPU; a smaller floor lets decode steps run on fewer slots.
    default = engine_config(parse_args([]), cascade=True, prefix_caching=True)
    assert default.min_num_tokens_bucket == 2048
    args = parse_args(["--min-tokens-bucket", "256"])
    assert engine_config(args, cascade=True, prefix_caching=True).min_num_tokens_bucket == 256


def test_the_long_prefill_threshold_reaches_the_engines_scheduler():
    default = engine_config(parse_args([]), cascade=True, prefix_caching=True)
    assert default.scheduler.long_prefill_token_threshold == 0  # the budget
    args = parse_args(["--long-prefill-token-threshold", "64"])
    assert (
        engine_config(args, cascade=False, prefix_caching=True).scheduler.max_tokens_per_request
        == 64
    )


def test_the_kv_usage_peak_counts_the_blocks_of_the_step_in_which_requests_finish():
    # It read the usage after each step: with one token each, both requests finish in
    # their prefill step and free their blocks before step() returns, so the peak was 0.
    from flax import nnx

    from benchmarks.serve import run_one
    from jaxkv.models import Llama, LlamaConfig

    argv = "--num-requests 2 --system-len 16 --question-len 8 --max-tokens 1"
    args = parse_args([*argv.split(), "--max-num-batched-tokens", "64"])
    model = Llama(LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
    result = run_one(model, workload(args), args, "flat", False, True)
    assert result["num_steps"] == 1
    # 4 handable blocks (2 a request); the second request finds the first's system
    # prompt block in the prefix cache: 3 held.
    assert result["peak_kv_usage"] == 0.75


def test_without_out_it_writes_its_json_under_benchmarks_results(tmp_path, monkeypatch):
    # It wrote none without --out, unlike every other benchmark: a run's figures were
    # left in the terminal only.
    import json

    from benchmarks import serve, serve_args
    from benchmarks.cli_args import RESULTS_DIR

    assert parse_args([]).out == RESULTS_DIR / "serve.json"
    monkeypatch.setattr(serve_args, "RESULTS_DIR", tmp_path)  # the run's default
    argv = ["--num-requests", "2", "--system-len", "16", "--question-len", "2"]
    argv += ["--max-tokens", "2", "--max-num-batched-tokens", "32", "--decode-batch", "2"]
    assert serve.main([*argv, "--configs", "cascade+prefix_cache,flat+prefix_cache"]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [r["config"] for r in report["results"]] == ["cascade+prefix_cache", "flat+prefix_cache"]
    assert report.items() >= machine_fields().items()


def test_a_decode_batch_no_step_can_reach_is_refused_by_name(capsys):
    # The default, 256, with fewer requests (gpu_checks.sh runs 128), or --decode-batch
    # 512 with 256, ran every engine to print NaN in each column of the host-time goal:
    # no decode step ever schedules more requests than there are.
    assert parse_args([]).decode_batch == 256
    assert parse_args(["--num-requests", "128"]).decode_batch == 128  # all of them
    assert parse_args(["--num-requests", "64", "--decode-batch", "32"]).decode_batch == 32
    with pytest.raises(SystemExit):
        parse_args(["--decode-batch", "512"])
    assert "--decode-batch 512 must be <= --num-requests 256" in capsys.readouterr().err


def test_prompt_logprobs_read_no_cache_but_other_samples_read_sample_0s():
    # The module said every request then computed its whole prompt with no prefix-cache
    # reads; under --samples only sample 0 does (it alone returns the prompt logprobs),
    # and the others read its KV: the printed hit rate was 0.8, not 0.
    from flax import nnx

    from benchmarks import serve
    from benchmarks.serve import run_one
    from jaxkv.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
    argv = "--system-len 16 --question-len 8 --max-tokens 1 --prompt-logprobs 0"
    rates = {}
    for samples in (1, 2):
        args = parse_args([*argv.split(), "--num-requests", "2", "--samples", str(samples)])
        result = run_one(model, workload(args), args, "flat", False, True)
        rates[samples] = result["prefix_cache_hit_rate"]
    assert rates[1] == 0 and rates[2] > 0
    assert "under --samples, sample 0 computes its whole prompt" in " ".join(serve.__doc__.split())


def _main_with_stub_runs(monkeypatch, argv, step_logs, host_s=None, outputs=None):
    """serve.main(argv) over stub engine runs, whose tokens per step are given per
    config, and optionally each step's host seconds (default 0.1) and the outputs."""
    from benchmarks import serve

    def run_one(model, prompts, args, name, cascade, prefix_caching):
        host = (host_s or {}).get(name, 0.1)
        steps = [_stats(False, tokens, tokens, host) for tokens in step_logs[name]]
        figures = step_figures(steps, [s.num_tokens for s in steps], args.decode_batch)
        return dict(
            figures, config=name, num_steps=len(steps), num_compiles=0, cascade_steps=2,
            prefix_cache_hit_rate=0.5, outputs=(outputs or {}).get(name, [[1, 2]]),
        )  # fmt: skip

    monkeypatch.setattr(serve, "Llama", lambda *a, **kw: None)
    monkeypatch.setattr(serve, "run_one", run_one)
    assert serve.main(argv) == 0


def test_a_pair_scheduled_differently_is_reported_with_no_ratio(tmp_path, monkeypatch, capsys):
    # The cascade run planned cascade steps, but the two runs scheduled other tokens: no
    # step compares, and the run says so rather than print a ratio of unlike steps.
    import json

    argv = ["--configs", "cascade+prefix_cache,flat+prefix_cache", "--out", str(tmp_path / "s")]
    logs = {"cascade+prefix_cache": [8, 8], "flat+prefix_cache": [8, 7]}
    _main_with_stub_runs(monkeypatch, argv, logs)
    out = capsys.readouterr().out
    assert "prefix_cache: no step that both runs scheduled alike and neither compiled" in out
    assert "x flat in generated tokens/s" not in out
    assert json.loads((tmp_path / "s").read_text())["cascade_vs_flat"] == {"prefix_cache": None}


def test_a_pair_scheduled_alike_prints_its_ratio_and_whether_the_tokens_agree(
    tmp_path, monkeypatch, capsys
):
    import json

    argv = ["--configs", "cascade+prefix_cache,flat+prefix_cache", "--out", str(tmp_path / "s")]
    logs = {"cascade+prefix_cache": [8, 8], "flat+prefix_cache": [8, 8]}
    host = {"cascade+prefix_cache": 0.1, "flat+prefix_cache": 0.3}  # flat's steps: 3x longer
    outputs = {"flat+prefix_cache": [[1, 3]]}
    _main_with_stub_runs(monkeypatch, argv, logs, host, outputs)
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "prefix_cache: cascade 3.00x flat in generated tokens/s (80 against 27) over the 2 "
        "steps that compiled in neither run; generated tokens identical: NO"
    ) in out
    pair = json.loads((tmp_path / "s").read_text())["cascade_vs_flat"]["prefix_cache"]
    assert pair["speedup"] == pytest.approx(3.0) and pair["outputs_identical"] is False


def test_the_headline_names_the_penalties_and_prompt_logprobs_asked_for(
    tmp_path, monkeypatch, capsys
):
    argv = ["--configs", "flat+prefix_cache", "--out", str(tmp_path / "s.json")]
    argv += ["--frequency-penalty", "0.5", "--prompt-logprobs", "2"]
    _main_with_stub_runs(monkeypatch, argv, {"flat+prefix_cache": [8]})
    headline = capsys.readouterr().out.splitlines()[0]
    assert headline.startswith(
        "256 requests (penalties: repetition 1.0, frequency 0.5, presence 0.0)"
        " (prompt logprobs: 2), system prompt 128"
    )


def test_an_unknown_config_name_is_refused_not_left_out(capsys):
    # main runs the CONFIGS whose names --configs lists: a misspelt one would run nothing
    # in its place and write a report without it.
    with pytest.raises(SystemExit):
        parse_args(["--configs", "flat+prefix_cache,flat"])
    err = capsys.readouterr().err
    assert "--configs: unknown ['flat']; choose from ['cascade+prefix_cache'," in err


def test_a_step_that_ran_no_model_adds_no_step_to_the_figures(monkeypatch):
    # Engine.step returns [] without running the model when it schedules nothing:
    # last_step stays the previous step's, which must not count twice.
    import dataclasses
    import types

    from benchmarks import serve

    held = [dataclasses.replace(_stats(False, 4, 4, 0.1), num_blocks_held=n) for n in (3, 2)]
    output = lambda token: types.SimpleNamespace(request_id="0", index=0, new_token_ids=[token])
    script = [(held[0], [output(5)]), (None, []), (held[1], [output(6)])]

    class Engine:
        def __init__(self, model, tokenizer, config):
            self.last_step, self.manager = None, types.SimpleNamespace(pool=None)
            self.manager.pool = types.SimpleNamespace(num_blocks=config.cache.num_blocks)
            self.metrics = types.SimpleNamespace(
                num_steps=2, num_compiles=1, generation_tokens_per_s=1.0, tokens_per_s=2.0,
                cascade_steps=0, cascade_steps_by_levels={}, prefix_cache_hit_rate=0.0,
                as_dict=dict,
            )  # fmt: skip

        def add_request(self, prompt, params):
            pass

        def has_unfinished_requests(self):
            return bool(script)

        def step(self):
            ran, outputs = script.pop(0)
            self.last_step = ran or self.last_step
            return outputs

        def close(self):
            pass

    monkeypatch.setattr(serve, "Engine", Engine)
    args = parse_args(["--num-requests", "1", "--system-len", "16", "--question-len", "8"])
    result = serve.run_one(None, workload(args), args, "flat", False, True)
    assert [s[:3] for s in result["step_log"]] == [(False, 4, 1), (False, 4, 1)]
    assert result["num_warm_steps"] == 2 and result["outputs"] == [[5, 6]]
    assert result["peak_kv_usage"] == 3 / (engine_config(args, False, True).cache.num_blocks - 1)
