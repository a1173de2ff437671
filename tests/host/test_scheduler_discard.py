"""Scheduler.discard: a step that failed before its KV was written is handed back.

schedule() enters the blocks a step's tokens will fill into the prefix cache when it
allocates them. If that step never runs, those blocks hold no KV; a request that later
hits them would read garbage. discard() takes them out again and un-admits what the
failed schedule() admitted (such a request may hold one of them as a cache hit).
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request, RequestStatus, SamplingParams
from jaxkv.kv_transfer import KVConnector
from tests.host._sched_util import (
    FakeCopier,
    OracleLoadConnector,
    add,
    make_scheduler,
    run_until_idle,
    step,
)
from tests.host._util import make_request


def _num_hit_tokens(sched, tokens) -> int:
    probe = Request("probe", list(tokens), SamplingParams())
    return sched.manager.get_computed_blocks(probe)[1]


def _a_decoding_and_b_sharing_its_blocks(sched, copier):
    """a (7 tokens) prefilled; b = a's 8 tokens and 3 more, so that the next schedule()
    fills a's second block (a's decode) and b hits it in the same call."""
    a = add(sched, "a", range(1, 8), max_tokens=5)
    step(sched, copier)
    assert a.num_computed_tokens == 7 and a.num_tokens == 8
    b = add(sched, "b", [*a.all_token_ids, 50, 51, 52], max_tokens=5)
    return a, b


def test_discard_uncaches_only_what_the_step_would_have_written_and_unadmits_admissions():
    sched, copier = make_scheduler(block_size=4), FakeCopier(64, 4)
    a, b = _a_decoding_and_b_sharing_its_blocks(sched, copier)
    probe_tokens = list(b.all_token_ids)
    out = sched.schedule()
    assert out.request_ids == ["a", "b"] and out.num_computed_tokens.tolist() == [7, 8]
    assert _num_hit_tokens(sched, probe_tokens) == 8  # a's second block, not yet written

    sched.discard(out)
    assert _num_hit_tokens(sched, probe_tokens) == 4  # a's first block was written
    # a keeps running where it was; b, admitted by that schedule(), waits again.
    assert sched.running == [a] and a.num_computed_tokens == 7
    assert list(sched.waiting) == [b] and b.status == RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    m = sched.manager
    assert m.request_ids == ["a"] and len(m.block_ids("a")) == 2
    m.check_integrity()
    with pytest.raises(ValueError, match="output"):
        sched.discard(out)  # already handed back
    with pytest.raises(ValueError, match="output"):
        sched.update_from_output(out, [1, 2])

    # The queue serves on: both recompute (step checks every hit holds its own KV).
    while sched.has_unfinished_requests():
        step(sched, copier)
    assert a.num_output_tokens == b.num_output_tokens == 5
    assert m.num_free_blocks == m.pool.num_blocks - 1


def test_a_request_aborted_before_its_step_is_discarded_leaves_no_unwritten_cache_hit():
    sched, copier = make_scheduler(block_size=4), FakeCopier(64, 4)
    a, b = _a_decoding_and_b_sharing_its_blocks(sched, copier)
    probe_tokens = list(b.all_token_ids)
    out = sched.schedule()  # enters a's second block (not yet written) into the cache
    assert sched.abort("a") and sched.abort("b")  # freed: discard can no longer reach them
    sched.discard(out)
    assert _num_hit_tokens(sched, probe_tokens) == 4  # a's first block was written
    m = sched.manager
    assert m.request_ids == [] and m.num_free_blocks == m.pool.num_blocks - 1
    m.check_integrity()


def test_a_request_aborted_before_its_step_runs_keeps_the_step_applicable():
    sched, copier = make_scheduler(block_size=4), FakeCopier(64, 4)
    a, b = _a_decoding_and_b_sharing_its_blocks(sched, copier)
    out = sched.schedule()
    block_ids = {r: sched.manager.block_ids(r) for r in ("a", "b")}
    assert sched.abort("a")
    # The step runs the batch as scheduled: it writes a's token too (into a block b holds).
    for req, start in zip(out.requests, out.num_computed_tokens.tolist(), strict=True):
        ids, pos = block_ids[req.request_id], np.arange(start, req.num_tokens)
        copier.device[np.asarray(ids)[pos // 4], pos % 4] = 1000 * pos + req.all_token_ids[start:]
    outputs = sched.update_from_output(out, [5, 6])  # b gets its token
    assert [o.request_id for o in outputs] == ["b"] and b.output_token_ids == [6]
    # The step wrote a's second block, which b holds as a hit: it stays cached (the
    # abort took it out of the cache, and b never put it back).
    assert _num_hit_tokens(sched, [*a.all_token_ids, 99]) == 8
    while sched.has_unfinished_requests():
        step(sched, copier)  # checks every hit holds its own KV
    assert b.num_output_tokens == 5
    assert _num_hit_tokens(sched, [*a.all_token_ids, 99]) == 8
    sched.manager.check_integrity()


def test_a_request_aborted_before_its_step_and_its_sharer_leave_nothing_unwritten_cached():
    """Aborted before its step, a's unwritten block stays cached (b hit it) until the
    step is discarded: then it leaves the cache, though a freed it and b is unadmitted."""
    sched, copier = make_scheduler(block_size=4), FakeCopier(64, 4)
    a, b = _a_decoding_and_b_sharing_its_blocks(sched, copier)
    out = sched.schedule()
    assert sched.abort("a") and _num_hit_tokens(sched, b.all_token_ids) == 8
    sched.discard(out)
    assert _num_hit_tokens(sched, b.all_token_ids) == 4  # a's first block was written
    assert list(sched.waiting) == [b] and sched.manager.request_ids == []
    sched.manager.check_integrity()
    while sched.has_unfinished_requests():
        step(sched, copier)  # b recomputes its second block: checks its KV
    assert b.num_output_tokens == 5 and _num_hit_tokens(sched, b.prompt_token_ids) == 8


def test_finished_ids_of_a_discarded_output_are_reported_by_the_next_one():
    sched = make_scheduler(block_size=4)
    add(sched, "a", range(1, 6), max_tokens=3)
    add(sched, "b", range(1, 6), max_tokens=3)
    assert sched.abort("b")
    out = sched.schedule()
    assert out.finished_request_ids == ("b",)
    sched.discard(out)
    assert sched.schedule().finished_request_ids == ("b",)


def test_a_request_aborted_before_the_discard_is_reported_after_the_discarded_ones():
    # The next output reports every id that finished since the last one, in finishing
    # order: the discarded output's, then those aborted between its schedule and discard.
    sched = make_scheduler(block_size=4)
    for rid in "abcd":
        add(sched, rid, range(1, 6), max_tokens=3)
    assert sched.abort("b")
    out = sched.schedule()
    assert out.finished_request_ids == ("b",) and out.request_ids == ["a", "c", "d"]
    assert sched.abort("c") and sched.abort("d")  # two: none of them lost
    sched.discard(out)
    out = sched.schedule()
    assert out.finished_request_ids == ("b", "c", "d") and out.request_ids == ["a"]
    sched.discard(out)  # again: reported once more, in the same order
    assert sched.schedule().finished_request_ids == ("b", "c", "d")


class _RaisingConnector(KVConnector):
    def __init__(self) -> None:
        self.raise_for: str | None = None

    def on_admission(self, request: Request, num_computed_tokens: int) -> int:
        if request.request_id == self.raise_for:
            raise OSError("injected connector failure")
        return 0


def test_an_exception_inside_schedule_hands_back_what_it_had_scheduled():
    connector = _RaisingConnector()
    sched, copier = make_scheduler(block_size=4, connector=connector), FakeCopier(64, 4)
    a, b = _a_decoding_and_b_sharing_its_blocks(sched, copier)
    connector.raise_for = "b"
    with pytest.raises(OSError, match="injected"):
        sched.schedule()  # a's decode allocated (and cached) its second block, then b raised
    assert _num_hit_tokens(sched, b.all_token_ids) == 4
    assert sched.running == [a] and list(sched.waiting) == [b]
    sched.manager.check_integrity()
    connector.raise_for = None
    while sched.has_unfinished_requests():
        step(sched, copier)
    assert a.num_output_tokens == b.num_output_tokens == 5


def test_a_load_started_by_a_discarded_schedule_does_not_keep_its_unwritten_cache_hit():
    """p is admitted and fills two blocks; r, behind it, hits them in the same schedule()
    and starts a load of its third block. The step fails: p's blocks were never written,
    so r may not count them as computed (its KV would be zeros)."""
    copier = FakeCopier(64, 4)
    connector = OracleLoadConnector(copier, {"r": 4})
    sched = make_scheduler(block_size=4, connector=connector)
    p = add(sched, "p", range(1, 10), max_tokens=3)  # 9 tokens: 2 full blocks
    r = add(sched, "r", [*range(1, 9), 20, 21, 22, 23, 24], max_tokens=3)  # 13 tokens
    out = sched.schedule()
    assert out.request_ids == ["p"] and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert r.num_computed_tokens == 8  # p's two blocks, allocated but not yet written

    held = sched.manager.block_ids("r")
    sched.discard(out)
    sched.manager.check_integrity()
    assert _num_hit_tokens(sched, r.all_token_ids) == 0
    # The copy may still write r's blocks: held until it lands, then r starts over.
    assert sched.manager.block_ids("r") == held and list(sched.waiting) == [p, r]
    connector.hold = True
    out = sched.schedule()
    assert out.request_ids == ["p"] and sched.manager.block_ids("r") == held
    sched.discard(out)
    connector.hold = False
    # Every step checks that each request's computed KV is its own (step()).
    while sched.has_unfinished_requests():
        step(sched, copier)
    assert p.num_output_tokens == r.num_output_tokens == 3
    assert connector.started == ["r", "r"]  # started over after the cancelled load
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1


def test_a_discard_leaves_loads_of_earlier_steps_and_an_aborted_cancelled_load_is_released():
    copier = FakeCopier(64, 4)
    connector = OracleLoadConnector(copier, {"r": 8})
    sched = make_scheduler(block_size=4, connector=connector)
    r = add(sched, "r", range(1, 14), max_tokens=2)
    connector.hold = True
    step(sched, copier)  # r's load starts and stays in flight
    q = add(sched, "q", range(50, 55), max_tokens=2)
    sched.discard(sched.schedule())  # q was admitted; r's load is from an earlier step
    connector.hold = False
    out, _ = step(sched, copier)  # r's load lands and counts
    assert out.request_ids == ["r", "q"] and out.num_computed_tokens.tolist() == [8, 0]

    connector.claims = {"t": 4}
    t = add(sched, "t", [*range(60, 72), 7], max_tokens=2)
    connector.hold = True
    sched.discard(sched.schedule())  # t's load, started by this schedule, is cancelled
    assert sched.abort("t") and sched.transferring == {"t": t}
    connector.hold = False
    run_until_idle(sched, copier)
    assert t.status == RequestStatus.FINISHED_ABORTED and "t" not in sched.requests
    assert r.num_output_tokens == q.num_output_tokens == 2
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1


def test_discard_requeues_admitted_requests_in_order_with_their_status():
    # 4 usable blocks: b is preempted by a, then b (PREEMPTED) and c (WAITING) are
    # admitted together once a finishes; that schedule is discarded.
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, max_model_len=32)
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=8)
    b = add(sched, "b", [5, 6, 7, 8], max_tokens=8)
    c = add(sched, "c", [9, 10, 11, 12], max_tokens=1)
    while not a.is_finished():
        step(sched)
    assert b.num_preemptions == 1 and b.status == RequestStatus.PREEMPTED
    out = sched.schedule()
    assert out.request_ids == ["b", "c"]
    sched.discard(out)
    assert list(sched.waiting) == [b, c] and not sched.running
    assert (b.status, c.status) == (RequestStatus.PREEMPTED, RequestStatus.WAITING)
    sched.manager.check_integrity()
    assert run_until_idle(sched) == {"b": "length", "c": "length"}


class _LoadsForA(KVConnector):
    """Claims 4 cached tokens for each request whose id starts with "A" (a load that
    never lands); raises on admitting `raise_for`."""

    def __init__(self, raise_for: str | None = None) -> None:
        self.raise_for = raise_for

    def on_admission(self, request: Request, num_computed_tokens: int) -> int:
        if request.request_id == self.raise_for:
            raise OSError("injected connector failure")
        return 4 if request.request_id.startswith("A") else 0

    def start_load(self, request: Request, block_ids) -> None:
        pass


@pytest.mark.parametrize("raise_for", [None, "C"])
def test_admitted_requests_go_back_behind_a_request_passed_over_for_its_load(raise_for):
    # A's load keeps it waiting; B and C, queued after it, are admitted (or B is and C's
    # admission raises). Handed back, they return behind A, as they were queued.
    sched = make_scheduler(block_size=4, connector=_LoadsForA(raise_for))
    for rid in "ABC":
        add(sched, rid, [ord(rid), *range(10)])
    if raise_for is None:
        out = sched.schedule()
        assert out.request_ids == ["B", "C"]
        sched.discard(out)
    else:
        with pytest.raises(OSError, match="injected"):
            sched.schedule()
    assert [r.request_id for r in sched.waiting] == ["A", "B", "C"]
    assert not sched.running
    sched.manager.check_integrity()


def test_an_admitted_request_goes_back_behind_every_request_still_loading():
    # A1's load started a step before, A2's starts in this one; B, queued behind both,
    # is admitted. Handed back, B returns behind both of them, as it was queued.
    sched = make_scheduler(block_size=4, connector=_LoadsForA())
    add(sched, "A1", [1, *range(10)])
    sched.update_from_output(sched.schedule(), [])  # A1's load starts
    add(sched, "A2", [2, *range(10)])
    add(sched, "B", [3, *range(10)])
    out = sched.schedule()
    assert out.request_ids == ["B"]
    sched.discard(out)
    assert [r.request_id for r in sched.waiting] == ["A1", "A2", "B"]
    sched.manager.check_integrity()


def test_a_landed_load_goes_back_ahead_of_a_request_admitted_behind_it():
    copier = FakeCopier(64, 4)
    sched = make_scheduler(block_size=4, connector=OracleLoadConnector(copier, {"l": 4}))
    add(sched, "l", range(1, 8), max_tokens=1)
    step(sched, copier)  # l's load starts
    add(sched, "b", range(20, 28), max_tokens=1)
    out = sched.schedule()  # l's load has landed: l runs, then b
    assert out.request_ids == ["l", "b"]
    sched.discard(out)
    assert [r.request_id for r in sched.waiting] == ["l", "b"]
    sched.manager.check_integrity()


def test_uncache_unwritten_leaves_a_later_block_another_request_cached_again():
    # Only the blocks this request itself entered into the cache (its first num_cached)
    # leave it: after two failed steps, block 2, which c cached again on its retry, lies
    # past b's cached blocks and must stay cached (c counts it as cached and would never
    # cache it again).
    m = KVCacheManager(32, 4, max_model_len=64)
    b = make_request("b", range(1, 14))  # 13 tokens: blocks 0..2 full, 3 partial
    m.allocate_slots(b, 13)
    b.num_computed_tokens = 13
    c = make_request("c", [*range(1, 13), 99, 98])  # shares b's three full blocks
    ids, num = m.get_computed_blocks(c)
    assert num == 12
    m.allocate_slots(c, 2, num_new_computed_tokens=num, new_computed_blocks=ids)
    shared = m.block_ids("b")[2]
    m.uncache_unwritten(b, 8)  # a failed step: b and c wrote only 8 tokens each
    m.uncache_unwritten(c, 8)
    assert m.pool.blocks[shared].block_hash is None
    c.num_computed_tokens = 8
    m.allocate_slots(c, 6)  # c's retry fills block 2 again and caches it again
    assert m.pool.blocks[shared].block_hash == c.block_hashes[2]
    m.uncache_unwritten(b, 4)  # b fails again after 4 tokens: its block 1 leaves
    assert m.pool.blocks[m.block_ids("b")[1]].block_hash is None
    assert m.pool.blocks[shared].block_hash == c.block_hashes[2]
    m.check_integrity()


def test_discard_unapplied_hands_back_only_a_pending_batch_that_holds_requests():
    sched, copier = make_scheduler(block_size=4), FakeCopier(64, 4)
    assert not sched.discard_unapplied()  # nothing scheduled yet
    assert sched.schedule().num_requests == 0 and not sched.discard_unapplied()
    a = add(sched, "a", range(1, 8), max_tokens=5)
    out = sched.schedule()
    assert out.request_ids == ["a"] and sched.discard_unapplied()
    assert list(sched.waiting) == [a] and not sched.discard_unapplied()
    with pytest.raises(ValueError, match="output"):
        sched.update_from_output(out, [1])  # handed back: not to be applied
    run_until_idle(sched, copier)
    sched.manager.check_integrity()


def test_a_ctrl_c_during_a_discard_is_raised_once_every_unwritten_block_left_the_cache():
    # A second Ctrl-C (the first stopped the step) that cut the discard halfway left the
    # blocks after it cached with KV never written: once their requests were aborted
    # (generate's cleanup), a later request with their prompt hit them and read garbage.
    sched, copier = make_scheduler(block_size=4), FakeCopier(64, 4)
    a, b = _a_decoding_and_b_sharing_its_blocks(sched, copier)
    c = add(sched, "c", range(30, 39), max_tokens=5)
    out = sched.schedule()
    assert out.request_ids == ["a", "b", "c"] and _num_hit_tokens(sched, c.all_token_ids) == 8
    manager, calls = sched.manager, []

    def interrupted(request, num_written):
        calls.append(request.request_id)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGINT)  # raised at this call's return, unheld
        return manager.__class__.uncache_unwritten(manager, request, num_written)

    manager.uncache_unwritten = interrupted
    with pytest.raises(KeyboardInterrupt):
        sched.discard(out)
    del manager.uncache_unwritten
    assert calls == ["a", "b", "c"]
    assert sched.abort("a") and sched.abort("b") and sched.abort("c")
    assert _num_hit_tokens(sched, list(b.all_token_ids)) == 4  # a's first block, written
    assert _num_hit_tokens(sched, list(c.all_token_ids)) == 0
    manager.check_integrity()


def test_a_later_discard_leaves_the_blocks_an_applied_step_wrote_for_an_aborted_request():
    sched, copier = make_scheduler(block_size=4), FakeCopier(64, 4)
    a, b = _a_decoding_and_b_sharing_its_blocks(sched, copier)
    out = sched.schedule()
    assert sched.abort("a")
    sched.update_from_output(out, [5, 6])  # the step wrote a's second block (b hit it)
    sched.discard(sched.schedule())  # the next step fails: only its own blocks leave
    assert _num_hit_tokens(sched, [*a.all_token_ids, 99]) == 8
