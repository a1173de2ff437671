"""A request owed prompt logprobs reads no cached KV (Request.skips_prefix_cache_reads),
from the prefix cache or a connector, and its own blocks are still cached; the rows of
a batch's flat token array that PromptLogprobs lists for the step program."""

from __future__ import annotations

import numpy as np

from jaxkv import KVCacheManager, Request, RequestOutput, SamplingParams
from jaxkv.prompt_logprobs import PromptLogprobs
from jaxkv.request import RequestStatus
from tests.host._sched_util import FakeCopier, OracleLoadConnector, add, make_scheduler, step

BS = 4
PROMPT = list(range(1, 14))  # 3 full blocks of 4 + 1 token


def _cached_manager() -> KVCacheManager:
    manager = KVCacheManager(32, BS, max_model_len=64)
    first = Request("first", PROMPT)
    manager.allocate_slots(first, len(PROMPT))
    manager.free(first)  # its 3 full blocks stay cached
    manager.reset_prefix_cache_stats()
    return manager


def test_the_manager_finds_no_hit_and_counts_no_lookup_until_the_first_output():
    manager = _cached_manager()
    owed = Request("owed", PROMPT, SamplingParams(prompt_logprobs=2))
    assert owed.skips_prefix_cache_reads
    assert manager.get_computed_blocks(owed) == ([], 0)
    assert manager.prefix_cache_stats.requests == 0
    plain = Request("plain", PROMPT, SamplingParams(prompt_logprobs=None))
    ids, hit = manager.get_computed_blocks(plain)
    assert hit == 12 and len(ids) == 3
    # With its first output the prompt logprobs are done: a recompute may read the cache.
    owed.append_output_token_ids(7)
    assert not owed.skips_prefix_cache_reads
    assert manager.get_computed_blocks(owed)[1] == 12


def test_its_blocks_are_cached_for_the_next_request():
    sched = make_scheduler(block_size=BS)
    add(sched, "owed", PROMPT, max_tokens=1, prompt_logprobs=0)
    out, _ = step(sched)
    assert out.num_computed_tokens.tolist() == [0]
    add(sched, "next", PROMPT[:12] + [99], max_tokens=1)
    out, _ = step(sched)
    assert out.num_computed_tokens.tolist() == [12]


def test_the_scheduler_computes_the_whole_prompt_and_asks_no_connector():
    copier = FakeCopier(32, BS)
    connector = OracleLoadConnector(copier, {"owed": 8, "plain": BS})
    sched = make_scheduler(block_size=BS, connector=connector)
    add(sched, "first", PROMPT, max_tokens=1)
    while sched.has_unfinished_requests():
        step(sched, copier)
    add(sched, "owed", PROMPT, max_tokens=1, prompt_logprobs=1)
    out, _ = step(sched, copier)  # the step checks the KV attention reads
    assert out.num_computed_tokens.tolist() == [0]
    assert out.num_scheduled_tokens.tolist() == [len(PROMPT)]
    assert connector.started == []
    add(sched, "plain", PROMPT + [5, 6, 7, 8, 9], max_tokens=1)
    step(sched, copier)
    assert connector.started == ["plain"]  # the same connector serves the others


def test_a_request_owed_prompt_logprobs_waits_for_no_load_of_its_blocks():
    # It came with its block hashes computed, and a load in flight for another request
    # brings its first block: reading no cached KV, it runs at once instead of waiting.
    copier = FakeCopier(32, BS)
    connector = OracleLoadConnector(copier, {"loader": 8})
    connector.hold = True
    sched = make_scheduler(block_size=BS, connector=connector)
    add(sched, "loader", PROMPT, max_tokens=1)
    owed = Request("owed", PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))
    owed.update_block_hashes(BS)
    sched.add_request(owed)
    out, _ = step(sched, copier)
    assert connector.started == ["loader"] and out.request_ids == ["owed"]


def _segments(tracker, requests, computed, scheduled, order):
    query_lens = np.asarray(scheduled)[order] if order is not None else np.asarray(scheduled)
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    return tracker.rows(requests, np.asarray(computed), np.asarray(scheduled), order, cu, 64)


