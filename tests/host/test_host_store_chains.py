"""HostOffloadConnector keeps whole prefixes: a prompt's blocks are usable only from its
first one, so a load refreshes the whole prefix it extends, and a save that lands after
its prefix's head left the store stores none of the blocks behind it."""

from __future__ import annotations

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import (
    FakeCopier,
    add,
    make_scheduler,
    run_until_idle,
    step,
    store_link_faults,
)

BS = 4


def _claim(connector, prompt, device_blocks: int = 0) -> int:
    """on_admission's claim for `prompt` after `device_blocks` device-cache hits."""
    probe = Request("probe", list(prompt), SamplingParams())
    return connector.on_admission(probe, device_blocks * BS)


def test_a_load_after_a_device_hit_refreshes_the_blocks_before_it_too():
    copier = FakeCopier(64, BS)
    connector = HostOffloadConnector(3 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=64, block_size=BS, connector=connector)
    x = add(sched, "x", range(1, 14), max_tokens=1)  # its 3 full blocks a0 a1 a2 saved
    run_until_idle(sched, copier)
    a = x.block_hashes[:3]
    assert sched.manager.reset_prefix_cache()
    add(sched, "y", range(1, 6), max_tokens=1)  # reloads a0: a0 back in the device cache
    run_until_idle(sched, copier)
    add(sched, "z", range(1, 14), max_tokens=8)  # a0 hit on the device, a1 a2 loaded
    add(sched, "w", range(60, 65), max_tokens=1)  # finishes at once, saving one block
    step(sched, copier)
    order = connector.stored_hashes()
    assert [order.index(h) for h in a] == [2, 1, 0]  # a0 most recent: evicted last
    step(sched, copier)  # w's save lands: the full store evicts its tail, a2
    assert sched.abort("z")
    run_until_idle(sched, copier)
    assert a[2] not in connector.stored_hashes() and _claim(connector, range(1, 14)) == 8


def test_a_save_landing_after_its_head_was_evicted_stores_nothing_behind_it():
    copier = FakeCopier(64, BS)
    connector = HostOffloadConnector(2 * copier.bytes_per_block, copy_delay_steps=2)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=64, block_size=BS, connector=connector)
    add(sched, "x", range(1, 6), max_tokens=1)  # h0 stored
    run_until_idle(sched, copier)
    b = add(sched, "b", range(20, 25), max_tokens=1)
    c = add(sched, "c", range(30, 35), max_tokens=1)
    step(sched, copier)  # b's and c's saves start
    a = add(sched, "a", range(1, 10), max_tokens=1)  # h0 hit on the device, h1 its own
    step(sched, copier)  # a finishes: h0 refreshed, h1's save starts
    run_until_idle(sched, copier)  # b, c land and evict h0; then h1 lands without it
    stored = connector.stored_hashes()
    assert a.block_hashes[1] not in stored  # it would have evicted a usable block
    assert stored == [b.block_hashes[0], c.block_hashes[0]]
    assert _claim(connector, range(20, 25)) == 4 and _claim(connector, range(30, 35)) == 4


def _a_and_b_sharing_two_blocks():
    """A copier landing copies on complete(), its connector, and finished requests a (two
    full blocks) and b (the same two, then one more)."""
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    a = Request("a", list(range(1, 10)), SamplingParams())
    b = Request("b", list(range(1, 14)), SamplingParams())
    a.num_computed_tokens, b.num_computed_tokens = 8, 12
    return copier, connector, a, b


def test_a_save_behind_another_requests_failed_save_is_stored_demoted():
    # b's h2 lands behind h0 h1, whose save (a's) fails: the device may still hold h0 h1
    # (only the host copy failed), so h2 stays, loadable behind those device hits.
    copier, connector, a, b = _a_and_b_sharing_two_blocks()
    copier.fail_saves = True
    assert connector.on_finish(a, [1, 2])  # h0 h1: this copy fails
    copier.fail_saves = False
    assert connector.on_finish(b, [1, 2, 3])  # copies h2 only: h0 h1 are being saved
    copier.complete()
    events = connector.poll()
    assert events.saved == ("b",) and events.failed_saves == ("a",)
    assert connector.stored_hashes() == [b.block_hashes[2]] and not store_link_faults(connector)
    assert _claim(connector, range(1, 14)) == 0 and _claim(connector, range(1, 14), 2) == 4
    # Once a's save lands instead, the whole chain loads from the store.
    assert connector.on_finish(a, [1, 2]) and not connector.on_finish(b, [1, 2, 3])  # h2 kept
    copier.complete()
    assert connector.poll().saved == ("a",) and _claim(connector, range(1, 14)) == 12


