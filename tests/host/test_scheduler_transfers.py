"""TransferTracker paths the connector tests leave out, driven through the Scheduler."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_abort_while_loading_then_the_load_fails_releases_the_blocks_once():
    copier = FakeCopier(64, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=64, block_size=BS, connector=connector)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks stored, then reloaded
    add(sched, "a", prompt, max_tokens=1)
    step(sched, copier)
    copier.complete()
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()
    copier.fail_loads = True
    b = add(sched, "b", prompt, max_tokens=3)
    step(sched, copier)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    held = sched.manager.block_ids("b")
    assert sched.abort("b") and sched.transferring == {"b": b}
    step(sched, copier)
    assert sched.manager.block_ids("b") == held  # the failing load may still write them
    copier.complete()
    out, _ = step(sched, copier)
    assert out.finished_request_ids == ("b",) and "b" not in sched.requests
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_pending_transfers() and not sched.has_unfinished_requests()
    assert sched.manager.num_free_blocks == 63
    assert connector.stats.num_failed_loads == 1


class _ClaimingConnector(KVConnector):
    """Claims `claim` tokens for every admission; start_load raises for ids in `failing`."""

    def __init__(self, claim, *, failing=()) -> None:
        self.claim, self.failing, self.loads = claim, set(failing), []

    def on_admission(self, request, num_computed_tokens):
        return self.claim

    def start_load(self, request, block_ids):
        if request.request_id in self.failing:
            raise OSError("injected start_load failure")
        self.loads.append((request.request_id, list(block_ids)))


def _queued(sched) -> list[str]:
    return [r.request_id for r in sched.waiting]


@pytest.mark.parametrize(
    "claim",
    [12, 16, 2, -4, 4.0, "4"],
    ids=["whole_prompt", "past_last_token", "part_block", "negative", "float", "str"],
)
def test_a_bad_claim_is_refused_with_the_queue_and_blocks_unchanged(claim):
    sched = make_scheduler(num_blocks=16, block_size=BS, connector=_ClaimingConnector(claim))
    for rid in ("a", "b", "c"):
        add(sched, rid, range(1, 13), max_tokens=2)  # 12 tokens: at most 8 loadable
    with pytest.raises(ValueError, match=r"on_admission\('a', 0\) returned .*whole number"):
        sched.schedule()
    assert _queued(sched) == ["a", "b", "c"]
    assert sched.manager.num_free_blocks == 15 and not sched.running
    assert all(r.status == RequestStatus.WAITING and not r.num_computed_tokens
               for r in sched.waiting)  # fmt: skip
    sched.manager.check_integrity()


def test_a_claim_on_a_prompt_of_one_block_names_no_loadable_token():
    # 3 tokens of 4 per block: no whole block ends before the last token.
    sched = make_scheduler(num_blocks=16, block_size=BS, connector=_ClaimingConnector(4))
    add(sched, "a", [1, 2, 3], max_tokens=2)
    with pytest.raises(ValueError, match=r"returned 4: .*\(at most 0 tokens here\)$"):
        sched.schedule()
    assert _queued(sched) == ["a"] and sched.manager.num_free_blocks == 15


def test_a_claim_of_no_tokens_starts_no_load():
    # Admission asks for a load only after a nonzero claim: the tracker is driven directly.
    manager = KVCacheManager(16, BS, max_model_len=64)
    tracker = TransferTracker(_ClaimingConnector(0), manager, manager.free)
    a = Request("a", list(range(1, 15)), SamplingParams())
    a.update_block_hashes(BS, 0)
    with pytest.raises(ValueError, match=r"returned 0: a claim must be a whole number"):
        tracker.start_load(a, [], 0, 0)
    assert a.status == RequestStatus.WAITING and "a" not in manager.request_ids


def test_a_numpy_claim_of_whole_blocks_is_taken():
    connector = _ClaimingConnector(np.int64(8))
    sched = make_scheduler(num_blocks=16, block_size=BS, connector=connector)
    a = add(sched, "a", range(1, 15), max_tokens=2)
    sched.schedule()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV and a.num_computed_tokens == 0
    assert connector.loads == [("a", sched.manager.block_ids("a")[:2])]


def test_a_claim_of_one_one_token_block_starts_a_load():
    connector = _ClaimingConnector(1)  # the least claim there is: one block of one token
    sched = make_scheduler(num_blocks=16, block_size=1, connector=connector)
    a = add(sched, "a", [1, 2], max_tokens=2)
    sched.schedule()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert connector.loads == [("a", sched.manager.block_ids("a")[:1])]


def test_a_started_load_holds_blocks_for_every_token_of_its_request():
    # 13 tokens need 4 blocks, the last for token 13 alone: a landed load must hold them
    # all, so that the request needs no further block to be admitted.
    connector = _ClaimingConnector(8)
    sched = make_scheduler(num_blocks=16, block_size=BS, connector=connector)
    a = add(sched, "a", range(1, 14), max_tokens=2)
    sched.schedule()
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert sched.manager.block_ids("a") == [1, 2, 3, 4] and sched.manager.num_free_blocks == 11
    assert connector.loads == [("a", [1, 2])]


def test_a_failing_start_load_frees_its_blocks_and_keeps_the_queue():
    connector = _ClaimingConnector(0, failing={"b"})
    sched = make_scheduler(num_blocks=16, block_size=BS, connector=connector)
    running = add(sched, "r", range(1, 3), max_tokens=5)
    step(sched)  # "r" runs, holding one block
    connector.claim = 8
    # Prompts of their own: a request whose next block another's load brings waits for it.
    a, b, c = (add(sched, rid, range(20 * i, 20 * i + 14), max_tokens=2)
               for i, rid in enumerate("abc", 1))  # fmt: skip
    with pytest.raises(OSError, match="injected"):
        sched.schedule()  # "a" starts its load (4 blocks), then "b" fails
    assert _queued(sched) == ["a", "b", "c"] and sched.running == [running]
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert sched.manager.num_free_blocks == 15 - 1 - 4
    sched.manager.check_integrity()
    connector.failing.clear()  # the connector recovers: the next step starts the load
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["r"]
    assert [rid for rid, _ in connector.loads] == ["a", "b", "c"]


class _Interrupt(BaseException):
    """Not an Exception, as KeyboardInterrupt."""


class _InterruptedConnector(_ClaimingConnector):
    def start_load(self, request, block_ids):
        raise _Interrupt


def test_a_start_load_interrupted_by_a_base_exception_frees_its_blocks():
    sched = make_scheduler(num_blocks=16, block_size=BS, connector=_InterruptedConnector(8))
    a = add(sched, "a", range(1, 15), max_tokens=2)
    with pytest.raises(_Interrupt):
        sched.schedule()
    assert _queued(sched) == ["a"] and "a" not in sched.manager.request_ids
    assert a.status == RequestStatus.WAITING and a.num_computed_tokens == 0
    assert sched.manager.num_free_blocks == 15
    sched.manager.check_integrity()


def test_a_claim_that_reaches_the_last_token_after_a_device_cache_hit_is_refused():
    # 14 tokens: 12 loadable from position 0, but only 8 after the 4-token device hit.
    connector = _ClaimingConnector(0)
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    add(sched, "p", range(1, 6), max_tokens=1)
    run_until_idle(sched)  # caches the block of tokens 1..4
    connector.claim = 12
    r = add(sched, "r", range(1, 15), max_tokens=2)
    with pytest.raises(ValueError, match=r"on_admission\('r', 4\) returned 12.*at most 8 tokens"):
        sched.schedule()
    assert _queued(sched) == ["r"] and "r" not in sched.manager.request_ids
    assert r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
    sched.manager.check_integrity()


class _LandingConnector(_ClaimingConnector):
    """Its loads land at the next poll() after `to_land` names them, in that order."""

    def __init__(self, claim) -> None:
        super().__init__(claim)
        self.to_land: list[str] = []

    def poll(self):
        landed, self.to_land = tuple(self.to_land), []
        return TransferEvents(loaded=landed)


def test_landed_loads_are_admitted_in_landing_order_not_queue_order():
    connector = _LandingConnector(4)
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    a = add(sched, "a", range(1, 8), max_tokens=2)
    b = add(sched, "b", range(11, 18), max_tokens=2)
    sched.schedule()
    assert a.status == b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    connector.to_land = ["b", "a"]
    out = sched.schedule()
    assert out.request_ids == ["b", "a"] and out.num_computed_tokens.tolist() == [4, 4]


def test_a_failing_start_load_after_a_device_cache_hit_leaves_nothing_computed():
    # "b" hits r's two cached blocks (8 tokens) before its load fails: it holds no
    # block afterwards, so it must not keep counting those 8 tokens as computed.
    connector = _ClaimingConnector(0, failing={"b"})
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    add(sched, "r", range(1, 10), max_tokens=5)
    step(sched)  # caches r's blocks of tokens 1..4 and 5..8
    connector.claim = 4
    b = add(sched, "b", range(1, 15), max_tokens=2)
    with pytest.raises(OSError, match="injected"):
        sched.schedule()
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    sched.manager.check_integrity()
    connector.failing.clear()
    sched.schedule()  # admits "b" again: its load starts after the same hit
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV and b.num_computed_tokens == 8


def test_a_load_the_pool_cannot_hold_yet_leaves_its_cache_hit_uncounted():
    # "b" hits r's two cached blocks (8 tokens) and is claimed 4 more, but the pool has
    # one free block for the two it needs: it waits holding nothing, so it must not count
    # the 8 hit tokens as computed (its next allocation would find them past its blocks).
    connector = _ClaimingConnector(0)
    sched = make_scheduler(num_blocks=5, block_size=BS, connector=connector)
    r = add(sched, "r", range(1, 10), max_tokens=3)
    step(sched)  # r holds 3 blocks; its blocks of tokens 1..4 and 5..8 are cached
    connector.claim = 4
    b = add(sched, "b", range(1, 15), max_tokens=2)
    assert sched.manager.get_computed_blocks(b, count=False)[1] == 8
    out = sched.schedule()
    assert out.request_ids == ["r"] and not connector.loads
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert "b" not in sched.manager.request_ids
    sched.manager.check_integrity()
    while r.status == RequestStatus.RUNNING:
        sched.update_from_output(out, [7] * len(out.requests))
        out = sched.schedule()
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV and b.num_computed_tokens == 8
    assert [rid for rid, _ in connector.loads] == ["b"]


def test_requests_waiting_for_their_loads_keep_their_queue_order():
    connector = _ClaimingConnector(8, failing={"c"})
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    for i, rid in enumerate("abcd", 1):
        add(sched, rid, range(20 * i, 20 * i + 14), max_tokens=2)  # no prefix in common
    with pytest.raises(OSError, match="injected"):
        sched.schedule()  # "a" and "b" start their loads, then "c" fails
    assert _queued(sched) == ["a", "b", "c", "d"]
    connector.failing.clear()
    sched.schedule()  # "c" and "d" start theirs behind "a" and "b", still loading
    assert _queued(sched) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("block_size,hash_seed", [(8, 0), (BS, 1)])
def test_a_connector_bound_with_another_block_size_or_seed_is_refused(block_size, hash_seed):
    # Its hashes could never be the manager's: every save used to fail with a warning.
    copier = FakeCopier(64, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    assert connector.hash_layout is None and KVConnector().hash_layout is None
    make_scheduler(block_size=BS, connector=connector)  # unbound: nothing to compare
    connector.bind(copier, block_size=block_size, hash_seed=hash_seed)
    assert connector.hash_layout == (block_size, hash_seed)
    match = rf"\(block_size, hash_seed\)=\({block_size}, {hash_seed}\), the manager has \(4, 0\)"
    with pytest.raises(ValueError, match=match):
        make_scheduler(block_size=BS, connector=connector)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(block_size=BS, connector=connector)
    add(sched, "a", list(range(1, 14)), max_tokens=1)
    run_until_idle(sched, copier)
    assert connector.stats.num_stored_blocks == 3


class _LoadsOnceAfterPreemption(KVConnector):
    """Claims one block for a preempted request's first readmission; poll() reports
    `events` once."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.events = TransferEvents()

    def on_admission(self, request, num_computed_tokens):
        first = request.num_preemptions and request.request_id not in self.started
        return BS if first else 0

    def start_load(self, request, block_ids):
        self.started.append(request.request_id)

    def poll(self):
        events, self.events = self.events, TransferEvents()
        return events


