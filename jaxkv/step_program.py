"""The jitted step program: the model forward and the sampler, one per model graph.

Every engine over the same graph (flax NNX GraphDef and parameter tree structure) shares
it, so engines reuse each other's compiles of equal shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx

from jaxkv.sampler import sample


@functools.lru_cache(maxsize=8)
def step_program(graphdef: nnx.GraphDef, state_treedef) -> Callable:
    """The jitted forward + sampler of one model graph, shared by every engine over it.

    Takes the parameters as a flat list of arrays: flattening an nnx.State on every call
    costs Python time per leaf, a flat list goes through jit's C++ fast path.

    `num_logprobs` (static) None returns the sampled tokens, an int also the logprob
    arrays of jaxkv.logprobs.top_logprobs with that many top tokens per row.
    """

    @functools.partial(jax.jit, donate_argnums=3, static_argnames="num_logprobs")
    def program(
        state_leaves, input_ids, positions, kv_caches, metadata, sampling, *, num_logprobs=None
    ):
        state = jax.tree.unflatten(state_treedef, state_leaves)
        model = nnx.merge(graphdef, state)
        logits, kv_caches = model(input_ids, positions, kv_caches, metadata)
        return sample(logits, *sampling, num_logprobs=num_logprobs), kv_caches

    return program
