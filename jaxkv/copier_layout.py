"""What a KV copier declares of its blocks, checked once at bind; whether the blocks a
save landed match it (jaxkv.host_offload_connector stores only blocks that do); and the
block ids a copy may be asked for."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxkv.field_checks import as_int, is_unordered
from jaxkv.hashing import BlockHash
from jaxkv.kv_transfer import KVCopier
from jaxkv.request import Request


class StoreLayout(NamedTuple):
    """What the blocks in a host store were saved under: the store serves a copier bound
    under an equal layout only. block_shape and dtype are None where the copier declares
    none."""

    block_size: int
    hash_seed: int
    bytes_per_block: int
    block_shape: tuple[int, ...] | None
    dtype: np.dtype | None
    model_fingerprint: object  # bytes naming the model (jaxkv.model_fingerprint), or None


UNBOUND = StoreLayout(0, 0, 0, None, None, None)  # equal to no bound copier's layout


def store_layout(copier: KVCopier, block_size: object, hash_seed: object) -> StoreLayout:
    """The layout of `copier`'s blocks under `block_size` and `hash_seed`; ValueError
    naming the first of block_size, hash_seed (see checked_layout), copier.block_shape or
    copier.dtype (see declared_block) that is wrong, or naming the declared block_shape
    and dtype where no block of them holds bytes_per_block bytes (every save of such a
    copier would be refused when it lands)."""
    size, seed, bytes_per_block = checked_layout(copier, block_size, hash_seed)
    shape, dtype = declared_block(copier)
    _check_block_bytes(shape, dtype, bytes_per_block)
    fingerprint = getattr(copier, "model_fingerprint", None)
    return StoreLayout(size, seed, bytes_per_block, shape, dtype, fingerprint)


def checked_layout(copier: KVCopier, block_size: object, hash_seed: object) -> tuple[int, ...]:
    """(block_size, hash_seed, copier.bytes_per_block) as ints; ValueError naming the first
    that is not an int >= 1 (hash_seed: an int that fits in 64 bits, as Request takes)."""
    size, seed = as_int(block_size), as_int(hash_seed)
    if size is None or size < 1:
        raise ValueError(f"{block_size=} must be an int >= 1")
    if seed is None or not -(2**63) <= seed < 2**63:
        raise ValueError(f"{hash_seed=} must be an int that fits in 64 bits")
    raw = getattr(copier, "bytes_per_block", None)
    bytes_per_block = as_int(raw)
    if bytes_per_block is None or bytes_per_block < 1:
        raise ValueError(f"copier.bytes_per_block={raw!r} must be an int >= 1")
    return size, seed, bytes_per_block


def declared_block(copier: KVCopier) -> tuple[tuple[int, ...] | None, np.dtype | None]:
    """The copier's block_shape as a tuple of ints and dtype as a numpy dtype, each None
    where it declares none; ValueError naming the first that is neither."""
    raw_shape = getattr(copier, "block_shape", None)
    shape = None
    if raw_shape is not None:
        dims = _as_ints(raw_shape)
        if dims is None or any(d is None or d < 1 for d in dims):
            raise ValueError(f"copier.block_shape={raw_shape!r} must be a sequence of ints >= 1")
        shape = tuple(dims)
    raw_dtype = getattr(copier, "dtype", None)
    dtype = None
    if raw_dtype is not None:
        try:
            dtype = np.dtype(raw_dtype)
        except (TypeError, ValueError) as e:
            raise ValueError(f"copier.dtype={raw_dtype!r} must be a numpy dtype") from e
    return shape, dtype


def _check_block_bytes(shape, dtype, bytes_per_block: int) -> None:
    """ValueError unless a block of the declared shape and dtype can hold bytes_per_block
    bytes: exactly, where both are declared; a whole number of elements or of items where
    one is."""
    elements = None if shape is None else int(np.prod(shape))
    if shape is not None and dtype is not None:
        if elements * dtype.itemsize != bytes_per_block:
            raise ValueError(
                f"copier.block_shape={shape} of copier.dtype={dtype} holds "
                f"{elements * dtype.itemsize} bytes, not copier.bytes_per_block={bytes_per_block}"
            )
    elif shape is not None and bytes_per_block % elements:
        raise ValueError(
            f"copier.bytes_per_block={bytes_per_block} must be a whole number of "
            f"copier.block_shape={shape}'s {elements} elements"
        )
    elif dtype is not None and bytes_per_block % dtype.itemsize:
        raise ValueError(
            f"copier.bytes_per_block={bytes_per_block} must be a whole number of "
            f"copier.dtype={dtype}'s {dtype.itemsize}-byte items"
        )


def declared_num_blocks(copier: KVCopier) -> int | None:
    """The copier's num_blocks as an int, None where it declares none; ValueError unless
    an int >= 1."""
    raw = getattr(copier, "num_blocks", None)
    if raw is None:
        return None
    num_blocks = as_int(raw)
    if num_blocks is None or num_blocks < 1:
        raise ValueError(f"copier.num_blocks={raw!r} must be an int >= 1")
    return num_blocks


def _mismatch(name: str, got: object, declared: object, held: object) -> str | None:
    """What is wrong with a landed block's `got` shape or dtype: not the copier's
    `declared` one, or, where it declares none, not that of the blocks the store `held`
    (None: it holds none)."""
    if declared is not None:
        return None if got == declared else f"{name} {got}, not the copier's {declared}"
    if held is not None and got != held:
        return f"{name} {got}, not the stored blocks' {held}"
    return None


def checked_copied_blocks(
    result: object, num_asked: int, layout: StoreLayout, held: np.ndarray | None
) -> np.ndarray:
    """A landed save's `result` as one array of `num_asked` blocks. An exception (from
    numpy, for blocks no array holds, such as ragged ones) or ValueError unless it is
    one, and unless its blocks have the copier's declared block_shape and dtype
    (`layout`'s), or, where it declares none, those of `held`, a block the store holds
    (None: it holds none), since a load makes the stored blocks it gathers one array;
    and unless each has the copier's bytes_per_block, by which the store counts its
    host_bytes (larger blocks overran the budget, unseen in the stats)."""
    data = np.asarray(result)
    if len(data) != num_asked:
        raise ValueError(f"{len(data)} blocks copied for {num_asked} asked")
    held_shape = None if held is None else held.shape
    held_dtype = None if held is None else held.dtype
    size = data.nbytes // len(data)
    wrong = [
        problem
        for problem in (
            _mismatch("shape", data.shape[1:], layout.block_shape, held_shape),
            _mismatch("dtype", data.dtype, layout.dtype, held_dtype),
            None
            if size == layout.bytes_per_block
            else f"{size} bytes each, not the copier's bytes_per_block {layout.bytes_per_block}",
        )
        if problem
    ]
    if wrong:
        raise ValueError("copied blocks of " + " and ".join(wrong))
    return data


def load_span(
    request: Request, num_blocks: int, layout: StoreLayout, call: str
) -> tuple[list[BlockHash], int]:
    """(the request's block hashes under `layout`, the index of the first of them a load
    of `num_blocks` blocks after its computed tokens reads); ValueError naming `call`
    unless those blocks are whole prompt blocks, at least one, before its last token's
    (whose logits must be computed)."""
    bs = layout.block_size
    first, rem = divmod(request.num_computed_tokens, bs)
    hashes = request.update_block_hashes(bs, layout.hash_seed)
    last = (request.num_tokens - 1) // bs  # the last token's block: never loaded
    if rem or not num_blocks or first + num_blocks > min(len(hashes), last):
        raise ValueError(
            f"{call}: {num_blocks} block_ids do not cover whole prompt blocks after "
            f"{request.num_computed_tokens} computed tokens and before its last token "
            "(whose logits must be computed)"
        )
    return hashes, first


def checked_block_ids(block_ids: object, call: str, num_blocks: int | None) -> list[int]:
    """`block_ids` as a list of distinct ints >= 1, below num_blocks where the copier
    declares num_blocks (its cache less the null block 0); ValueError naming them and
    `call` otherwise: a block loaded twice would hold whichever copy landed last, and a
    copier's start_load refusing an id would count as a failed load, dropping the stored
    blocks. The null block 0 and negative ids are in no engine's cache: refused whether
    or not the copier declares num_blocks (ids past a cache it does not declare reach it).
    A set or mapping is refused too: block_ids[i] holds the request's i-th block, and a
    set iterates in hash order ({2, 9} as 9, 2: each block saved under the other's hash)."""
    ordered = not is_unordered(block_ids)
    ids = _as_ints(block_ids) if ordered else None
    if ids is None or None in ids or len(set(ids)) != len(ids):
        raise ValueError(
            f"{call}: block_ids={block_ids!r} must be block ids in the "
            "bound engine's cache, each given once"
        )
    if ids and (min(ids) < 1 or (num_blocks is not None and max(ids) >= num_blocks)):
        upper = "..." if num_blocks is None else num_blocks
        raise ValueError(
            f"{call}: block_ids={block_ids!r} must be block ids in [1, {upper}), "
            "the bound engine's cache less the null block 0"
        )
    return ids


def _as_ints(values: object) -> list[int | None] | None:
    """as_int of each of `values`; None unless they are an iterable other than a str."""
    if isinstance(values, (str, bytes)):
        return None
    try:
        return [as_int(v) for v in values]
    except TypeError:  # not iterable
        return None
