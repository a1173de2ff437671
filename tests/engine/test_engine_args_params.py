"""Engine takes a model only if it is an nnx.Module Llama, and params only as the model's
state: same tree structure (not merely as many leaves), concrete jax or numpy arrays."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv import SamplingParams
from jaxkv.engine import Engine
from tests.engine._util import engine_config, tiny_model


class _DuckLlama:
    """Has a Llama's config and init_kv_caches, but is no nnx.Module."""

    def __init__(self):
        model = tiny_model()
        self.config = model.config
        self.init_kv_caches = model.init_kv_caches


def test_a_model_that_is_no_nnx_module_is_refused_by_name():
    with pytest.raises(ValueError, match="model=_DuckLlama must be a jaxkv.models.Llama"):
        Engine(_DuckLlama(), None, engine_config())


def test_params_with_the_models_leaves_but_not_its_structure_are_refused():
    leaves = jax.tree.leaves(nnx.state(tiny_model()))
    with pytest.raises(ValueError, match=f"params: a list with {len(leaves)} leaves must be"):
        Engine(tiny_model(), leaves, engine_config())


def test_numpy_params_serve_as_the_models_own():
    model = tiny_model()
    params = jax.tree.map(np.asarray, nnx.state(model))
    prompts, sampling = [[1, 2, 3], [7, 8]], SamplingParams(max_tokens=4)
    engine = Engine(model, params, engine_config())
    got = [o.output_token_ids for o in engine.generate(prompts, sampling, progress=False)]
    plain = Engine(model, None, engine_config())
    want = [o.output_token_ids for o in plain.generate(prompts, sampling, progress=False)]
    assert got == want and all(len(t) == 4 for t in got)


def test_params_given_replace_the_weights_the_model_holds():
    """Negated weights give other tokens than the model's own: the params are used."""
    model = tiny_model()
    params = jax.tree.map(lambda x: -np.asarray(x), nnx.state(model))
    prompts, sampling = [[1, 2, 3], [7, 8]], SamplingParams(max_tokens=4, ignore_eos=True)
    engine = Engine(model, params, engine_config())
    got = [o.output_token_ids for o in engine.generate(prompts, sampling, progress=False)]
    plain = Engine(model, None, engine_config())
    want = [o.output_token_ids for o in plain.generate(prompts, sampling, progress=False)]
    assert got != want
