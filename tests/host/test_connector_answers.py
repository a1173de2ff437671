"""What the Scheduler does with a connector's answers that break the hooks' contract:
on_admission's claim is an int (a numpy one too), any other answer refused with the
queue and the blocks unchanged; on_finish's answer is a bool (a numpy one too), any
other read by its truth with a logged warning naming it (a truthy one may have started
a save that reads the blocks: they stay held until poll() reports it)."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from jaxkv import RequestStatus
from jaxkv.kv_transfer import KVConnector, TransferEvents
from tests.host._sched_util import add, make_scheduler, run_until_idle, step


class _Answering(KVConnector):
    """Claims `claims[request_id]` (0 for others) and answers on_finish `finish_answer`;
    records the loads it is asked to start."""

    def __init__(self, claims=None, finish_answer=False) -> None:
        self.claims, self.finish_answer, self.loads = claims or {}, finish_answer, []

    def on_admission(self, request, num_computed_tokens):
        return self.claims.get(request.request_id, 0)

    def start_load(self, request, block_ids):
        self.loads.append(request.request_id)

    def on_finish(self, request, block_ids):
        return self.finish_answer


@pytest.mark.parametrize(
    "answer",
    [None, False, 0.0, np.float64(0), np.False_],
    ids=["None", "False", "float", "numpy_float", "numpy_False"],
)
def test_a_no_claim_that_is_no_int_is_refused_with_the_queue_and_blocks_unchanged(answer):
    # None (an on_admission that forgot its return) once passed as no claim, silently.
    sched = make_scheduler(num_blocks=16, block_size=4, connector=_Answering({"a": answer}))
    r = add(sched, "r", range(50, 56), max_tokens=2)  # admitted first in the same schedule()
    a = add(sched, "a", range(1, 13), max_tokens=2)
    returned = re.escape(f"on_admission('a', 0) returned {answer!r}:")
    with pytest.raises(ValueError, match=returned + r".*\(an int, 0 for none\)"):
        sched.schedule()
    assert list(sched.waiting) == [r, a] and not sched.running
    assert r.status == a.status == RequestStatus.WAITING
    assert sched.manager.num_free_blocks == 15 and not sched._transfers.landed()
    sched.manager.check_integrity()


@pytest.mark.parametrize("answer", [True, np.True_])
def test_a_claim_of_true_is_refused_where_one_token_is_a_whole_block(answer):
    # Under block_size 1, True passed as a claim of one token, and its load started.
    connector = _Answering({"a": answer})
    sched = make_scheduler(num_blocks=32, block_size=1, max_num_batched_tokens=16,
                           connector=connector)  # fmt: skip
    a = add(sched, "a", range(1, 9), max_tokens=2)
    with pytest.raises(ValueError, match=re.escape(f"on_admission('a', 0) returned {answer!r}:")):
        sched.schedule()
    assert connector.loads == [] and a.status == RequestStatus.WAITING
    assert "a" not in sched.manager.request_ids and sched.manager.num_free_blocks == 31
    sched.manager.check_integrity()


def test_a_numpy_zero_claims_nothing_and_the_request_computes_its_prompt():
    sched = make_scheduler(num_blocks=16, block_size=4, connector=_Answering({"a": np.int64(0)}))
    add(sched, "a", range(1, 13), max_tokens=2)
    out, _ = step(sched)
    assert out.request_ids == ["a"] and out.num_scheduled_tokens.tolist() == [12]
    assert run_until_idle(sched) == {"a": "length"}


@pytest.mark.parametrize("answer", [None, 0, ""])
def test_a_falsy_on_finish_answer_that_is_no_bool_frees_the_blocks_with_a_warning(answer, caplog):
    # None freed them with no word: a connector that forgot its return never saved.
    sched = make_scheduler(num_blocks=16, block_size=4, connector=_Answering(finish_answer=answer))
    a = add(sched, "a", range(1, 6), max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="jaxkv.scheduler_transfers"):
        _, outputs = step(sched)
    assert f"on_finish('a') returned {answer!r}, not a bool; read as False" in caplog.text
    assert [(o.request_id, o.finished) for o in outputs] == [("a", True)]
    assert a.status == RequestStatus.FINISHED_LENGTH and not sched.has_pending_transfers()
    assert sched.requests == {} and sched.manager.num_free_blocks == 15


@pytest.mark.parametrize("answer", [1, "yes"])
def test_a_truthy_on_finish_answer_that_is_no_bool_holds_the_blocks_until_the_save_lands(
    answer, caplog
):
    # Freeing them could let a save that had started read another request's KV.
    connector = _Answering(finish_answer=answer)
    sched = make_scheduler(num_blocks=16, block_size=4, connector=connector)
    a = add(sched, "a", range(1, 6), max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="jaxkv.scheduler_transfers"):
        step(sched)
    assert f"on_finish('a') returned {answer!r}, not a bool; read as True" in caplog.text
    assert sched.transferring == {"a": a} and sched.manager.num_free_blocks == 13
    connector.poll = lambda: TransferEvents(saved=("a",))
    sched.schedule()
    assert a.status == RequestStatus.FINISHED_LENGTH and sched.requests == {}
    assert sched.manager.num_free_blocks == 15
    sched.manager.check_integrity()


def test_a_numpy_true_from_on_finish_holds_the_blocks_for_the_save():
    sched = make_scheduler(
        num_blocks=16, block_size=4, connector=_Answering(finish_answer=np.True_)
    )
    a = add(sched, "a", range(1, 6), max_tokens=1)
    step(sched)
    assert sched.transferring == {"a": a} and a.status == RequestStatus.FINISHED_TRANSFERRING
    assert sched.manager.num_free_blocks == 13
