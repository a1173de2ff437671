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
from jaxkv.request import SamplingParams as SamplingParams
