"""jaxkv: paged KV cache management and cascade attention for JAX serving loops.

The host side (requests, block pool, KV cache manager, scheduler) is plain Python and
numpy; planning turns each scheduled batch into static-shape attention metadata; the
attention dispatch runs flat or cascade attention through Pallas kernels or XLA.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Public names are re-exported below, one block per module, as modules land.

# Host KV block management (plain Python + numpy).
from jaxkv.block_pool import AllBlocksCleared as AllBlocksCleared
from jaxkv.block_pool import BlockRemoved as BlockRemoved
from jaxkv.block_pool import BlockStored as BlockStored
from jaxkv.block_pool import IntegrityError as IntegrityError
from jaxkv.kv_cache_manager import KVCacheManager as KVCacheManager
from jaxkv.kv_cache_manager import PrefixCacheStats as PrefixCacheStats
from jaxkv.kv_cache_manager import UnknownRequestError as UnknownRequestError
from jaxkv.prefix_index import longest_common_prefix as longest_common_prefix
from jaxkv.request import Request as Request
from jaxkv.request import RequestStatus as RequestStatus
from jaxkv.sampling_params import SamplingParams as SamplingParams

# isort: split
# Serving: configs, scheduler and KV transfer (host side), the Engine, outputs and metrics.
from jaxkv.cascade_cost import AttentionShape as AttentionShape
from jaxkv.cascade_cost import CascadeCostModel as CascadeCostModel
from jaxkv.config import CacheConfig as CacheConfig
from jaxkv.config import EngineConfig as EngineConfig
from jaxkv.config import SchedulerConfig as SchedulerConfig
from jaxkv.engine import Engine as Engine
from jaxkv.host_offload_connector import HostOffloadConnector as HostOffloadConnector
from jaxkv.kv_transfer import KVConnector as KVConnector
from jaxkv.kv_transfer import TransferStats as TransferStats
from jaxkv.logprobs import Logprob as Logprob
from jaxkv.metrics import EngineMetrics as EngineMetrics
from jaxkv.metrics import StepStats as StepStats
from jaxkv.outputs import CompletionOutput as CompletionOutput
from jaxkv.outputs import RequestOutput as RequestOutput
from jaxkv.scheduler import Scheduler as Scheduler
from jaxkv.scheduler import SchedulerOutput as SchedulerOutput

# isort: split
# Several devices: tensor parallelism over a mesh, data-parallel replicas behind a router.
from jaxkv.engine_replicas import engine_replicas as engine_replicas
from jaxkv.router import PrefixAwareRouter as PrefixAwareRouter
from jaxkv.sharding import make_mesh as make_mesh
from jaxkv.sharding import replica_meshes as replica_meshes
from jaxkv.sharding import shard_model as shard_model

# What `from jaxkv import *` binds: the names above, not the submodules that importing
# them loads (jaxkv.config, jaxkv.engine, ...), which would rebind a caller's own names.
__all__ = [
    "AllBlocksCleared",
    "AttentionShape",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CascadeCostModel",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "HostOffloadConnector",
    "IntegrityError",
    "KVCacheManager",
    "KVConnector",
    "Logprob",
    "PrefixAwareRouter",
    "PrefixCacheStats",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepStats",
    "TransferStats",
    "UnknownRequestError",
    "engine_replicas",
    "longest_common_prefix",
    "make_mesh",
    "replica_meshes",
    "shard_model",
]
