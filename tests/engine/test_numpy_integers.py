"""numpy integers (and 0-d integer arrays of numpy or JAX) are taken wherever an int size,
count or seed is, and stored as Python ints; numpy bools and integral floats are refused
as Python bools and floats are."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.cascade_cost import AttentionShape, CascadeCostModel
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxkv.hashing import root_hash
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.models.config import LlamaConfig, RopeScaling
from jaxkv.router import PrefixAwareRouter
from jaxkv.sharding import replica_meshes
from tests.sharding._router_util import FakeReplica

_LLAMA = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2
)


def _numpy(fields: dict) -> dict:
    return {name: np.int64(value) for name, value in fields.items()}


def _int_fields(obj, names) -> dict:
    fields = {name: getattr(obj, name) for name in names}
    assert all(type(value) is int for value in fields.values()), fields
    return fields


@pytest.mark.parametrize(
    "cls, fields",
    [
        (CacheConfig, dict(num_blocks=64, block_size=16, hash_seed=-3)),
        (SchedulerConfig, dict(max_num_batched_tokens=128, max_num_seqs=8, max_model_len=100)),
        (EngineConfig, dict(seed=7, max_cascade_groups=3, min_pages_bucket=2)),
        (AttentionShape, dict(num_q_heads=8, num_kv_heads=2, head_dim=64, kv_itemsize=2)),
        (CascadeCostModel, dict(min_requests=3)),
        (LlamaConfig, dict(_LLAMA, head_dim=8, max_position_embeddings=256)),
        (RopeScaling, dict(original_max_position_embeddings=8192)),
    ],
)
def test_frozen_configs_store_numpy_integers_as_ints(cls, fields):
    from_numpy = cls(**_numpy(fields))
    assert _int_fields(from_numpy, fields) == fields
    assert from_numpy == cls(**fields) and hash(from_numpy) == hash(cls(**fields))
    assert repr(from_numpy) == repr(cls(**fields))  # np.int64(64) would print otherwise


_REPLICAS = [FakeReplica(0)]  # the router checks only its methods here


@pytest.mark.parametrize("bad", [np.bool_(True), np.float64(16.0), 16.0])
@pytest.mark.parametrize(
    "make, name",
    [
        (lambda v: CacheConfig(block_size=v), "block_size"),
        (lambda v: CacheConfig(hash_seed=v), "hash_seed"),
        (lambda v: SchedulerConfig(max_num_seqs=v), "max_num_seqs"),
        (lambda v: EngineConfig(seed=v), "seed"),
        (lambda v: AttentionShape(8, 2, 64).per_device(v), "tensor_parallel_size"),
        (lambda v: HostOffloadConnector(v), "host_bytes"),
        (lambda v: HostOffloadConnector(0, copy_delay_steps=v), "copy_delay_steps"),
        (lambda v: PrefixAwareRouter(_REPLICAS, block_size=v), "block_size"),
        (lambda v: PrefixAwareRouter(_REPLICAS, block_size=4, max_imbalance=v), "max_imbalance"),
        (lambda v: LlamaConfig(**dict(_LLAMA, num_layers=v)), "num_layers"),
        (lambda v: replica_meshes(v), "tensor_parallel_size"),
        (lambda v: root_hash(v), "seed"),
    ],
)
def test_numpy_bools_and_floats_are_refused_by_name(make, name, bad):
    with pytest.raises(ValueError, match=f"{name}=.* must be"):
        make(bad)


def test_calls_take_numpy_integers_as_ints():
    assert AttentionShape(8, 2, 64).per_device(np.int32(2)) == AttentionShape(4, 1, 64)
    connector = HostOffloadConnector(np.int64(1 << 20), copy_delay_steps=np.int8(2))
    assert (type(connector.host_bytes), type(connector.copy_delay_steps)) == (int, int)
    assert connector.copy_delay_steps == 2
    router = PrefixAwareRouter(
        _REPLICAS,
        block_size=np.int64(4),
        max_prefix_blocks=np.int16(2),
        max_imbalance=np.int64(0),
        hash_seed=np.uint8(5),
    )
    sizes = (router.block_size, router.max_prefix_blocks, router.max_imbalance, router.hash_seed)
    assert sizes == (4, 2, 0, 5) and all(type(value) is int for value in sizes)
    assert root_hash(np.int64(-5)) == root_hash(-5)
    assert len(replica_meshes(np.int64(1), jax.devices()[:1])) == 1


def test_zero_d_integer_arrays_of_numpy_and_jax_are_ints_and_others_are_refused():
    params = SamplingParams(
        max_tokens=jnp.int32(5), seed=np.array(7, np.uint64), stop_token_ids=jnp.array([1, 2]),
        temperature=jnp.float32(0.5), top_p=np.array(0.75),
    )  # fmt: skip
    assert (params.max_tokens, params.seed, params.stop_token_ids) == (5, 7, (1, 2))
    assert (params.temperature, params.top_p) == (0.5, 0.75)
    assert all(type(v) is int for v in (params.max_tokens, params.seed, *params.stop_token_ids))
    assert SchedulerConfig(max_num_seqs=jnp.array(4)).max_num_seqs == 4
    for bad in (np.array(True), jnp.array([5]), np.array(5.0), jnp.array(True)):
        with pytest.raises(ValueError, match="^max_tokens="):
            SamplingParams(max_tokens=bad)