@pytest.mark.parametrize("end", ["landed", "failed", "cancelled"])
def test_a_preempted_request_whose_load_ends_waits_as_preempted(end):
    """As a discard leaves a preempted request it had admitted: PREEMPTED, not WAITING
    (which a landed, failed or cancelled load used to set)."""
    connector = _LoadsOnceAfterPreemption()
    sched = make_scheduler(
        num_blocks=5, max_num_seqs=2, max_model_len=32, enable_prefix_caching=False,
        connector=connector,
    )  # fmt: skip
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=8)
    b = add(sched, "b", [5, 6, 7, 8], max_tokens=8)
    while not a.is_finished():  # b is preempted by a, as in the discard tests
        step(sched)
    assert b.num_preemptions == 1 and b.status == RequestStatus.PREEMPTED
    out = sched.schedule()  # b's readmission starts its load
    assert connector.started == ["b"] and b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    if end == "cancelled":
        sched.discard(out)
    field = "failed_loads" if end == "failed" else "loaded"  # a cancelled load: either
    connector.events = TransferEvents(**{field: ("b",)})
    sched._transfers.apply_events()
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == (BS if end == "landed" else 0)
    assert run_until_idle(sched) == {"b": "length"}
    sched.manager.check_integrity()


def test_a_discard_after_the_copies_were_forgotten_leaves_no_load_behind():
    """A load the batch started, ended as failed by forget_transfers (a close past it)
    before the batch is handed back: the discard cancels nothing. Re-listed as loading,
    the request was held for good, and a later forget_transfers freed it again."""
    copier = FakeCopier(64, BS)
    connector = OracleLoadConnector(copier, {"x": 8})
    connector.hold = True  # it lands never: the connector forgot it
    sched = make_scheduler(block_size=BS, connector=connector)
    x = add(sched, "x", list(range(1, 14)), max_tokens=2)
    out = sched.schedule()
    assert connector.started == ["x"] and x.status == RequestStatus.WAITING_FOR_REMOTE_KV
    sched.forget_transfers()
    sched.discard(out)
    assert x.status == RequestStatus.WAITING and x.num_computed_tokens == 0
    connector.claims = {}  # it recomputes its prompt
    assert run_until_idle(sched, copier) == {"x": "length"}
    sched.forget_transfers()  # as a close does: nothing is in flight
    assert x.status == RequestStatus.FINISHED_LENGTH and sched.manager.num_free_blocks == 63
