"""Sample logprobs (SamplingParams.logprobs), as vLLM V1 returns them by default.

Taken from log_softmax of the model's raw logits in float32: before penalties,
min_tokens' ban, temperature, min_p, top-k and top-p. Each output token gets a dict
{token_id: Logprob(logprob, rank, decoded_token)}: the sampled token first, then the
request's k most likely tokens by descending logprob (ties: lowest id first, as
jax.lax.top_k orders them), the sampled one not twice. rank is 1 + the number of tokens
whose logprob is strictly greater, so tied tokens share a rank (vLLM ranks a top-k entry
by its position, and the sampled token by the count of tokens at least as likely: ties
differ from vLLM's, nothing else does). decoded_token is the token's own text
(jaxkv.token_texts) when the Engine has a tokenizer, else None.

Device side: top_logprobs, which the step program runs only for a batch where some
request asked (a static width: the engine's max_logprobs). Host side: StepLogprobs
hands one step's rows to the RequestOutputs of the requests that asked.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.step_inputs import in_schedule_order


class Logprob(NamedTuple):
    """One token's log-probability, rank (1: the most likely) and text, as vLLM's Logprob:
    decoded_token is the token decoded alone (jaxkv.token_texts), or None when the Engine
    has no tokenizer."""

    logprob: float
    rank: int
    decoded_token: str | None = None


logprob_of = functools.partial(tuple.__new__, Logprob)  # Logprob((lp, rank, text)), faster


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


def logprob_entry(
    token: int, logprob: float, rank: int, top_ids: list, top: list, top_rank: list, texts
) -> dict:
    """One position's dict in the format of this module: `token` (the sampled or prompt
    one) first, then the top ones in the order given, `token` not twice; decoded_token
    from `texts` (token id -> text; None: None for every token)."""
    if texts is None:
        entry = {token: logprob_of((logprob, rank, None))}
        for t, lp, r in zip(top_ids, top, top_rank, strict=True):
            if t not in entry:
                entry[t] = logprob_of((lp, r, None))
        return entry
    entry = {token: logprob_of((logprob, rank, texts[token]))}
    for t, lp, r in zip(top_ids, top, top_rank, strict=True):
        if t not in entry:
            entry[t] = logprob_of((lp, r, texts[t]))
    return entry


class StepLogprobs:
    """One step's top_logprobs on the host, first `n` rows in schedule order; `texts`
    (jaxkv.token_texts.TokenTexts, None without a tokenizer) gives decoded_token."""

    def __init__(self, arrays, n: int, order: np.ndarray | None, texts=None):
        ids, top, top_rank, sampled, rank = (in_schedule_order(a, n, order) for a in arrays)
        self._top = (ids, top, top_rank)
        self._sampled = sampled.tolist(), rank.tolist()
        self._texts = texts

    def attach(self, outputs: list, requests: list, wanted: dict[str, int]) -> list:
        """`outputs` (RequestOutputs of the scheduled `requests`, rows in that order) with
        their logprobs where their request is in `wanted` (request id -> its k)."""
        rows = {r.request_id: i for i, r in enumerate(requests) if r.request_id in wanted}
        ids, top, top_rank = self._top
        sampled, rank = self._sampled
        texts = self._texts
        for j, output in enumerate(outputs):
            i = rows.get(output.request_id)
            if i is None:
                continue
            k = wanted[output.request_id]
            entry = logprob_entry(
                output.new_token_ids[0], sampled[i], rank[i],
                ids[i, :k].tolist(), top[i, :k].tolist(), top_rank[i, :k].tolist(), texts,
            )  # fmt: skip
            outputs[j] = output._replace(logprobs=(entry,))
        return outputs
