"""Checks of Engine's constructor arguments, run before it builds anything.

A config of another type, a connector that is no KVConnector or params that are not the
model's state used to fail with AttributeError from deep inside the constructor (after
the KV cache was allocated), or, for params, only at the first step().
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxkv.attention import check_backend
from jaxkv.cascade import AttentionShape
from jaxkv.config import EngineConfig
from jaxkv.kv_transfer import KVConnector


def checked_engine_args(model, params, config, connector) -> EngineConfig:
    """`config` (EngineConfig() for None); ValueError naming the argument unless `model`
    is an nnx.Module with a `config` and `init_kv_caches` (a jaxkv.models.Llama),
    `params` None or a state of the model's structure, leaf shapes and dtypes (concrete
    arrays, not abstract ones), `config` None or an EngineConfig whose max_model_len fits
    the model's max_position_embeddings, and `connector` None or a KVConnector; the
    connector's RuntimeError if it cannot be bound (it serves another live engine)."""
    llama = all(hasattr(model, name) for name in ("config", "init_kv_caches"))
    if not (isinstance(model, nnx.Module) and llama):
        raise ValueError(f"model={type(model).__name__} must be a jaxkv.models.Llama")
    if config is not None and not isinstance(config, EngineConfig):
        raise ValueError(f"config={config!r} must be None or an EngineConfig")
    if connector is not None and not isinstance(connector, KVConnector):
        raise ValueError(f"connector={connector!r} must be None or a KVConnector")
    if isinstance(params, EngineConfig):  # Engine(model, config): params come second
        raise ValueError(
            "params: an EngineConfig, where the model's weights (or None) go; pass it as config=..."
        )
    if params is not None:
        check_params(model, params)
    config = EngineConfig() if config is None else config
    max_len, max_positions = config.scheduler.max_model_len, model.config.max_position_embeddings
    if max_len > max_positions:
        raise ValueError(
            f"config.scheduler.max_model_len={max_len} exceeds the model's "
            f"max_position_embeddings={max_positions}"
        )
    if connector is not None:
        connector.check_can_bind()  # before the weights are placed and the KV cache made
    return config


def check_params(model, params) -> None:
    """ValueError naming `params` (and the leaf) unless it is a state of `model`'s
    structure whose leaves are concrete arrays of the model's shapes and dtypes."""
    state = nnx.state(model)
    want, got = jax.tree.structure(state), jax.tree.structure(params)
    if got != want:
        raise ValueError(
            f"params: a {type(params).__name__} with {got.num_leaves} leaves must be the "
            f"model's state (nnx.state(model): {want.num_leaves} leaves, same structure)"
        )
    for (path, w), g in zip(jax.tree.leaves_with_path(state), jax.tree.leaves(params), strict=True):
        where = f"params{jax.tree_util.keystr(path)}"
        if getattr(g, "shape", None) != w.shape:
            raise ValueError(
                f"{where}: shape {getattr(g, 'shape', None)} must be {w.shape}, as the model's"
            )
        # An abstract leaf (jax.ShapeDtypeStruct) failed only at the first step; weights
        # of another dtype (ints, say) served garbage silently.
        if not isinstance(g, (jax.Array, np.ndarray)) or g.dtype != w.dtype:
            raise ValueError(
                f"{where}: {type(g).__name__} of dtype {getattr(g, 'dtype', None)}; it must "
                f"be an array of {w.dtype}, as the model's"
            )


def served_heads(backend: str, config: EngineConfig, mc, num_devices: int) -> AttentionShape:
    """One device's attention heads of the model config `mc` over `num_devices` (each
    device reads only its own heads' KV in every kernel call: the kernels are checked
    with, and the cost model weighs, those); ValueError naming the cache's block_size and
    kv_dtype unless `backend` can serve them here."""
    cc = config.cache
    kv_itemsize = jax.numpy.dtype(cc.kv_dtype or mc.dtype).itemsize
    shape = AttentionShape(mc.num_heads, mc.num_kv_heads, mc.head_dim, kv_itemsize)
    heads = shape.per_device(num_devices)
    try:  # the kernels name their page_size and kv_pages.dtype: name the config's too
        check_backend(
            backend, interpret=config.interpret, num_q_heads=heads.num_q_heads,
            num_kv_heads=heads.num_kv_heads, head_dim=mc.head_dim,
            block_size=cc.block_size, q_dtype=mc.dtype, kv_dtype=cc.kv_dtype or mc.dtype,
        )  # fmt: skip
    except ValueError as e:
        given = f"cache.block_size={cc.block_size}, cache.kv_dtype={cc.kv_dtype!r}"
        raise ValueError(f"backend={backend!r} cannot serve {given} here: {e}") from None
    return heads
