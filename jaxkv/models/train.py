"""Training and sampling helpers for `Llama` on the dense (no-cache) path.

The functional form (graphdef + parameter state, optax on the state) keeps one jitted
program per step with the parameters and optimizer state donated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxkv.field_checks import as_float, as_int
from jaxkv.models.llama import Llama, check_model


def next_token_loss(
    model: Llama,
    tokens: jax.Array,  # i32[B, L + 1]
) -> jax.Array:  # f32[]
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1], in nats.

    Ids are not checked (it runs under jit): one outside [0, vocab_size) gives a NaN or
    silently wrong loss; Trainer.step and eval_loss check theirs."""
    logits = model.dense_forward(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_optimizer(
    *,
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float = 0.1,
    clip_norm: float = 1.0,
    end_lr_ratio: float = 0.1,
) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay, after global-norm gradient clipping.

    Weight decay applies to matrices only (not to norm weights). The learning rate rises
    from 0 to `peak_lr` over `warmup_steps`, then falls along a cosine to `peak_lr *
    end_lr_ratio` at `total_steps` (a run no longer than its warmup warms up, then takes
    one step down to the end value). ValueError naming the argument unless `peak_lr` and
    `clip_norm` are positive (`clip_norm` may be inf: no clipping), `weight_decay` is
    finite and >= 0, `end_lr_ratio` lies in [0, 1], `warmup_steps` is an int >= 0 and
    `total_steps` an int >= 1: anything else trains uphill, not at all, or on NaN.
    """
    reals = (
        ("peak_lr", peak_lr, "finite and > 0", lambda x: 0 < x < math.inf),
        ("weight_decay", weight_decay, "finite and >= 0", lambda x: 0 <= x < math.inf),
        ("clip_norm", clip_norm, "> 0 (inf: no clipping)", lambda x: x > 0),
        ("end_lr_ratio", end_lr_ratio, "in [0, 1]", lambda x: 0 <= x <= 1),
    )
    for name, value, expected, holds in reals:
        if not holds(as_float(value)):  # NaN (a non-number, a bool, NaN) holds nothing
            raise ValueError(f"{name}={value!r} must be a real number {expected}")
    for name, value, low in (("warmup_steps", warmup_steps, 0), ("total_steps", total_steps, 1)):
        if as_int(value) is None or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak_lr,
        warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1),
        end_value=peak_lr * end_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )


@dataclasses.dataclass
class Trainer:
    """Holds the parameters and optimizer state; `step` runs one jitted update in place.

    The trainer owns copies: the model given to `create` and the models `model()` returns
    stay valid after later steps (the update program donates the trainer's own buffers).
    `step` and `eval_loss` refuse (ValueError, nothing changed) tokens that are not an
    integer array [batch, length + 1] of the model's token ids: an id past the embedding
    embeds as NaN, and one NaN update leaves every weight NaN for good.
    """

    graphdef: Any
    params: Any  # nnx.State of nnx.Param
    rest: Any  # nnx.State of everything else (empty for Llama)
    opt_state: Any
    _step: Callable
    _eval: Callable
    _vocab_size: int

    @classmethod
    def create(cls, model: Llama, tx: optax.GradientTransformation) -> Trainer:
        """A trainer of a copy of `model`'s weights, updated by `tx`; ValueError unless
        `model` is a Llama and `tx` an optax transformation (with init and update)."""
        check_model(model)  # None raised AttributeError
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise ValueError(f"tx={type(tx).__name__} must be an optax.GradientTransformation")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = jax.tree.map(jnp.copy, params)  # `step` donates them

        def loss_of(params, rest, tokens):
            return next_token_loss(nnx.merge(graphdef, params, rest), tokens)

        @functools.partial(jax.jit, donate_argnums=(0, 2))
        def step(params, rest, opt_state, tokens):
            loss, grads = jax.value_and_grad(loss_of)(params, rest, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        vocab_size = model.config.vocab_size
        return cls(graphdef, params, rest, tx.init(params), step, jax.jit(loss_of), vocab_size)

    def step(self, tokens: np.ndarray) -> jax.Array:  # tokens: i32[B, L + 1]
        """One optimizer update on `tokens`; returns the loss before the update (async)."""
        _check_tokens(tokens, self._vocab_size)
        self.params, self.opt_state, loss = self._step(
            self.params, self.rest, self.opt_state, tokens
        )
        return loss

    def eval_loss(self, tokens: np.ndarray) -> float:  # tokens: i32[B, L + 1]
        _check_tokens(tokens, self._vocab_size)
        return float(self._eval(self.params, self.rest, tokens))

    def model(self) -> Llama:
        """A model holding a copy of the current parameters (unchanged by later steps)."""
        return nnx.merge(self.graphdef, jax.tree.map(jnp.copy, self.params), self.rest)


def _check_tokens(tokens, vocab_size: int) -> None:
    """ValueError unless `tokens` is an integer array [batch >= 1, length + 1 >= 2] of ids
    in [0, vocab_size): a negative id would wrap to another token, a larger one embed as
    NaN, and a single position leave no token to predict (a mean of nothing: NaN)."""
    shape, dtype = getattr(tokens, "shape", None), getattr(tokens, "dtype", None)
    if shape is None or dtype is None or len(shape) != 2 or shape[0] < 1 or shape[1] < 2:
        raise ValueError(f"tokens of shape {shape} must be an array [batch, length + 1 >= 2]")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"tokens of dtype {dtype} must hold integer token ids")
    low, high = int(tokens.min()), int(tokens.max())
    if not 0 <= low <= high < vocab_size:
        raise ValueError(f"tokens must be ids in [0, {vocab_size=}), got {low}..{high}")


@functools.lru_cache(maxsize=8)
def _greedy_next_token(graphdef: nnx.GraphDef):
    """The jitted argmax of the dense forward at one position, shared by calls on one graph."""

    @jax.jit
    def next_token(state, buf, last):
        logits = nnx.merge(graphdef, state).dense_forward(buf)
        return jnp.argmax(logits[0, last])

    return next_token


def greedy_generate(
    model: Llama,
    prompt: list[int],
    num_new_tokens: int,
    *,
    window: int = 256,
    pad_id: int = 0,
) -> list[int]:
    """Greedy continuation of `prompt` with the dense forward (no cache; for small models).

    Runs on a fixed [1, window] buffer, so it compiles once per model graph and window
    (calls with other prompts reuse the program); the context is the last `window` tokens.
    Causal attention means the padding after the context never matters, as long as it is
    a token id of the model: ValueError for a `model` that is not a Llama, a `prompt` that
    is not a sequence (or 1-D array) of ints, a `pad_id` or prompt id outside the
    vocabulary, a `window` below 1 or a negative `num_new_tokens`.
    """
    check_model(model)  # .config raised AttributeError
    # None or an int raised TypeError from len(); a set or a dict was read in no set order.
    if not (isinstance(prompt, Sequence) or getattr(prompt, "ndim", None) == 1):
        raise ValueError(
            f"prompt={type(prompt).__name__} must be a sequence or 1-D array of token ids"
        )
    if len(prompt) == 0:
        raise ValueError("prompt must hold at least one token")
    if any(as_int(t) is None for t in prompt):  # 3.7 would be cut to 3 in the buffer
        raise ValueError(f"prompt must hold int token ids, got {list(prompt)[:8]!r}")
    if as_int(window) is None or window < 1:
        raise ValueError(f"{window=} must be an int >= 1")
    if as_int(num_new_tokens) is None or num_new_tokens < 0:
        raise ValueError(f"{num_new_tokens=} must be an int >= 0")
    vocab = model.config.vocab_size
    # An id past the embedding table embeds as NaN, and NaN * 0 is NaN.
    if as_int(pad_id) is None or not 0 <= pad_id < vocab:
        raise ValueError(f"{pad_id=} must be a token id in [0, {vocab})")
    if not 0 <= min(prompt) <= max(prompt) < vocab:
        raise ValueError(f"prompt ids must lie in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
    graphdef, state = nnx.split(model)
    next_token = _greedy_next_token(graphdef)
    tokens = list(prompt)
    for _ in range(num_new_tokens):
        context = tokens[-window:]
        buf = np.full((1, window), pad_id, dtype=np.int32)
        buf[0, : len(context)] = context
        tokens.append(int(next_token(state, buf, len(context) - 1)))
    return tokens[len(prompt) :]
