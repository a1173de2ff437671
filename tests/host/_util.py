"""Shared helpers for host-side tests: request builders and state snapshots."""

from __future__ import annotations

from jaxkv import KVCacheManager, Request


def make_request(request_id: str, tokens, **kwargs) -> Request:
    return Request(request_id, list(tokens), **kwargs)


def prefill(manager: KVCacheManager, request: Request) -> list[int] | None:
    """Cache lookup plus one allocation for the whole prompt; advances num_computed_tokens."""
    hit_ids, num_hit = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit
    new_ids = manager.allocate_slots(
        request, num_new, num_new_computed_tokens=num_hit, new_computed_blocks=hit_ids
    )
    if new_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return new_ids


def decode(manager: KVCacheManager, request: Request, token: int) -> list[int] | None:
    """Appends one sampled token and allocates the slot to compute it."""
    request.append_output_token_ids([token])
    new_ids = manager.allocate_slots(request, 1)
    if new_ids is not None:
        request.num_computed_tokens += 1
    return new_ids


def ref_counts(manager: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in manager.pool.blocks]


def snapshot(manager: KVCacheManager) -> dict:
    """Everything a failed call must leave untouched."""
    pool = manager.pool
    return {
        "free_queue": pool.free_block_queue.block_ids(),
        "ref_counts": ref_counts(manager),
        "hashes": [b.block_hash for b in pool.blocks],
        "cache_map": {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        "block_table": manager.block_table.tolist(),
        "prefix_ids": manager.prefix_ids.tolist(),
        "holders": {rid: manager.block_ids(rid) for rid in manager.request_ids},
        "num_free_blocks": manager.num_free_blocks,
        "rows": {rid: int(manager.rows_of([rid])[0]) for rid in manager.request_ids},
        "num_cached": dict(manager._num_cached),
        "owner_hashes": {
            rid: (list(r.block_hashes), r.num_computed_tokens) for rid, r in manager._owner.items()
        },
        "stats": manager.prefix_cache_stats,
        "pending_events": list(pool._events),  # read without taking them
        "cache_epoch": pool.cache_epoch,
        "versions": (manager.sharing_version, manager.row_version),
    }


def two_request_manager() -> KVCacheManager:
    """32 blocks of 4 tokens; "A" (10 tokens) and "B" (12) share their first two blocks."""
    m = KVCacheManager(32, 4, max_model_len=64)
    prefill(m, make_request("A", range(10)))
    prefill(m, make_request("B", [*range(8), 50, 51]))
    m.check_integrity()
    return m
