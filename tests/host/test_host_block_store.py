"""HostBlockStore: LRU order, entries owning their memory, and the entries stored behind
one that leaves becoming the next to be evicted, the deepest first."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from jaxkv.host_block_store import HostBlockStore


def _chain(store: HostBlockStore, names: str, parent: bytes | None = None, **kw) -> None:
    for name in names:
        h = name.encode()
        store.put(h, parent, np.full(2, ord(name)), **kw)
        parent = h


def _order(store: HostBlockStore) -> str:
    return "".join(h.decode() for h in store)


def test_entries_are_copies_in_lru_order_and_touch_refreshes():
    store = HostBlockStore()
    data = np.arange(3)
    store.put(b"a", None, data)
    data[:] = 7
    assert store[b"a"].tolist() == [0, 1, 2] and store[b"a"].base is None
    _chain(store, "bc", b"a")
    store.touch(b"a")
    assert _order(store) == "bca" and store.parent_of(b"c") == b"b"


def test_a_dropped_entry_demotes_what_is_stored_behind_it_deepest_first():
    store = HostBlockStore()
    _chain(store, "xabc")  # x <- a <- b <- c
    _chain(store, "de", b"a")  # a second branch under a: a <- d <- e
    _chain(store, "y")
    store.drop(b"a")
    assert _order(store) == "cebdxy"  # depth 3, depth 2, then depth 1, before the rest
    # a's children stay listed under it: a stored again would make them whole again.
    assert {p: list(c) for p, c in store._children.items()} == {
        b"a": [b"b", b"d"], b"b": [b"c"], b"d": [b"e"]
    }  # fmt: skip
    store.evict_to(4)  # c and e go first: each is useless without the one before it
    assert _order(store) == "bdxy"


def test_a_drop_by_serial_leaves_a_copy_stored_again_since():
    """A reader that names the serial it read drops that copy only: the hash evicted and
    stored again (another save) keeps its new copy and what is stored behind it."""
    store = HostBlockStore()
    _chain(store, "ab")
    read = store.serial(b"a")
    store.touch(b"a")
    store.drop(b"a", read)  # the copy read: dropped, b demoted
    assert _order(store) == "b"
    _chain(store, "a")
    store.put(b"b", b"a", np.full(2, 1))  # a stored again, b under it
    assert store.serial(b"a") != read
    store.drop(b"a", read)  # a stale serial: nothing changes
    assert _order(store) == "ab" and store.parent_of(b"b") == b"a"
    store.drop(b"a", store.serial(b"a"))
    assert _order(store) == "b" and b"a" not in store._serial_of


def test_eviction_demotes_the_tail_of_an_evicted_head():
    store = HostBlockStore()
    _chain(store, "ab")
    _chain(store, "z")
    store.touch(b"b")  # a's tail more recent than a: a is evicted first
    store.evict_to(2)
    assert _order(store) == "bz"  # b demoted, so the next eviction takes it, not z
    store.evict_to(1)
    assert _order(store) == "z" and store._children == {} and set(store._parent_of) == {b"z"}


def test_demoted_puts_and_blocks_behind_a_parent_that_was_never_stored():
    store = HostBlockStore()
    _chain(store, "y")
    _chain(store, "bc", b"a")  # a: its save still in flight elsewhere
    store.demote_behind(b"a")  # a's save ended without storing it
    assert _order(store) == "cby"
    _chain(store, "p")
    store.put(b"q", b"p", np.zeros(2), demoted=True)
    store.put(b"r", b"q", np.zeros(2), demoted=True)  # stored behind q: evicted before it
    assert _order(store) == "rqcbyp"
    store.drop(b"missing")  # neither stored nor a parent: nothing happens
    assert _order(store) == "rqcbyp"


def test_clear_forgets_the_children_of_cleared_entries():
    store = HostBlockStore()
    store.put(b"a", None, np.zeros(2))
    store.put(b"b", b"a", np.ones(2))  # b is stored behind a
    store.clear()
    assert len(store) == 0 and store._children == {}
    store.put(b"a", None, np.zeros(2))  # a again, without b
    store.put(b"x", None, np.zeros(2))
    store.drop(b"a")  # demotes what is stored behind a now: nothing
    assert _order(store) == "x"
    store.put(b"a", None, np.zeros(2))
    store.demote_behind(b"a")  # a failed save of a's child would ask the same
    assert _order(store) == "xa"


def test_clear_forgets_the_parents_of_cleared_entries():
    store = HostBlockStore()
    store.put(b"a", None, np.zeros(2))
    store.put(b"b", b"a", np.ones(2))
    store.clear()
    with pytest.raises(KeyError):
        store.parent_of(b"b")  # as for a block never stored
    assert store._parent_of == {}
    store.put(b"b", None, np.ones(2))  # b stored again as a prompt's first block
    assert store.parent_of(b"b") is None


def test_clear_forgets_the_serials_of_cleared_entries():
    store = HostBlockStore()
    store.put(b"a", None, np.zeros(2))
    before = store.serial(b"a")
    store.clear()
    with pytest.raises(KeyError):
        store.serial(b"a")  # as for a block never stored
    assert store._serial_of == {}
    store.put(b"a", None, np.zeros(2))
    assert store.serial(b"a") != before  # a new copy: another serial


def test_dropping_a_parent_no_longer_stored_demotes_its_children_again():
    """drop(h) demotes what is stored behind h even when h itself already left: a failed
    load drops hashes that eviction may have taken meanwhile, and their children, refreshed
    since, must again be the next to be evicted."""
    store = HostBlockStore()
    _chain(store, "ab")  # a <- b
    _chain(store, "z")
    store.drop(b"a")
    store.touch(b"b")  # b used again behind a device hit of a
    assert _order(store) == "zb"
    store.drop(b"a")  # a is not stored, but b is still stored behind it
    assert _order(store) == "bz"


class _OutOfMemoryOn(dict):
    """A table whose next insert of a new key raises MemoryError while `armed`, as a dict
    that fails to grow does (it is left unchanged)."""

    armed = False

    def __setitem__(self, key, value):
        if self.armed and key not in self:
            raise MemoryError("the table could not grow")
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if self.armed and key not in self:
            raise MemoryError("the table could not grow")
        return super().setdefault(key, default)


class _OrderedOutOfMemory(collections.OrderedDict):
    armed = False

    def __setitem__(self, key, value):
        if self.armed and key not in self:
            raise MemoryError("the table could not grow")
        super().__setitem__(key, value)


def _links(store: HostBlockStore) -> tuple:
    return (
        list(store._entries),
        dict(store._parent_of),
        {p: list(c) for p, c in store._children.items()},
        dict(store._serial_of),
    )


@pytest.mark.parametrize("table", ["parents", "children", "siblings", "serials", "entries"])
def test_a_put_that_runs_out_of_memory_growing_a_table_stores_nothing(table):
    # The entry was stored first: out of memory growing the parent links, it stayed with
    # no parent, and the connector's rollback (drop) raised KeyError out of poll().
    store = HostBlockStore()
    _chain(store, "ab")
    if table == "parents":
        store._parent_of = failing = _OutOfMemoryOn(store._parent_of)
    elif table == "children":  # c would be the first child listed under b
        store._children = failing = _OutOfMemoryOn(store._children)
    elif table == "siblings":  # b's list of children, which d joins
        _chain(store, "d", b"b")
        store._children[b"b"] = failing = _OutOfMemoryOn(store._children[b"b"])
    elif table == "serials":
        store._serial_of = failing = _OutOfMemoryOn(store._serial_of)
    else:
        store._entries = failing = _OrderedOutOfMemory(store._entries)
    before = _links(store)
    failing.armed = True
    with pytest.raises(MemoryError):
        store.put(b"c", b"b", np.full(2, 9))
    assert _links(store) == before and b"c" not in store
    failing.armed = False
    store.drop(b"c")  # the connector's rollback: nothing to drop
    assert _links(store) == before
    store.put(b"c", b"b", np.full(2, 9))
    assert store.parent_of(b"c") == b"b" and _order(store)[-1] == "c"
    store.drop(b"b")  # c is linked under b: demoted, the next to be evicted
    assert _order(store).index("c") < _order(store).index("a")
    assert b"b" not in store._children.get(b"a", {})


class _InterruptedSet(dict):
    """A table whose every store raises KeyboardInterrupt while `armed`, as a Ctrl-C
    landing on that line does (the table is left unchanged)."""

    armed = False

    def __setitem__(self, key, value):
        if self.armed:
            raise KeyboardInterrupt
        super().__setitem__(key, value)


def test_a_put_of_a_stored_entry_cut_short_keeps_it_stored_with_its_links():
    # Only a new entry is removed when its put fails: one stored before had its links
    # already, and removing it lost a block the store held.
    store = HostBlockStore()
    _chain(store, "abc")
    store._serial_of = failing = _InterruptedSet(store._serial_of)
    before = _links(store)
    failing.armed = True
    with pytest.raises(KeyboardInterrupt):
        store.put(b"b", b"a", np.full(2, 0))
    assert _links(store) == before and store[b"b"].tolist() == [ord("b")] * 2
    failing.armed = False
    store.drop(b"a")  # b and c are still linked under a: the next to go, deepest first
    assert _order(store) == "cb"
