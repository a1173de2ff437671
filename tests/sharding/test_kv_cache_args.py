"""jaxkv.sharding.init_kv_caches and kv_cache_sharding refuse bad arguments by name, as
Llama.init_kv_caches does (one check shared), before anything is placed; a sharded
model's own init_kv_caches places its caches on its mesh. These run on whatever devices
this process has (one CPU is enough)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxkv import sharding
from tests.models.conftest import random_model, small_config

CFG = small_config()


def _tp(**fields) -> sharding.TensorParallel:
    return dataclasses.replace(sharding.TensorParallel(sharding.make_mesh(1)), **fields)


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1, 4), "^num_blocks=-1 must be an int >= 1$"),  # a TypeError from jax
        ((2.0, 4), "^num_blocks=2.0 must be an int >= 1$"),
        ((4, 0), "^block_size=0 must be an int >= 1$"),  # an empty cache
        ((4, 4, "floot"), "^dtype='floot' must be None, float32"),  # a TypeError from jax
        ((4, 4, "int32"), "^dtype='int32' must be None, float32"),  # built, refused at use
        ((4, 4, "int8"), "^dtype='int8' must be None, float32, bfloat16 or float16 \\(the "),
        ((4, 4, "float8_e4m3fn"), "^dtype='float8_e4m3fn' must be None, float32, bfloat16"),
    ],
)
def test_init_kv_caches_refuses_sizes_and_dtypes_as_the_model_does(args, match):
    with pytest.raises(ValueError, match=match):
        sharding.init_kv_caches(CFG, _tp(), *args)
    [cache, _] = sharding.init_kv_caches(CFG, _tp(), 3, 2, "bfloat16")
    assert cache.shape == (3, 2, 2 * CFG.num_kv_heads, CFG.head_dim) and cache.dtype == "bfloat16"


def test_init_kv_caches_refuses_a_config_tp_or_mesh_of_another_type_by_name():
    with pytest.raises(ValueError, match="^config=dict must be a jaxkv.models.LlamaConfig"):
        sharding.init_kv_caches(CFG.to_dict(), _tp(), 4, 4)  # AttributeError before
    with pytest.raises(ValueError, match="^tp=Mesh must be a jaxkv.sharding.TensorParallel"):
        sharding.init_kv_caches(CFG, sharding.make_mesh(1), 4, 4)
    with pytest.raises(ValueError, match="^mesh=str must be a jax.sharding.Mesh"):
        sharding.init_kv_caches(CFG, _tp(mesh="model"), 4, 4)
    with pytest.raises(ValueError, match="^axis_name='tp' is not an axis of"):
        sharding.init_kv_caches(CFG, _tp(axis_name="tp"), 4, 4)  # KeyError before
    with pytest.raises(ValueError, match=r"^tp.kv_replicas=0 must be an int >= 1$"):
        sharding.init_kv_caches(CFG, _tp(kv_replicas=0), 4, 4)  # a cache of no heads


def test_init_kv_caches_refuses_a_tp_that_splits_a_k_v_pair_across_devices():
    # A mesh listing one device twice has an axis of size 2 without needing two devices:
    # the check runs before anything is placed. Three KV heads do not split in two, and
    # a device holding a K without its V would not be a cache the kernels read.
    [device] = jax.devices()[:1]
    twice = Mesh(np.array([device, device]), (sharding.DEFAULT_AXIS,))
    cfg = small_config(num_heads=6, num_kv_heads=3, hidden_size=48)
    with pytest.raises(
        ValueError, match=r"^tensor_parallel_size=2 must divide num_kv_heads \* kv_replicas=3$"
    ):
        sharding.init_kv_caches(cfg, sharding.TensorParallel(twice), 4, 4)


def test_kv_cache_sharding_refuses_a_mesh_or_axis_it_cannot_use_by_name():
    with pytest.raises(ValueError, match="^mesh=list must be a jax.sharding.Mesh"):
        sharding.kv_cache_sharding(jax.devices()[:1])
    with pytest.raises(ValueError, match="^axis_name='tp' is not an axis of"):
        sharding.kv_cache_sharding(sharding.make_mesh(1), "tp")  # refused only when used
    # Over one device the caches are made as jit returns them (test_one_device_mesh).
    assert sharding.kv_cache_sharding(sharding.make_mesh(1)).spec == P()


def test_a_sharded_models_caches_are_placed_on_its_mesh():
    # Llama.init_kv_caches of a model from shard_model hands over to sharding.init_kv_caches.
    mesh = sharding.make_mesh(1)
    caches = sharding.shard_model(random_model(CFG), mesh).init_kv_caches(4, 2)
    assert len(caches) == CFG.num_layers
    assert all(c.sharding == sharding.kv_cache_sharding(mesh) for c in caches)
    assert random_model(CFG).init_kv_caches(4, 2)[0].sharding != sharding.kv_cache_sharding(mesh)
