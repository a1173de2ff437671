"""The block pool: every KV block, its holders, LRU eviction and the prefix-cache map.

Host side, no JAX; built on KVCacheBlock (jaxkv.kv_cache_block) and the free queue
(jaxkv.free_block_queue), both re-exported here.

Blocks are created once and addressed by id. Block 0 is the null block: never handed out,
the fill value of unused block-table entries. Every other block is either free (ref_cnt 0,
in the free queue) or held (ref_cnt = number of holders). A free block keeps its hash
until it is handed out again (lazy eviction), so a later request can still hit it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from jaxkv.field_checks import as_int, bool_fields
from jaxkv.free_block_queue import FreeKVCacheBlockQueue
from jaxkv.hashing import BlockHash, is_block_hash
from jaxkv.held_interrupts import holding_interrupts
from jaxkv.kv_cache_block import KVCacheBlock
from jaxkv.request import MAX_TOKEN_ID

__all__ = [
    "MAX_INT32",
    "NULL_BLOCK_ID",
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "FreeKVCacheBlockQueue",
    "IntegrityError",
    "KVCacheBlock",
    "KVCacheEvent",
]

NULL_BLOCK_ID = 0
MAX_INT32 = 2**31 - 1  # block ids, positions and lengths are int32 in device arrays


class IntegrityError(AssertionError):
    """A conservation law of the block pool or the manager does not hold."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks that became full and entered the prefix cache, in prefix order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None  # hash of the block before the first one; None at start
    token_ids: tuple[int, ...]  # tokens of all stored blocks, concatenated
    block_size: int
    adapter_id: str | None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks that left the prefix cache: evicted (their ids were handed out again) or
    uncached while held (their KV was never written, KVCacheManager.uncache_unwritten)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """Owns every KV block: ref counts, free queue and the hash -> block cache map.

    One cached block per hash: if a second block becomes full with a hash already cached,
    it stays uncached (its KV is a duplicate) and is reused as a plain free block.
    Calls that change state validate their arguments first and change nothing on error.
    """

    def __init__(
        self, num_blocks: int, *, enable_caching: bool = True, enable_events: bool = False
    ) -> None:
        given, num_blocks = num_blocks, as_int(num_blocks)  # a numpy int is taken as one
        if num_blocks is None or not 2 <= num_blocks <= MAX_INT32:
            raise ValueError(
                f"num_blocks={given!r} must be an int in [2, {MAX_INT32}] (block 0 is the "
                "null block; block ids are int32 in block tables)"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        bool_fields(self, "enable_caching", "enable_events")  # "no" cached, by its truthiness
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVCacheEvent] = []
        # Bumped whenever a block loses its hash (eviction by get_new_blocks,
        # uncache_blocks, reset_prefix_cache): while it is unchanged, every block found in
        # the prefix cache still carries the hash it was found under.
        self.cache_epoch = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_held_blocks(self) -> int:
        """Handable blocks (all but the null block) that some request holds."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of handable blocks (all but the null block) that are held."""
        return self.num_held_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Sequence[KVCacheBlock], *, validate: bool = True) -> None:
        """Adds one holder to each block; a free block leaves the free queue (a cache hit).

        Raises ValueError (nothing changed) if a block is the null block or not this pool's.
        validate=False skips that check, for an owner that passes only blocks of this pool.
        """
        if validate:  # (a generator: checked, then walked again)
            blocks = self._check_own("blocks", blocks)
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Takes `n` blocks from the head of the free queue, evicting their cached hashes.

        Raises ValueError (nothing changed) unless `n` is an int >= 0 (not a bool) and at
        most num_free_blocks.
        """
        if type(n) is not int or n < 0:
            raise ValueError(f"get_new_blocks: n={n!r} must be an int >= 0")
        blocks = self.free_block_queue.popleft_n(n)
        removed = []
        for block in blocks:
            if block.block_hash is not None:
                removed.append(block.block_hash)
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        if removed:
            self.cache_epoch += 1
            if self.enable_events:
                self._events.append(BlockRemoved(tuple(removed)))
        return blocks

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        *,
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        adapter_id: str | None,
        validate: bool = True,
    ) -> None:
        """Marks `blocks` (consecutive full blocks of one request) with `block_hashes`.

        A block that already carries a hash, or whose hash another block carries, is
        left as it is. With events on, each run of consecutive blocks that were stored
        is reported as one BlockStored (its parent hash, its tokens). Raises ValueError
        (nothing changed) unless there is one hash and `block_size` tokens per block and
        every block is this pool's, not the null block and held (a free block's contents
        are nobody's), each hash (the parent too) is a 16-byte BlockHash, each token id
        an int (numpy's too, stored as a Python int; not a bool) in [0, 2**63), as a
        Request holds them, `adapter_id` is None or a str and `block_size` an int >= 1
        (validate=False skips these checks, for an owner that passes only blocks it
        holds, with their hashes and its Request's tokens).
        """
        if validate:
            size = as_int(block_size)  # 2.0 used to raise TypeError after caching blocks
            if size is None or size < 1:
                raise ValueError(f"cache_full_blocks: {block_size=} must be an int >= 1")
            block_size = size
            blocks = self._check_own("blocks", blocks)  # None or a block: len() named nothing
            try:
                num_hashes, num_tokens = len(block_hashes), len(token_ids)
            except TypeError:
                raise ValueError(
                    f"cache_full_blocks: {block_hashes=} and {token_ids=} must be sequences"
                ) from None
            if num_hashes != len(blocks) or num_tokens != len(blocks) * block_size:
                raise ValueError(
                    f"cache_full_blocks: {len(blocks)} blocks need as many block_hashes "
                    f"(got {num_hashes}) and {len(blocks)} * {block_size=} token_ids "
                    f"(got {num_tokens})"
                )
            # None was cached as a key, a list raised TypeError midway; a parent or adapter
            # id of the wrong kind went into the BlockStored events unchecked.
            bad = [h for h in block_hashes if not is_block_hash(h)][:1]
            if bad:
                raise ValueError(f"cache_full_blocks: block hash {bad[0]!r} is no BlockHash")
            token_ids = _checked_token_ids(token_ids)  # else BlockStored carried them as given
            if parent_block_hash is not None and not is_block_hash(parent_block_hash):
                raise ValueError(f"cache_full_blocks: {parent_block_hash=} is no BlockHash")
            if adapter_id is not None and not isinstance(adapter_id, str):
                raise ValueError(f"cache_full_blocks: {adapter_id=} must be None or a str")
            free = [b.block_id for b in blocks if b.ref_cnt == 0]
            if free:
                raise ValueError(f"cache_full_blocks: blocks {free} are free (held by nobody)")
        if not self.enable_caching:
            return
        cache_block = self.cache_block
        if not self.enable_events:  # no runs to report
            for block, block_hash in zip(blocks, block_hashes, strict=True):
                cache_block(block, block_hash)
            return
        runs: list[list[int]] = []  # [start, end) of consecutive stored blocks
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if not cache_block(block, block_hash):
                continue
            if runs and runs[-1][1] == i:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        for start, end in runs:
            self._events.append(
                BlockStored(
                    tuple(block_hashes[start:end]),
                    block_hashes[start - 1] if start else parent_block_hash,
                    tuple(token_ids[start * block_size : end * block_size]),
                    block_size,
                    adapter_id,
                )
            )

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Marks `block` with `block_hash` and caches it under that hash, unless the block
        already carries a hash or another block carries this one (one block per hash);
        True if it was stored. Unchecked and reporting no event: for cache_full_blocks and
        owners that pass a held block of this pool with its request's hash, caching on."""
        cached = self.cached_block_hash_to_block
        if block.block_hash is not None or block_hash in cached:
            return False
        block.block_hash = block_hash
        cached[block_hash] = block
        return True

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes `blocks` out of the prefix cache (their KV was never written); a block
        that carries no hash, or whose hash maps to another block, is left as it is.
        Raises ValueError (nothing changed) if a block is the null block or not this pool's."""
        blocks = self._check_own("blocks", blocks)
        cached = self.cached_block_hash_to_block
        removed = []
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None and cached.get(block_hash) is block:
                del cached[block_hash]
                block.block_hash = None
                removed.append(block_hash)
        if removed:
            self.cache_epoch += 1
            if self.enable_events:
                self._events.append(BlockRemoved(tuple(removed)))

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], *, validate: bool = True) -> None:
        """Drops one holder from each block; blocks reaching 0 join the queue in this order.

        Raises ValueError (nothing changed) if a block is the null block, not this pool's,
        or would be freed more times than it has holders. validate=False skips the
        checks, for an owner that frees only blocks it holds.
        """
        if validate:
            ordered_blocks = self._check_own("ordered_blocks", ordered_blocks)
            times = Counter(map(id, ordered_blocks))
            for block in ordered_blocks:
                if times[id(block)] > block.ref_cnt:
                    raise ValueError(
                        f"ordered_blocks: {block} freed {times[id(block)]} times, more than "
                        f"its {block.ref_cnt} holders"
                    )
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Refused (returns False) while any block is held. A
        Ctrl-C while it runs is raised once every hash is forgotten: cut midway, blocks
        without their hash stayed in the map, and a later hit found one that held
        another request's KV by then."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        with holding_interrupts():
            for block in self.cached_block_hash_to_block.values():
                block.block_hash = None
            self.cached_block_hash_to_block.clear()
            self.cache_epoch += 1
            if self.enable_events:
                self._events.append(AllBlocksCleared())
        return True

    def _check_own(self, name: str, blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        """`blocks` as a list; ValueError naming `name` unless every block is this pool's
        and not the null block."""
        try:
            blocks, pool = list(blocks), self.blocks
        except TypeError:  # None, one block, a number: "not iterable" named nothing
            raise ValueError(f"{name}={blocks!r} must be an iterable of blocks") from None
        for block in blocks:
            block_id = getattr(block, "block_id", None)
            if (
                type(block_id) is not int
                or not 0 < block_id < len(pool)
                or pool[block_id] is not block
            ):
                raise ValueError(f"{name}: {block!r} is the null block or not of this pool")
        return blocks

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, in order (none unless enable_events). They are
        kept until taken, unbounded (see KVCacheManager.take_events)."""
        events, self._events = self._events, []
        return events

    def check_integrity(self, holder_counts: Mapping[int, int] | None = None) -> None:
        """Raises IntegrityError unless the pool's conservation laws hold.

        Every non-null block is free (ref_cnt 0, in the queue) or held (ref_cnt > 0, not in
        the queue); the queue links are consistent; every cached hash maps to a block that
        carries it and every hashed block is in the map. With `holder_counts` (block id ->
        number of holders), each block's ref_cnt must equal its count (0 if absent).
        """
        _check(self.null_block.ref_cnt == 0, f"null block ref_cnt={self.null_block.ref_cnt}")
        _check(self.null_block.block_hash is None, "null block carries a hash")
        queued = []
        prev = self.free_block_queue._head
        for block in self.free_block_queue:
            _check(block.prev_free is prev, f"broken free-queue link before {block}")
            queued.append(block.block_id)
            prev = block
        _check(self.free_block_queue._tail.prev_free is prev, "broken free-queue tail link")
        in_queue = set(queued)
        _check(len(in_queue) == len(queued), "a block appears twice in the free queue")
        _check(NULL_BLOCK_ID not in in_queue, "null block is in the free queue")
        _check(
            len(queued) == self.free_block_queue.num_free_blocks,
            f"free queue holds {len(queued)} blocks, counter says "
            f"{self.free_block_queue.num_free_blocks}",
        )
        for block in self.blocks[1:]:
            free = block.block_id in in_queue
            _check(block.ref_cnt >= 0, f"{block} has a negative ref_cnt")
            _check(free == (block.ref_cnt == 0), f"{block} free={free} disagrees with ref_cnt")
            if holder_counts is not None:
                expected = holder_counts.get(block.block_id, 0)
                _check(block.ref_cnt == expected, f"{block} has {expected} holders")
            if block.block_hash is not None:
                owner = self.cached_block_hash_to_block.get(block.block_hash)
                _check(owner is block, f"{block} carries a hash the cache map does not give it")
        for block_hash, block in self.cached_block_hash_to_block.items():
            _check(block.block_hash == block_hash, f"cache map entry for {block} has a stale hash")
        if holder_counts is not None:
            unknown = set(holder_counts) - set(range(1, self.num_blocks))
            _check(not unknown, f"holders reference invalid block ids {sorted(unknown)[:8]}")


def _checked_token_ids(token_ids: Sequence[int]) -> list[int]:
    """`token_ids` as Python ints; ValueError naming token_ids unless each is an int
    (numpy's too; not a bool, and no text) in [0, MAX_TOKEN_ID]."""
    if isinstance(token_ids, (str, bytes, bytearray)):
        raise ValueError(f"cache_full_blocks: token_ids={token_ids!r} must be token ids, not text")
    ids = list(map(as_int, token_ids))
    bad = [i for i, t in enumerate(ids) if t is None or not 0 <= t <= MAX_TOKEN_ID][:1]
    if bad:
        raise ValueError(
            f"cache_full_blocks: token_ids[{bad[0]}]={token_ids[bad[0]]!r} must be a token id, "
            f"an int in [0, {MAX_TOKEN_ID}]"
        )
    return ids


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)
