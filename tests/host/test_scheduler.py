"""Scheduler: continuous batching, chunked prefill, prefix hits, preemption, abort, stops."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import RequestStatus
from jaxkv.cascade import AttentionShape, CascadePlanner
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, add, make_scheduler, run_until_idle, step


def test_batch_prefills_then_decodes_one_token_each_and_frees_everything():
    sched = make_scheduler()
    a = add(sched, "a", range(1, 10), max_tokens=3)
    b = add(sched, "b", range(20, 26), max_tokens=2)
    out, results = step(sched)
    assert out.request_ids == ["a", "b"]
    assert out.num_scheduled_tokens.tolist() == [9, 6]
    assert out.num_computed_tokens.tolist() == [0, 0]
    assert [(r.request_id, r.finished) for r in results] == [("a", False), ("b", False)]
    out, results = step(sched)
    assert out.num_scheduled_tokens.tolist() == [1, 1]
    assert out.num_computed_tokens.tolist() == [9, 6]
    assert [(r.request_id, r.finished, r.finish_reason) for r in results] == [
        ("a", False, None),
        ("b", True, "length"),
    ]
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 2
    out, results = step(sched)
    assert out.request_ids == ["a"] and out.finished_request_ids == ("b",)
    assert results[0].finished and a.num_output_tokens == 3
    assert not sched.has_unfinished_requests()
    assert sched.manager.num_free_blocks == 63
    assert sched.stats.num_generated_tokens == 5


def test_chunked_prefill_splits_prompt_and_discards_chunk_samples():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    a = add(sched, "a", range(1, 21), max_tokens=2)
    sizes = []
    for _ in range(3):
        out, results = step(sched)
        sizes.append(out.num_scheduled_tokens.tolist())
        if a.num_computed_tokens < 20:
            assert results == [] and a.num_output_tokens == 0
    assert sizes == [[8], [8], [4]]
    assert a.num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched = make_scheduler(
        max_num_batched_tokens=16, max_num_seqs=4, max_model_len=16, enable_chunked_prefill=False
    )
    add(sched, "a", range(1, 13), max_tokens=3)
    add(sched, "b", range(30, 42), max_tokens=1)
    out, _ = step(sched)
    assert out.request_ids == ["a"]  # b's 12 tokens do not fit the 4 left
    out, _ = step(sched)
    # a's decode token first, then b's whole 12-token prompt fits the 15 left.
    assert out.request_ids == ["a", "b"]
    assert out.num_scheduled_tokens.tolist() == [1, 12]


def test_running_requests_come_first_and_max_num_seqs_caps_admission():
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    add(sched, "a", range(1, 6), max_tokens=4)
    add(sched, "b", range(10, 15), max_tokens=4)
    add(sched, "c", range(20, 25), max_tokens=1)
    out, _ = step(sched)
    assert out.request_ids == ["a", "b"]
    out, _ = step(sched)
    assert out.request_ids == ["a", "b"]  # c waits: two running is the cap
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_token_budget_leaves_running_requests_unscheduled():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=8)
    for i in range(4):
        add(sched, f"r{i}", range(10 * i + 1, 10 * i + 3), max_tokens=5)
    out, _ = step(sched)
    assert out.request_ids == ["r0", "r1", "r2", "r3"]
    add(sched, "long", range(50, 62), max_tokens=1)
    out, _ = step(sched)
    assert out.num_scheduled_tokens.tolist() == [1, 1, 1, 1, 4]  # chunk of the new prompt
    assert out.request_ids[-1] == "long"


def test_prefix_cache_hit_on_admission_skips_cached_blocks():
    sched = make_scheduler()
    prompt = list(range(1, 14))  # 3 full blocks of 4 + 1
    add(sched, "a", prompt, max_tokens=1)
    run_until_idle(sched)
    b = add(sched, "b", prompt[:12] + [99, 98], max_tokens=1)
    out, _ = step(sched)
    assert out.num_computed_tokens.tolist() == [12]
    assert out.num_scheduled_tokens.tolist() == [2]
    assert b.num_computed_tokens == 14
    assert sched.manager.prefix_cache_stats.hits == 12


def test_same_step_admissions_share_blocks_of_the_first():
    sched = make_scheduler()
    prompt = list(range(1, 10))
    add(sched, "a", prompt, max_tokens=2)
    add(sched, "b", prompt, max_tokens=2)
    out, _ = step(sched)
    assert out.num_computed_tokens.tolist() == [0, 8]  # b hits a's blocks being computed now
    ids_a, ids_b = sched.manager.block_ids("a"), sched.manager.block_ids("b")
    assert ids_a[:2] == ids_b[:2] and ids_a[2] != ids_b[2]


def test_preemption_takes_the_most_recent_request_and_it_resumes():
    # 7 usable blocks of 4 tokens; three requests of 8 + 8 tokens cannot all fit.
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=32, max_model_len=32)
    reqs = [add(sched, f"r{i}", range(10 * i + 1, 10 * i + 9), max_tokens=8) for i in range(3)]
    preempted = []
    finished = {}
    num_tokens = num_decode_steps = 0
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        had_output = {r.request_id for r in reqs if r.output_token_ids}
        out, results = step(sched)
        num_tokens += out.total_num_scheduled_tokens
        num_decode_steps += sum(
            r.request_id in had_output and n == 1
            for r, n in zip(out.requests, out.num_scheduled_tokens.tolist(), strict=True)
        )
        preempted.extend(out.preempted_request_ids)
        finished.update({r.request_id: r.finish_reason for r in results if r.finished})
    assert preempted and preempted[0] == "r2"
    # A preempted request's recompute is prefill work, though it already has output.
    stats = sched.stats
    assert stats.num_decode_tokens_computed == num_decode_steps
    assert stats.num_prompt_tokens_computed + stats.num_decode_tokens_computed == num_tokens
    assert finished == {"r0": "length", "r1": "length", "r2": "length"}
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert reqs[2].num_preemptions >= 1 and sched.stats.num_preemptions == len(preempted)
    assert sched.manager.num_free_blocks == 7


def test_preempted_request_recomputes_to_the_same_tokens():
    def outputs(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=32, max_model_len=32)
        reqs = [add(sched, f"r{i}", range(7 * i + 1, 7 * i + 10), max_tokens=9) for i in range(3)]
        run_until_idle(sched)
        return [r.output_token_ids for r in reqs], sched.stats.num_preemptions

    roomy, n_roomy = outputs(64)
    tight, n_tight = outputs(9)
    assert n_roomy == 0 and n_tight > 0
    assert tight == roomy


def test_stop_token_and_max_model_len():
    sched = make_scheduler(max_model_len=12)
    a = add(sched, "a", [1, 2, 3], max_tokens=50)
    step(sched)
    stop = a.output_token_ids[0]
    b = add(sched, "b", [1, 2, 3], max_tokens=50, stop_token_ids=(stop,))
    reasons = run_until_idle(sched)
    assert reasons == {"a": "length", "b": "stop"}
    assert a.num_tokens == 12 and a.status == RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [stop] and b.status == RequestStatus.FINISHED_STOPPED


def test_transferring_is_a_read_only_view():
    sched = make_scheduler(connector=HostOffloadConnector(1 << 20, copy_delay_steps=2))
    copier = FakeCopier(64, 4)  # held here: the connector holds it weakly
    sched.connector.bind(copier, block_size=4, hash_seed=0)
    add(sched, "a", list(range(1, 10)), max_tokens=1)
    view = sched.transferring
    step(sched, copier)
    assert list(view) == ["a"]  # follows the scheduler
    with pytest.raises(TypeError):
        view["b"] = view["a"]  # would have held has_pending_transfers() True for ever
    run_until_idle(sched, copier)
    assert list(view) == [] and not sched.has_pending_transfers()


def test_abort_from_waiting_running_and_preempted_frees_blocks():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=32, max_model_len=32)
    add(sched, "run", range(1, 9), max_tokens=20)
    add(sched, "late", range(20, 28), max_tokens=20)
    step(sched)
    add(sched, "wait", range(40, 44))
    assert sched.abort("wait") and "wait" not in sched.requests
    for _ in range(10):
        out, _ = step(sched)
        if out.preempted_request_ids:
            break
    late = sched.requests["late"]
    assert late.status == RequestStatus.PREEMPTED
    assert sched.abort("late") and late.status == RequestStatus.FINISHED_ABORTED
    assert sched.abort("run")
    assert not sched.abort("run") and not sched.abort("nope")
    assert not sched.has_unfinished_requests()
    sched.manager.check_integrity()
    assert sched.manager.num_free_blocks == 7


def test_finished_requests_hold_blocks_while_saving_and_planning_ignores_them():
    """The correctness trap through the scheduler: A shares X with a saving C, B does not."""
    copier = FakeCopier(64, 4, auto_complete=False)
    connector = HostOffloadConnector(1 << 20, copy_delay_steps=0)
    sched = make_scheduler(connector=connector)
    connector.bind(copier, block_size=4, hash_seed=0)
    shared = list(range(1, 9))
    add(sched, "c", shared + [50], max_tokens=1)
    step(sched, copier)
    c = sched.transferring["c"]
    assert c.status == RequestStatus.FINISHED_TRANSFERRING
    held = sched.manager.block_ids("c")
    add(sched, "a", shared + [60, 61], max_tokens=4)
    add(sched, "b", [70, 71, 72, 73, 74], max_tokens=4)
    step(sched, copier)
    out, _ = step(sched, copier)
    assert out.request_ids == ["a", "b"]
    assert sched.manager.block_ids("a")[:2] == held[:2]  # A hit C's blocks
    planner = CascadePlanner(AttentionShape(4, 2, 16, 4), enable_cascade=True)
    plan = planner.plan(out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens,
                        sched.manager)  # fmt: skip
    assert plan.num_common_prefix_blocks == 0 and not plan.uses_cascade
    assert sched.manager.block_ids("c") == held  # still held while the copy is pending
    copier.complete()
    step(sched, copier)
    assert "c" not in sched.transferring
    reasons = run_until_idle(sched, copier)
    assert set(reasons) == {"a", "b"}
    assert sched.manager.num_free_blocks == 63


def test_schedule_output_arrays_are_int32_and_parallel():
    sched = make_scheduler()
    add(sched, "a", [1, 2, 3])
    out = sched.schedule()
    assert out.num_scheduled_tokens.dtype == np.int32
    assert out.num_computed_tokens.dtype == np.int32
    assert len(out.requests) == len(out.request_ids) == len(out.num_scheduled_tokens)


def test_a_request_without_max_tokens_is_sized_up_to_max_model_len():
    # max_tokens=None generates until a stop token or max_model_len: up to 31 tokens of
    # KV, 8 blocks of 4 where the pool has 4. Sized as a short request, it would preempt
    # itself once it outgrew the pool and wait forever.
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=32, max_model_len=32)
    with pytest.raises(
        ValueError, match="'open': up to 31 tokens of KV .* 8 blocks of 4; the pool"
    ):
        add(sched, "open", range(1, 5), max_tokens=None)
    assert not sched.requests and not sched.waiting
    roomy = make_scheduler(num_blocks=9, max_num_batched_tokens=32, max_model_len=32)
    r = add(roomy, "open", range(1, 5), max_tokens=None)
    assert run_until_idle(roomy) == {"open": "length"}
    assert r.num_tokens == 32 and roomy.stats.num_preemptions == 0


def test_abort_answers_false_as_a_bool_for_unknown_and_finished_requests():
    # A caller may test `abort(...) is False` to tell "nothing to abort" from a failure.
    sched = make_scheduler()
    add(sched, "a", [1, 2, 3], max_tokens=1)
    run_until_idle(sched)
    assert sched.abort("nope") is False
    assert sched.abort("a") is False  # finished and released
    b = add(sched, "b", [1, 2, 3], max_tokens=1)
    step(sched)
    assert sched.abort("b") is False and b.status == RequestStatus.FINISHED_LENGTH
    assert sched.abort(add(sched, "c", [4, 5]).request_id) is True


def test_discard_unapplied_answers_false_as_a_bool_when_nothing_is_pending():
    sched = make_scheduler()
    assert sched.discard_unapplied() is False
    add(sched, "a", [1, 2, 3])
    sched.schedule()
    assert sched.discard_unapplied() is True and sched.discard_unapplied() is False
