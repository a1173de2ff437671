"""The main job (examples/serve_shared_prefix.py) end to end with small flags."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from jaxkv.metrics import StepStats
from jaxkv.models import TINY_CHECKPOINT
from tests.examples._example_modules import load_example


@pytest.fixture(scope="module")
def serve():
    return load_example("serve_shared_prefix")


# One prefill step (every request after the first hits the prefix cache), then every
# request decodes in step: few programs to compile.
SMALL = "--num-requests 6 --prefix-len 64 --max-tokens 4 --max-batched-tokens 512".split()
SMALL += ["--always-cascade"]  # the cost model declines cascade for so small a prefix


def test_small_run_shares_prefixes_uses_cascade_and_matches_flat_attention(serve, capsys):
    summary = serve.main(SMALL)  # the shipped checkpoint
    out = capsys.readouterr().out

    assert summary["num_requests"] == 6
    # Every request after the first of its group finds its group's prefix cached.
    assert summary["prefix_cache_hit_rate"] > 0
    assert 0 < summary["cascade_steps"] <= summary["num_steps"]
    # Two system prompts under one preamble: both levels appear in some step.
    assert "global+groups" in summary["cascade_steps_by_levels"]
    assert summary["outputs_identical"]
    runs = summary["runs"]
    assert runs["cascade off"]["cascade_steps"] == 0
    assert runs["cascade on"]["num_generated_tokens"] == sum(map(len, summary["outputs"])) > 0
    # Shared blocks are held once: fewer than the workload needs without sharing.
    assert runs["cascade on"]["peak_blocks"] < summary["blocks_without_sharing"]

    assert "generated tokens identical with cascade on and off: yes" in out
    # A 21-token preamble and "System: speak as " (the console may wrap the line).
    assert "of which 64 shared (38 by all" in " ".join(out.split())
    for label in ("prefix-cache hit rate", "steps using cascade", "KV blocks held", "tokens/s"):
        assert label in out


def test_workload_has_two_system_prompts_under_one_preamble(serve):
    prompts = sys.modules["shared_prefix_workload"].workload(num_requests=10, prefix_len=96, seed=0)
    a = [p.token_ids for p in prompts if p.group == 0]
    b = [p.token_ids for p in prompts if p.group == 1]
    assert len(a) == len(b) == 5
    assert all(p[:96] == a[0][:96] for p in a) and all(p[:96] == b[0][:96] for p in b)
    assert a[0][:32] == b[0][:32] and a[0][32:96] != b[0][32:96]
    assert len({p.question for p in prompts}) == 10  # distinct questions
    assert all(p.token_ids[96:99] == list(b"Q: ") for p in prompts)


def test_more_requests_than_questions_still_ask_distinct_questions(serve):
    # Past the distinct questions they come round again, numbered: every request keeps a
    # question of its own, so no two requests share a whole prompt.
    wl = sys.modules["shared_prefix_workload"]
    n = len(wl.QUESTIONS) * len(wl.NAMES) * len(wl.TOPICS)
    prompts = wl.workload(num_requests=2 * n + 1, prefix_len=96, seed=0)
    assert len({p.question for p in prompts}) == 2 * n + 1
    assert prompts[n].question == f"{prompts[0].question} (2)"
    assert prompts[2 * n].question == f"{prompts[0].question} (3)"
    assert prompts[n].token_ids[-len(" (2)\nA:") :] == list(b" (2)\nA:")


@pytest.mark.parametrize("seed", [0, 1])
def test_the_shortest_prompt_len_is_the_shortest_prompts_without_building_them(serve, seed):
    # The script's int32 check before building the workload counts on it as a lower bound.
    wl = sys.modules["shared_prefix_workload"]
    n = len(wl.QUESTIONS) * len(wl.NAMES) * len(wl.TOPICS)  # every question, once or more
    lengths = [len(p.token_ids) for p in wl.workload(2 * n + 1, 96, seed)]
    assert wl.shortest_prompt_len(96) == min(lengths)


def test_every_request_shares_the_preamble_and_the_system_prompts_opening_words(serve):
    wl = sys.modules["shared_prefix_workload"]
    a, b = wl.shared_prefixes(96)
    assert len(a) == len(b) == 96
    assert a[:32] == b[:32] == wl.PREAMBLE[:32]  # the preamble: a third
    assert a[32:49] == b[32:49] == "System: speak as " and a[49] != b[49]
    assert wl.common_prefix_len(96) == 49  # what the run prints as shared by all


def test_a_prefix_too_short_for_two_system_prompts_is_refused(serve, capsys):
    # --prefix-len 6 to 25 were taken: both groups' prefixes were the preamble and
    # "System: speak as " cut short, identical, while the run printed "2 system prompts"
    # and "25 shared (25 by all, the rest by each system prompt's group)".
    wl = sys.modules["shared_prefix_workload"]
    a, b = wl.shared_prefixes(25)
    assert a == b and wl.shared_prefixes(26)[0] != wl.shared_prefixes(26)[1]
    assert wl.min_prefix_len() == 26
    with pytest.raises(SystemExit):
        serve.parse_args(["--prefix-len", "25"])
    assert "--prefix-len must be >= 26" in capsys.readouterr().err
    assert serve.parse_args(["--prefix-len", "26"]).prefix_len == 26


def test_a_large_block_asks_for_no_positions_past_the_longest_request(serve):
    # max_model_len was the longest request rounded up to a whole block: with blocks of
    # 2048 the run was refused for needing 2048 positions of the model's 1024.
    argv = ["--num-requests", "2", "--max-tokens", "4", "--prefix-len", "700"]
    args = serve.parse_args([*argv, "--block-size", "600"])
    prompts = sys.modules["shared_prefix_workload"].workload(
        args.num_requests, args.prefix_len, args.seed
    )
    config = serve.engine_config(args, prompts, True)
    longest = max(len(p.token_ids) for p in prompts) + 4
    assert config.scheduler.max_model_len == longest < 1024 < 2 * 600
    assert config.cache.num_blocks == 2 * 2 + 1  # two blocks a request, and the null block


def test_help_lists_every_flag(serve, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in (
        "--backend",
        "--num-requests",
        "--prefix-len",
        "--max-tokens",
        "--checkpoint",
        "--no-cascade",
        "--seed",
        "--preset",
        "--interpret",
    ):
        assert flag in text


def test_a_negative_seed_is_refused_by_its_flag(serve, capsys):
    # It loaded the model, then failed in numpy's default_rng naming no flag.
    with pytest.raises(SystemExit):
        serve.parse_args(["--seed", "-1"])
    assert "--seed must be >= 0" in capsys.readouterr().err


def test_a_seed_past_int64_is_refused_by_its_flag(serve, capsys):
    # Random weights' jax.random.key raised OverflowError, a traceback naming no flag.
    assert serve.parse_args(["--seed", str(2**63 - 1)]).seed == 2**63 - 1
    with pytest.raises(SystemExit):
        serve.parse_args(["--checkpoint", "random", "--seed", str(2**63)])
    assert f"--seed {2**63} must be < 2**63" in capsys.readouterr().err


def test_a_checkpoint_with_a_preset_that_runs_random_weights_is_refused(serve, capsys):
    # It was parsed and ignored: the Llama-3 presets built random weights regardless.
    with pytest.raises(SystemExit):
        serve.parse_args(["--preset", "llama3_2_1b", "--checkpoint", "/some/ckpt"])
    assert "--checkpoint /some/ckpt: only --preset tiny loads" in capsys.readouterr().err
    assert serve.parse_args(["--preset", "llama3_2_1b", "--checkpoint", "random"])


def test_an_empty_checkpoint_is_refused_rather_than_read_as_the_default(serve, capsys):
    # "" (an unset shell variable) is falsy: the run served the shipped checkpoint, not
    # the one asked for, and said nothing.
    with pytest.raises(SystemExit):
        serve.parse_args(["--checkpoint", ""])
    assert "--checkpoint is empty" in capsys.readouterr().err


def test_always_cascade_with_no_cascade_is_refused(serve, capsys):
    # It was parsed and ignored: --no-cascade serves one run with cascade off, in which
    # --always-cascade's cost model plans nothing.
    with pytest.raises(SystemExit):
        serve.parse_args(["--always-cascade", "--no-cascade"])
    assert "--always-cascade plans cascade; with --no-cascade" in capsys.readouterr().err
    assert serve.parse_args(["--always-cascade"]).always_cascade


def test_interpret_without_a_pallas_backend_is_refused(serve):
    # --interpret with the xla backend (the CPU's default) was parsed and ignored: the
    # run served with XLA attention, no Pallas kernel interpreted.
    with pytest.raises(SystemExit, match="--interpret runs a Pallas backend .* here is xla"):
        serve.main(["--interpret", "--backend", "xla", "--num-requests", "2", "--max-tokens", "1"])


def test_a_pallas_backend_off_its_platform_asks_for_interpret_by_flag(serve):
    # The engine raised "ValueError: backend='pallas_gpu' ... pass interpret=True" in a
    # traceback, naming a config field rather than the example's --interpret.
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU compiles neither Pallas backend")
    with pytest.raises(SystemExit, match="--backend pallas_gpu compiles only .* add --interpret"):
        serve.main(["--backend", "pallas_gpu", "--num-requests", "2", "--max-tokens", "1"])


def test_pallas_tpu_backend_with_a_head_dim_the_kernel_lacks_says_why(serve):
    with pytest.raises(SystemExit, match="head_dim"):
        serve.main(["--backend", "pallas_tpu", "--num-requests", "2", "--max-tokens", "1"])


def test_a_checkpoint_that_is_missing_or_damaged_is_named_without_a_traceback(serve, tmp_path):
    with pytest.raises(SystemExit, match=f"--checkpoint {tmp_path}: .*config.json"):
        serve.main(["--checkpoint", str(tmp_path), "--num-requests", "2", "--max-tokens", "1"])
    shipped = TINY_CHECKPOINT
    (tmp_path / "config.json").write_bytes((shipped / "config.json").read_bytes())
    (tmp_path / "params.msgpack").write_bytes(b"not the weights")
    with pytest.raises(SystemExit, match="params.msgpack: its SHA-256"):
        serve.main(["--checkpoint", str(tmp_path), "--num-requests", "2", "--max-tokens", "1"])


def test_warm_tokens_per_s_times_every_run_over_the_same_steps(serve):
    report = sys.modules["serving_report"]
    # Step 1 compiled only in the first run: it is left out of both, so both rates
    # cover steps 0 and 2 (a heavy step 1 warm in one run only would skew the ratio).
    on = report.RunResult(
        "on", step_log=[(False, 4, 1.0, False), (True, 64, 9.0, False), (False, 4, 1.0, True)]
    )
    off = report.RunResult(
        "off", step_log=[(False, 4, 2.0, False), (False, 64, 2.0, False), (False, 4, 4.0, True)]
    )
    assert report.warm_tokens_per_s([on, off]) == [4.0, 4 / 3]
    # Of those, the decode-only step 2, and the mean time of the steps with prefill.
    assert report.warm_tokens_per_s([on, off], decode_only=True) == [4.0, 1.0]
    assert report.warm_prefill_ms([on, off]) == [1000.0, 2000.0]
    # Runs of different step counts: each over its own warm steps.
    short = report.RunResult("short", step_log=[(False, 4, 1.0, True), (True, 8, 1.0, True)])
    assert report.warm_tokens_per_s([on, short]) == [4.0, 4.0]
    cold = report.RunResult("cold", step_log=[(True, 1, 1.0, True)])
    assert report.warm_tokens_per_s([cold]) == [None] and report.warm_prefill_ms([cold]) == [None]


class _ScriptedEngine:
    """Stands in for jaxkv.Engine: plays back steps of (ran the model, outputs, blocks
    held while it ran, blocks held after it), each model step timed 1 + 2 + 3 seconds of
    host, device and update."""

    SCRIPT = [
        (True, [], 5, 5),  # a prefill chunk: the model ran, nothing generated
        (True, [(0, 7, False), (1, 8, False)], 9, 9),
        (False, [], 9, 9),  # nothing could be scheduled: the model did not run
        # The peak: both requests take a block for their last token, then finish and
        # free every block before step() returns.
        (True, [(0, 9, True), (1, 10, True)], 11, 0),
    ]

    def __init__(self, model, tokenizer, config):
        self.steps = iter(self.SCRIPT)
        self.last_step, self.left = None, len(self.SCRIPT)
        self.manager = SimpleNamespace(pool=SimpleNamespace(num_blocks=100))
        self.metrics = "metrics"

    def add_request(self, token_ids, params):
        return f"r{token_ids[0]}"

    def has_unfinished_requests(self):
        return self.left > 0

    def step(self):
        ran, outputs, held, held_after = next(self.steps)
        self.left -= 1
        self.manager.num_free_blocks = 100 - 1 - held_after
        if ran:
            first = self.last_step is None
            self.last_step = StepStats(
                host_s=1.0, host_cpu_s=1.0, device_s=2.0, update_s=3.0, num_requests=1,
                num_tokens=1 if outputs else 3, cascade_levels="", new_program=first,
                num_blocks_held=held,
            )  # fmt: skip
        return [
            SimpleNamespace(request_id=f"r{i}", new_token_ids=[t], finished=f)
            for i, t, f in outputs
        ]

    def close(self):
        pass


def test_the_step_log_has_every_step_that_ran_the_model(serve, monkeypatch):
    monkeypatch.setattr(serve, "Engine", _ScriptedEngine)
    prompts = [serve.Prompt(0, "a", [0, 1]), serve.Prompt(1, "b", [1, 2])]
    args = serve.parse_args(["--num-requests", "2", "--max-tokens", "2"])
    console = Console(file=io.StringIO())
    result = serve.serve(None, prompts, args, True, console)
    # The prefill chunk that generated nothing took its time too; the step that ran
    # nothing is not a step.
    assert result.step_log == [(True, 0, 6.0, False), (False, 2, 6.0, True), (False, 2, 6.0, True)]
    # Blocks held while a step ran, those of requests that finished in it included.
    assert result.peak_blocks == 11
    assert result.outputs == [(7, 9), (8, 10)]


def test_seed_help_says_it_also_seeds_random_weights(serve, capsys):
    # Its help said only "seed of the question order", but with random weights it seeds
    # them too: two seeds served two different models.
    import numpy as np
    from flax import nnx
    from jax import tree

    def weights(seed):
        args = serve.parse_args(["--checkpoint", "random", "--seed", str(seed)])
        model, _ = serve.load_model(args, Console(file=io.StringIO()))
        return tree.leaves(nnx.state(model.embed_tokens))

    assert not np.array_equal(weights(0)[0], weights(1)[0])
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    assert "random weights" in " ".join(capsys.readouterr().out.split()).split("--seed SEED")[-1]


def test_too_many_positions_for_a_random_preset_are_refused_before_it_is_built(serve, monkeypatch):
    # The check ran after load_model: --preset llama3_2_1b built 1B random weights (20 s,
    # 5 GB on the CPU) before refusing, and llama3_8b ran out of memory first.
    def load_model(args, console):
        raise AssertionError("the model was built before the flags were checked")

    monkeypatch.setattr(serve, "load_model", load_model)
    argv = ["--preset", "llama3_2_1b", "--max-tokens", "1000000", "--num-requests", "2"]
    with pytest.raises(SystemExit, match="--max-tokens 1000000 need .* the model has 131072"):
        serve.main(argv)


def test_a_pallas_backend_off_its_platform_is_refused_before_the_model_is_built(serve, monkeypatch):
    # The check ran after load_model: --preset llama3_2_1b --backend pallas_gpu on the
    # CPU built 1B random weights (25 s) before saying to add --interpret.
    import jax

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU compiles neither Pallas backend")

    def load_model(args, console):
        raise AssertionError("the model was built before the flags were checked")

    monkeypatch.setattr(serve, "load_model", load_model)
    with pytest.raises(SystemExit, match="--backend pallas_gpu compiles only"):
        serve.main(["--preset", "llama3_2_1b", "--backend", "pallas_gpu", "--num-requests", "2"])


@pytest.mark.parametrize("flag", ["--num-requests", "--prefix-len", "--max-tokens", "--block-size"])
def test_a_size_below_one_is_refused_by_its_flag(serve, capsys, flag):
    with pytest.raises(SystemExit):
        serve.parse_args([flag, "0"])
    assert f"{flag} must be >= 1" in capsys.readouterr().err


def test_a_step_budget_below_one_token_per_request_is_refused(serve, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--num-requests", "8", "--max-batched-tokens", "7"])
    assert "--max-batched-tokens must be >= --num-requests" in capsys.readouterr().err
    assert serve.parse_args(["--num-requests", "8", "--max-batched-tokens", "8"])
