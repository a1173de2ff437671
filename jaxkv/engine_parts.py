"""The host-side parts an Engine builds from its EngineConfig: the KV cache manager and
the cascade planner.

Plain construction, no state of its own: each call builds a new part from a checked
config (jaxkv.engine_args), so every engine owns its manager and planner alone.
"""

from __future__ import annotations

from jaxkv.cascade import AttentionShape, CascadePlanner
from jaxkv.config import EngineConfig
from jaxkv.kv_cache_manager import KVCacheManager

__all__ = ["cascade_planner", "kv_cache_manager"]


def kv_cache_manager(config: EngineConfig) -> KVCacheManager:
    """A KVCacheManager of config.cache's blocks, prefix caching, hash seed and cache
    events, for requests of up to config.scheduler.max_model_len tokens."""
    cc = config.cache
    return KVCacheManager(
        cc.num_blocks,
        cc.block_size,
        max_model_len=config.scheduler.max_model_len,
        enable_prefix_caching=cc.enable_prefix_caching,
        hash_seed=cc.hash_seed,
        enable_kv_cache_events=cc.enable_kv_cache_events,
    )


def cascade_planner(config: EngineConfig, heads: AttentionShape, backend: str) -> CascadePlanner:
    """A CascadePlanner for one device's attention `heads` on `backend`, with config's
    cost model, cascade switch, group cap and page buckets."""
    return CascadePlanner(
        heads,
        backend=backend,
        cost_model=config.cascade_cost_model,
        enable_cascade=config.enable_cascade,
        max_groups=config.max_cascade_groups,
        page_buckets=config.buckets.page_buckets,
    )
