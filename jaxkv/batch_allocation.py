"""One step's slot allocation for many running requests at once, all or nothing.

Plain Python, no JAX. The body of KVCacheManager.allocate_slots_batch (whose docstring
states the guarantees): it reads and changes the manager's private state, so the manager
is its only caller. Every check runs before the first change; the fresh blocks of the
whole batch are taken from the pool in one call and the single-block appends, the common
decode case, are written to the block table in one call.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from operator import add, attrgetter, gt, is_not
from typing import TYPE_CHECKING

from jaxkv.allocation_args import (
    check_computed_within_held,
    check_total_fits,
    checked_request_id,
    count,
    not_the_owner_message,
)
from jaxkv.block_pool import KVCacheBlock
from jaxkv.block_table import HostBlockTable
from jaxkv.field_checks import is_unordered
from jaxkv.hashing import extend_block_hashes
from jaxkv.request import Request
from jaxkv.slot_allocation import cache_full_blocks

if TYPE_CHECKING:
    from jaxkv.kv_cache_manager import KVCacheManager

__all__ = ["allocate_slots_batch"]

_PLAIN_INT = {int}
_REQUEST_TYPE = {Request}
_TOKEN_IDS = attrgetter("_all_token_ids")  # Request.num_tokens is their len, without a call


def allocate_slots_batch(
    manager: KVCacheManager, requests: Sequence[Request], num_new_tokens: Sequence[int]
) -> bool:
    """manager.allocate_slots_batch(requests, num_new_tokens); see there."""
    requests, counts = _as_list("requests", requests), _as_list("num_new_tokens", num_new_tokens)
    if not set(map(type, requests)) <= _REQUEST_TYPE:  # the common case, at C speed
        for r in requests:
            checked_request_id(r)
    ids = [r.request_id for r in requests]
    if len(counts) != len(ids):
        raise ValueError(f"{len(requests)=} must equal {len(counts)=}")
    if not ids:
        return True
    if not (set(map(type, counts)) <= _PLAIN_INT and min(counts) >= 0):
        counts = [count("num_new_tokens", n, r) for r, n in zip(ids, counts, strict=True)]
    owners = list(map(manager._owner.get, ids))
    if any(map(is_not, owners, requests)):
        i = next(i for i, r in enumerate(requests) if owners[i] is not r)
        manager._blocks_of(ids[i])  # raises UnknownRequestError
        raise ValueError(not_the_owner_message(ids[i]))
    held = list(map(manager._blocks.__getitem__, ids))
    if len(set(ids)) != len(ids):
        raise ValueError("requests: request ids must be distinct")
    computed = [r.num_computed_tokens for r in requests]
    if not (set(map(type, computed)) <= _PLAIN_INT and min(computed) >= 0):
        computed = [
            count("request.num_computed_tokens", n, r) for r, n in zip(ids, computed, strict=True)
        ]
    i = _first(map(gt, computed, map(len, map(_TOKEN_IDS, requests))))
    if i is not None:  # allocate_slots refuses it the same way
        raise ValueError(
            f"request {ids[i]!r}: request.num_computed_tokens={computed[i]} exceeds "
            f"its {len(_TOKEN_IDS(requests[i]))} tokens"
        )
    bs = manager.block_size
    num_held = list(map(len, held))
    i = _first(map(gt, computed, [n * bs for n in num_held]))
    if i is not None:
        check_computed_within_held(ids[i], computed[i], num_held[i], bs)
    totals = list(map(add, computed, counts))
    i = _first(map(manager.max_model_len.__lt__, totals))
    if i is not None:
        check_total_fits(
            ids[i], totals[i], manager.max_model_len,
            num_computed_tokens=computed[i], num_new_tokens=counts[i],
        )  # fmt: skip
    needs = [-(-t // bs) - n for t, n in zip(totals, num_held, strict=True)]
    total = sum(k for k in needs if k > 0)
    if total > manager.pool.num_free_blocks:
        return False
    filling = []  # (request, tokens) of the requests that fill a block: cache it
    if manager.enable_prefix_caching:
        num_cached_of = manager._num_cached
        for request, req_id, num_total in zip(requests, ids, totals, strict=True):
            if num_total // bs > num_cached_of[req_id]:
                request.check_hash_config(bs, manager.hash_seed)  # before any change
                filling.append((request, num_total))
    if total:
        fresh = manager.pool.get_new_blocks(total)
        _take_fresh_blocks(manager._table, ids, held, needs, fresh)
    if filling:
        _cache_filled_blocks(manager, filling)
    return True


def _first(flags: Iterable[bool]) -> int | None:
    """The index of the first true one of `flags` (the request of the batch that a check
    refuses first), or None; at C speed, as every step runs these checks."""
    return next(itertools.compress(itertools.count(), flags), None)


def _as_list(name: str, values) -> list:
    """`values` as a list (a generator is read once); ValueError naming `name` unless it
    is iterable (None or one Request raised TypeError, a generator of requests was used
    up by the type check and then read as empty) and ordered (a set's order is not the
    one it was written in: {4, 1} paired 1 with the first request)."""
    if type(values) is list:
        return values
    if is_unordered(values):
        raise ValueError(f"{name}={values!r} must be a sequence (a set or mapping has no order)")
    try:
        return list(values)
    except TypeError:
        raise ValueError(f"{name}={values!r} must be a sequence") from None


def _cache_filled_blocks(manager: KVCacheManager, filling: list[tuple[Request, int]]) -> None:
    """cache_full_blocks(manager, request, num_tokens) for each (request, num_tokens) of
    `filling`, in order, whose hash configuration the caller has checked.

    A request that fills one block past block 0 whose hash is all it lacks (a decode
    step's; with no cache events to report) is hashed (hashing.extend_block_hashes, as
    Request.update_block_hashes would) and cached here, without the per-call layers and
    checks that hold by then (its block list, its hash configuration, its tokens as
    Request keeps them); any other goes through cache_full_blocks. A hash that fails
    raises its ValueError, as cache_full_blocks would (Request.update_block_hashes makes
    the same call).
    """
    pool = manager.pool
    if pool.enable_events or not pool.enable_caching:
        for request, num_tokens in filling:
            cache_full_blocks(manager, request, num_tokens)
        return
    bs, seed = manager.block_size, manager.hash_seed
    config = (bs, seed)
    blocks_of, num_cached_of = manager._blocks, manager._num_cached
    cache_block = pool.cache_block
    for request, num_tokens in filling:
        req_id = request.request_id
        i = num_cached_of[req_id]  # the block this fills
        blocks, hashes, token_ids = blocks_of[req_id], request.block_hashes, request._all_token_ids
        if not (
            i
            and num_tokens // bs == i + 1 == len(token_ids) // bs
            and len(blocks) > i
            and len(hashes) == i
            and request._hash_config == config
        ):
            cache_full_blocks(manager, request, num_tokens)
            continue
        # Appends block i's hash, changing nothing if it raises: the ValueError that
        # cache_full_blocks would raise, from this same call.
        extend_block_hashes(
            hashes, token_ids, bs, seed=seed, adapter_id=request.adapter_id,
            cache_salt=request.cache_salt, tokens_checked=True,
        )  # fmt: skip
        cache_block(blocks[i], hashes[i])
        num_cached_of[req_id] = i + 1


def _take_fresh_blocks(
    table: HostBlockTable,
    ids: list[str],
    held: list[list[KVCacheBlock]],
    needs: list[int],
    fresh: list[KVCacheBlock],
) -> None:
    """Hands out `fresh` in order: needs[i] blocks (if > 0) to request ids[i].

    Appends to the held lists in place (they are the manager's own) and mirrors the
    appends into `table`.
    """
    one_each_ids, one_each_blocks, taken = [], [], 0
    for req_id, blocks, k in zip(ids, held, needs, strict=True):
        if k == 1:
            block = fresh[taken]
            blocks.append(block)
            one_each_ids.append(req_id)
            one_each_blocks.append(block.block_id)
        elif k > 1:
            added = fresh[taken : taken + k]
            blocks.extend(added)
            table.append(req_id, [b.block_id for b in added], shared=False)
        else:
            continue
        taken += k
    if one_each_ids:
        table.append_one_each(one_each_ids, one_each_blocks)
