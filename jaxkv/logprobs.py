"""Sample logprobs (SamplingParams.logprobs), as vLLM V1 returns them by default.

Taken from log_softmax of the model's raw logits in float32: before temperature, top-k
and top-p. Each output token gets a dict {token_id: Logprob(logprob, rank)}: the sampled
token first, then the request's k most likely tokens by descending logprob (ties: lowest
id first, as jax.lax.top_k orders them), the sampled one not twice. rank is 1 + the
number of tokens whose logprob is strictly greater.

Device side: top_logprobs, which the step program runs only when asked (a static
width, num_logprobs).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Logprob(NamedTuple):
    """One token's log-probability and rank (1: the most likely), as vLLM's Logprob."""

    logprob: float
    rank: int


def top_logprobs(
    logits: jax.Array,  # f32[S, vocab] the model's raw logits
    tokens: jax.Array,  # i32[S] the sampled tokens
    width: int,  # static: how many top tokens per row
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(top ids i32[S, width], their logprobs f32[S, width], their ranks i32[S, width],
    the sampled tokens' logprobs f32[S], their ranks i32[S])."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, top_ids = jax.lax.top_k(logprobs, width)
    sampled = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > sampled[:, None], axis=-1, dtype=jnp.int32)
    # Every token above a top one is among the top ones: rank among them is exact.
    top_rank = 1 + jnp.sum(top[:, None, :] > top[:, :, None], axis=-1, dtype=jnp.int32)
    return top_ids.astype(jnp.int32), top, top_rank, sampled, rank
