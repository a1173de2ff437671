"""HostOffloadConnector with a fake device: held blocks, LRU store, reloads, failures, aborts."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import Request, RequestStatus, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import (
    FakeCopier,
    add,
    bound_host_connector,
    make_scheduler,
    run_until_idle,
    step,
)

BS = 4


def setup(host_blocks=64, *, delay=0, auto=True, num_blocks=64, **kw):
    copier = FakeCopier(num_blocks, BS, auto_complete=auto)
    connector = HostOffloadConnector(host_blocks * copier.bytes_per_block, copy_delay_steps=delay)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=num_blocks, block_size=BS, connector=connector, **kw)
    return sched, connector, copier


def expected_kv(tokens, num_blocks):
    pos = np.arange(num_blocks * BS)
    return (1000 * pos + np.asarray(tokens[: num_blocks * BS])).reshape(num_blocks, BS)


def test_save_holds_blocks_for_delay_steps_then_frees_and_stores():
    sched, conn, copier = setup(delay=3)
    prompt = list(range(1, 12))  # 11 tokens + 1 output: 2 full computed blocks
    add(sched, "a", prompt, max_tokens=2)
    step(sched, copier)
    step(sched, copier)  # a finishes: 12 computed tokens -> 3 full blocks
    a = sched.transferring["a"]
    assert a.status == RequestStatus.FINISHED_TRANSFERRING
    held = sched.manager.block_ids("a")
    assert copier.saved_block_ids == [held[:3]]
    for _ in range(2):
        step(sched, copier)
        assert sched.manager.block_ids("a") == held
    step(sched, copier)
    assert not sched.has_pending_transfers() and sched.manager.num_free_blocks == 63
    assert a.status == RequestStatus.FINISHED_LENGTH  # its own end again, once saved
    assert conn.stats.num_saves == 1 and conn.stats.bytes_offloaded == 3 * copier.bytes_per_block
    assert conn.stored_hashes() == a.block_hashes[2::-1]  # head most recent


def test_already_stored_blocks_are_not_copied_twice():
    sched, conn, copier = setup()
    prompt = list(range(1, 10))
    add(sched, "a", prompt, max_tokens=1)
    run_until_idle(sched, copier)
    add(sched, "b", prompt + [77, 78, 79, 80], max_tokens=1)
    run_until_idle(sched, copier)
    first, second = copier.saved_block_ids
    assert len(first) == 2 and len(second) == 1  # only b's third block is new
    assert conn.stats.num_stored_blocks == 3


def test_lru_store_stays_within_its_byte_budget():
    sched, conn, copier = setup(host_blocks=3)
    reqs = [add(sched, f"r{i}", range(10 * i + 1, 10 * i + 9), max_tokens=1) for i in range(3)]
    run_until_idle(sched, copier)
    assert conn.stats.num_stored_blocks == 3
    assert conn.stats.stored_bytes <= conn.host_bytes
    # r0's two blocks went first, then r1's second: a prefix's first block outlives its
    # tail, which is useless without it. Least recently used first:
    r1, r2 = reqs[1].block_hashes, reqs[2].block_hashes
    assert conn.stored_hashes() == [r1[0], r2[1], r2[0]]


def test_store_entries_own_their_memory_and_prefix_heads_outlive_tails():
    # A 6-block prompt into a 4-block store: the first 4 blocks stay, so a reload still
    # supplies them (keeping the tail instead would supply nothing).
    sched, conn, copier = setup(host_blocks=4)
    prompt = list(range(1, 26))  # 6 full blocks + 1
    add(sched, "a", prompt, max_tokens=1)
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()
    b = add(sched, "b", prompt, max_tokens=1)
    assert conn.on_admission(b, 0) == 4 * BS
    assert all(block.base is None for block in conn._store.values())  # no views
    assert conn.stats.stored_bytes == 4 * copier.bytes_per_block <= conn.host_bytes


def test_device_cache_miss_reloads_from_host_with_the_computed_kv():
    sched, conn, copier = setup(delay=2)
    prompt = list(range(1, 15))  # 3 full blocks + 2
    a = add(sched, "a", prompt, max_tokens=3)
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()  # the device cache forgets everything
    copier.device[:] = -1
    b = add(sched, "b", prompt, max_tokens=3)
    out, _ = step(sched, copier)
    assert out.num_requests == 0 and b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    ids = sched.manager.block_ids("b")  # the whole prompt's blocks; the first 3 load
    assert len(ids) == 4 and copier.loaded_block_ids == [ids[:3]]
    ids = ids[:3]
    step(sched, copier)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV  # delay: still loading
    out, _ = step(sched, copier)
    assert out.request_ids == ["b"] and out.num_computed_tokens.tolist() == [12]
    np.testing.assert_array_equal(copier.device[ids], expected_kv(prompt, 3))
    run_until_idle(sched, copier)
    assert b.output_token_ids == a.output_token_ids
    assert conn.stats.bytes_reloaded == 3 * copier.bytes_per_block
    assert conn.stats.num_loaded_tokens == 12
    assert sched.manager.num_free_blocks == 63


def test_landed_loads_cannot_deadlock_a_small_pool():
    # 8 usable blocks; a and b each need 6 and both find 3 blocks in the host store. If
    # both loads started holding only the loaded blocks, neither could get the rest of
    # its prompt once they landed, and with nothing running nothing would free a block.
    sched, conn, copier = setup(num_blocks=9, max_model_len=32, enable_prefix_caching=False)
    shared = list(range(1, 13))
    add(sched, "r0", [*shared, 99], max_tokens=1)
    run_until_idle(sched, copier)
    assert conn.stats.num_stored_blocks == 3
    a = add(sched, "a", [*shared, *range(20, 29)], max_tokens=4)
    b = add(sched, "b", [*shared, *range(40, 49)], max_tokens=4)
    assert run_until_idle(sched, copier, max_steps=60) == {"a": "length", "b": "length"}
    assert conn.stats.num_loads >= 1 and sched.manager.num_free_blocks == 8
    plain = make_scheduler(num_blocks=64, block_size=BS, max_model_len=32)
    a2 = add(plain, "a", a.prompt_token_ids, max_tokens=4)
    b2 = add(plain, "b", b.prompt_token_ids, max_tokens=4)
    run_until_idle(plain)
    assert (a.output_token_ids, b.output_token_ids) == (a2.output_token_ids, b2.output_token_ids)


def test_a_landed_load_runs_while_the_head_of_the_queue_cannot_get_blocks():
    # R fills the pool with x's load; when R outgrows it, R preempts itself and heads
    # the queue needing 5 blocks while x's landed load holds 4 of the 8. x needs no new
    # block, so it runs and frees them; stopping at R would leave nothing running.
    sched, conn, copier = setup(num_blocks=9, max_model_len=32, enable_prefix_caching=False)
    shared = list(range(1, 13))
    add(sched, "r0", [*shared, 99], max_tokens=1)
    run_until_idle(sched, copier)
    r = add(sched, "R", range(40, 56), max_tokens=12)
    x = add(sched, "x", [*shared, 7, 7, 7, 7], max_tokens=2)
    step(sched, copier)
    out, _ = step(sched, copier)
    assert out.preempted_request_ids == ("R",) and x.status == RequestStatus.WAITING
    out, _ = step(sched, copier)
    assert out.request_ids == ["x"] and out.num_computed_tokens.tolist() == [12]
    assert [q.request_id for q in sched.waiting] == ["R"]
    assert run_until_idle(sched, copier) == {"x": "length", "R": "length"}
    assert r.num_output_tokens == 12 and sched.manager.num_free_blocks == 8


def test_a_landed_load_runs_when_the_request_ahead_of_it_keeps_preempting_itself():
    # 9 usable blocks. x's landed load holds 5 (all 17 of its tokens); h needs 5 too but
    # gets only the 2 blocks of an 8-token chunk at admission, so it is never blocked
    # there: it takes the whole budget, grows to 4 blocks, cannot get a 5th and preempts
    # itself, and heads the queue again. Nothing frees x's blocks unless x runs.
    sched, conn, copier = setup(
        num_blocks=10, max_model_len=32, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    shared = list(range(1, 13))
    add(sched, "r0", [*shared, 99], max_tokens=1)
    run_until_idle(sched, copier)
    x = add(sched, "x", [*shared, *range(20, 25)], max_tokens=2)
    h = add(sched, "h", range(40, 57), max_tokens=4)
    out, _ = step(sched, copier)
    assert out.request_ids == ["h"] and x.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert run_until_idle(sched, copier, max_steps=40) == {"x": "length", "h": "length"}
    assert conn.stats.num_loads == 1 and h.num_output_tokens == 4
    assert sched.manager.num_free_blocks == 9


def test_start_load_refuses_blocks_the_store_does_not_hold():
    sched, conn, copier = setup()
    prompt = list(range(1, 15))
    add(sched, "a", prompt, max_tokens=1)
    run_until_idle(sched, copier)
    b = add(sched, "b", prompt, max_tokens=1)
    assert conn.on_admission(b, 0) == 12
    with pytest.raises(ValueError, match="4 block_ids do not cover whole prompt blocks"):
        conn.start_load(b, [5, 6, 7, 8])  # the 4th block holds the last prompt tokens
    c = add(sched, "c", [50, *prompt[1:]], max_tokens=1)
    with pytest.raises(ValueError, match="no longer holds"):
        conn.start_load(c, [5])
    assert copier.loaded_block_ids == [] and not conn.has_pending()


def test_claim_never_covers_the_last_prompt_token():
    sched, conn, copier = setup()
    prompt = list(range(1, 13))  # exactly 3 blocks
    add(sched, "a", prompt, max_tokens=2)
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()
    b = add(sched, "b", prompt, max_tokens=1)
    step(sched, copier)
    assert len(copier.loaded_block_ids[-1]) == 2  # blocks 0-1; block 2 holds the last token
    run_until_idle(sched, copier)
    assert b.num_output_tokens == 1


def test_failed_save_frees_blocks_and_stores_nothing():
    sched, conn, copier = setup(auto=False)
    copier.fail_saves = True
    a = add(sched, "a", range(1, 10), max_tokens=5, stop_token_ids=(146,))  # samples 146
    step(sched, copier)
    assert "a" in sched.transferring
    copier.complete()
    step(sched, copier)
    assert not sched.has_pending_transfers() and sched.manager.num_free_blocks == 63
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [146]
    assert conn.stats.num_failed_saves == 1 and conn.stats.num_stored_blocks == 0


def test_failed_load_drops_entries_frees_blocks_and_recomputes():
    sched, conn, copier = setup()
    prompt = list(range(1, 15))
    a = add(sched, "a", prompt, max_tokens=3)
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()
    copier.fail_loads = True
    b = add(sched, "b", prompt, max_tokens=3)
    step(sched, copier)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    copier.fail_loads = False
    out, _ = step(sched, copier)  # failure seen: blocks freed, prompt recomputed from 0
    assert out.request_ids == ["b"] and out.num_computed_tokens.tolist() == [0]
    assert conn.stats.num_failed_loads == 1
    assert not set(a.block_hashes[:3]) & set(conn.stored_hashes())
    run_until_idle(sched, copier)
    assert b.output_token_ids == a.output_token_ids
    assert sched.manager.num_free_blocks == 63


def test_abort_while_loading_holds_blocks_until_the_load_lands():
    sched, conn, copier = setup(auto=False)
    prompt = list(range(1, 15))
    add(sched, "a", prompt, max_tokens=1)
    step(sched, copier)
    copier.complete()
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()
    b = add(sched, "b", prompt, max_tokens=3)
    step(sched, copier)
    held = sched.manager.block_ids("b")
    assert sched.abort("b") and b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests() and sched.has_pending_transfers()
    step(sched, copier)
    assert sched.manager.block_ids("b") == held  # the load may still write them
    copier.complete()
    out, _ = step(sched, copier)
    assert "b" in out.finished_request_ids and sched.manager.num_free_blocks == 63


def test_abort_of_a_transferring_request_is_a_no_op():
    sched, conn, copier = setup(delay=5)
    add(sched, "a", range(1, 10), max_tokens=1)
    step(sched, copier)
    assert sched.requests["a"].status == RequestStatus.FINISHED_TRANSFERRING
    assert not sched.abort("a")
    assert sched.requests["a"].status == RequestStatus.FINISHED_TRANSFERRING
    run_until_idle(sched, copier)
    assert sched.manager.num_free_blocks == 63


def test_zero_budget_store_never_keeps_blocks():
    sched, conn, copier = setup(host_blocks=0)
    add(sched, "a", range(1, 10), max_tokens=1)
    step(sched, copier)
    assert not sched.has_pending_transfers() and copier.saved_block_ids == []


def test_constructor_validates_its_sizes():
    for bad in ({"host_bytes": -1}, {"host_bytes": True}, {"copy_delay_steps": -2},
                {"copy_delay_steps": True}):  # fmt: skip
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.* must be an int >= 0"):
            HostOffloadConnector(**{"host_bytes": 10, **bad})


def test_sizes_set_later_are_checked_and_a_smaller_store_evicts_at_once():
    # Set later, they were taken unchecked: host_bytes=None raised TypeError out of each
    # on_finish, -1 out of poll() (evicting from an empty store), a smaller one kept the
    # store above it until the next save landed.
    sched, conn, copier = setup(host_blocks=4)
    r = add(sched, "r", range(1, 10), max_tokens=1)
    run_until_idle(sched, copier)
    assert conn.stored_hashes() == r.block_hashes[1::-1]
    for name, bad in (("host_bytes", -1), ("host_bytes", None), ("copy_delay_steps", True)):
        with pytest.raises(ValueError, match=f"{name}={bad!r} must be an int >= 0"):
            setattr(conn, name, bad)
    assert (conn.host_bytes, conn.copy_delay_steps) == (4 * copier.bytes_per_block, 0)
    assert len(conn.stored_hashes()) == 2
    conn.host_bytes = np.int64(copier.bytes_per_block)  # a numpy int, stored as an int
    assert type(conn.host_bytes) is int and conn.stored_hashes() == r.block_hashes[:1]
    assert conn.stats.stored_bytes <= conn.host_bytes


def test_finishing_again_refreshes_stored_blocks_in_the_lru():
    sched, conn, copier = setup(host_blocks=4)
    r0 = add(sched, "r0", range(1, 10), max_tokens=1)
    r1 = add(sched, "r1", range(20, 29), max_tokens=1)
    run_until_idle(sched, copier)
    add(sched, "r2", list(range(1, 9)) + [99], max_tokens=1)  # r0's two blocks again
    run_until_idle(sched, copier)
    r3 = add(sched, "r3", range(40, 49), max_tokens=1)
    run_until_idle(sched, copier)
    a, c = r0.block_hashes, r3.block_hashes
    assert conn.stored_hashes() == [a[1], a[0], c[1], c[0]]
    assert not set(r1.block_hashes) & set(conn.stored_hashes())


def test_a_chain_whose_head_was_stored_before_keeps_its_head_last_in_the_lru():
    # y shares x's stored head block and saves only its two new blocks, which land after
    # the head was refreshed; a 2-block store must still evict y's tail, not its head.
    sched, conn, copier = setup(host_blocks=2)
    add(sched, "x", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1)
    run_until_idle(sched, copier)
    y = add(sched, "y", [1, 2, 3, 4, *range(20, 29)], max_tokens=1)
    run_until_idle(sched, copier)
    assert len(copier.saved_block_ids[-1]) == 2  # the head was not copied again
    assert conn.stored_hashes() == [y.block_hashes[1], y.block_hashes[0]]
    probe = Request("p", [1, 2, 3, 4, *range(20, 30)], SamplingParams())
    assert conn.on_admission(probe, 0) == 8


def test_a_store_of_exactly_one_block_keeps_one_block():
    sched, conn, copier = setup(host_blocks=1)
    a = add(sched, "a", range(1, 6), max_tokens=1)  # 5 tokens: one full block
    step(sched, copier)
    assert sched.transferring == {"a": a} and copier.saved_block_ids == [[1]]
    run_until_idle(sched, copier)
    assert conn.stored_hashes() == a.block_hashes[:1]


def test_blocks_whose_save_is_in_flight_are_not_copied_again():
    sched, conn, copier = setup(delay=3)
    prompt = list(range(1, 10))  # two full blocks
    add(sched, "a", prompt, max_tokens=2)
    step(sched, copier)
    add(sched, "b", prompt, max_tokens=1)
    step(sched, copier)  # a finishes, its save starts; b hits a's blocks
    step(sched, copier)  # b finishes while a's save is in flight
    assert len(copier.saved_block_ids) == 1 and list(sched.transferring) == ["a"]
    run_until_idle(sched, copier)
    assert conn.stats.num_saves == 1 and conn.stats.num_stored_blocks == 2


def test_a_load_refreshes_its_blocks_in_the_lru_and_is_pending_until_it_lands():
    sched, conn, copier = setup(host_blocks=4, auto=False)
    r0 = add(sched, "r0", range(1, 10), max_tokens=1)  # two full blocks each
    r1 = add(sched, "r1", range(20, 29), max_tokens=1)
    step(sched, copier)
    assert conn.has_pending()  # the saves
    copier.complete()
    run_until_idle(sched, copier)
    a, b = r0.block_hashes[:2], r1.block_hashes[:2]
    assert conn.stored_hashes() == [a[1], a[0], b[1], b[0]] and not conn.has_pending()
    assert sched.manager.reset_prefix_cache()
    r2 = add(sched, "r2", range(1, 10), max_tokens=1)
    step(sched, copier)  # r2 starts loading r0's blocks: now the most recently used
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KV and conn.has_pending()
    assert conn.stored_hashes() == [b[1], b[0], a[1], a[0]]
    copier.complete()
    step(sched, copier)
    assert r2.status != RequestStatus.WAITING_FOR_REMOTE_KV and not conn.has_pending()


def test_a_block_whose_last_token_was_never_computed_is_not_saved():
    # 8 tokens, 7 computed: the second block is full of tokens but not of KV.
    copier, connector = bound_host_connector()
    r = Request("r", list(range(1, 9)), SamplingParams())
    r.num_computed_tokens = 7
    assert connector.on_finish(r, [1, 2])
    assert copier.saved_block_ids == [[1]]


def test_blocks_of_a_failed_save_can_be_saved_by_a_later_request():
    copier, connector = bound_host_connector()
    copier.fail_saves = True
    first = Request("first", list(range(1, 9)), SamplingParams())
    first.num_computed_tokens = 8
    assert connector.on_finish(first, [1, 2])
    connector.poll()
    copier.fail_saves = False
    again = Request("again", list(range(1, 9)), SamplingParams())
    again.num_computed_tokens = 8
    assert connector.on_finish(again, [3, 4])  # its hashes are no longer "being saved"
    connector.poll()
    assert connector.stored_hashes() == again.block_hashes[1::-1]
