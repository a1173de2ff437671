"""Argument checks of the Scheduler's constructor.

Plain Python, no JAX. Scheduler runs these before it keeps anything, so a refused
argument fails where it is given, with a ValueError naming it, rather than as an
AttributeError in the constructor or, a connector's, in the first step.
"""

from __future__ import annotations

from jaxkv.config import SchedulerConfig
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.kv_transfer import KVConnector

__all__ = ["checked_scheduler_args"]


def checked_scheduler_args(
    config: SchedulerConfig, manager: KVCacheManager, connector: KVConnector | None
) -> KVConnector:
    """The connector the scheduler uses (a plain KVConnector for None). Raises ValueError
    unless `config`, `manager` and `connector` are of their types, the manager holds
    requests as long as config.max_model_len, and the connector is unbound or bound with
    the manager's (block_size, hash_seed)."""
    connector = KVConnector() if connector is None else connector
    for name, value, kind in (
        ("config", config, SchedulerConfig),
        ("manager", manager, KVCacheManager),
        ("connector", connector, KVConnector),
    ):  # each used to raise AttributeError here or, a connector, in the first step
        if not isinstance(value, kind):
            raise ValueError(f"{name}={value!r} must be a {kind.__name__}")
    if manager.max_model_len < config.max_model_len:
        raise ValueError(f"{manager.max_model_len=} must be >= {config.max_model_len=}")
    layout = (manager.block_size, manager.hash_seed)
    if connector.hash_layout not in (None, layout):  # its saves would all be refused
        raise ValueError(
            f"connector is bound with (block_size, hash_seed)={connector.hash_layout}, the "
            f"manager has {layout}: bind it with the manager's (it serves one engine)"
        )
    return connector
