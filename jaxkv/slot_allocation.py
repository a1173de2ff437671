"""The state changes of one request's slot allocation, and the scheduler's admission path.

Plain Python, no JAX. KVCacheManager.allocate_slots checks its arguments and then calls
`commit`. The scheduler's admission (jaxkv.scheduler_admission) admits requests that
Scheduler.add_request already checked (a Request, its prompt within max_model_len, its
hash configuration the manager's): it looks up the prefix cache with `find_cache_hit`
and allocates with `allocate_admitted`, skipping the public calls' re-checks of the
same request, counts and cache hit. Everything here but `needs_manager` (the scheduler's
test whether a running request's next tokens need the manager at all) reads and changes
the manager's private state, so the manager and the scheduler are its only callers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from jaxkv.allocation_args import check_total_fits
from jaxkv.block_pool import KVCacheBlock
from jaxkv.request import Request

if TYPE_CHECKING:
    from jaxkv.kv_cache_manager import KVCacheManager

__all__ = [
    "CacheHit",
    "allocate_admitted",
    "cache_full_blocks",
    "commit",
    "count_lookup",
    "find_cache_hit",
    "needs_manager",
]


class CacheHit(NamedTuple):
    """The leading cached blocks of a request, as found at `cache_epoch`."""

    blocks: list[KVCacheBlock]
    block_ids: list[int]
    num_tokens: int
    cache_epoch: int  # the pool's cache_epoch at the lookup


def find_cache_hit(manager: KVCacheManager, request: Request) -> CacheHit:
    """get_computed_blocks(request, count=False) without its checks of `request`."""
    pool = manager.pool
    if not manager.enable_prefix_caching or request.skips_prefix_cache_reads:
        return CacheHit([], [], 0, pool.cache_epoch)
    bs = manager.block_size
    # Hashes stay on the Request: a request looked up again (it waited for room) or
    # preempted hashes only the blocks it has gained since.
    hashes = request.update_block_hashes(bs, manager.hash_seed)
    max_blocks = (request.num_tokens - 1) // bs  # never the last token
    lookup = pool.cached_block_hash_to_block.get
    blocks = []
    for block_hash in hashes[:max_blocks] if max_blocks < len(hashes) else hashes:
        block = lookup(block_hash)
        if block is None:
            break
        blocks.append(block)
    return CacheHit(blocks, [b.block_id for b in blocks], len(blocks) * bs, pool.cache_epoch)


def count_lookup(manager: KVCacheManager, request: Request, num_hit_tokens: int) -> None:
    """count_prefix_lookup(request, num_hit_tokens) without its checks."""
    if manager.enable_prefix_caching and not request.skips_prefix_cache_reads:
        manager._lookups.count(request.num_tokens, num_hit_tokens)


def allocate_admitted(
    manager: KVCacheManager, request: Request, num_new_tokens: int, hit: CacheHit
) -> bool:
    """allocate_slots(request, num_new_tokens, num_new_computed_tokens=hit.num_tokens,
    new_computed_blocks=hit.block_ids) is not None, for a checked request and an int
    num_new_tokens >= 0, with `hit` from find_cache_hit.

    The hit is trusted without re-checking each block's hash only while the request
    holds no blocks, has computed nothing and the pool's cache_epoch is the lookup's (no
    block has lost its hash since); otherwise allocate_slots' own checks decide.
    """
    req_id = request.request_id
    if (
        req_id in manager._blocks
        or request.num_computed_tokens
        or (hit.cache_epoch != manager.pool.cache_epoch)
    ):
        got = manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens=hit.num_tokens,
            new_computed_blocks=hit.block_ids,
        )
        return got is not None
    num_total = hit.num_tokens + num_new_tokens
    check_total_fits(
        req_id, num_total, manager.max_model_len,
        num_new_computed_tokens=hit.num_tokens, num_new_tokens=num_new_tokens,
    )  # fmt: skip
    num_new_blocks = max(0, -(-num_total // manager.block_size) - len(hit.blocks))
    got = commit(manager, request, [], hit.blocks, hit.block_ids, num_new_blocks, num_total)
    return got is not None


def commit(
    manager: KVCacheManager,
    request: Request,
    held: list[KVCacheBlock],
    computed: list[KVCacheBlock],
    computed_ids: list[int],
    num_new_blocks: int,
    num_filled_tokens: int,
) -> list[int] | None:
    """Appends the cache hit `computed` (ids `computed_ids`) and `num_new_blocks` fresh
    blocks to the blocks `request` holds (`held`: the manager's list, or a new empty
    one for a request without a row), then caches the blocks `num_filled_tokens` fill.
    Returns the fresh block ids, or None with nothing changed if the pool cannot fit
    them. The caller has checked everything else."""
    pool = manager.pool
    num_free_hits = sum(1 for b in computed if not b.ref_cnt) if computed else 0
    if num_new_blocks + num_free_hits > pool.num_free_blocks:
        return None
    req_id = request.request_id
    num_held = len(held)
    if req_id not in manager._blocks:
        manager._blocks[req_id] = held
        manager._owner[req_id] = request
        manager._num_cached[req_id] = 0
        manager._table.add_row(req_id)
    if computed:  # cache hits leave the free queue before fresh blocks are taken
        pool.touch(computed, validate=False)
    new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
    new_ids = [b.block_id for b in new_blocks]
    if computed or new_blocks:
        held += computed
        held += new_blocks
        manager._table.append(req_id, computed_ids + new_ids, shared=bool(computed))
    if computed and manager._num_cached[req_id] == num_held:
        manager._num_cached[req_id] = num_held + len(computed)
    cache_full_blocks(manager, request, num_filled_tokens)
    return new_ids


def cache_full_blocks(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Enters into the prefix cache every block of `request` that `num_tokens` tokens
    fill. Every caller has checked the request's hash configuration is the manager's."""
    if not manager.enable_prefix_caching:
        return
    req_id = request.request_id
    blocks = manager._blocks[req_id]
    bs = manager.block_size
    num_full = min(num_tokens // bs, len(blocks))
    num_cached = manager._num_cached[req_id]
    if num_full <= num_cached:
        return
    hashes = request.block_hashes  # extended only if the request gained full blocks
    if len(hashes) < num_full:
        hashes = request.update_block_hashes(bs, manager.hash_seed)
        num_full = min(num_full, len(hashes))
    pool = manager.pool
    pool.cache_full_blocks(
        blocks[num_cached:num_full],
        hashes[num_cached:num_full],
        parent_block_hash=hashes[num_cached - 1] if num_cached else None,
        # Read only for events: without them, no copy of the tokens.
        token_ids=request.all_token_ids[num_cached * bs : num_full * bs]
        if pool.enable_events
        else (),
        block_size=bs,
        adapter_id=request.adapter_id,
        validate=False,  # the request's own blocks, hashes and tokens
    )
    manager._num_cached[req_id] = num_full


def needs_manager(manager: KVCacheManager, computed: int, n: int) -> bool:
    """Whether `n` more tokens after `computed` of a running request need a block or a
    prefix-cache entry.

    A running request holds ceil(computed / block_size) blocks (every allocation is
    exact; only a request whose KV load landed holds blocks for all its tokens until
    they are computed), so tokens that stay inside its partly filled last block need
    nothing; tokens that exactly fill it need the manager only to cache it.
    """
    bs = manager.block_size
    offset = computed % bs
    fills_last = offset + n == bs and manager.enable_prefix_caching
    return offset == 0 or offset + n > bs or fills_last
