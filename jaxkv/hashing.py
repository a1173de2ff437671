"""Chained hashes of full KV blocks, the keys of the prefix cache.

A block's hash names its whole prefix: H(parent hash, the block's token ids, extra keys).
Extra keys carry the adapter id on every block (KV computed under one adapter is not
valid under another) and the cache salt on the first block only (the salt is inherited
by every later block through the chain).

Collision safety: the digest is BLAKE2b with a 16-byte (128-bit) output over a canonical
length-prefixed byte encoding, so distinct inputs never encode alike and an accidental
collision needs about 2**64 blocks. A cache hit is trusted on the digest alone; stored
tokens are not re-compared. Hashes depend only on the seed and the inputs, never on
Python's per-process hash randomisation, so they are stable across processes.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

from jaxkv.field_checks import as_int

BlockHash = bytes  # 16-byte digest naming a full block and all blocks before it

HASH_NUM_BYTES = 16
_INT64 = struct.Struct("<q")
_EMPTY_STATE = hashlib.blake2b(digest_size=HASH_NUM_BYTES)  # only ever copied, never updated
_DOMAIN = b"jaxkv.block.v1"


def root_hash(seed: int = 0) -> BlockHash:
    """The parent hash of every request's first block, derived from `seed` only."""
    value = seed if type(seed) is int else as_int(seed)  # the common case without the ABC
    if value is None or not -(2**63) <= value < 2**63:
        raise ValueError(f"{seed=} must be an int that fits in 64 bits")
    return _root_hash(value)


@functools.lru_cache(maxsize=64)
def _root_hash(seed: int) -> BlockHash:
    """root_hash of a checked seed: a pure function of it, so it never goes stale."""
    return hashlib.blake2b(_DOMAIN + _INT64.pack(seed), digest_size=HASH_NUM_BYTES).digest()


def block_extra_keys(
    block_index: int, *, adapter_id: str | None, cache_salt: str | None
) -> tuple[str, ...]:
    """Extra keys of block `block_index`: adapter id on every block, salt on block 0 only."""
    keys: list[str] = []
    if adapter_id is not None:
        keys.append("adapter:" + adapter_id)
    if cache_salt is not None and block_index == 0:
        keys.append("salt:" + cache_salt)
    return tuple(keys)


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()
) -> BlockHash:
    """H(parent_hash, token_ids, extra_keys) as a 16-byte BLAKE2b digest.

    The encoding is canonical: parent digest, token count, tokens as little-endian int64,
    then each extra key as length-prefixed UTF-8, so no two distinct inputs share bytes.
    Raises ValueError unless `parent_hash` is a BlockHash (16 bytes), the tokens a
    sequence of ints (not bools) that fit in int64 and `extra_keys` a tuple of str
    encodable as UTF-8 (one str would be read as its letters).
    """
    if not is_block_hash(parent_hash):
        raise ValueError(f"{parent_hash=} must be a BlockHash ({HASH_NUM_BYTES} bytes)")
    if type(extra_keys) is not tuple or not all(map(is_hash_key, extra_keys)):
        raise ValueError(f"extra_keys={extra_keys!r} must be a tuple of str encodable as UTF-8")
    try:
        n = len(token_ids)
        if bool in set(map(type, token_ids)):  # struct packs True as 1
            raise struct.error
        packed = struct.pack(f"<{n}q", *token_ids)
    except (struct.error, TypeError):  # TypeError: no sequence (len() of an int)
        raise ValueError(
            f"token_ids={token_ids!r} must be ints (not bools) that fit in int64"
        ) from None
    return _digest(parent_hash, n, packed, extra_keys)


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: int = 0,
    adapter_id: str | None = None,
    cache_salt: str | None = None,
    tokens_checked: bool = False,
) -> list[BlockHash]:
    """Appends to `block_hashes` the hashes of the full blocks of `token_ids` it lacks.

    `block_hashes` must hold the hashes of the first len(block_hashes) blocks of
    `token_ids` (computed with the same block size, seed and keys). Returns the list.
    Equal to chaining hash_block_tokens block by block (one digest call per block).
    Raises ValueError, changing nothing, unless `block_size` is an int >= 1, the
    tokens hashed are ints (a bool is not) that fit in int64 and `adapter_id` and
    `cache_salt` are None or str encodable as UTF-8. `tokens_checked`: the
    caller has refused bools already (a Request's tokens), so they are not looked for.
    Raises ValueError too unless `block_hashes` is a list whose last hash (the parent of
    the first block it lacks) is a BlockHash.
    """
    if type(block_hashes) is not list:
        raise ValueError(f"block_hashes={block_hashes!r} must be a list (extended in place)")
    if type(block_size) is not int or block_size < 1:
        size = as_int(block_size)
        if size is None or size < 1:
            raise ValueError(f"{block_size=} must be an int >= 1")
        block_size = size
    start, num_full = len(block_hashes), len(token_ids) // block_size
    if start and not is_block_hash(block_hashes[-1]):  # a chain from it names no prefix
        raise ValueError(f"block_hashes[-1]={block_hashes[-1]!r} must be a BlockHash")
    if num_full <= start:  # nothing to hash: the keys are refused all the same
        check_hash_key("adapter_id", adapter_id)
        check_hash_key("cache_salt", cache_salt)
        return block_hashes
    parent = block_hashes[-1] if start else root_hash(seed)
    try:
        count, first, later = _block_encoding(block_size, adapter_id, cache_salt)
    except (TypeError, UnicodeEncodeError):  # named here, not on the common path
        check_hash_key("adapter_id", adapter_id)
        check_hash_key("cache_salt", cache_salt)
        # Valid keys: a str subclass without a hash, which the memo cannot take, is
        # encoded as the str it holds.
        count, first, later = _block_encoding(block_size, _plain(adapter_id), _plain(cache_salt))
    # All new blocks' tokens packed in one call; each digest starts from a copy of an
    # empty 16-byte BLAKE2b state (cheaper than parsing digest_size on every block).
    lo, width = start * block_size, block_size * 8
    n = num_full * block_size - lo
    tokens = token_ids[lo : lo + n]
    try:
        if not tokens_checked and bool in set(map(type, tokens)):  # struct packs True as 1
            raise struct.error
        packed = _int64s(n).pack(*tokens)
    except struct.error:
        raise ValueError("token_ids must be ints (not bools) that fit in int64") from None
    new_state = _EMPTY_STATE.copy
    for i in range(start, num_full):
        h = new_state()
        h.update(parent)
        h.update(count)
        at = (i - start) * width
        h.update(packed[at : at + width])
        h.update(later if i else first)
        parent = h.digest()
        block_hashes.append(parent)
    return block_hashes


