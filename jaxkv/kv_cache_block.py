"""KVCacheBlock: one KV block's id, holder count, cached hash and free-queue links (host side)."""

from __future__ import annotations

from jaxkv.hashing import BlockHash

__all__ = ["KVCacheBlock"]


class KVCacheBlock:
    """One KV block: id, holder count, hash while cached, and free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, {cached})"
