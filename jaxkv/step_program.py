"""The jitted step program: the model forward and the sampler, one per model graph.

Every engine over the same graph (flax NNX GraphDef and parameter tree structure) shares
it, so engines reuse each other's compiles of equal shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx

from jaxkv.logprobs import top_logprobs
from jaxkv.sampler import sample


@functools.lru_cache(maxsize=8)
def step_program(graphdef: nnx.GraphDef, state_treedef) -> Callable:
    """The jitted forward + sampler of one model graph, shared by every engine over it.

    Takes the parameters as a flat list of arrays: flattening an nnx.State on every call
    costs Python time per leaf, a flat list goes through jit's C++ fast path.

    Returns (sampled, new kv caches, prompt logprobs). `num_logprobs` (static) None makes
    `sampled` the sampled tokens, an int also the logprob arrays of
    jaxkv.logprobs.top_logprobs with that many top tokens per row. `prompt_rows` (a
    jaxkv.prompt_logprobs.PromptRows, or None) are token rows whose top_logprobs, with
    `num_prompt_logprobs` (static) top tokens, against their targets make the prompt
    logprobs; None without them.
    """

    @functools.partial(
        jax.jit, donate_argnums=3, static_argnames=("num_logprobs", "num_prompt_logprobs")
    )
    def program(
        state_leaves, input_ids, positions, kv_caches, metadata, sampling, prompt_rows=None,
        *, num_logprobs=None, num_prompt_logprobs=0,
    ):  # fmt: skip
        state = jax.tree.unflatten(state_treedef, state_leaves)
        model = nnx.merge(graphdef, state)
        if prompt_rows is None:
            logits, kv_caches = model(input_ids, positions, kv_caches, metadata)
            prompt = None
        else:
            hidden, kv_caches = model.hidden_states(input_ids, positions, kv_caches, metadata)
            logits = model.logits(hidden[metadata.logits_indices])
            prompt_logits = model.logits(hidden[prompt_rows.indices])
            prompt = top_logprobs(prompt_logits, prompt_rows.targets, num_prompt_logprobs)
        return sample(logits, *sampling, num_logprobs=num_logprobs), kv_caches, prompt

    return program
