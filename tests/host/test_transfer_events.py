"""A connector's poll() events are checked before any is applied: a bad report leaves
every queue, block and transfer as it was, and the good report after it still lands."""

from __future__ import annotations

import pytest

from jaxkv import RequestStatus
from jaxkv.kv_transfer import KVConnector, TransferEvents
from tests.host._sched_util import add, make_scheduler, run_until_idle, step

BS = 4


class _ScriptedConnector(KVConnector):
    """Holds the finished request "a" for a save, claims `claims[id]` tokens at
    admission, and reports from poll() whatever `report` holds (once), nothing by itself."""

    def __init__(self, claims: dict[str, int]) -> None:
        self.claims, self.report, self.in_flight = claims, None, set()

    def on_finish(self, request, block_ids):
        if request.request_id != "a":
            return False
        self.in_flight.add(request.request_id)
        return True

    def on_admission(self, request, num_computed_tokens):
        return self.claims.get(request.request_id, 0)

    def start_load(self, request, block_ids):
        self.in_flight.add(request.request_id)

    def poll(self):
        report, self.report = self.report, None
        return TransferEvents() if report is None else report

    def has_pending(self):
        return bool(self.in_flight)


def _saving_and_loading():
    """A scheduler with "a" finished and held for its save, "b" waiting for its load."""
    connector = _ScriptedConnector({"b": 8})
    sched = make_scheduler(num_blocks=32, block_size=BS, connector=connector)
    a = add(sched, "a", range(1, 7), max_tokens=1)
    step(sched)  # "a" prefills, samples its one token and finishes: held for a save
    b = add(sched, "b", range(20, 34), max_tokens=2)
    step(sched)  # "b" starts its load of 8 tokens
    assert sched.transferring == {"a": a} and b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    return sched, connector, a, b


BAD_REPORTS = {
    "unknown_load": (TransferEvents(loaded=("zzz",)), r"reported loaded 'zzz', but no load"),
    "a_load_reported_as_a_save": (TransferEvents(saved=("b",)), r"reported saved 'b', but no save"),
    "a_save_reported_as_a_load": (
        TransferEvents(failed_loads=("a",)),
        r"reported failed_loads 'a', but no load",
    ),
    "save_twice": (
        TransferEvents(saved=("a",), failed_saves=("a",)),
        r"reported the save of 'a' twice",
    ),
    "load_twice": (TransferEvents(loaded=("b", "b")), r"reported the load of 'b' twice"),
    "good_then_bad": (
        TransferEvents(saved=("a",), loaded=("b", "zzz")),
        r"reported loaded 'zzz', but no load",
    ),
    "not_events": ({"saved": ("a",)}, r"returned \{'saved'.*expected a TransferEvents"),
    "ids_as_one_str": (TransferEvents(loaded="b"), r"returned loaded='b'; expected request ids"),
    "unhashable_id": (TransferEvents(loaded=(["b"],)), r"reported loaded \['b'\], but no load"),
}


@pytest.mark.parametrize("report", list(BAD_REPORTS.values()), ids=list(BAD_REPORTS))
def test_a_bad_report_is_refused_with_nothing_applied(report):
    events, message = report
    sched, connector, a, b = _saving_and_loading()
    held = {rid: sched.manager.block_ids(rid) for rid in "ab"}
    free = sched.manager.num_free_blocks
    connector.report = events
    with pytest.raises(ValueError, match=r"_ScriptedConnector\.poll\(\) " + message):
        sched.schedule()
    sched.manager.check_integrity()
    assert sched.transferring == {"a": a} and a.status == RequestStatus.FINISHED_TRANSFERRING
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV and b.num_computed_tokens == 0
    assert {rid: sched.manager.block_ids(rid) for rid in "ab"} == held
    assert sched.manager.num_free_blocks == free
    # The connector's true report still lands both copies; then everything is freed.
    connector.report = TransferEvents(saved=("a",), loaded=("b",))
    connector.in_flight.clear()
    out, _ = step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH and out.request_ids == ["b"]
    assert out.num_scheduled_tokens.tolist() == [6]  # 8 of its 14 tokens were loaded
    run_until_idle(sched)
    assert sched.manager.num_free_blocks == 31


def test_a_load_aborted_in_flight_reported_as_a_save_is_refused_and_still_held():
    sched, connector, a, b = _saving_and_loading()
    assert sched.abort("b") and sched.transferring == {"a": a, "b": b}
    held = sched.manager.block_ids("b")
    connector.report = TransferEvents(saved=("b",))
    with pytest.raises(ValueError, match=r"reported saved 'b', but no save"):
        sched.schedule()
    assert sched.transferring == {"a": a, "b": b} and sched.manager.block_ids("b") == held
    connector.report = TransferEvents(saved=("a",), failed_loads=("b",))
    connector.in_flight.clear()
    out, _ = step(sched)
    assert set(out.finished_request_ids) >= {"b"} and not sched.transferring
    assert b.status == RequestStatus.FINISHED_ABORTED and sched.manager.num_free_blocks == 31
