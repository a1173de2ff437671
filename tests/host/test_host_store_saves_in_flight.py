"""HostOffloadConnector: a block whose save is still in flight is no gap in a chain. A
save landing behind another request's save in flight stores its blocks as usual (most
recently used), not demoted: that other save is expected to store the blocks before them."""

from __future__ import annotations

import gc

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, store_link_faults

BS = 4


def _finished(request_id: str, tokens, computed: int) -> Request:
    request = Request(request_id, list(tokens), SamplingParams())
    request.num_computed_tokens = computed
    return request


def _b_saved_while_a_is_in_flight():
    """(connector, copier, a's save in flight, x, b): x stored first, then a (h0 h1) and
    b (h0 h1 h2) finish and only b's save lands: its h2 stored behind a's blocks."""
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    x = _finished("x", range(40, 45), 4)
    assert connector.on_finish(x, [5])
    copier.complete()
    assert connector.poll().saved == ("x",)
    a = _finished("a", range(1, 10), 8)  # h0 h1
    b = _finished("b", range(1, 14), 12)  # h0 h1 h2
    assert connector.on_finish(a, [1, 2]) and connector.on_finish(b, [1, 2, 3])
    a_save, b_save = copier.pending
    copier.pending.clear()
    FakeCopier._run(*b_save)  # b's h2 lands while h0 h1 are still being saved
    assert connector.poll().saved == ("b",)
    return connector, copier, a_save, x, b


def test_a_save_landing_behind_blocks_still_being_saved_is_stored_most_recent():
    connector, _, a_save, x, b = _b_saved_while_a_is_in_flight()
    x0, (h0, h1, h2) = x.block_hashes[0], b.block_hashes
    assert connector.stored_hashes() == [x0, h2]  # x0 is the next evicted, not h2
    FakeCopier._run(*a_save)
    assert connector.poll().saved == ("a",)
    assert connector.stored_hashes() == [x0, h2, h1, h0] and not store_link_faults(connector)


def test_a_rebind_after_the_copier_was_collected_demotes_what_its_lost_saves_were_before():
    """Saves in flight through a copier collected without close() never land: a rebind
    counts them as ended unstored, so blocks stored behind them become the next evicted."""
    connector, copier, a_save, x, b = _b_saved_while_a_is_in_flight()
    x0, h2 = x.block_hashes[0], b.block_hashes[2]
    assert connector.stored_hashes() == [x0, h2]
    del copier, a_save  # the engine is dropped without close(): a's save never lands
    gc.collect()
    connector.bind(FakeCopier(16, BS), block_size=BS, hash_seed=0)  # same layout: kept
    assert connector.stored_hashes() == [h2, x0]  # h2 is useless without h0 h1: next out
    assert not connector.has_pending() and not store_link_faults(connector)


def test_lost_saves_demote_the_blocks_behind_them_once_their_copier_is_collected():
    # Not only at the next bind: until then, h2 was evicted after x0, which is usable.
    connector, copier, a_save, x, b = _b_saved_while_a_is_in_flight()
    x0, h2 = x.block_hashes[0], b.block_hashes[2]
    del copier, a_save
    gc.collect()
    assert connector.stored_hashes() == [h2, x0] and not store_link_faults(connector)
    assert not connector.has_pending() and connector.stats.num_failed_saves == 1
