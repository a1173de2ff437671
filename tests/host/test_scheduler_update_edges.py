"""update_from_output details the scenario tests left unpinned: each step's outputs in
batch order with the token sampled, any of several stop tokens, and the prefill/decode
counters of a 1-token recompute chunk that leaves exactly one token to compute, no
schedule() while its previous batch is pending, which stop rule (min_tokens, an EOS
under ignore_eos, a stop token's text) decides a finish, and the counters of the
requests a tokenizer interrupt leaves unadvanced or an abort takes out of a step before
its update."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import RequestOutput, RequestStatus
from jaxkv.detokenizer import Detokenizer
from jaxkv.request import MAX_TOKEN_ID
from tests.host._sched_util import add, make_scheduler, token_of


def _run_to_the_end(sched) -> int:
    """Steps `sched` until no request is unfinished; the tokens those steps scheduled."""
    num_tokens = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        num_tokens += out.total_num_scheduled_tokens
        sched.update_from_output(out, [token_of(r) for r in out.requests])
    return num_tokens


def test_outputs_follow_the_batch_order_and_carry_the_sampled_token():
    sched = make_scheduler()
    add(sched, "a", [1, 2, 3], max_tokens=1)
    add(sched, "b", [4, 5], max_tokens=3)
    out = sched.schedule()
    assert out.request_ids == ["a", "b"]
    # A finished request's output stays in its batch place, ahead of a running one's.
    assert sched.update_from_output(out, [7, 8]) == [
        RequestOutput("a", (7,), True, "length"),
        RequestOutput("b", (8,), False, None),
    ]
    out = sched.schedule()
    assert sched.update_from_output(out, [9]) == [RequestOutput("b", (9,), False, None)]


def test_any_of_several_stop_tokens_stops_the_request():
    sched = make_scheduler()
    a = add(sched, "a", [1, 2], max_tokens=5, stop_token_ids=(5, 7))
    b = add(sched, "b", [3, 4], max_tokens=5, stop_token_ids=(5, 7))
    out = sched.schedule()
    assert sched.update_from_output(out, [7, 6]) == [
        RequestOutput("a", (7,), True, "stop", stop_reason=7),
        RequestOutput("b", (6,), False, None),
    ]
    assert a.status == RequestStatus.FINISHED_STOPPED and b.status == RequestStatus.RUNNING


def test_a_one_token_recompute_chunk_before_the_last_token_counts_as_prefill():
    # c (1-token prompt) is preempted after sampling one token, then recomputes its 2
    # tokens in 1-token chunks next to b's chunks: the chunk of position 0 leaves one
    # token to compute, so it is prefill; only the chunk of position 1 is a decode.
    sched = make_scheduler(
        num_blocks=7, max_num_batched_tokens=3, max_num_seqs=3, max_model_len=32,
        enable_prefix_caching=False,
    )  # fmt: skip
    add(sched, "a", range(1, 9), max_tokens=8)
    add(sched, "b", range(11, 19), max_tokens=8)
    c = add(sched, "c", [31], max_tokens=2)
    c_chunks = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if c in out.requests:
            i = out.requests.index(c)
            n, done = out.num_scheduled_tokens[i], out.num_computed_tokens[i]
            c_chunks.append((int(n), int(done), c.num_output_tokens))
        sched.update_from_output(out, [token_of(r) for r in out.requests])
    # (tokens, computed before, outputs): its prompt, then after preemption two chunks
    assert c_chunks == [(1, 0, 0), (1, 0, 1), (1, 1, 1)]
    stats = sched.stats
    assert stats.num_preemptions == 2
    assert (stats.num_prompt_tokens_computed, stats.num_decode_tokens_computed) == (27, 14)


def test_sampled_token_ids_at_either_end_of_the_id_range_are_taken():
    sched = make_scheduler()
    a = add(sched, "a", [1, 2, 3], max_tokens=3)
    b = add(sched, "b", [4, 5], max_tokens=3)
    out = sched.schedule()
    for bad in ([-1, 5], np.array([5, MAX_TOKEN_ID + 1], np.uint64)):
        with pytest.raises(ValueError, match=r"sampled_token_ids: .* must lie in \[0,"):
            sched.update_from_output(out, bad)
    assert a.output_token_ids == b.output_token_ids == []  # nothing applied
    sched.update_from_output(out, [0, MAX_TOKEN_ID])
    assert (a.output_token_ids, b.output_token_ids) == ([0], [MAX_TOKEN_ID])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64])
def test_sampled_tokens_land_in_both_token_lists_as_python_ints(dtype):
    # The update appends to the Request's lists itself, not through its checked append:
    # each token must still reach all_token_ids too, as an int whatever the array held.
    sched = make_scheduler()
    a = add(sched, "a", [1, 2, 3], max_tokens=4)
    b = add(sched, "b", [4, 5], max_tokens=4)
    for step in range(4):
        out = sched.schedule()
        sched.update_from_output(out, np.array([10 + step, 20 + step], dtype))
    for request, prompt, first in ((a, [1, 2, 3], 10), (b, [4, 5], 20)):
        assert request.output_token_ids == list(range(first, first + 4))
        assert list(request.all_token_ids) == prompt + request.output_token_ids
        assert request.num_tokens == len(prompt) + 4
        assert all(type(t) is int for t in request.all_token_ids)
    assert not sched.has_unfinished_requests()


def test_request_output_fields_keep_the_order_the_update_builds_them_in():
    # scheduler_update builds RequestOutputs from positional 9-tuples (request_output_of,
    # for speed): a field added or moved must be added or moved there too.
    assert RequestOutput._fields == (
        "request_id", "new_token_ids", "finished", "finish_reason", "logprobs", "index",
        "prompt_logprobs", "stop_reason", "text",
    )  # fmt: skip


def test_schedule_is_refused_while_the_previous_batch_is_neither_applied_nor_discarded():
    # It used to schedule the same tokens again and replace the pending output.
    sched = make_scheduler()
    a, b = add(sched, "a", range(1, 6), max_tokens=3), add(sched, "b", range(1, 7), max_tokens=3)
    sched.update_from_output(sched.schedule(), [7, 8])
    pending = sched.schedule()

    def state():
        blocks = {r: sched.manager.block_ids(r) for r in ("a", "b")}
        return [(r.num_computed_tokens, list(r.output_token_ids)) for r in (a, b)], blocks

    before = state()
    with pytest.raises(RuntimeError, match="previous output's 2 requests are neither applied"):
        sched.schedule()
    assert state() == before
    sched.discard(pending)
    newer = sched.schedule()
    with pytest.raises(ValueError, match="not the latest schedule"):
        sched.update_from_output(pending, [9, 10])
    sched.update_from_output(newer, [9, 10])
    assert [r.output_token_ids for r in (a, b)] == [[7, 9], [8, 10]]
    sched.update_from_output(sched.schedule(), [11, 12])
    assert not sched.has_unfinished_requests()
    empty = sched.schedule()  # an output of no request needs no update
    assert empty.num_requests == 0 and sched.schedule().num_requests == 0


def test_schedule_is_refused_while_a_previous_batch_of_one_request_is_pending():
    """One unapplied request is enough to refuse schedule(): its token would be
    scheduled a second time. Nothing changes; applying the pending output goes on."""
    sched = make_scheduler()
    a = add(sched, "a", range(1, 6), max_tokens=3)
    sched.update_from_output(sched.schedule(), [7])
    pending = sched.schedule()
    assert pending.num_requests == 1
    before = (a.num_computed_tokens, list(a.output_token_ids), sched.manager.block_ids("a"))
    with pytest.raises(RuntimeError, match="previous output's 1 requests are neither applied"):
        sched.schedule()
    assert (a.num_computed_tokens, list(a.output_token_ids), sched.manager.block_ids("a")) == before
    sched.update_from_output(pending, [8])
    assert a.output_token_ids == [7, 8]


class _Letters:
    """Token i decodes to the letter chr(ord("a") + i); EOS is token 5 ("f")."""

    eos_token_id = 5

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _outputs(sched, tokens) -> list[RequestOutput]:
    """Each step's outputs, every scheduled request sampling that step's token."""
    outputs = []
    for token in tokens:
        if sched.has_unfinished_requests():
            out = sched.schedule()
            outputs += sched.update_from_output(out, [token] * out.num_requests)
    return outputs


def test_a_stop_token_stops_only_once_more_than_min_tokens_are_out():
    # The sampler bans stop tokens before min_tokens; should the min_tokens-th token still
    # be one, it does not stop the request.
    sched = make_scheduler()
    add(sched, "r", [1, 2], max_tokens=9, min_tokens=2, stop_token_ids=(7,))
    assert [o.finished for o in _outputs(sched, [7, 7, 7])] == [False, False, True]


def test_an_eos_listed_as_stop_token_under_ignore_eos_is_reported_by_its_id():
    sched = make_scheduler()
    sched.detokenizer = Detokenizer(_Letters())
    add(sched, "r", [1, 2], max_tokens=9, stop_token_ids=(5,), ignore_eos=True)
    (out,) = _outputs(sched, [5])
    assert (out.finish_reason, out.stop_reason) == ("stop", 5)


def test_a_stop_tokens_text_is_a_stop_string_only_if_the_output_keeps_it():
    sched = make_scheduler()
    sched.detokenizer = Detokenizer(_Letters())
    add(sched, "token", [1, 2], max_tokens=9, stop_token_ids=(7,), stop="h")
    add(sched, "string", [1, 2], max_tokens=9, stop="h")
    outs = _outputs(sched, [7])
    assert [(o.finish_reason, o.stop_reason) for o in outs] == [("stop", 7), ("stop", "h")]


class _Interrupting(_Letters):
    """_Letters whose decode raises KeyboardInterrupt while `armed`."""

    armed = False

    def decode(self, ids) -> str:
        if self.armed:
            raise KeyboardInterrupt
        return super().decode(ids)


def test_tokens_an_interrupted_update_leaves_unadvanced_count_each_time_they_run():
    # a's streamed read is interrupted in the second step, before b's decode and c's
    # first prompt chunk are applied: both were computed and are computed again next
    # step, and the counters count each run (as the steps' tokens do), a decode as one.
    sched = make_scheduler(max_num_batched_tokens=6, max_num_seqs=3)
    tokenizer = _Interrupting()
    sched.detokenizer = Detokenizer(tokenizer)
    a = add(sched, "a", [1, 2], max_tokens=3, stream_text=True)
    b = add(sched, "b", [3, 4], max_tokens=3)
    out = sched.schedule()
    sched.update_from_output(out, [token_of(r) for r in out.requests])
    c = add(sched, "c", range(10, 20), max_tokens=2)
    out = sched.schedule()
    assert out.requests == [a, b, c] and out.num_scheduled_tokens.tolist() == [1, 1, 4]
    tokenizer.armed = True
    with pytest.raises(KeyboardInterrupt):
        sched.update_from_output(out, [token_of(r) for r in out.requests])
    tokenizer.armed = False
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (3, 2, 0)
    stats = sched.stats
    assert (stats.num_prompt_tokens_computed, stats.num_decode_tokens_computed) == (8, 2)
    num_tokens = 4 + 6 + _run_to_the_end(sched)
    stats = sched.stats
    assert stats.num_prompt_tokens_computed == 4 + 2 * 4 + 6
    assert stats.num_prompt_tokens_computed + stats.num_decode_tokens_computed == num_tokens


def test_tokens_of_requests_aborted_before_their_step_is_applied_count_once_run():
    # The step runs the batch as scheduled, aborted requests included, but the update
    # skipped them uncounted: the counters fell short of the tokens the steps computed.
    # A discarded step ran nothing: its aborted requests' tokens do not count.
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    add(sched, "a", [1, 2], max_tokens=5)
    add(sched, "b", [3, 4], max_tokens=5)
    out = sched.schedule()
    sched.update_from_output(out, [token_of(r) for r in out.requests])
    add(sched, "c", range(10, 20), max_tokens=2)
    add(sched, "d", range(30, 40), max_tokens=2)
    out = sched.schedule()
    assert out.request_ids == ["a", "b", "c"] and out.num_scheduled_tokens.tolist() == [1, 1, 6]
    assert sched.abort("a") and sched.abort("c")  # a decode and a prompt chunk
    sched.update_from_output(out, [token_of(r) for r in out.requests])
    stats = sched.stats
    assert (stats.num_prompt_tokens_computed, stats.num_decode_tokens_computed) == (4 + 6, 2)
    out = sched.schedule()
    assert out.request_ids == ["b", "d"]
    assert sched.abort("d")
    sched.discard(out)
    assert sched.stats == stats
    num_tokens = 4 + 8 + _run_to_the_end(sched)
    stats = sched.stats
    assert stats.num_prompt_tokens_computed + stats.num_decode_tokens_computed == num_tokens


def test_a_one_token_prompt_aborted_before_its_update_counts_as_prefill():
    # Its one token with nothing sampled yet is a prompt token, as if it had been applied
    # (a decode needs output; a one-token chunk alone does not make one).
    sched = make_scheduler()
    add(sched, "a", [7], max_tokens=3)
    out = sched.schedule()
    assert out.num_scheduled_tokens.tolist() == [1] and sched.abort("a")
    sched.update_from_output(out, [5])
    stats = sched.stats
    assert (stats.num_prompt_tokens_computed, stats.num_decode_tokens_computed) == (1, 0)
