"""Scheduler policy details that the larger scenario tests left unpinned: the pool-size
refusal's max_model_len cap, queue order after preemption, the finish reason when the
last allowed token is a stop token (stopped, as in vLLM), prefill/decode counters, a
request aborted between schedule() and update_from_output(), no admission in a step
that preempts, and text options refused without a tokenizer."""

from __future__ import annotations

import pytest

from jaxkv import Request, RequestStatus, SamplingParams
from tests.host._sched_util import add, make_scheduler, run_until_idle, step, token_of


def test_the_pool_check_caps_a_request_at_max_model_len():
    # 4 usable blocks of 4 tokens hold max_model_len=16 tokens: max_tokens=100 cannot
    # be reached, so the request fits and stops by length at 16 tokens.
    sched = make_scheduler(num_blocks=5, max_model_len=16)
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=100)
    assert run_until_idle(sched) == {"a": "length"}
    assert a.num_tokens == 16 and a.num_output_tokens == 12


def test_a_preempted_request_waits_ahead_of_requests_queued_after_it():
    # 4 usable blocks; a and b (4-token prompts) each need a third block after 8
    # tokens, so b is preempted; c, queued later (max_num_seqs=2 held it), must wait
    # behind b.
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, max_model_len=32)
    add(sched, "a", [1, 2, 3, 4], max_tokens=8)
    b = add(sched, "b", [5, 6, 7, 8], max_tokens=8)
    add(sched, "c", [9, 10, 11, 12], max_tokens=1)
    for _ in range(10):
        out, _ = step(sched)
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ("b",) and b.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert run_until_idle(sched) == {"a": "length", "b": "length", "c": "length"}


def test_a_stop_token_that_is_also_the_last_allowed_token_finishes_as_stopped():
    # As vLLM's check_stop since it checks the length limit last: the request completed
    # on its own, which "length" would hide (it used to say so, as vLLM did before).
    sched = make_scheduler()
    a = add(sched, "a", [1, 2, 3], max_tokens=1, stop_token_ids=(7,))
    out = sched.schedule()
    [result] = sched.update_from_output(out, [7])
    assert (result.finished, result.finish_reason, result.stop_reason) == (True, "stop", 7)
    assert a.status == RequestStatus.FINISHED_STOPPED
    # At max_model_len too: the prompt leaves room for one token only.
    sched = make_scheduler()
    add(sched, "b", range(1, 64), max_tokens=None, stop_token_ids=(7,))  # max_model_len 64
    [result] = sched.update_from_output(sched.schedule(), [7])
    assert (result.finished, result.finish_reason, result.stop_reason) == (True, "stop", 7)
    # Not a stop token: the length limit.
    sched = make_scheduler()
    add(sched, "c", [1, 2, 3], max_tokens=1, stop_token_ids=(7,))
    [result] = sched.update_from_output(sched.schedule(), [8])
    assert (result.finished, result.finish_reason, result.stop_reason) == (True, "length", None)


def test_a_one_token_prompt_counts_as_prefill_and_its_decodes_as_decode():
    sched = make_scheduler()
    add(sched, "a", [5], max_tokens=3)
    step(sched)
    stats = sched.stats
    assert (stats.num_prompt_tokens_computed, stats.num_decode_tokens_computed) == (1, 0)
    run_until_idle(sched)
    stats = sched.stats
    assert (stats.num_prompt_tokens_computed, stats.num_decode_tokens_computed) == (1, 2)


def test_a_request_aborted_between_schedule_and_update_gets_no_token():
    sched = make_scheduler()
    a = add(sched, "a", range(1, 6), max_tokens=3)
    b = add(sched, "b", range(10, 16), max_tokens=3)
    out = sched.schedule()
    assert sched.abort("a")
    results = sched.update_from_output(out, [7, 8])
    assert [r.request_id for r in results] == ["b"]
    assert a.status == RequestStatus.FINISHED_ABORTED and a.output_token_ids == []
    assert a.num_computed_tokens == 0 and "a" not in sched.requests
    assert b.output_token_ids == [8] and sched.running == [b]
    sched.manager.check_integrity()
    assert run_until_idle(sched) == {"b": "length"}
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1


