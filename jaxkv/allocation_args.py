"""Argument checks of KV block allocation: token counts, lengths and cache hits.

Plain Python, no JAX. KVCacheManager and its batch allocation run these before they
change any state, so a refused call leaves the pool, the block table and the request as
they were. Each check raises ValueError naming the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jaxkv.block_pool import MAX_INT32, BlockPool, KVCacheBlock
from jaxkv.field_checks import as_int, is_unordered
from jaxkv.request import Request
from jaxkv.request_id_lists import plain_id

__all__ = [
    "allocation_counts",
    "check_computed_within_held",
    "check_computed_within_tokens",
    "check_prompt_fits",
    "check_total_fits",
    "checked_hit_tokens",
    "checked_request_id",
    "count",
    "manager_args",
    "not_the_owner_message",
    "request_id_of",
    "validated_computed_blocks",
]


def plain_int(value):
    """`value` as a Python int if it is an integer (numpy ones too; bool is not), else as is."""
    as_python = as_int(value)
    return value if as_python is None else as_python


def request_id_of(name: str, request, owner: Mapping[str, Request]) -> str:
    """The id of `request` (a Request or its id); ValueError naming `name` otherwise, or
    for a Request other than `owner`'s for its id (it would act on another's blocks)."""
    if isinstance(request, str):
        return plain_id(request)
    if isinstance(request, Request):
        req_id = request.request_id
        found = owner.get(req_id)
        if found is not request and found is not None:
            raise ValueError(not_the_owner_message(req_id))
        return req_id
    raise ValueError(f"{name}={request!r} must be a Request or a request id (str)")


def manager_args(
    num_blocks, block_size, max_model_len, hash_seed, **flags
) -> tuple[int, int, int, int]:
    """KVCacheManager's sizes and seed as Python ints (numpy integers included); ValueError
    unless block_size and max_model_len are ints in [1, 2**31 - 1], num_blocks * block_size
    at most 2**31, hash_seed an int of 64 bits and each flag a bool (a flag read from
    text, "false", would switch on by truthiness)."""
    num_blocks = plain_int(num_blocks)  # BlockPool checks it
    block_size, max_model_len = plain_int(block_size), plain_int(max_model_len)
    for name, value in (("block_size", block_size), ("max_model_len", max_model_len)):
        if type(value) is not int or not 1 <= value <= MAX_INT32:
            raise ValueError(f"{name}={value!r} must be an int in [1, {MAX_INT32}] (int32)")
    # As CacheConfig: a token's KV slot, block_id * block_size + offset, is int32 on the
    # device (build_attention_metadata's slot_mapping), so past 2**31 slots it wrapped.
    in_range = type(num_blocks) is int and 2 <= num_blocks <= MAX_INT32  # else BlockPool's
    if in_range and num_blocks * block_size > MAX_INT32 + 1:
        raise ValueError(
            f"num_blocks={num_blocks} times block_size={block_size} must be at most 2**31 "
            "token slots (KV slot ids are int32 on the device)"
        )
    hash_seed = plain_int(hash_seed)
    if type(hash_seed) is not int:
        raise ValueError(f"{hash_seed=} must be an int")
    if not -(2**63) <= hash_seed < 2**63:  # root_hash's range, named as this argument
        raise ValueError(f"{hash_seed=} must be an int that fits in 64 bits")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r} must be a bool")
    return num_blocks, block_size, max_model_len, hash_seed


def checked_request_id(request) -> str:
    """The id of `request`; ValueError unless it is a Request (a bare id has no tokens)."""
    if not isinstance(request, Request):
        raise ValueError(f"request={request!r} must be a Request")
    return request.request_id


def not_the_owner_message(req_id: str) -> str:
    """Why a Request may not act as `req_id`: its blocks were allocated for another
    Request object with that id."""
    return (
        f"request {req_id!r} holds blocks allocated for another Request object with that "
        "id: free it before reusing the id"
    )


def checked_hit_tokens(request, num_hit_tokens) -> int:
    """`num_hit_tokens` as an int in [0, request.num_tokens]; ValueError otherwise, or
    unless `request` is a Request."""
    hits = count("num_hit_tokens", num_hit_tokens, checked_request_id(request))
    if hits > request.num_tokens:
        raise ValueError(f"{num_hit_tokens=} exceeds the {request.num_tokens} tokens of {request}")
    return hits


def count(name: str, value, req_id: str) -> int:
    """`value` as a Python int (numpy integers included); ValueError unless an int >= 0
    (a bool is refused: True as a token count is a caller's mistake, not 1)."""
    result = plain_int(value)
    if type(result) is not int or result < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0 (request {req_id!r})")
    return result


def allocation_counts(
    req_id: str,
    num_new_tokens,
    num_new_computed_tokens,
    num_lookahead_tokens,
    num_computed_tokens,
) -> tuple[int, int, int, int]:
    """The four counts of one allocate_slots call as Python ints, each checked >= 0."""
    if (
        type(num_new_tokens) is int
        and type(num_new_computed_tokens) is int
        and type(num_lookahead_tokens) is int
        and type(num_computed_tokens) is int
        and num_new_tokens >= 0
        and num_new_computed_tokens >= 0
        and num_lookahead_tokens >= 0
        and num_computed_tokens >= 0
    ):  # the common case, without a call per count
        return num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_computed_tokens
    return (
        count("num_new_tokens", num_new_tokens, req_id),
        count("num_new_computed_tokens", num_new_computed_tokens, req_id),
        count("num_lookahead_tokens", num_lookahead_tokens, req_id),
        count("request.num_computed_tokens", num_computed_tokens, req_id),
    )


def check_prompt_fits(request: Request, max_model_len: int) -> None:
    if request.num_prompt_tokens > max_model_len:
        raise ValueError(
            f"request {request.request_id!r}: {request.num_prompt_tokens=} exceeds {max_model_len=}"
        )


def check_computed_within_tokens(request: Request, num_computed_tokens: int) -> None:
    """Refuses marking more tokens computed than the request has."""
    if num_computed_tokens > request.num_tokens:
        raise ValueError(
            f"request {request.request_id!r}: num_computed_tokens + num_new_computed_tokens "
            f"= {num_computed_tokens} exceeds its {request.num_tokens} tokens"
        )


def check_total_fits(req_id: str, num_total: int, max_model_len: int, **terms: int) -> None:
    """Refuses a request growing past max_model_len; the message names the `terms` (the
    counts that add up to num_total), so a caller sees which argument is too large."""
    if num_total > max_model_len:
        parts = " + ".join(f"{name}={value}" for name, value in terms.items())
        raise ValueError(
            f"request {req_id!r} would hold {num_total} tokens > {max_model_len=}"
            + (f" ({parts})" if parts else "")
        )


def check_computed_within_held(
    req_id: str, num_computed_tokens: int, num_held_blocks: int, block_size: int
) -> None:
    """Refuses computed tokens past the blocks held: those blocks would be cached as
    holding tokens nobody computed into them."""
    num_held_tokens = num_held_blocks * block_size
    if num_computed_tokens > num_held_tokens:
        raise ValueError(
            f"request {req_id!r}: num_computed_tokens={num_computed_tokens} exceeds the "
            f"{num_held_tokens} tokens of the blocks it holds ({num_held_blocks} blocks; a "
            "request whose blocks were freed starts again from 0)"
        )


def validated_computed_blocks(
    pool: BlockPool,
    request: Request,
    num_held_blocks: int,
    num_computed_tokens: int,
    num_new_computed_tokens: int,
    block_ids: Sequence[int],
    *,
    block_size: int,
    hash_seed: int,
) -> list[KVCacheBlock]:
    """The pool's blocks of a cache hit (`block_ids`), checked to start where the
    request's computed tokens end, to be covered by num_new_computed_tokens and to still
    carry the request's block hashes at their positions. Requires prefix caching on
    unless `block_ids` is empty ([] then)."""
    try:
        if not len(block_ids):
            return []
    except TypeError:
        raise ValueError(
            f"new_computed_blocks={block_ids!r} must be a sequence of block ids"
        ) from None
    if is_unordered(block_ids):  # as allocate_slots_batch refuses
        raise ValueError(
            f"new_computed_blocks={block_ids!r} must be a sequence of block ids "
            "(a set or mapping has no order)"
        )
    if not pool.enable_caching:
        raise ValueError("new_computed_blocks given while prefix caching is disabled")
    if num_computed_tokens != num_held_blocks * block_size:
        raise ValueError(
            f"new_computed_blocks must start where the computed tokens end: request "
            f"{request.request_id!r} has num_computed_tokens={num_computed_tokens} and holds "
            f"{num_held_blocks} blocks of {block_size} tokens"
        )
    if num_new_computed_tokens < len(block_ids) * block_size:
        raise ValueError(
            f"{num_new_computed_tokens=} must be at least {len(block_ids) * block_size}, the "
            f"tokens of the {len(block_ids)} new_computed_blocks"
        )
    hashes = request.update_block_hashes(block_size, hash_seed)
    start = num_held_blocks
    if start + len(block_ids) > len(hashes):
        raise ValueError(
            f"new_computed_blocks={list(block_ids)} run past the request's full blocks"
        )
    blocks = []
    for i, block_id in enumerate(block_ids):
        if type(block_id) is not int:
            block_id = plain_int(block_id)
            if type(block_id) is not int:
                raise ValueError(f"new_computed_blocks: {block_id!r} must be a block id (an int)")
        if not 0 < block_id < pool.num_blocks:
            raise ValueError(f"new_computed_blocks: invalid block id {block_id}")
        block = pool.blocks[block_id]
        if block.block_hash != hashes[start + i]:
            raise ValueError(
                f"new_computed_blocks: block {block_id} no longer caches position "
                f"{start + i} of request {request.request_id!r} (stale cache hit)"
            )
        blocks.append(block)
    return blocks
