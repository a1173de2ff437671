"""The device state an Engine owns: its weights as placed for serving, the jitted step
program over them, its paged KV caches, and the copier that moves the caches' blocks to
and from the host (jaxkv.kv_copy)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv.cascade import AttentionShape
from jaxkv.config import EngineConfig
from jaxkv.engine_args import served_heads
from jaxkv.kv_copy import DeviceKVCopier
from jaxkv.model_fingerprint import model_fingerprint
from jaxkv.sharding import TensorParallel, place_model, tensor_parallel_of
from jaxkv.step_program import step_program


@dataclasses.dataclass(eq=False)
class DeviceState:
    """What device_state built. `placed`: the TensorParallel the model runs with (None: one
    device); `state_leaves`: its weights, flat, as `program` (jaxkv.step_program of its
    graph) takes them; `heads`: one device's attention heads (served_heads); `kv_caches`:
    num_layers x [num_blocks, block_size, 2*num_kv_heads, head_dim], zeroed."""

    placed: TensorParallel | None
    state_leaves: list[jax.Array]
    program: Callable
    heads: AttentionShape
    kv_caches: list[jax.Array]

    def free(self) -> None:
        """Deletes the KV caches (the engine made them and is their only user) and empties
        both lists in place: whatever holds them (the engine, a copier's fingerprint, the
        frames of a kept traceback) then holds neither the caches nor the weights."""
        for cache in self.kv_caches:
            cache.delete()
        self.kv_caches.clear()
        self.state_leaves.clear()


def device_state(
    model: nnx.Module, params: nnx.State | None, config: EngineConfig, backend: str, mesh
) -> DeviceState:
    """`model`, with `params` as its weights (None: its own), placed over `mesh` as
    jaxkv.sharding.place_model places it, and committed KV caches of `config.cache` for
    it (without a mesh, where the weights lie: _where_weights_lie);
    served_heads' ValueError (`backend` cannot serve the config) before they are made,
    and ValueError naming `params` (or `model` when params is None) when, without a mesh,
    its weights lie on different devices.
    An exception after the placement propagates with this call's frame holding none of
    the placed weights (a traceback kept in a notebook would hold their memory)."""
    # Weights Megatron-sharded over the mesh, KV cache and attention split by KV heads;
    # host block management is unchanged (block ids mean the same on every shard).
    model, params = place_model(model, params, mesh)
    try:
        placed = tensor_parallel_of(model)
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state if params is None else params)
        where = None
        if placed is None:
            where = _where_weights_lie(leaves, "model" if params is None else "params")
        program = step_program(graphdef, treedef)
        heads = served_heads(backend, config, model.config, 1 if placed is None else placed.size)
        caches = _kv_caches(model, config.cache, where)
    except BaseException:
        model = params = state = leaves = None
        raise
    return DeviceState(placed, leaves, program, heads, caches)


def _kv_caches(
    model: nnx.Module, cache: Any, where: jax.Device | jax.sharding.Sharding | None
) -> list[jax.Array]:
    """The model's zeroed KV caches for CacheConfig `cache`, committed: on the device
    `where` names (None: jax's default one, or the model's mesh), or made directly with
    the sharding it is. Committed because a KV load's scatter (jaxkv.kv_copy) and a step
    over committed weights return committed caches, and jit compiles a program again for
    committed arguments: each step shape compiled twice."""
    make = functools.partial(model.init_kv_caches, cache.num_blocks, cache.block_size)
    if isinstance(where, jax.sharding.Sharding):  # never whole on one device first
        return jax.jit(make, static_argnums=0, out_shardings=where)(cache.kv_dtype)
    with contextlib.nullcontext() if where is None else jax.default_device(where):
        caches = make(cache.kv_dtype)
    return [jax.device_put(c, c.sharding) for c in caches]  # committed where they lie


def _where_weights_lie(leaves: list[Any], name: str) -> jax.Device | NamedSharding | None:
    """Where the KV caches of a model without a mesh go: the one device every jax.Array
    of `leaves` (its weights) lies on; where committed weights lie on several devices,
    replicated over them in a committed weight's device order (jit takes no arguments
    over the same devices in another order); else None (jax's default device). The step
    program runs where the weights lie; caches made on jax's default device instead held
    the whole KV pool there (another replica's device, say) until the first step moved
    it. ValueError naming `name` unless the committed arrays lie on one set of devices in
    one order: the step program takes them together, and weights left on two devices (or
    on two in both orders) were taken, then every step() raised jit's error about
    incompatible devices, naming its own arguments."""
    devices: set = set()
    placements: set[tuple[int, ...]] = set()  # device ids in each one's device order
    anchor = None  # a committed weight
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            devices |= leaf.sharding.device_set
            if leaf.committed:
                placements.add(tuple(shard.device.id for shard in leaf.addressable_shards))
                anchor = leaf if anchor is None else anchor
    if len(placements) > 1:
        ids = sorted(list(p) for p in placements)
        raise ValueError(
            f"{name}: the weights lie on different devices, or on the same ones in another "
            f"order (ids {ids}); place them all on one device (or one set of devices in "
            "one order), or give mesh or tensor_parallel_size to shard them"
        )
    if len(devices) == 1:
        return devices.pop()
    if anchor is None:
        return None
    if isinstance(anchor.sharding, NamedSharding):
        return NamedSharding(anchor.sharding.mesh, PartitionSpec())
    in_order = [shard.device for shard in anchor.addressable_shards]
    return NamedSharding(Mesh(np.array(in_order), ("devices",)), PartitionSpec())


def engine_copier(
    engine: Any, device: DeviceState, model_config: Any, *, max_blocks: int
) -> DeviceKVCopier:
    """A DeviceKVCopier that reads and replaces `engine.kv_caches` (jaxkv.kv_copy), naming
    the model by the fingerprint of `model_config` (a LlamaConfig) and `device`'s weights.
    It reaches the engine weakly: a connector holding it must not keep a dropped engine
    (and its KV cache) alive."""
    ref = weakref.ref(engine)
    return DeviceKVCopier(
        lambda: ref().kv_caches,
        lambda caches: setattr(ref(), "kv_caches", caches),
        max_blocks=max_blocks,
        kv_replicas=1 if device.placed is None else device.placed.kv_replicas,
        fingerprint=functools.partial(
            model_fingerprint, model_config.to_kv_dict(), device.state_leaves
        ),
    )
