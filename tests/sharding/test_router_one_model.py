"""A router's replicas serve one model: replicas whose model_config differ are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv.models.config import LlamaConfig
from jaxkv.router import PrefixAwareRouter
from tests.sharding._router_util import BLOCK, FakeReplica

CONFIG = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2,
)  # fmt: skip


def replica(index: int, model_config=None) -> FakeReplica:
    r = FakeReplica(index)
    r.model_config = model_config
    return r


def test_replicas_of_one_model_config_are_taken():
    same = dataclasses.replace(CONFIG)  # equal, not the same object
    replicas = [replica(0, CONFIG), replica(1, same), replica(2), replica(3, None)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    assert router.replicas == tuple(replicas)


@pytest.mark.parametrize(
    ("changes", "fields"),
    [
        ({"num_layers": 3}, "num_layers"),
        ({"dtype": "bfloat16", "rope_theta": 5e5}, "rope_theta, dtype"),
        ({"eos_token_ids": (2,)}, "eos_token_ids"),
    ],
)
def test_replicas_of_other_model_configs_are_refused_by_name(changes, fields):
    # Their tokens would depend on the routing, and a prefix route would send a prompt
    # to KV that another model computed.
    other = dataclasses.replace(CONFIG, **changes)
    replicas = [replica(0), replica(1, CONFIG), replica(2, CONFIG), replica(3, other)]
    match = (
        rf"^replicas: replica 3 serves another model than replica 1 \(model_config "
        rf"differs in {fields}\); a router's replicas must serve one model$"
    )
    with pytest.raises(ValueError, match=match):
        PrefixAwareRouter(replicas, block_size=BLOCK)
    assert not any(r.running or r.prompts for r in replicas)  # nothing sent to any


def test_model_configs_of_other_types_or_without_a_truth_are_refused():
    with pytest.raises(ValueError, match=r"model_config LlamaConfig != dict\)"):
        PrefixAwareRouter([replica(0, CONFIG), replica(1, CONFIG.to_dict())], block_size=BLOCK)
    arrays = [replica(0, np.zeros(2)), replica(1, np.zeros(2))]  # == answers an array
    with pytest.raises(ValueError, match=r"model_config ndarray != ndarray\)"):
        PrefixAwareRouter(arrays, block_size=BLOCK)


def test_model_configs_holding_arrays_name_the_field_that_differs():
    @dataclasses.dataclass
    class WithArray:
        weights: np.ndarray
        name: str = "a"

    replicas = [replica(0, WithArray(np.zeros(2))), replica(1, WithArray(np.ones(2)))]
    with pytest.raises(ValueError, match=r"model_config differs in weights\)"):
        PrefixAwareRouter(replicas, block_size=BLOCK)