def test_without_chunked_prefill_a_prompt_exactly_filling_the_budget_left_runs():
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False)
    add(sched, "a", [1, 2, 3], max_tokens=4)
    step(sched)
    add(sched, "b", range(10, 17), max_tokens=1)  # 7 tokens: the budget after a's decode
    out, _ = step(sched)
    assert out.request_ids == ["a", "b"] and out.num_scheduled_tokens.tolist() == [1, 7]


def test_a_step_that_preempts_admits_no_waiting_request():
    # 5 usable blocks. In the third step c's prompt chunk needs a third block while a and
    # b hold two, so c is preempted. Budget and its freed blocks would let it be admitted
    # again in that very step (from scratch, prefix caching off), as vLLM never does: a
    # step that preempts admits nothing, and c waits for the next one.
    sched = make_scheduler(
        num_blocks=6, max_num_batched_tokens=8, max_num_seqs=3, max_model_len=32,
        enable_prefix_caching=False,
    )  # fmt: skip
    add(sched, "a", [1, 2], max_tokens=8)
    add(sched, "b", [3, 4, 5, 6, 7], max_tokens=9)
    c = add(sched, "c", range(10, 19), max_tokens=12)
    scheduled = []
    for _ in range(3):
        out, _ = step(sched)
        scheduled.append(dict(zip(out.request_ids, out.num_scheduled_tokens.tolist(), strict=True)))
    assert scheduled == [{"a": 2, "b": 5, "c": 1}, {"a": 1, "b": 1, "c": 6}, {"a": 1, "b": 1}]
    assert out.preempted_request_ids == ("c",) and c.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["c"] and c.num_computed_tokens == 0
    assert "c" not in sched.manager.request_ids
    assert run_until_idle(sched) == {"a": "length", "b": "length", "c": "length"}


def test_a_recompute_in_one_token_chunks_counts_as_prefill():
    # With a budget of 2 tokens a preempted request recomputes its context one token at a
    # time; those chunks used to count as decodes (prompt 28 and decode 42 here, for 33
    # and 37). A decode computes only the request's last sampled token.
    sched = make_scheduler(
        num_blocks=9, max_num_batched_tokens=2, max_num_seqs=2, max_model_len=32,
        enable_prefix_caching=False,
    )  # fmt: skip
    add(sched, "a", range(1, 9), max_tokens=20)
    add(sched, "b", range(11, 19), max_tokens=20)
    prompt = decode = recompute_singles = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        chunks = zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens, strict=True)
        for r, n, done in chunks:
            if n == 1 and r.num_output_tokens and done + 1 == r.num_tokens:
                decode += 1
            else:
                prompt += int(n)
                recompute_singles += n == 1 and r.num_output_tokens > 0
        sched.update_from_output(out, [token_of(r) for r in out.requests])
    stats = sched.stats
    assert stats.num_preemptions >= 1 and recompute_singles >= 1  # the case is exercised
    assert (stats.num_prompt_tokens_computed, stats.num_decode_tokens_computed) == (prompt, decode)


def test_a_step_that_preempts_still_caches_the_block_a_decode_exactly_fills():
    # 3 usable blocks: a (7 tokens) holds 2, b (4 tokens) holds 1. Next step a's token
    # fills a's second block and b needs a new block, so the batch allocation fails and
    # the requests are allocated one by one (b preempts itself). a needs no block, but
    # its filled block must still enter the prefix cache in that step.
    sched = make_scheduler(num_blocks=4)
    a = add(sched, "a", range(1, 8), max_tokens=5)
    add(sched, "b", [20, 21, 22, 23], max_tokens=5)
    step(sched)
    m = sched.manager
    assert m.block_ids("a") == [1, 2] and m.block_ids("b") == [3]
    out, _ = step(sched)
    assert out.request_ids == ["a"] and out.preempted_request_ids == ("b",)
    probe = Request("probe", [*a.all_token_ids[:8], 99])
    assert m.get_computed_blocks(probe, count=False) == ([1, 2], 8)


