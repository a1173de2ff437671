"""A Ctrl-C at any line of Scheduler.update_from_output: each request is applied whole or
not at all, and the run goes on to the tokens of an uninterrupted one. In the tokenizer
(user code) it still stops the update at once; in the connector's on_finish, which may
have started a save, it waits for the update."""

from __future__ import annotations

import signal

import pytest

from jaxkv import RequestStatus
from jaxkv.detokenizer import Detokenizer
from jaxkv.kv_transfer import KVConnector
from jaxkv.models import ByteTokenizer
from tests.host._line_interrupts import LineInterrupts, raised_at_once
from tests.host._sched_util import add, make_scheduler, token_of

# The update's own code. None of its lines lets a Ctrl-C through: the detokenizer marks
# the tokenizer's calls itself (tests/host/test_detokenizer_interrupts), and the
# connector's on_finish, which may have started a save, is held too.
FILES = {"scheduler.py", "scheduler_update.py", "scheduler_transfers.py"}


def _requests(sched):
    """Its updates' third step applies prefill chunks, a decode that streams its text and
    one that finishes (length); its fifth, decodes that finish by length, stop token and
    stop string, with the decode carry."""
    return [
        add(sched, "a", range(1, 10), max_tokens=3, stream_text=True),  # reads its tokens
        add(sched, "b", range(20, 25), max_tokens=4),  # its finished text only
        add(sched, "c", range(30, 44), max_tokens=4, stop_token_ids=[146]),  # chunked
        add(sched, "d", range(50, 53), max_tokens=5, stop="\ufffd"),
        add(sched, "e", range(60, 66), max_tokens=3),
    ]


TRIED_STEPS = (2, 4)


def _assert_consistent(sched, requests, out, before):
    """Each request of `out` applied whole or not at all; queues, blocks and counters
    agree."""
    for r, n in zip(out.requests, out.num_scheduled_tokens.tolist(), strict=True):
        computed, num_tokens = before[r.request_id]
        assert r.num_tokens == r.num_prompt_tokens + len(r.output_token_ids), r
        if r.num_computed_tokens == computed:  # not advanced: runs the same tokens again
            assert r.num_tokens == num_tokens, r
            assert r.status is RequestStatus.RUNNING or r in sched.waiting, r  # (discarded)
        else:
            assert r.num_computed_tokens == computed + n, r
            assert r.num_tokens == num_tokens + (computed + n == num_tokens), r
    running = {r.request_id for r in sched.running}
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING and r.num_computed_tokens < r.num_tokens, r
        assert len(r.output_token_ids) < r.sampling_params.max_tokens, r
    for r in requests:
        assert r.is_finished() == (r.request_id not in sched.requests), r
        assert not r.is_finished() or r.request_id not in running, r
    assert set(sched.requests) == running | {r.request_id for r in sched.waiting}
    assert set(sched.manager.request_ids) == running
    carry = sched._decode_carry
    if carry is not None:
        assert carry.num_computed == [r.num_computed_tokens for r in sched.running]
        assert carry.token_ids == [r.all_token_ids[-1] for r in sched.running]
    sched.manager.check_integrity()
    generated = sum(len(r.output_token_ids) for r in requests)
    assert sched.stats.num_generated_tokens == generated


def _run(at):
    """Runs the requests to the end, a SIGINT at the `at`-th line of the code of the
    updates of TRIED_STEPS."""
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=12)
    sched.detokenizer = Detokenizer(ByteTokenizer())
    requests = _requests(sched)
    lines, interrupt, untaken, scheduled = LineInterrupts(at, FILES), None, False, 0
    for step in range(99):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        before = {r.request_id: (r.num_computed_tokens, r.num_tokens) for r in out.requests}
        scheduled += out.total_num_scheduled_tokens
        tokens = [token_of(r) for r in out.requests]
        try:
            if step in TRIED_STEPS:
                with lines:
                    sched.update_from_output(out, tokens)
            else:
                sched.update_from_output(out, tokens)
        except KeyboardInterrupt as e:
            assert interrupt is None and lines.fired
            interrupt, untaken = e, sched.discard_unapplied()
            if untaken:  # the update did not take the batch: its tokens count when run again
                scheduled -= out.total_num_scheduled_tokens
            _assert_consistent(sched, requests, out, before)
    _assert_consistent(sched, requests, out, before)
    stats = sched.stats
    assert stats.num_prompt_tokens_computed + stats.num_decode_tokens_computed == scheduled
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1
    outputs = [(list(r.output_token_ids), r.status) for r in requests]
    return lines.fired, interrupt, untaken, outputs


def test_a_ctrl_c_at_any_line_of_the_update_leaves_every_request_whole():
    # A Ctrl-C between a request's computed tokens and its token's append left it with
    # nothing to compute (the next step scheduled 0 tokens), between the two appends
    # with output and all tokens apart, after its last token but before its status as
    # running past its end, and after _finish took requests out of `running` but
    # before their release with their blocks held and their ids in use for good.
    *_, expected = _run(None)
    assert {status for _, status in expected} == {
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_STOPPED,
    }
    at = 0
    while True:
        at += 1
        fired, interrupt, untaken, got = _run(at)
        if fired is None:
            break
        assert interrupt is not None, fired
        # Raised at once before the update takes the batch (for discard_unapplied);
        # anywhere else once the update is done.
        assert raised_at_once(interrupt) == untaken, fired
        assert got == expected, fired
    assert at > 400  # every line of those updates was tried


def test_a_ctrl_c_in_the_tokenizer_stops_it_at_once():
    class _Signalling(ByteTokenizer):
        after = None

        def decode(self, ids):
            if self.after is not None:
                self.after = None
                signal.raise_signal(signal.SIGINT)
                self.after = "ran on"  # a held Ctrl-C let the tokenizer finish
            return super().decode(ids)

    sched = make_scheduler(block_size=4)
    tokenizer = _Signalling()
    sched.detokenizer = Detokenizer(tokenizer)
    a = add(sched, "a", range(1, 10), max_tokens=3, stream_text=True)
    tokenizer.after = 0
    out = sched.schedule()
    with pytest.raises(KeyboardInterrupt):
        sched.update_from_output(out, [7])
    assert tokenizer.after is None
    assert a.output_token_ids == [7] and a.num_computed_tokens == 9 and sched.running == [a]


def test_a_ctrl_c_in_the_connectors_on_finish_waits_for_the_update():
    # Let through, it freed the blocks of a save on_finish had started (the save then
    # read them after another request was given them) and the requests after it
    # finished without calling on_finish.
    class _Signalling(KVConnector):
        calls = 0

        def on_finish(self, request, block_ids):
            self.calls += 1
            if self.calls == 1:
                signal.raise_signal(signal.SIGINT)
            return True  # a save started: the blocks stay held until it is reported

    connector = _Signalling()
    sched = make_scheduler(block_size=4, connector=connector)
    a = add(sched, "a", range(1, 10), max_tokens=1)
    b = add(sched, "b", range(11, 20), max_tokens=1)
    out = sched.schedule()
    with pytest.raises(KeyboardInterrupt):
        sched.update_from_output(out, [7, 8])
    assert connector.calls == 2
    assert a.status == b.status == RequestStatus.FINISHED_TRANSFERRING  # held for the saves
    assert sorted(sched.transferring) == ["a", "b"] and not sched.running
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1 - 6
    sched.manager.check_integrity()
