from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxkv.models import TINY_CHECKPOINT, ByteTokenizer, load_checkpoint, make_dense_forward
from jaxkv.models.train import Trainer, _greedy_next_token, greedy_generate
from tests.examples._example_modules import load_example
from tests.models.conftest import random_model, small_config

ROOT = Path(__file__).resolve().parents[2]


def test_byte_tokenizer_round_trips_utf8_and_skips_specials():
    tok = ByteTokenizer()
    text = "Botchan said: “naïve” — 坊っちゃん"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert max(ids[1:-1]) < 256 and len(ids) == len(text.encode()) + 2
    assert tok.decode(ids + [tok.pad_id]) == text
    np.testing.assert_array_equal(tok.encode_array(text), ids[1:-1])


def _example():
    return load_example("train_tiny_lm")


def test_training_example_lowers_held_out_loss_and_saves_a_loadable_checkpoint(tmp_path, capsys):
    # The example with a one-layer width-32 model: the same code path, seconds to compile.
    small = ["num_layers=1", "hidden_size=32", "intermediate_size=64", "num_heads=2"]
    args = [str(tmp_path / "ckpt"), "--steps", "40", "--batch-size", "16", "--seq-len", "32"]
    args += ["--peak-lr", "1e-2", "--warmup-steps", "5", "--eval-batches", "2"]
    args += ["--sample-tokens", "4", *[a for o in small for a in ("--override", o)]]
    result = _example().main(args)
    assert result["initial_eval_loss"] > 5.0  # about ln(259): uniform over bytes
    assert result["eval_loss"] < result["initial_eval_loss"] - 1.5
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert (loaded.config.num_layers, loaded.config.hidden_size) == (1, 32)
    out = capsys.readouterr().out
    assert "step 0: eval loss" in out and "greedy | I was " in out


def test_shipped_tiny_checkpoint_loads_and_predicts_held_out_text():
    model = load_checkpoint(TINY_CHECKPOINT)
    data = ByteTokenizer().encode_array((ROOT / "jaxkv" / "data" / "botchan.txt").read_bytes())
    held_out = data[int(len(data) * 0.9) :]
    windows = held_out[np.arange(0, 8 * 1000, 1000)[:, None] + np.arange(65)]
    logits = np.asarray(make_dense_forward(model)(jnp.asarray(windows[:, :-1])))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    loss = -np.take_along_axis(logp, windows[:, 1:, None], -1).mean()
    # Uniform over bytes is ~5.56 nats; the shipped model reaches ~1.8 on held-out text.
    assert loss < 2.1


def test_greedy_generate_compiles_once_per_model_graph():
    model = load_checkpoint(TINY_CHECKPOINT)
    first = greedy_generate(model, [73, 32], 3, window=64)
    again = greedy_generate(model, [73, 32], 3, window=64)
    other = greedy_generate(model, list(b"The school"), 3, window=64)
    assert first == again and len(other) == 3
    assert _greedy_next_token(nnx.split(model)[0])._cache_size() == 1


def test_trainer_refuses_tokens_that_are_not_ids_of_the_model_and_keeps_its_weights():
    # An id past the vocabulary embedded as NaN: the update left every weight NaN for good
    # (the loss of a good batch after it was nan); a negative id trained on another token.
    cfg = small_config(num_layers=1, vocab_size=16, hidden_size=8, intermediate_size=8)
    trainer = Trainer.create(random_model(cfg), optax.sgd(0.1))
    good = np.random.default_rng(0).integers(0, 16, (2, 5)).astype(np.int32)
    before = trainer.eval_loss(good)
    for bad, match in [
        (np.full((2, 5), 16, np.int32), r"ids in \[0, vocab_size=16\), got 16\.\.16"),
        (np.full((2, 5), -3, np.int32), r"got -3\.\.-3"),
        (good[:, :1], r"shape \(2, 1\) must be an array \[batch, length \+ 1 >= 2\]"),
        (good[0], r"shape \(5,\)"),
        (good.astype(np.float32), "dtype float32 must hold integer token ids"),
        (good.tolist(), "shape None"),
    ]:
        for call in (trainer.step, trainer.eval_loss):
            with pytest.raises(ValueError, match=match):
                call(bad)
    assert trainer.eval_loss(good) == before
    assert np.isfinite(float(trainer.step(good))) and trainer.eval_loss(good) < before


def test_trainer_takes_the_least_batches_and_refuses_an_empty_one_by_shape():
    # One row of two tokens is one prediction; a batch of one id repeated is ids too.
    cfg = small_config(num_layers=1, vocab_size=16, hidden_size=8, intermediate_size=8)
    trainer = Trainer.create(random_model(cfg), optax.sgd(0.1))
    for tokens in (np.array([[3, 9]], np.int32), np.zeros((2, 3), np.int32), np.full((1, 2), 15)):
        assert np.isfinite(trainer.eval_loss(tokens)) and np.isfinite(float(trainer.step(tokens)))
    with pytest.raises(ValueError, match=r"shape \(0, 5\) must be an array \[batch, length"):
        trainer.step(np.zeros((0, 5), np.int32))
