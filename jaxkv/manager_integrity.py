"""The consistency check of a KVCacheManager's bookkeeping.

Plain Python, no JAX. The body of KVCacheManager.check_integrity (whose docstring states
what is checked): it reads the manager's private state, so the manager is its only
caller.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from jaxkv.block_pool import IntegrityError

if TYPE_CHECKING:
    from jaxkv.kv_cache_manager import KVCacheManager

__all__ = ["check_manager_integrity"]


def check_manager_integrity(manager: KVCacheManager) -> None:
    """manager.check_integrity(); see there."""
    held = manager._blocks
    counts = collections.Counter(b.block_id for blocks in held.values() for b in blocks)
    manager.pool.check_integrity(counts)
    problems = manager._table.check_integrity(
        {req_id: [b.block_id for b in blocks] for req_id, blocks in held.items()}
    )
    own = manager.pool.blocks  # counted by id above: a copy of a block would pass
    problems += [
        f"{req_id!r}: block {block.block_id} at {i} is not the pool's block {block.block_id}"
        for req_id, blocks in held.items()
        for i, block in enumerate(blocks)
        if own[block.block_id] is not block
    ]
    owner = manager._owner
    problems += [
        f"{req_id!r}: its blocks have no owner"
        if owner.get(req_id) is None
        else f"{req_id!r}: its blocks' owner is request {owner[req_id].request_id!r}"
        for req_id in held
        if getattr(owner.get(req_id), "request_id", None) != req_id
    ]
    num_cached = manager._num_cached
    if not len(owner) == len(num_cached) == len(held):
        problems.append(
            f"{len(held)} requests hold blocks, {len(owner)} have an owner, "
            f"{len(num_cached)} have a cached-block count"
        )
    problems += [
        f"{req_id!r}: num_cached={num_cached.get(req_id)}"
        for req_id, blocks in held.items()
        if not 0 <= num_cached.get(req_id, -1) <= len(blocks)
    ]
    problems += _hash_problems(manager)
    if problems:
        raise IntegrityError("; ".join(problems))


def _hash_problems(manager: KVCacheManager) -> list[str]:
    """A held block that carries a hash must carry its Request's hash of that position:
    else a later cache hit on it returns KV of another prefix."""
    problems = []
    for req_id, blocks in manager._blocks.items():
        request = manager._owner.get(req_id)
        if request is None:
            continue  # reported above
        hashes = request.block_hashes
        problems += [
            f"{req_id!r}: block {block.block_id} at {i} carries another hash than the request's"
            for i, block in enumerate(blocks)
            if block.block_hash is not None and (i >= len(hashes) or hashes[i] != block.block_hash)
        ]
    return problems
