"""Data-parallel replicas: one Engine per group of devices, for PrefixAwareRouter."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxkv.closable import try_each_noted
from jaxkv.field_checks import as_int


def engine_replicas(
    model: Any,
    config: Any = None,
    *,
    tensor_parallel_size: int = 1,
    num_replicas: int | None = None,
    devices: Sequence[Any] | None = None,
    params: Any = None,
    tokenizer: Any = None,
) -> list[Any]:
    """Engines over consecutive groups of `tensor_parallel_size` devices (default: all of
    jax.devices()), one per group, at most `num_replicas`. Each engine holds its own copy
    of the weights and its own KV cache on its group. Replica i gets `config` with seed
    config.seed + i, so requests without a seed of their own draw different random
    streams on different replicas (with one seed, the n-th request of every replica would
    sample the same tokens). Each engine gets `tokenizer` (Engine's). Raises ValueError
    naming both numbers when the TP size does not divide the device count, or too few
    groups exist, naming num_replicas unless it is None or an int >= 1, config unless it
    is None or an EngineConfig, and as replica_meshes does on `tensor_parallel_size`
    (no int, below 1) or `devices`; all before any engine is built. When building a
    later engine fails, the engines already built are closed (their device memory freed)
    before the error propagates: every one, a close that raises noted on that error
    (`__notes__`), not raised instead."""
    from jaxkv.config import EngineConfig
    from jaxkv.engine import Engine
    from jaxkv.sharding import replica_meshes

    meshes = replica_meshes(tensor_parallel_size, devices)
    if num_replicas is not None:
        count = as_int(num_replicas)
        if count is None or count < 1:  # 0 was named as needing "0 groups"
            raise ValueError(f"num_replicas={num_replicas!r} must be None or an int >= 1")
        num_replicas = count
        if num_replicas > len(meshes):
            raise ValueError(
                f"{num_replicas=} needs {num_replicas} groups of {tensor_parallel_size} "
                f"devices; there are {len(meshes)}"
            )
        meshes = meshes[:num_replicas]
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):  # a dict raised AttributeError on config.seed
        raise ValueError(f"config={config!r} must be None or an EngineConfig")
    seeds = [(config.seed + i) % 2**64 for i in range(len(meshes))]  # within EngineConfig's
    engines: list[Any] = []
    try:
        for seed, mesh in zip(seeds, meshes, strict=True):
            replica_config = dataclasses.replace(config, seed=seed)
            engines.append(Engine(model, params, replica_config, mesh=mesh, tokenizer=tokenizer))
    except BaseException as error:  # their weights and KV pools would stay placed
        try_each_noted(lambda engine: engine.close(), reversed(engines), "close", error)
        raise
    return engines
