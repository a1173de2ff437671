"""examples/serve_shared_prefix.py around its serving runs (stubbed here): where its model
comes from, the engine it configures, the backend it falls back to, and its exit status
run as a script."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from benchmarks import kv_memory
from jaxkv.metrics import StepStats
from tests.examples._example_modules import load_example


@pytest.fixture(scope="module")
def serve():
    return load_example("serve_shared_prefix")


@pytest.fixture(scope="module")
def serve_args(serve):
    return sys.modules["serve_shared_prefix_args"]  # its command line, loaded with it


def test_the_default_checkpoint_is_the_shipped_one_else_the_cached_else_trained(
    serve, monkeypatch, tmp_path
):
    shipped, cached = tmp_path / "shipped", tmp_path / "cached"
    monkeypatch.setattr(serve, "TINY_CHECKPOINT", shipped)
    monkeypatch.setattr(serve, "CACHED_CHECKPOINT", cached)
    trained = []

    def train(argv):
        trained.append(argv)
        (cached / "params.msgpack").write_bytes(b"weights")

    cached.mkdir()
    monkeypatch.setitem(sys.modules, "train_tiny_lm", SimpleNamespace(main=train))
    out = io.StringIO()
    assert serve._default_checkpoint(Console(file=out)) == cached
    assert trained == [[str(cached)]] and "No tiny checkpoint found: training one" in out.getvalue()
    assert serve._default_checkpoint(Console(file=out)) == cached  # now cached: no training
    shipped.mkdir()
    (shipped / "params.msgpack").write_bytes(b"weights")
    assert serve._default_checkpoint(Console(file=out)) == shipped
    assert len(trained) == 1


def test_the_engine_on_an_accelerator_takes_power_of_two_token_buckets(
    serve, serve_args, monkeypatch
):
    # On the CPU every step runs one token bucket (compiling dominates); elsewhere steps
    # as small as 64 tokens get their own programs.
    import jax

    args = serve.parse_args(["--num-requests", "4", "--max-batched-tokens", "512"])
    prompts = serve_args.workload(args.num_requests, args.prefix_len, args.seed)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert serve.engine_config(args, prompts, True).min_num_tokens_bucket == 512
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert serve.engine_config(args, prompts, True).min_num_tokens_bucket == 64
    args.max_batched_tokens = 32
    assert serve.engine_config(args, prompts, True).min_num_tokens_bucket == 32


def _fake_runs(serve, monkeypatch, identical=True):
    """Stands in for the serving runs and their report: returns the (backend, cascade) of
    each run served."""
    served = []
    metrics = SimpleNamespace(
        as_dict=dict, prefix_cache_hit_rate=0.5, cascade_steps=1, cascade_steps_by_levels={},
        num_steps=2,
    )  # fmt: skip

    def fake_serve(model, prompts, args, cascade, console):
        served.append((args.backend, cascade))
        run = serve.RunResult("cascade on" if cascade else "cascade off", metrics=metrics)
        run.outputs = [(7,) for _ in prompts]
        return run

    monkeypatch.setattr(serve, "serve", fake_serve)
    monkeypatch.setattr(serve, "print_samples", lambda *a: None)
    monkeypatch.setattr(serve, "print_report", lambda *a: identical)
    return served


def test_random_weights_fall_back_from_the_default_pallas_tpu_once(serve, monkeypatch, capsys):
    # The model is checked once, before random weights are built; checked again after,
    # the fallback it had made (args.backend set to xla) read as a --backend pallas_tpu
    # the user asked for, and the run was refused.
    served = _fake_runs(serve, monkeypatch)
    monkeypatch.setattr(serve, "default_backend", lambda: "pallas_tpu")  # as on a TPU
    argv = ["--checkpoint", "random", "--num-requests", "2", "--max-tokens", "1"]
    summary = serve.main(argv)
    out = " ".join(capsys.readouterr().out.split())
    assert served == [("xla", True), ("xla", False)]
    assert out.count("Using the xla attention backend: the Pallas TPU kernel needs") == 1
    assert "model: tiny, random weights" in out and "engine: backend xla" in out
    assert summary["outputs_identical"] is True


def test_the_workload_is_built_once(serve, serve_args, monkeypatch):
    # parse_args built it to check --block-size against the longest prompt, and main
    # built it again (3 s for 200,000 requests).
    _fake_runs(serve, monkeypatch)
    built, build = [], serve_args.workload

    def workload(*args):
        built.append(args)
        return build(*args)

    monkeypatch.setattr(serve_args, "workload", workload)
    summary = serve.main(["--checkpoint", "random", "--num-requests", "3", "--max-tokens", "1"])
    assert built == [(3, 384, 0)] and summary["num_requests"] == 3


class _OneStepEngine:
    """Stands in for jaxkv.Engine: one step in which every request generates one token
    and finishes."""

    def __init__(self, model, tokenizer, config):
        self.requests, self.last_step = [], None
        self.metrics = SimpleNamespace(
            as_dict=dict, prefix_cache_hit_rate=0.5, cascade_steps=1,
            cascade_steps_by_levels={}, num_steps=1,
        )  # fmt: skip

    def add_request(self, token_ids, params):
        self.requests.append(f"r{len(self.requests)}")
        return self.requests[-1]

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.last_step = StepStats(1.0, 1.0, 1.0, 1.0, len(self.requests), 1, "", False)
        done, self.requests = self.requests, []
        return [SimpleNamespace(request_id=r, new_token_ids=[7], finished=True) for r in done]

    def close(self):
        pass


@pytest.mark.parametrize("identical", [True, False])
def test_the_script_exits_non_zero_when_cascade_changed_the_tokens(serve, monkeypatch, identical):
    # Run as a script (python examples/serve_shared_prefix.py), its exit status says
    # whether cascade on and off generated the same tokens.
    import runpy

    import jaxkv

    report = sys.modules["serving_report"]
    monkeypatch.setattr(jaxkv, "Engine", _OneStepEngine)
    monkeypatch.setattr(report, "print_samples", lambda *a: None)
    monkeypatch.setattr(report, "print_report", lambda *a: identical)
    argv = ["--checkpoint", "random", "--num-requests", "2", "--max-tokens", "1"]
    monkeypatch.setattr(sys, "argv", ["serve_shared_prefix.py", *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout on it
    path = str(serve.REPO / "examples" / "serve_shared_prefix.py")
    if identical:
        assert runpy.run_path(path, run_name="__main__")["summary"]["outputs_identical"]
    else:
        with pytest.raises(SystemExit, match="cascade on and off generated different tokens"):
            runpy.run_path(path, run_name="__main__")


def _no_model(*_):
    raise AssertionError("the model was loaded")


def test_sizes_past_the_engines_int32_bounds_are_refused_before_the_model_loads(serve, monkeypatch):
    # EngineConfig's ValueError came as a traceback after the model was loaded; then it
    # named the config's field, max_num_batched_tokens, not the flag.
    monkeypatch.setattr(serve, "load_model", _no_model)
    with pytest.raises(SystemExit, match="--max-batched-tokens 2147483648 must be an int in"):
        serve.main(["--max-batched-tokens", str(2**31)])


def test_requests_past_the_int32_kv_slots_are_refused_before_the_workload_is_built(
    serve, serve_args, monkeypatch, capsys
):
    # --num-requests 2**31 built the workload first: terabytes of token lists.
    def workload(*args):
        raise AssertionError("the workload was built")

    monkeypatch.setattr(serve_args, "workload", workload)
    with pytest.raises(SystemExit):
        serve.parse_args(["--num-requests", str(2**31)])
    err = " ".join(capsys.readouterr().err.split())
    assert "--num-requests 2147483648: its requests (--prefix-len, a question and" in err
    assert "more than the 2**31 that the device's int32 slot ids address" in err


def test_requests_are_refused_past_the_int32_kv_slots_of_their_whole_blocks(
    serve, serve_args, capsys
):
    # One request and its null block fill 2**31 slots exactly; one more token needs a
    # block more. It was refused in main, naming the engine's num_blocks, not a flag.
    prompt_len = len(serve_args.workload(1, 384, 0)[0].token_ids)
    fits = 2**31 - 16 - prompt_len
    args = serve.parse_args(["--num-requests", "1", "--max-tokens", str(fits)])
    assert args.max_tokens == fits
    with pytest.raises(SystemExit):
        serve.parse_args(["--num-requests", "1", "--max-tokens", str(fits + 1)])
    err = " ".join(capsys.readouterr().err.split())
    assert (
        "--num-requests 1: its requests (--prefix-len, a question and --max-tokens each) need"
        in err
    )
    assert "2147483664 KV slots (whole blocks of 16, and the null block), more than" in err


@pytest.mark.parametrize("block_size", [100000, 2**31])
def test_a_block_longer_than_any_request_is_refused_by_its_flag(serve, capsys, block_size):
    # --block-size 100000 was accepted: 65 blocks of 100,000 tokens, 13 GB of KV for
    # requests of at most 472 tokens.
    with pytest.raises(SystemExit):
        serve.parse_args(["--block-size", str(block_size)])
    err = capsys.readouterr().err
    assert f"--block-size {block_size} must be at most 472, the tokens of the longest" in err
    assert serve.parse_args(["--block-size", "472"]).block_size == 472


def test_a_kv_cache_past_the_devices_memory_is_refused_before_the_model_is_built(
    serve, monkeypatch
):
    # 64 requests' 1895 blocks of 16 tokens and the null block, at 2 KiB a token: 59.2 MiB.
    monkeypatch.setattr(serve, "load_model", _no_model)
    monkeypatch.setattr(kv_memory, "device_memory_bytes", lambda: 32 << 20)
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--checkpoint", "random"])
    message = "the KV cache, 1896 blocks of 16 tokens, needs 59.2 MiB, and the weights 3.1 MiB"
    assert f"{message}: more than the 32.0 MiB" in str(exit_info.value)
