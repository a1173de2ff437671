"""The free queue of KV blocks: LRU eviction order with O(1) removal of a cache hit."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jaxkv.kv_cache_block import KVCacheBlock

__all__ = ["FreeKVCacheBlockQueue"]


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with head and tail sentinels.

    Eviction order: blocks are taken from the head and returned to the tail, so the least
    recently freed block is evicted first. A caller that frees a request appends its
    blocks tail first, so within one request the tail blocks (the least shareable) are
    evicted before its head blocks. `remove` takes a cache hit out of the middle in O(1).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Pops the head (the next block to evict). Raises ValueError when none is free."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free block to pop")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pops the first `n` free blocks, head first. Raises ValueError (nothing changed)
        unless `n` is an int >= 0 (not a bool) and at most num_free_blocks."""
        if type(n) is not int or n < 0:
            raise ValueError(f"popleft_n: n={n!r} must be an int >= 0")
        if n > self.num_free_blocks:
            raise ValueError(f"{n=} exceeds num_free_blocks={self.num_free_blocks}")
        blocks = []
        block = self._head
        for _ in range(n):  # walk, then unlink the whole run from the head at once
            block = block.next_free
            blocks.append(block)
        if n:
            rest = block.next_free
            self._head.next_free = rest
            rest.prev_free = self._head
            for block in blocks:
                block.prev_free = block.next_free = None
            self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def __iter__(self):
        """Free blocks in eviction order (head first)."""
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first)."""
        return [b.block_id for b in self]
