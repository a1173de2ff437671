"""Training helpers against plain oracles: the loss in float64 numpy, the optimizer by its
formulas (warmup-cosine learning rate, decoupled weight decay on matrices only, Adam on
globally clipped gradients), greedy decoding by argmax of the numpy model."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxkv.models.train import Trainer, greedy_generate, make_optimizer
from tests.models.conftest import random_model, small_config
from tests.models.reference import hf_llama_forward, random_hf_weights

CONFIG = small_config(num_layers=1)


def test_eval_loss_is_the_mean_next_token_cross_entropy():
    weights = random_hf_weights(CONFIG, seed=2)
    model = random_model(CONFIG, seed=2)
    tokens = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 7)).astype(np.int32)
    nll = []
    for row in tokens:
        logits = hf_llama_forward(weights, CONFIG, row[:-1])  # f64[6, vocab]
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll.extend(-logp[np.arange(6), row[1:]])
    got = Trainer.create(model, optax.sgd(0.0)).eval_loss(tokens)
    assert math.isclose(got, float(np.mean(nll)), rel_tol=1e-5)


def _updates(tx, params, grads_per_step):
    """params after one optimizer update per entry of grads_per_step (one jitted program)."""

    @jax.jit
    def run(params, grads_per_step):
        state = tx.init(params)
        for grads in grads_per_step:
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params

    return run(params, grads_per_step)


def test_learning_rate_and_weight_decay_follow_the_schedule_on_matrices_only():
    peak, end_ratio, wd = 0.2, 0.25, 0.5
    tx = make_optimizer(peak_lr=peak, warmup_steps=1, total_steps=3, weight_decay=wd,
                        end_lr_ratio=end_ratio)  # fmt: skip
    params = {"kernel": jnp.ones((2, 2)), "norm": jnp.ones(2)}
    zero = {k: jnp.zeros_like(v) for k, v in params.items()}
    got = _updates(tx, params, [zero] * 4)
    # Zero gradients: Adam moves nothing, decay multiplies by (1 - lr * wd) per step, with
    # lr 0 (warmup start), peak, halfway down the cosine, the end value.
    end = peak * end_ratio
    lrs = [0.0, peak, (peak + end) / 2, end]
    np.testing.assert_allclose(got["kernel"], np.prod([1 - lr * wd for lr in lrs]), rtol=1e-6)
    np.testing.assert_array_equal(got["norm"], np.ones(2))


def test_a_run_no_longer_than_its_warmup_warms_up_then_ends_at_the_default_end_lr():
    # total_steps <= warmup_steps (e.g. a short run of the example with its default
    # warmup) still builds: warmup, then one step down to the end value. The defaults
    # apply: weight decay 0.1 and an end learning rate a tenth of the peak.
    peak = 0.2
    tx = make_optimizer(peak_lr=peak, warmup_steps=2, total_steps=2)
    params = {"kernel": jnp.ones((2, 2))}
    got = _updates(tx, params, [{"kernel": jnp.zeros((2, 2))}] * 5)
    lrs = [0.0, peak / 2, peak, peak * 0.1, peak * 0.1]
    np.testing.assert_allclose(got["kernel"], np.prod([1 - lr * 0.1 for lr in lrs]), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"peak_lr": -0.1}, "peak_lr=-0.1 must be a real number finite and > 0"),  # uphill
        ({"peak_lr": 0.0}, "peak_lr=0.0 must"),  # trains nothing
        ({"peak_lr": math.nan}, "peak_lr=nan must"),  # every weight NaN after a step
        ({"peak_lr": None}, "peak_lr=None must"),  # a TypeError from the schedule
        ({"peak_lr": "0.1"}, "peak_lr='0.1' must"),
        ({"peak_lr": True}, "peak_lr=True must"),
        ({"peak_lr": math.inf}, "peak_lr=inf must"),  # every weight NaN after a step
        ({"weight_decay": math.inf}, "weight_decay=inf must be a real number finite and >= 0"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 must be a real number finite and >= 0"),
        ({"clip_norm": 0.0}, r"clip_norm=0.0 must be a real number > 0 \(inf: no clipping\)"),
        ({"end_lr_ratio": -0.5}, r"end_lr_ratio=-0.5 must be a real number in \[0, 1\]"),
        ({"end_lr_ratio": 2.0}, "end_lr_ratio=2.0 must"),
        ({"warmup_steps": -1}, "warmup_steps=-1 must be an int >= 0"),  # optax took it
        ({"warmup_steps": 2.5}, "warmup_steps=2.5 must be an int"),
        ({"total_steps": 0}, "total_steps=0 must be an int >= 1"),
        ({"total_steps": -3}, "total_steps=-3 must be an int >= 1"),
    ],
)
def test_make_optimizer_refuses_what_cannot_train_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_optimizer(**{"peak_lr": 0.1, "warmup_steps": 1, "total_steps": 10, **kwargs})
    # The bounds themselves are settings that train: no warmup, no clipping, no decay.
    make_optimizer(peak_lr=0.1, warmup_steps=0, total_steps=1, weight_decay=0.0,
                   clip_norm=math.inf, end_lr_ratio=1.0)  # fmt: skip
    make_optimizer(peak_lr=0.1, warmup_steps=0, total_steps=1, end_lr_ratio=0.0)


@pytest.mark.parametrize(("kwargs", "clip"), [({}, 1.0), ({"clip_norm": 2.0}, 2.0)])
def test_adam_runs_on_gradients_clipped_to_the_global_norm(kwargs, clip):
    # clip_norm is the bound the gradients are clipped to; 1.0 by default.
    b1, b2, eps, peak = 0.9, 0.95, 1e-8, 0.1
    tx = make_optimizer(peak_lr=peak, warmup_steps=1, total_steps=1000, **kwargs)
    grads = [np.array([60.0, 80.0]), np.array([0.3, 0.4])]  # global norms 100 and 0.5
    got = _updates(tx, {"b": jnp.zeros(2)}, [{"b": jnp.asarray(g)} for g in grads])["b"]
    clipped = [g * min(1.0, clip / np.linalg.norm(g)) for g in grads]
    m = (1 - b1) * (b1 * clipped[0] + clipped[1])
    v = (1 - b2) * (b2 * clipped[0] ** 2 + clipped[1] ** 2)
    # The first update has learning rate 0 (warmup start); the second the peak.
    want = -peak * (m / (1 - b1**2)) / (np.sqrt(v / (1 - b2**2)) + eps)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_greedy_generate_takes_the_argmax_of_the_last_window_tokens():
    weights = random_hf_weights(CONFIG, seed=4, std=0.5)
    model = random_model(CONFIG, seed=4, std=0.5)
    prompt = np.random.default_rng(5).integers(0, CONFIG.vocab_size, 10).tolist()
    window, seq = 8, list(prompt)
    for _ in range(4):
        logits = hf_llama_forward(weights, CONFIG, np.array(seq[-window:]))[-1]
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 1e-3, "near-tie: pick another seed"
        seq.append(int(np.argmax(logits)))
    assert greedy_generate(model, prompt, 4, window=window) == seq[len(prompt) :]


def test_greedy_generate_refuses_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        greedy_generate(random_model(CONFIG), [], 1)