def test_a_request_with_a_cache_hit_that_waits_for_budget_is_left_as_it_was():
    # Without chunked prefill, c (a hit of 2 blocks, 6 tokens left) does not fit the 4
    # tokens b leaves: it must wait with nothing computed, or the next step would take
    # it for a landed load that holds blocks.
    sched = make_scheduler(
        max_num_batched_tokens=16, max_model_len=17, enable_chunked_prefill=False
    )
    a = add(sched, "a", range(1, 10), max_tokens=1)
    assert run_until_idle(sched) == {"a": "length"}
    add(sched, "b", range(50, 62), max_tokens=2)
    c = add(sched, "c", [*a.prompt_token_ids[:8], *range(70, 76)], max_tokens=2)
    out, _ = step(sched)
    assert out.request_ids == ["b"]
    assert c.status is RequestStatus.WAITING and c.num_computed_tokens == 0
    assert "c" not in sched.manager.request_ids
    out, _ = step(sched)
    assert out.request_ids == ["b", "c"] and out.num_computed_tokens.tolist() == [12, 8]
    assert run_until_idle(sched) == {"c": "length"}  # b finished with that step


def test_admission_stops_once_the_token_budget_is_spent():
    sched = make_scheduler(max_num_batched_tokens=8)
    add(sched, "a", range(1, 9))
    add(sched, "b", range(20, 24))
    sched.schedule()
    assert [r.request_id for r in sched.running] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_a_request_that_is_not_new_is_refused():
    sched = make_scheduler()
    computed = Request("computed", [1, 2, 3])
    computed.num_computed_tokens = 1
    running = Request("running", [1, 2, 3])
    running.status = RequestStatus.RUNNING
    answered = Request("answered", [1, 2, 3], SamplingParams(max_tokens=2))
    answered.append_output_token_ids([5, 6])  # was served to max_tokens=2, then a third
    for request in (computed, running, answered):
        with pytest.raises(ValueError, match="must be new"):
            sched.add_request(request)
    assert not sched.waiting


def test_an_id_holding_blocks_in_the_manager_is_refused():
    # It was queued, and then every schedule() raised on its admission: the scheduler
    # stuck for good, and every request behind it too.
    sched = make_scheduler()
    held = Request("x", [1, 2, 3, 4, 5])
    assert sched.manager.allocate_slots(held, 5) is not None
    for request in (held, Request("x", [1, 2, 3, 4, 5])):
        with pytest.raises(ValueError, match="'x' holds a row in the manager"):
            sched.add_request(request)
    add(sched, "y", [1, 2, 3])
    out, _ = step(sched)
    assert out.request_ids == ["y"] and not sched.waiting


@pytest.mark.parametrize("params", [{"stop": "ab"}, {"stream_text": True}])
def test_a_request_reading_its_output_text_is_refused_without_a_tokenizer(params):
    """Stop strings and streamed text both read the output text: with no detokenizer
    either one is refused before the request queues."""
    sched = make_scheduler()
    with pytest.raises(ValueError, match="needs a tokenizer"):
        add(sched, "a", [1, 2, 3], **params)
    assert not sched.waiting and not sched.requests


def test_a_request_reached_with_one_token_of_budget_left_is_scheduled_or_preempted():
    # Three decodes share a budget of three tokens. Once each next token needs a fresh
    # block and two are free, the pass one by one gives a and b theirs and reaches c
    # with one token of budget left: c, which cannot get a block, is preempted.
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=3, max_num_seqs=3)
    for rid, token in zip("abc", (1, 2, 3), strict=True):
        add(sched, rid, [token], max_tokens=8)
    for _ in range(5):
        out, _ = step(sched)
        if out.preempted_request_ids:
            break
    assert out.request_ids == ["a", "b"] and out.preempted_request_ids == ("c",)
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert run_until_idle(sched) == {"a": "length", "b": "length", "c": "length"}
