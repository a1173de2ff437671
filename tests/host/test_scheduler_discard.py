"""Scheduler.discard: a step that failed before its KV was written is handed back.

schedule() enters the blocks a step's tokens will fill into the prefix cache when it
allocates them. If that step never runs, those blocks hold no KV; a request that later
hits them would read garbage. discard() takes them out again and un-admits what the
failed schedule() admitted (such a request may hold one of them as a cache hit).
"""

from __future__ import annotations

import pytest

from jaxkv import Request, RequestStatus, SamplingParams
from jaxkv.kv_transfer import KVConnector
from tests.host._sched_util import FakeCopier, add, make_scheduler, step


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
