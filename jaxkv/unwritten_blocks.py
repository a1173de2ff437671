"""Prefix-cache entries of blocks whose KV a failed step never wrote.

Plain Python, no JAX. A step's allocation enters the blocks its tokens will fill into the
prefix cache before the step runs; if the step fails, those entries point at KV that was
never written. Both KVCacheManager.uncache_unwritten and the scheduler's record of an
aborted request's entries (scheduler_discard.keep_unwritten_of) find them here. Reads the
manager's private state: the manager and the scheduler are its only callers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxkv.block_pool import KVCacheBlock
    from jaxkv.kv_cache_manager import KVCacheManager

__all__ = ["cached_unwritten", "uncache_unwritten"]


def cached_unwritten(manager: KVCacheManager, req_id: str, num_written: int) -> list[KVCacheBlock]:
    """The blocks of `req_id` (which holds a row) past its first `num_written` tokens that
    it entered into the prefix cache itself: those among its first num_cached blocks.

    A later block can carry a hash only if another holder entered it (after an uncache,
    that holder's retry cached it again, and counts it as cached for good): its KV is
    written, and it is left out. A block in the result may carry no hash (a duplicate of
    a block cached first, or one already taken out).
    """
    first = num_written // manager.block_size
    return manager._blocks[req_id][first : manager._num_cached[req_id]]


def uncache_unwritten(manager: KVCacheManager, req_id: str, num_written: int) -> None:
    """Takes cached_unwritten's blocks out of the prefix cache; `req_id` then counts only
    the blocks before them as cached, so an allocation that fills them caches them anew."""
    blocks = cached_unwritten(manager, req_id, num_written)
    if blocks:
        manager.pool.uncache_blocks(blocks)
        manager._num_cached[req_id] = num_written // manager.block_size