def test_blocks_stored_behind_another_requests_failed_save_become_the_next_evicted():
    copier, connector, a, b = _a_and_b_sharing_two_blocks()
    copier.fail_saves = True
    assert connector.on_finish(a, [1, 2])  # h0 h1: this copy will fail
    copier.fail_saves, copier.auto_complete = False, True
    x = Request("x", list(range(40, 45)), SamplingParams())
    x.num_computed_tokens = 4
    assert connector.on_finish(b, [1, 2, 3]) and connector.on_finish(x, [4])
    assert connector.poll().saved == ("b", "x")
    h2, x0 = b.block_hashes[2], x.block_hashes[0]
    connector._store.touch(h2)
    assert connector.stored_hashes() == [x0, h2]
    copier.complete()
    assert connector.poll().failed_saves == ("a",)
    assert connector.stored_hashes() == [h2, x0] and not store_link_faults(connector)


def _long_saved():
    """A connector whose store holds "long"'s three full blocks (13 tokens, 12 computed)."""
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    long = Request("long", list(range(1, 14)), SamplingParams())
    long.num_computed_tokens = 12
    assert connector.on_finish(long, [1, 2, 3]) and connector.poll().saved == ("long",)
    return copier, connector, long


def test_a_failed_load_demotes_the_blocks_stored_behind_the_ones_it_loaded():
    copier, connector, long = _long_saved()
    short = Request("short", list(range(1, 10)), SamplingParams())  # h0 h1 of long's
    assert connector.on_admission(short, 0) == 8
    copier.fail_loads = True
    connector.start_load(short, [4, 5])
    assert connector.poll().failed_loads == ("short",)
    assert connector.stored_hashes() == [long.block_hashes[2]] and not store_link_faults(connector)
    assert _claim(connector, range(1, 14)) == 0 and _claim(connector, range(1, 14), 2) == 4


def test_a_save_that_lands_behind_a_gap_is_stored_demoted_after_its_own_tail():
    # c saves h0 (fails), a saves h1 behind it, b saves h2 behind both. b lands first and
    # stores h2 (h0 and h1 are still being saved); c fails; a lands behind the gap at h0:
    # h1 is stored demoted, with h2, deeper, evicted before it.
    copier, connector, a, b = _a_and_b_sharing_two_blocks()
    c = Request("c", list(range(1, 6)), SamplingParams())
    c.num_computed_tokens = 4
    copier.fail_saves = True
    assert connector.on_finish(c, [1])
    copier.fail_saves = False
    assert connector.on_finish(a, [1, 2]) and connector.on_finish(b, [1, 2, 3])
    c_save, a_save, b_save = copier.pending
    copier.pending.clear()
    for (future, work), field, rid in (
        (b_save, "saved", "b"),
        (c_save, "failed_saves", "c"),
        (a_save, "saved", "a"),
    ):
        FakeCopier._run(future, work)
        assert getattr(connector.poll(), field) == (rid,)
        assert not store_link_faults(connector)
    assert connector.stored_hashes() == [b.block_hashes[2], b.block_hashes[1]]
    assert _claim(connector, range(1, 14)) == 0 and _claim(connector, range(1, 14), 1) == 8


def test_a_save_returning_the_wrong_number_of_blocks_counts_as_failed():
    copier, connector, a, _ = _a_and_b_sharing_two_blocks()
    assert connector.on_finish(a, [1, 2])
    ((future, _),) = copier.pending
    copier.pending.clear()
    future.set_result(copier.device[[1]])  # one block for the two asked
    assert connector.poll().failed_saves == ("a",)
    assert connector.stored_hashes() == [] and connector.stats.num_failed_saves == 1
    assert not connector._saving and not store_link_faults(connector)


def test_a_save_refreshes_no_stored_block_past_the_tokens_its_request_computed():
    copier, connector, long = _long_saved()
    h0, h1, h2 = long.block_hashes
    copier.fail_loads = True
    connector.start_load(Request("short", list(range(1, 10)), SamplingParams()), [4, 5])
    assert connector.poll().failed_loads == ("short",)  # drops h0 and h1: h2 is left
    copier.fail_loads = False
    other = Request("other", [50, 51, 52, 53, 54], SamplingParams())
    other.num_computed_tokens = 4
    assert connector.on_finish(other, [6]) and connector.poll().saved == ("other",)
    again = Request("again", list(range(1, 14)), SamplingParams())
    again.num_computed_tokens = 8  # h2's tokens are its own, but never computed
    assert connector.on_finish(again, [7, 8, 9]) and connector.poll().saved == ("again",)
    assert copier.saved_block_ids[-1] == [7, 8]
    assert connector.stored_hashes() == [h2, *other.block_hashes, h1, h0]
