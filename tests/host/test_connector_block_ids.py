"""HostOffloadConnector's on_finish and start_load refuse block_ids that are not distinct
integer block ids with a ValueError naming block_ids, copying and changing nothing: one
block saved under two hashes, or loaded twice, would hold the wrong KV for one of them.
bytes iterate as small integers, so b"\\x01\\x02" must be refused, not read as [1, 2],
and a set or mapping holds no order (block_ids[i] is the request's i-th block).
Where the copier declares num_blocks, ids outside [1, num_blocks) are refused the same
way, and the null block 0 and negative ids whether it declares it or not: a start_load
of the copier's that raised on them would drop the stored blocks."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, bound_host_connector, computed_request

BS = 4
BAD = {
    "bytes": b"\x01\x02",
    "str": "12",
    "twice": [1, 1],
    "not iterable": 3,
    "a float": [1, 2.5],
    "a None": [1, None],
    "a set": {2, 9},  # iterates as 9, 2: each block saved under the other's hash
    "a mapping": {1: 0, 2: 0},
}


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_on_finish_refuses_block_ids_that_are_not_distinct_ids(bad):
    copier, connector = bound_host_connector()
    with pytest.raises(ValueError, match=r"on_finish\('r'\): block_ids="):
        connector.on_finish(computed_request("r", list(range(1, 9))), bad)
    assert copier.saved_block_ids == [] and not connector.has_pending()
    assert connector.stored_hashes() == [] and connector.stats.num_saves == 0


def _stored_then_b(connector: HostOffloadConnector) -> tuple[list, Request]:
    """Stores three blocks of a saved request; (the store's order, a request "b" that
    can load them)."""
    assert connector.on_finish(computed_request("saved", list(range(1, 13))), [1, 2, 3])
    connector.poll()
    return connector.stored_hashes(), Request("b", list(range(1, 14)), SamplingParams())


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_start_load_refuses_block_ids_that_are_not_distinct_ids(bad):
    copier, connector = bound_host_connector()
    order, b = _stored_then_b(connector)
    with pytest.raises(ValueError, match=r"start_load\('b'\): block_ids="):
        connector.start_load(b, bad)
    assert copier.loaded_block_ids == [] and not connector.has_pending()
    assert connector.stored_hashes() == order  # nothing refreshed either


def test_numpy_integer_block_ids_are_taken():
    copier, connector = bound_host_connector()
    assert connector.on_finish(computed_request("r", list(range(1, 9))), np.array([3, 4]))
    connector.poll()
    assert copier.saved_block_ids == [[3, 4]] and len(connector.stored_hashes()) == 2


class _CountedCache(FakeCopier):
    """A FakeCopier that declares its cache's num_blocks and refuses ids outside it."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.num_blocks = num_blocks

    def start_load(self, block_ids, blocks):
        if not all(1 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"{block_ids=} outside the cache")
        return super().start_load(block_ids, blocks)


class _RefusingCache(FakeCopier):
    """A FakeCopier that declares no num_blocks but refuses ids outside its cache."""

    def start_load(self, block_ids, blocks):
        if not all(1 <= b < len(self.device) for b in block_ids):
            raise ValueError(f"{block_ids=} outside the cache")
        return super().start_load(block_ids, blocks)


@pytest.mark.parametrize(
    ("copier_type", "bad", "bounds"),
    [
        (_CountedCache, [0, 5], r"\[1, 16\)"),
        (_CountedCache, [5, 16], r"\[1, 16\)"),
        (_CountedCache, [-1, 5], r"\[1, 16\)"),
        (_RefusingCache, [0, 5], r"\[1, \.\.\.\)"),
        (_RefusingCache, [-1, 5], r"\[1, \.\.\.\)"),
    ],
    ids=["null", "past", "negative", "null-undeclared-cache", "negative-undeclared-cache"],
)
def test_block_ids_outside_the_cache_are_refused_keeping_the_store(copier_type, bad, bounds):
    # The copier's own refusal counts as a load that failed to start, dropping the store's
    # blocks (b, admitted later, would recompute them): the connector refuses such ids
    # before it calls the copier. Block 0 and negative ids are in no engine's cache, so
    # they are refused whether or not the copier declares num_blocks.
    copier = copier_type(16, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    order, b = _stored_then_b(connector)
    with pytest.raises(ValueError, match=rf"start_load\('b'\): block_ids=.* in {bounds}"):
        connector.start_load(b, bad)
    with pytest.raises(ValueError, match=rf"on_finish\('c'\): block_ids=.* in {bounds}"):
        connector.on_finish(computed_request("c", list(range(20, 28))), bad)
    assert copier.loaded_block_ids == [] and len(copier.saved_block_ids) == 1
    assert connector.stored_hashes() == order and not connector.has_pending()
    assert connector.stats.num_failed_loads == 0
    connector.start_load(b, [14, 15])  # the last blocks of the cache
    assert connector.poll().loaded == ("b",)


@pytest.mark.parametrize("value", [0, 2.5, "16", [16]])
def test_bind_refuses_a_num_blocks_that_is_no_count(value):
    copier = FakeCopier(16, BS)
    copier.num_blocks = value
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    with pytest.raises(ValueError, match=r"copier.num_blocks=.* must be an int >= 1"):
        connector.bind(copier, block_size=BS, hash_seed=0)
    assert connector.hash_layout is None


def test_a_copier_declaring_only_the_null_block_binds_and_every_block_id_is_refused():
    # num_blocks counts the null block 0: 1 is a cache with no block to copy, not a
    # count bind refuses.
    copier = _CountedCache(1, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    assert connector.hash_layout == (BS, 0)
    with pytest.raises(ValueError, match=r"on_finish\('c'\): block_ids=\[1\] .* in \[1, 1\)"):
        connector.on_finish(computed_request("c", list(range(20, 28))), [1])
    assert copier.saved_block_ids == [] and not connector.has_pending()
