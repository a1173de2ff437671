"""examples/train_tiny_lm.py as a user runs it: bad flags refused by name before any
training, a run repeatable from its seed, its checkpoint served by the engine, and the
shipped checkpoint's README matching the script's defaults."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

from jaxkv import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig
from jaxkv.models import ByteTokenizer, load_checkpoint
from jaxkv.models.checkpoint import flat_params
from tests.examples._example_modules import load_example

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["num_layers=1", "hidden_size=32", "intermediate_size=64", "num_heads=2"]
QUICK = ["--steps", "1", "--batch-size", "1", "--seq-len", "8", "--eval-batches", "1"]
QUICK += ["--sample-tokens", "0", *[a for o in SMALL for a in ("--override", o)]]


def _example():
    return load_example("train_tiny_lm")


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--peak-lr", "0"),
        ("--peak-lr", "-1e-3"),
        ("--peak-lr", "nan"),
        ("--peak-lr", "inf"),
        ("--warmup-steps", "-1"),
        ("--sample-tokens", "-1"),
        ("--seed", "-1"),
        ("--seed", str(2**63)),  # past jax.random.key's int64: OverflowError after setup
        ("--seq-len", "1025"),  # past the tiny preset's max_position_embeddings
    ],
)
def test_bad_flags_are_refused_by_name_before_training(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit):
        _example().parse_args([str(tmp_path / "ckpt"), flag, value])
    assert f"{flag} " in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("kind", ["file", "empty"])
def test_a_checkpoint_path_it_cannot_write_a_folder_at_is_refused_before_training(
    tmp_path, capsys, kind
):
    # A file there trained for minutes, then died in save_checkpoint's mkdir with
    # FileExistsError, the run lost; "" (an unset shell variable) wrote into the cwd.
    file = tmp_path / "ckpt"
    file.write_text("keep")
    with pytest.raises(SystemExit):
        _example().parse_args([str(file) if kind == "file" else ""])
    err = capsys.readouterr().err
    assert "argument checkpoint:" in err
    assert ("is a file; give a folder" if kind == "file" else "is empty") in err
    assert file.read_text() == "keep"


def test_defaults_and_the_largest_seq_len_are_accepted(tmp_path):
    example = _example()
    example.parse_args([str(tmp_path), "--seq-len", "1024", "--warmup-steps", "0"])
    args = example.parse_args([str(tmp_path)])
    # What jaxkv/data/tiny/README.md says the shipped checkpoint was made with.
    readme = (ROOT / "jaxkv" / "data" / "tiny" / "README.md").read_text()
    pattern = r"(\d+) steps of (\d+) x (\d+) bytes, AdamW peak ([\d.e-]+), seed (\d+)"
    made = re.search(pattern, readme)
    assert made is not None
    want = (int(made[1]), int(made[2]), int(made[3]), float(made[4]), int(made[5]))
    assert (args.steps, args.batch_size, args.seq_len, args.peak_lr, args.seed) == want
    assert f"{args.config.num_params:,} parameters" in readme


def test_two_runs_with_one_seed_save_identical_weights_that_an_engine_serves(tmp_path):
    example = _example()
    for name in ("a", "b"):
        example.main([str(tmp_path / name), *QUICK, "--seed", "3"])
    a, b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    assert a.config == b.config
    pa, pb = flat_params(a), flat_params(b)
    assert all(np.array_equal(np.asarray(pa[k]), np.asarray(pb[k])) for k in pa)
    tok = ByteTokenizer()
    config = EngineConfig(
        cache=CacheConfig(num_blocks=16, block_size=8),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2, max_model_len=32),
    )
    with Engine(a, config=config, tokenizer=tok) as engine:
        engine.add_request(tok.encode("I was "), SamplingParams(max_tokens=3, ignore_eos=True))
        new, finished = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                new += out.new_token_ids
                finished.append(out.finished)
    assert len(new) == 3 and finished[-1]


def test_a_corpus_too_short_for_one_window_is_refused_by_name_before_training(tmp_path, capsys):
    # Used to fail with numpy's IndexError (eval windows past the held-out bytes) or
    # "high <= 0" (no training window to draw). 81 bytes: 72 train, 9 held out.
    example = _example()
    corpus = tmp_path / "corpus.txt"
    for size, refused in ((80, True), (81, False)):
        corpus.write_bytes(b"x" * size)
        argv = [str(tmp_path / "ckpt"), "--corpus", str(corpus), "--seq-len", "8"]
        if refused:
            with pytest.raises(SystemExit):
                example.parse_args(argv)
            assert "--corpus " in capsys.readouterr().err
            continue
        example.parse_args(argv)
        data = np.arange(size, dtype=np.int32)
        split = example.train_size(size)
        assert example.eval_windows(data[split:], 2, 3, 9)[0].shape == (3, 9)
        rng = np.random.default_rng(0)
        assert example.random_windows(data[:split], rng, 4, 9).shape == (4, 9)
    with pytest.raises(SystemExit):
        example.parse_args([str(tmp_path / "ckpt"), "--corpus", str(tmp_path / "absent.txt")])
    assert "--corpus " in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_a_corpus_that_is_a_folder_is_refused_by_name_before_training(tmp_path, capsys):
    # A folder's stat size (4096 bytes, say) was taken for its text's: with a short
    # --seq-len the run built its model, then died reading it with IsADirectoryError.
    folder = tmp_path / "texts"
    folder.mkdir()
    with pytest.raises(SystemExit):
        _example().parse_args([str(tmp_path / "ckpt"), "--corpus", str(folder), "--seq-len", "8"])
    err = capsys.readouterr().err
    assert "--corpus " in err and "is a folder" in err
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_path_under_a_file_is_refused_before_training(tmp_path, capsys):
    # The run trained to the end, then save_checkpoint's mkdir raised NotADirectoryError.
    file = tmp_path / "notes.txt"
    file.write_text("keep")
    for path in (file / "ckpt", file / "a" / "ckpt"):
        with pytest.raises(SystemExit):
            _example().parse_args([str(path)])
        err = capsys.readouterr().err
        assert "argument checkpoint:" in err and "is a file, not a folder" in err
    assert file.read_text() == "keep"


@pytest.mark.parametrize("kind", ["read_only", "proc"])
def test_a_checkpoint_path_it_cannot_write_in_is_refused_before_training(kind, tmp_path, capsys):
    # The run trained to the end, then save_checkpoint's mkdir or write raised
    # PermissionError (FileNotFoundError under /proc) and lost it.
    if kind == "proc":  # refuses new files to root too
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc")
        folder = Path("/proc")
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        folder = tmp_path / "read_only"
        folder.mkdir(mode=0o555)
    for path in (folder, folder / "ckpt", folder / "a" / "ckpt"):
        with pytest.raises(SystemExit):
            _example().parse_args([str(path)])
        err = capsys.readouterr().err
        assert "argument checkpoint:" in err and "cannot write in" in err
    assert not (folder / "ckpt").exists() and not (folder / "a").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("num_layers", "'num_layers' must be FIELD=INT with FIELD one of ["),
        ("depth=2", "'depth=2' must be FIELD=INT with FIELD one of ["),
        ("num_layers=two", "'num_layers=two': 'two' is not an int"),
        ("vocab_size=100", "vocab_size=100 must hold the byte tokenizer's 259 ids"),
    ],
)
def test_a_bad_override_is_refused_by_name_before_training(tmp_path, capsys, override, message):
    with pytest.raises(SystemExit):
        _example().parse_args([str(tmp_path / "ckpt"), "--override", override])
    assert f"--override: {message}" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_run_as_a_script_it_evaluates_every_eval_every_steps_and_saves(
    tmp_path, monkeypatch, capsys
):
    # The held-out loss is printed after every --eval-every steps but the last, whose
    # evaluation is the final one.
    import runpy
    import sys

    argv = [str(tmp_path / "ckpt"), *QUICK, "--steps", "3", "--eval-every", "1"]
    monkeypatch.setattr(sys, "argv", ["train_tiny_lm.py", *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout on it
    runpy.run_path(str(ROOT / "examples" / "train_tiny_lm.py"), run_name="__main__")
    out = capsys.readouterr().out
    evals = re.findall(r"^step (\d+): train loss [\d.]+, eval loss [\d.]+$", out, re.M)
    assert evals == ["1", "2"]
    assert "done: 3 steps in" in out
    assert load_checkpoint(tmp_path / "ckpt").config.num_layers == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        # 2e13 parameters: accepted, then building the model failed.
        (["--override", "num_layers=100000000"], "parameters need 286.5 TiB with their"),
        # A billion windows of 512 tokens: 482 TiB of float32 logits a step.
        (["--batch-size", "1000000000"], "and a batch's logits 482.4 TiB: more than the"),
    ],
)
def test_a_run_past_the_devices_memory_is_refused_by_its_flags(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        _example().parse_args([str(tmp_path / "ckpt"), *argv])
    err = capsys.readouterr().err
    assert "--override, --batch-size and --seq-len: the model's" in err and message in err