def is_block_hash(value: object) -> bool:
    """Whether `value` can be a BlockHash: bytes of HASH_NUM_BYTES (a str or a digest of
    another length names no block)."""
    return type(value) is bytes and len(value) == HASH_NUM_BYTES


def _digest(parent: BlockHash, n: int, token_bytes: bytes, extra_keys: tuple[str, ...]) -> bytes:
    data = parent + _INT64.pack(n) + token_bytes + _encode_keys(extra_keys)
    return hashlib.blake2b(data, digest_size=HASH_NUM_BYTES).digest()


def is_hash_key(key: object) -> bool:
    """Whether `key` can be an extra key of a block hash (an adapter id, a cache salt): a
    str that encodes as UTF-8 (one holding a lone surrogate, "\\ud800", does not)."""
    if not isinstance(key, str):
        return False
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_hash_key(name: str, key: object) -> None:
    """ValueError naming `name` unless `key` is None or a valid extra key (is_hash_key)."""
    if key is not None and not is_hash_key(key):
        raise ValueError(f"{name}={key!r} must be None or a str encodable as UTF-8")


def _plain(key: str | None) -> str | None:
    """`key` as a str of str's own type (None stays None)."""
    return None if key is None else str.__str__(key)


def _encode_keys(extra_keys: tuple[str, ...]) -> bytes:
    """The key count, then each key as length-prefixed UTF-8."""
    parts = [_INT64.pack(len(extra_keys))]
    for key in extra_keys:
        raw = key.encode("utf-8")
        parts += (_INT64.pack(len(raw)), raw)
    return b"".join(parts)


@functools.lru_cache(maxsize=1024)
def _block_encoding(block_size: int, adapter_id: str | None, cache_salt: str | None):
    """(encoded token count, encoded extra keys of block 0, of later blocks)."""
    first, later = (
        _encode_keys(block_extra_keys(i, adapter_id=adapter_id, cache_salt=cache_salt))
        for i in (0, 1)
    )
    return _INT64.pack(block_size), first, later


@functools.lru_cache(maxsize=256)
def _int64s(n: int) -> struct.Struct:
    """Packer of `n` little-endian int64s."""
    return struct.Struct(f"<{n}q")
