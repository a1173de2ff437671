"""Engine refuses constructor arguments of the wrong kind by name, before it builds anything."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxkv import SamplingParams
from jaxkv.config import SchedulerConfig
from jaxkv.engine import Engine
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.engine._util import MAX_MODEL_LEN, engine_config, tiny_model


def _params_with_a_wrong_shape():
    state = nnx.state(tiny_model())
    leaves, treedef = jax.tree.flatten(state)
    leaves[0] = jnp.zeros((*leaves[0].shape[:-1], leaves[0].shape[-1] + 1), leaves[0].dtype)
    return jax.tree.unflatten(treedef, leaves)


def _config_longer_than_the_model():
    config = engine_config()  # the tiny model has max_position_embeddings=MAX_MODEL_LEN
    longer = dataclasses.replace(config.scheduler, max_model_len=MAX_MODEL_LEN + 1)
    return dataclasses.replace(config, scheduler=longer)


def _params_mapped(leaf_of):
    return jax.tree.map(leaf_of, nnx.state(tiny_model()))


class _ConfigOnly(nnx.Module):
    """A module with a config but no init_kv_caches: no Llama."""

    def __init__(self):
        self.config = tiny_model().config


@pytest.mark.parametrize(
    "make, match",
    [
        # Each used to raise AttributeError from inside the constructor.
        (lambda: Engine(tiny_model(), None, SchedulerConfig()), "config=.* must be None or an"),
        (lambda: Engine(tiny_model(), None, {"cache": None}), "config=.* must be None or an"),
        (lambda: Engine(tiny_model(), engine_config()), "params: an EngineConfig.*config="),
        (lambda: Engine(None), "model=NoneType must be a jaxkv.models.Llama"),
        # Both attributes are needed: a config alone is not enough.
        (lambda: Engine(_ConfigOnly()), "model=_ConfigOnly must be a jaxkv.models.Llama"),
        (lambda: Engine(tiny_model(), None, engine_config(), mesh="x"), "mesh='x' must be"),
        (
            lambda: Engine(tiny_model(), None, _config_longer_than_the_model()),
            f"max_model_len={MAX_MODEL_LEN + 1} exceeds the model's max_position_embeddings=",
        ),
        # Used to be accepted; the first step then failed on the number of leaves.
        (lambda: Engine(tiny_model(), {"w": 1}, engine_config()), "params: a dict with 1"),
        # Named by the leaf's path within params, as the dtype refusals below are.
        (
            lambda: Engine(tiny_model(), _params_with_a_wrong_shape(), engine_config()),
            r"params\[.*: shape \(.*\) must be \(.*\), as the model's",
        ),
        # Int weights served zeros; abstract ones failed only at the first step.
        (
            lambda: Engine(
                tiny_model(), _params_mapped(lambda x: x.astype(jnp.int32)), engine_config()
            ),
            r"params\[.*: \w+ of dtype int32; it must be an array of float32",
        ),
        (
            lambda: Engine(
                tiny_model(),
                _params_mapped(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)),
                engine_config(),
            ),
            r"params\[.*: ShapeDtypeStruct of dtype float32; it must be an array of float32",
        ),
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_connector_that_is_no_kvconnector_is_refused_and_a_refused_engine_binds_nothing():
    # "x" used to fail with AttributeError after the KV cache was allocated.
    with pytest.raises(ValueError, match="connector='x' must be None or a KVConnector"):
        Engine(tiny_model(), None, engine_config(), connector="x")
    connector = HostOffloadConnector(1 << 20)
    with pytest.raises(ValueError, match="params"):
        Engine(tiny_model(), {"w": 1}, engine_config(), connector=connector)
    engine = Engine(tiny_model(), None, engine_config(), connector=connector)  # still free
    [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), progress=False)
    assert len(out.output_token_ids) == 2


def test_the_models_own_state_is_taken_as_params():
    model = tiny_model()
    engine = Engine(model, nnx.state(model), engine_config())
    [out] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), progress=False)
    assert len(out.output_token_ids) == 2
