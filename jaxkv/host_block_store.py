"""The host store of HostOffloadConnector: block hash -> host copy, least recently used
first, with each block's place in its prompt's chain.

A stored block loads only behind its whole prefix, held either here or in the device
prefix cache: on_admission starts after a request's device hits and walks the store from
there. So a block whose parent leaves the store is not useless (the device may still
hold that parent), but it is worth less than a block whose whole prefix is here. Each
entry records its parent (the hash of the block before it; None for a prompt's first
block), and when a block leaves, or its save ends without storing it, the blocks stored
behind it are demoted: they become the next to be evicted, the deepest first, and stay
loadable until then. Using a demoted block again refreshes it like any other. Each put
gives its entry a new serial, so a caller that read an entry can later drop that copy
only, not one stored again under the same hash since (drop's `serial`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet

import numpy as np

from jaxkv.hashing import BlockHash


class HostBlockStore:
    """LRU map of block hash -> array with parent links; see the module doc."""

    def __init__(self) -> None:
        self._entries: collections.OrderedDict[BlockHash, np.ndarray] = collections.OrderedDict()
        self._parent_of: dict[BlockHash, BlockHash | None] = {}
        # parent -> its stored children, in the order they were stored (a dict as a set)
        self._children: dict[BlockHash, dict[BlockHash, None]] = {}
        self._serial_of: dict[BlockHash, int] = {}  # a new one at each put
        self._next_serial = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def __iter__(self) -> Iterator[BlockHash]:
        """Hashes, least recently used (next to be evicted) first."""
        return iter(self._entries)

    def __getitem__(self, block_hash: BlockHash) -> np.ndarray:
        return self._entries[block_hash]

    def values(self) -> Iterable[np.ndarray]:
        return self._entries.values()

    def parent_of(self, block_hash: BlockHash) -> BlockHash | None:
        return self._parent_of[block_hash]

    def serial(self, block_hash: BlockHash) -> int:
        """The serial of the stored entry: another once the hash is stored again."""
        return self._serial_of[block_hash]

    def put(
        self,
        block_hash: BlockHash,
        parent: BlockHash | None,
        data: np.ndarray,
        *,
        demoted: bool = False,
    ) -> None:
        """Stores a copy of `data` (each entry owns its memory) as the most recently used
        entry or, `demoted`, as the next to be evicted after what is stored behind it.
        An exception (a MemoryError copying `data` or growing a table) stores nothing:
        the entry and its links are in place together, or none of them is."""
        copy = np.array(data)  # first: out of memory here, nothing has changed
        new = block_hash not in self._entries
        try:
            self._parent_of[block_hash] = parent  # a chained digest has one parent
            if parent is not None:
                self._children.setdefault(parent, {})[block_hash] = None
            self._serial_of[block_hash] = self._next_serial
            self._entries[block_hash] = copy  # last: no entry is stored without its links
        except BaseException:
            if new:  # an entry stored before had these links already
                self._remove(block_hash)
            raise
        self._next_serial += 1
        self._entries.move_to_end(block_hash, last=not demoted)
        if demoted:
            self.demote_behind(block_hash)  # what is stored behind it goes first

    def put_chain(
        self,
        chain: list[BlockHash],
        landed: Mapping[BlockHash, np.ndarray],
        saving: AbstractSet[BlockHash],
    ) -> None:
        """Stores the `landed` blocks of a save of the full blocks `chain` (`saving`: the
        hashes other saves in flight will store). The chain up to its first block neither
        stored nor being saved (evicted or failed meanwhile) is refreshed tail first: its
        head, without which no prompt can use the rest from the store, is evicted last.
        Blocks past that gap load only behind device-cache hits: they are stored demoted,
        the next to be evicted."""
        usable = 0
        for h in chain:
            if h not in landed and h not in self._entries and h not in saving:
                break
            usable += 1
        for i in reversed(range(usable)):
            h = chain[i]
            if h in landed:
                self.put(h, chain[i - 1] if i else None, landed[h])
            elif h in self._entries:
                self.touch(h)
        for i in range(usable + 1, len(chain)):  # chain[usable] is the gap itself
            if chain[i] in landed:
                self.put(chain[i], chain[i - 1], landed[chain[i]], demoted=True)

    def touch(self, block_hash: BlockHash) -> None:
        """Marks a stored entry most recently used."""
        self._entries.move_to_end(block_hash)

    def drop(self, block_hash: BlockHash, serial: int | None = None) -> None:
        """Removes the entry, if stored, and demotes the entries stored behind it. With a
        `serial` (from serial()), does nothing unless the entry stored is that one: a copy
        stored again since is another's, kept with what is stored behind it."""
        if serial is not None and self._serial_of.get(block_hash) != serial:
            return
        if block_hash in self._entries:
            self._remove(block_hash)
        self.demote_behind(block_hash)

    def demote_behind(self, block_hash: BlockHash) -> None:
        """Makes the entries stored behind `block_hash` (its children, theirs, ...) the
        next to be evicted, the deepest first."""
        level = list(self._children.get(block_hash, ()))
        while level:
            for h in reversed(level):
                self._entries.move_to_end(h, last=False)
            level = [c for h in level for c in self._children.get(h, ())]

    def evict_to(self, max_entries: int) -> None:
        """Evicts from the front of the LRU order down to `max_entries` entries, demoting
        what is stored behind each evicted entry."""
        while len(self._entries) > max_entries:
            self.drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._parent_of.clear()
        self._children.clear()
        self._serial_of.clear()

    def _remove(self, block_hash: BlockHash) -> None:
        """Removes the entry and its links to its parent, whichever of them exist."""
        self._entries.pop(block_hash, None)
        self._serial_of.pop(block_hash, None)
        if block_hash not in self._parent_of:
            return
        parent = self._parent_of.pop(block_hash)
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.pop(block_hash, None)
            if not siblings:
                del self._children[parent]
