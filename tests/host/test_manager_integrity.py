"""KVCacheManager.check_integrity names each break of its request bookkeeping."""

from __future__ import annotations

import pytest

from jaxkv import IntegrityError
from tests.host._util import make_request, two_request_manager


def _other_owner(m):
    m._owner["B"] = make_request("B", range(3))


def _copied_blocks(m):
    owner = m._owner["B"]
    m._held_of[owner] = list(m._held_of[owner])


def _stale_owner(m):
    m._owner["gone"] = make_request("gone", range(3))


def _stale_holder(m):
    m._held_of[make_request("gone", range(3))] = []


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_other_owner, "'B': its blocks are not held by the Request it was allocated for"),
        (_copied_blocks, "'B': its blocks are not held by the Request it was allocated for"),
        (_stale_owner, "2 requests hold blocks, 3 have an owner, 2 owners hold blocks"),
        (_stale_holder, "2 requests hold blocks, 2 have an owner, 3 owners hold blocks"),
        (lambda m: m._num_cached.__setitem__("A", 4), "'A': num_cached=4"),
    ],
    ids=["other-owner", "copied-blocks", "stale-owner", "stale-holder", "num-cached"],
)
def test_each_break_of_the_bookkeeping_is_named(corrupt, message):
    m = two_request_manager()
    corrupt(m)
    with pytest.raises(IntegrityError, match=message):
        m.check_integrity()


def test_free_leaves_no_owner_behind():
    m = two_request_manager()
    m.free("A")
    m.check_integrity()
    assert list(m._owner) == ["B"] and len(m._held_of) == 1
