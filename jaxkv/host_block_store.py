"""The host store of HostOffloadConnector: block hash -> host copy, least recently used
first, holding only blocks a prompt can reach.

A stored block is usable only behind its whole prefix: on_admission walks a prompt's
hashes from its first block and stops at the first one missing. So each entry records
its parent (the hash of the block before it; None for a prompt's first block), and an
entry leaves with every entry stored behind it: a block whose parent is gone could never
be loaded again and would only take room from usable ones. A parent may be missing while
its own save is still in flight (the connector's `saving` set); `drop_behind` then takes
the entries behind it when that save ends without storing it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator

import numpy as np

from jaxkv.hashing import BlockHash


class HostBlockStore:
    """LRU map of block hash -> array with parent links; see the module doc.

    Guarantee: after every public call, each entry's parent is None, stored, or one the
    caller named in `saving` at the last put (a save in flight), unless the caller has
    since ended that save without calling drop_behind for it.
    """

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[BlockHash, np.ndarray] = collections.OrderedDict()
        self._parent_of: dict[BlockHash, BlockHash | None] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}  # parent -> stored children

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def __iter__(self) -> Iterator[BlockHash]:
        """Hashes, least recently used first."""
        return iter(self._entries)

    def __getitem__(self, block_hash: BlockHash) -> np.ndarray:
        return self._entries[block_hash]

    def values(self) -> Iterable[np.ndarray]:
        return self._entries.values()

    def parent_of(self, block_hash: BlockHash) -> BlockHash | None:
        return self._parent_of[block_hash]

    def put(self, block_hash: BlockHash, parent: BlockHash | None, data: np.ndarray) -> None:
        """Stores `data` (copied: each entry owns its memory) as the most recently used."""
        self._entries[block_hash] = np.array(data)
        self._entries.move_to_end(block_hash)
        self._parent_of[block_hash] = parent  # a chained digest has one parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """Marks a stored entry most recently used."""
        self._entries.move_to_end(block_hash)

    def drop(self, block_hash: BlockHash) -> None:
        """Removes the entry (if stored) and every entry stored behind it."""
        if block_hash in self._entries:
            self._remove(block_hash)
        self.drop_behind(block_hash)

    def drop_behind(self, block_hash: BlockHash) -> None:
        """Removes every entry stored behind `block_hash` (its children, theirs, ...)."""
        stack = list(self._children.pop(block_hash, ()))
        while stack:
            h = stack.pop()
            self._remove(h)
            stack.extend(self._children.pop(h, ()))

    def evict_to(self, max_entries: int) -> None:
        """Drops least recently used entries (each with those behind it) down to
        `max_entries`."""
        while len(self._entries) > max_entries:
            self.drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._parent_of.clear()
        self._children.clear()

    def _remove(self, block_hash: BlockHash) -> None:
        del self._entries[block_hash]
        parent = self._parent_of.pop(block_hash)
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(block_hash)
            if not siblings:
                del self._children[parent]