def test_rows_follow_the_batch_order_and_stop_before_the_last_prompt_token():
    tracker = PromptLogprobs(5)
    a = Request("a", [10, 11, 12, 13, 14, 15], SamplingParams(prompt_logprobs=2))
    b = Request("b", [20, 21, 22])
    c = Request("c", [30, 31, 32, 33], SamplingParams(prompt_logprobs=0))
    for request in (a, c):
        request.status = RequestStatus.RUNNING
        tracker.add(request)
    # Schedule order a, b, c; the batch runs c, a, b. a computes positions 2..5 (its last
    # prompt token's logits are the sampler's), c its first chunk, positions 0..1.
    order = np.array([2, 0, 1])
    rows, segments, completing = _segments(tracker, [a, b, c], [2, 0, 0], [4, 3, 2], order)
    # batch rows: c at 0..1, a at 2..5, b at 6..8
    assert segments == [("a", 2, 5, 0), ("c", 0, 2, 3)]
    assert completing == {"a"}  # its prompt is computed this step: its first output
    assert rows.indices[:5].tolist() == [2, 3, 4, 0, 1]
    assert rows.targets[:5].tolist() == [13, 14, 15, 31, 32]
    assert rows.indices.shape == (64,) and not rows.indices[5:].any()


def test_no_rows_when_nobody_in_the_batch_is_owed_any():
    tracker = PromptLogprobs(5)
    a = Request("a", [1, 2, 3])
    b = Request("b", [4], SamplingParams(prompt_logprobs=3))
    assert _segments(tracker, [a], [0], [3], None) is None  # nobody asked
    tracker.add(b)
    assert _segments(tracker, [a, b], [0, 0], [3, 1], None) is None  # b is not running yet
    b.status = RequestStatus.RUNNING
    assert _segments(tracker, [a], [0], [3], None) is None  # b runs, but not in this batch
    step = _segments(tracker, [a, b], [0, 0], [3, 1], None)
    assert step.rows is None and step.segments == [] and step.completing == {"b"}
    tracker.add(Request("b", [4]))  # queued again without asking
    assert _segments(tracker, [a, b], [0, 0], [3, 1], None) is None


def test_rows_are_padded_to_at_most_the_batchs_token_count():
    """Below the first row bucket (64) the rows stop at the batch's padded token count."""
    tracker = PromptLogprobs(5)
    a = Request("a", list(range(1, 11)), SamplingParams(prompt_logprobs=1))
    a.status = RequestStatus.RUNNING
    tracker.add(a)
    cu = np.array([0, 10, 10], np.int32)
    rows = tracker.rows([a], np.array([0]), np.array([10]), None, cu, 16).rows
    assert rows.indices.shape == rows.targets.shape == (16,)
    assert rows.indices[:9].tolist() == list(range(9)) and not rows.indices[9:].any()


def test_attach_skips_a_completed_request_discarded_meanwhile():
    """A request aborted after its step was listed gets no prompt logprobs, and no error."""
    tracker = PromptLogprobs(5)
    a = Request("a", [10, 11, 12], SamplingParams(prompt_logprobs=1))
    a.status = RequestStatus.RUNNING
    tracker.add(a)
    prompt_step = _segments(tracker, [a], [0], [3], None)
    assert prompt_step.completing == {"a"}
    tracker.discard("a")
    output = RequestOutput("a", (7,), False, None)
    assert tracker.attach([output], prompt_step) == [output] and len(tracker) == 0


def _step_arrays(logprob: float) -> tuple:
    """top_logprobs' five arrays for 64 rows: each row's top tokens 0 and 1."""
    top_ids = np.tile(np.int32([0, 1]), (64, 1))
    top = np.full((64, 2), logprob, np.float32)
    ranks = np.tile(np.int32([1, 2]), (64, 1))
    return top_ids, top, ranks, np.full(64, logprob, np.float32), np.full(64, 3, np.int32)


def test_registering_an_id_again_starts_its_prompt_logprobs_afresh():
    """A new request under an id whose earlier request had rows recorded gets the entries
    of its own prompt, none of the earlier one's."""
    tracker = PromptLogprobs(5)
    old = Request("a", [10, 11, 12], SamplingParams(prompt_logprobs=1))
    old.status = RequestStatus.RUNNING
    tracker.add(old)
    tracker.record(_segments(tracker, [old], [0], [1], None), _step_arrays(-1.0))
    new = Request("a", [20, 21, 22], SamplingParams(prompt_logprobs=1))
    new.status = RequestStatus.RUNNING
    tracker.add(new)
    prompt_step = _segments(tracker, [new], [0], [3], None)
    tracker.record(prompt_step, _step_arrays(-2.0))
    (output,) = tracker.attach([RequestOutput("a", (7,), False, None)], prompt_step)
    entries = output.prompt_logprobs
    assert [list(e) for e in entries[1:]] == [[21, 0], [22, 0]]
    assert entries.token_logprobs().tolist() == [-2.0, -2.0]
