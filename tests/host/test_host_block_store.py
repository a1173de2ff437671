"""HostBlockStore: LRU order, entries owning their memory, and an entry leaving with every
entry stored behind it (its prefix is the only way a prompt reaches it)."""

from __future__ import annotations

import numpy as np

from jaxkv.host_block_store import HostBlockStore


def _chain(store: HostBlockStore, names: str, parent: bytes | None = None) -> None:
    for name in names:
        h = name.encode()
        store.put(h, parent, np.full(2, ord(name)))
        parent = h


def test_entries_are_copies_in_lru_order_and_touch_refreshes():
    store = HostBlockStore()
    data = np.arange(3)
    store.put(b"a", None, data)
    data[:] = 7
    assert store[b"a"].tolist() == [0, 1, 2] and store[b"a"].base is None
    _chain(store, "bc", b"a")
    store.touch(b"a")
    assert list(store) == [b"b", b"c", b"a"] and store.parent_of(b"c") == b"b"


def test_eviction_and_drop_take_every_entry_behind_the_one_that_leaves():
    store = HostBlockStore()
    _chain(store, "abc")
    _chain(store, "de", b"a")  # a second branch under a
    _chain(store, "x")
    store.touch(b"b")
    store.touch(b"a")  # LRU order: c d e x b a
    store.drop(b"b")
    assert list(store) == [b"d", b"e", b"x", b"a"]
    for name in (b"x", b"e", b"d"):
        store.touch(name)  # a's tail more recent than a, evicted first: a d e leave
    store.evict_to(3)
    assert list(store) == [b"x"]
    assert store._children == {} and set(store._parent_of) == {b"x"}  # no stale links


def test_drop_behind_a_parent_that_was_never_stored():
    store = HostBlockStore()
    _chain(store, "bc", b"a")  # a: still being saved elsewhere
    _chain(store, "y")
    store.drop_behind(b"a")  # a's save ended without storing it
    assert list(store) == [b"y"] and store._children == {}
    store.drop(b"missing")  # neither stored nor a parent: nothing happens
    assert list(store) == [b"y"]
