"""Loads shared between requests: a request whose next block another request's load
brings waits for that load and then hits its blocks, which enter the prefix cache when
it lands, whatever becomes of the request that started it."""

from __future__ import annotations

from jaxkv import KVCacheManager, Request, RequestStatus, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.kv_transfer import KVConnector, TransferEvents
from jaxkv.scheduler_transfers import TransferTracker
from tests.host._sched_util import (
    FakeCopier,
    OracleLoadConnector,
    add,
    make_scheduler,
    run_until_idle,
    step,
)

BS = 4
PROMPT = list(range(1, 15))  # 3 full blocks, then 2 tokens


def _offloaded(sched_kwargs=None):
    """A scheduler whose connector's host store alone holds PROMPT's 3 full blocks, and
    copies that land only on copier.complete()."""
    copier = FakeCopier(64, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(
        num_blocks=64, block_size=BS, connector=connector, **(sched_kwargs or {})
    )
    add(sched, "a0", PROMPT, max_tokens=1)
    step(sched, copier)
    copier.complete()
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()  # the KV is now on the host only
    return sched, connector, copier


def test_a_request_whose_next_block_another_load_brings_waits_for_it_then_hits_it():
    sched, connector, copier = _offloaded()
    prompt = PROMPT
    b = add(sched, "b", prompt, max_tokens=2)
    c = add(sched, "c", prompt[:12] + [99, 98], max_tokens=2)  # the same 3 full blocks
    add(sched, "d", [50, 51, 52, 53, 54], max_tokens=2)  # behind them, still admitted
    out, _ = step(sched, copier)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert c.status == RequestStatus.WAITING and "c" not in sched.manager.request_ids
    assert [r.request_id for r in out.requests] == ["d"] and [
        r.request_id for r in sched.waiting
    ] == ["b", "c"]
    copier.complete()
    out, _ = step(sched, copier)  # b's load lands: b runs and caches its blocks, then c hits
    assert [r.request_id for r in out.requests] == ["d", "b", "c"]
    assert sched.manager.block_ids("c")[:3] == sched.manager.block_ids("b")[:3]
    scheduled = dict(zip(out.request_ids, out.num_scheduled_tokens.tolist(), strict=True))
    assert scheduled["c"] == 2 and connector.stats.num_loads == 1  # 12 tokens were a hit
    run_until_idle(sched, copier)
    assert sched.manager.num_free_blocks == 63


def test_a_landed_loads_blocks_are_cached_before_its_request_is_admitted():
    copier = FakeCopier(64, BS)
    connector = OracleLoadConnector(copier, {"b": 12})
    sched = make_scheduler(num_blocks=64, block_size=BS, max_num_seqs=1, connector=connector)
    prompt = list(range(1, 15))  # 3 full blocks loaded, then 2 tokens computed
    b = add(sched, "b", prompt, max_tokens=2)
    add(sched, "r", [50, 51], max_tokens=6)  # takes the one running slot
    step(sched, copier)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    out, _ = step(sched, copier)  # b's load lands; b waits for the slot
    assert out.request_ids == ["r"] and b.status == RequestStatus.WAITING
    probe = Request("probe", prompt + [7])
    hit, num_hit = sched.manager.get_computed_blocks(probe, count=False)
    assert num_hit == 12 and hit == sched.manager.block_ids("b")[:3]
    c = add(sched, "c", prompt[:12] + [99, 98], max_tokens=2)
    finished = run_until_idle(sched, copier)
    assert set(finished) == {"b", "c", "r"} and connector.started == ["b"]
    assert c.num_preemptions == 0 and sched.manager.num_free_blocks == 63


def test_a_load_whose_request_is_aborted_in_flight_still_serves_its_waiters():
    sched, connector, copier = _offloaded()
    a = add(sched, "a", PROMPT, max_tokens=2)
    b = add(sched, "b", PROMPT, max_tokens=2)
    step(sched, copier)  # a starts its load; b waits for it
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV and b.status == RequestStatus.WAITING
    assert sched.abort("a")  # its copy is still in flight: a's blocks stay held
    out, _ = step(sched, copier)
    assert out.request_ids == [] and b.status == RequestStatus.WAITING
    copier.complete()  # a's load lands with valid KV: its blocks are cached, then freed
    out, _ = step(sched, copier)
    assert out.request_ids == ["b"] and out.num_scheduled_tokens.tolist() == [2]
    assert connector.stats.num_loads == 1 and len(copier.loaded_block_ids) == 1
    run_until_idle(sched, copier)
    assert sched.manager.num_free_blocks == 63


def test_a_request_waits_for_no_load_of_a_block_it_cannot_hit():
    sched, connector, copier = _offloaded()
    add(sched, "a", PROMPT, max_tokens=2)
    b = add(sched, "b", PROMPT[:4], max_tokens=2)  # one block, holding its last token
    out, _ = step(sched, copier)  # a starts its load; b computes its 4 tokens at once
    assert out.request_ids == ["b"] and out.num_scheduled_tokens.tolist() == [4]
    assert b.status == RequestStatus.RUNNING
    c = add(sched, "c", PROMPT[:9], max_tokens=2)  # 2 hittable blocks: waits for a's load
    out, _ = step(sched, copier)
    assert c.status == RequestStatus.WAITING and "c" not in out.request_ids
    copier.complete()
    out, _ = step(sched, copier)
    scheduled = dict(zip(out.request_ids, out.num_scheduled_tokens.tolist(), strict=True))
    assert scheduled["a"] == 2 and scheduled["c"] == 1  # 8 of c's 9 tokens were a hit
    assert connector.stats.num_loads == 1


def test_every_block_a_load_in_flight_brings_counts_as_loading():
    sched, _, _ = _offloaded()
    b = add(sched, "b", PROMPT, max_tokens=2)
    sched.schedule()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert all(sched._transfers.is_loading(h) for h in b.block_hashes[:3])


def test_a_cancelled_load_holds_back_no_other_request():
    sched, _, _ = _offloaded()
    b = add(sched, "b", PROMPT, max_tokens=2)
    sched.discard(sched.schedule())  # b's load, started by that schedule, is cancelled
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV  # its copy is still in flight
    assert not any(sched._transfers.is_loading(h) for h in b.block_hashes[:3])
    c = add(sched, "c", [*PROMPT[:12], 99, 98], max_tokens=2)
    sched.schedule()  # c does not wait for blocks that load will never cache
    assert c.status != RequestStatus.WAITING


def test_a_load_after_a_device_hit_marks_the_blocks_it_brings_as_loading():
    copier = FakeCopier(64, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=64, block_size=BS, connector=connector)
    add(sched, "a0", PROMPT, max_tokens=1)
    step(sched, copier)
    copier.complete()
    run_until_idle(sched, copier)  # the 3 full blocks saved to the host
    assert sched.manager.reset_prefix_cache()
    add(sched, "p", PROMPT[:5], max_tokens=1)  # reloads the first block into the device
    run_until_idle(sched, copier)
    assert connector.stats.num_loads == 1
    b = add(sched, "b", PROMPT, max_tokens=2)
    sched.schedule()  # one block a device hit, the next two loaded from the host
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV and b.num_computed_tokens == BS
    loading = [sched._transfers.is_loading(h) for h in b.block_hashes[:3]]
    assert loading == [False, True, True]
    c = add(sched, "c", PROMPT[:9], max_tokens=2)  # its second block comes with b's load
    sched.schedule()
    assert c.status == RequestStatus.WAITING and "c" not in sched.manager.request_ids


class _LandsWhenTold(KVConnector):
    def __init__(self) -> None:
        self.to_land: list[str] = []

    def start_load(self, request, block_ids) -> None:
        pass

    def poll(self) -> TransferEvents:
        landed, self.to_land = tuple(self.to_land), []
        return TransferEvents(loaded=landed)


def test_a_block_two_loads_bring_counts_as_loading_until_both_have_ended():
    # Admission makes a request wait rather than load such a block again, so the
    # tracker is driven directly: its count must still cover each load.
    manager = KVCacheManager(32, BS, max_model_len=64)
    connector = _LandsWhenTold()
    tracker = TransferTracker(connector, manager, manager.free)
    a, b = (Request(rid, PROMPT, SamplingParams()) for rid in "ab")
    for request in (a, b):
        request.update_block_hashes(BS, 0)
        assert tracker.start_load(request, [], 0, 8)
    loaded = a.block_hashes[:2]
    assert loaded == b.block_hashes[:2]
    connector.to_land = ["a"]
    tracker.apply_events()
    assert all(tracker.is_loading(h) for h in loaded)  # b's load still brings them
    connector.to_land = ["b"]
    tracker.apply_events()
    assert not any(tracker.is_loading(h) for h in loaded)


def test_a_request_whose_next_block_follows_a_loads_last_block_does_not_wait_for_it():
    # b's load brings blocks 0-1 only; p, which reads no cached KV (prompt logprobs),
    # computes its own blocks 0-1 meanwhile, so c hits them and needs block 2 next: no
    # load in flight brings it, so c computes it now.
    copier = FakeCopier(64, BS)
    connector = OracleLoadConnector(copier, {"b": 8})
    connector.hold = True
    sched = make_scheduler(num_blocks=64, block_size=BS, connector=connector)
    b = add(sched, "b", PROMPT, max_tokens=2)
    add(sched, "p", [*PROMPT[:8], 90, 91, 92, 93, 94], max_tokens=1, prompt_logprobs=0)
    _, results = step(sched, copier)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV and results[0].finished
    c = add(sched, "c", [*PROMPT[:12], 99, 98], max_tokens=2)
    out, _ = step(sched, copier)
    assert c.status == RequestStatus.RUNNING and out.request_ids == ["c"]
    assert out.num_scheduled_tokens.tolist() == [6]  # blocks 0-1 were a device hit
    connector.hold = False
    assert set(run_until_idle(sched, copier)) == {"b", "c"}
    assert connector.started == ["b"] and sched.manager.num_free_blocks == 63


def test_without_prefix_caching_no_request_waits_for_another_requests_load():
    # Its loaded blocks never enter a prefix cache, so waiting for them gains nothing.
    # c's block hashes exist (the connector read them when the pool had no room for c's
    # load), so only the tracker's not counting them lets c start its own load.
    copier = FakeCopier(64, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(
        num_blocks=9, block_size=BS, connector=connector, enable_prefix_caching=False
    )
    add(sched, "a0", PROMPT, max_tokens=1)
    step(sched, copier)
    copier.complete()
    run_until_idle(sched, copier)  # the 3 full blocks saved to the host
    for i in range(4):  # one block each, no full block to save: freed as they finish
        add(sched, f"r{i}", [60 + i, 70, 80], max_tokens=1)
    b = add(sched, "b", PROMPT, max_tokens=2)
    c = add(sched, "c", PROMPT, max_tokens=2)
    step(sched, copier)  # b's load takes the last 4 free blocks; c's waits for room
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV and c.block_hashes
    assert c.status == RequestStatus.WAITING and sched.manager.num_free_blocks == 4
    step(sched, copier)  # b's load is still in flight
    assert c.status == RequestStatus.WAITING_FOR_REMOTE_KV
    copier.complete()
    assert set(run_until_idle(sched, copier)) == {"b", "c"}
    assert connector.stats.num_loads == 2 and sched.manager.num_free_blocks == 8
