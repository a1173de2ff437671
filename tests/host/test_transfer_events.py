"""A connector's poll() report is checked entry by entry: an entry naming no copy in
flight, or one already ended, is ignored and named in a ValueError after the others
are applied (each ended a real copy); a report that is no TransferEvents changes
nothing, nor does a poll() that raises. Either way every copy still in flight lands on
a later report and nothing leaks."""

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


# (report, what the error says, the requests whose copies it ends all the same)
BAD_REPORTS = {
    "unknown_load": (TransferEvents(loaded=("zzz",)), r"loaded 'zzz', but no load", ""),
    "a_load_reported_as_a_save": (TransferEvents(saved=("b",)), r"saved 'b', but no save", ""),
    "a_save_reported_as_a_load": (
        TransferEvents(failed_loads=("a",)),
        r"failed_loads 'a', but no load",
        "",
    ),
    "save_twice": (
        TransferEvents(saved=("a",), failed_saves=("a",)),
        r"failed_saves 'a', but its save ended already",
        "a",
    ),
    "load_twice": (
        TransferEvents(loaded=("b", "b")),
        r"loaded 'b', but its load ended already",
        "b",
    ),
    "good_and_bad": (
        TransferEvents(saved=("a", "zzz"), loaded=("yyy", "b")),
        r"saved 'zzz', but no save of it.*; loaded 'yyy', but no load of it",
        "ab",
    ),
    "ids_as_one_str": (
        TransferEvents(saved=("a",), loaded="b"),
        r"loaded='b', not a tuple",
        "a",
    ),
    "unhashable_id": (TransferEvents(loaded=(["b"],)), r"loaded \['b'\], but no load", ""),
}


def _ended_as_reported(sched, a, b, ended: str) -> None:
    """The copies of the requests in `ended` ended (a: its save, b: its load); the
    others are still in flight with their blocks held."""
    sched.manager.check_integrity()
    if "a" in ended:
        assert a.status == RequestStatus.FINISHED_LENGTH and "a" not in sched.transferring
        assert "a" not in sched.manager.request_ids
    else:
        assert sched.transferring["a"] is a and a.status == RequestStatus.FINISHED_TRANSFERRING
        assert len(sched.manager.block_ids("a")) == 2
    if "b" in ended:
        assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 8
    else:
        assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV and b.num_computed_tokens == 0
    assert len(sched.manager.block_ids("b")) == 4


@pytest.mark.parametrize("report", list(BAD_REPORTS.values()), ids=list(BAD_REPORTS))
def test_a_reports_bad_entries_are_named_and_ignored_and_the_rest_applied(report):
    events, message, ended = report
    sched, connector, a, b = _saving_and_loading()
    connector.report = events
    with pytest.raises(ValueError, match=r"_ScriptedConnector\.poll\(\) reported .*" + message):
        sched.schedule()
    _ended_as_reported(sched, a, b, ended)
    # The copies still in flight land on a later report; then everything is freed.
    connector.report = TransferEvents(
        saved=() if "a" in ended else ("a",), loaded=() if "b" in ended else ("b",)
    )
    connector.in_flight.clear()
    out, _ = step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH and out.request_ids == ["b"]
    assert out.num_scheduled_tokens.tolist() == [6]  # 8 of its 14 tokens were loaded
    run_until_idle(sched)
    assert sched.manager.num_free_blocks == 31


@pytest.mark.parametrize("report", [{"saved": ("a",)}, None], ids=["dict", "none"])
def test_a_report_that_is_no_transfer_events_is_refused_with_nothing_applied(report):
    # None too: a poll() that forgot its return would otherwise hold every copy for good.
    sched, connector, a, b = _saving_and_loading()
    connector.poll = lambda: report
    with pytest.raises(ValueError, match=r"poll\(\) returned .*; expected a TransferEvents"):
        sched.schedule()
    _ended_as_reported(sched, a, b, "")


def test_a_load_aborted_in_flight_reported_as_a_save_is_ignored_and_still_held():
    sched, connector, a, b = _saving_and_loading()
    assert sched.abort("b") and sched.transferring == {"a": a, "b": b}
    held = sched.manager.block_ids("b")
    connector.report = TransferEvents(saved=("b",))
    with pytest.raises(ValueError, match=r"reported saved 'b', but no save"):
        sched.schedule()  # "b" has no save: its load's blocks stay held for the copy
    assert sched.transferring == {"a": a, "b": b} and sched.manager.block_ids("b") == held
    connector.report = TransferEvents(saved=("a",), failed_loads=("b",))
    connector.in_flight.clear()
    out, _ = step(sched)
    assert set(out.finished_request_ids) >= {"b"} and not sched.transferring
    assert b.status == RequestStatus.FINISHED_ABORTED and sched.manager.num_free_blocks == 31


def test_a_report_that_lists_its_request_ids_in_lists_is_applied():
    sched, connector, a, b = _saving_and_loading()
    connector.report = TransferEvents(saved=["a"], loaded=["b"])
    connector.in_flight.clear()
    out, _ = step(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH and not sched.transferring
    assert out.request_ids == ["b"] and out.num_scheduled_tokens.tolist() == [6]


def test_a_poll_that_raises_propagates_with_nothing_changed_and_a_later_report_lands():
    sched, connector, a, b = _saving_and_loading()
    report = connector.poll

    def broken():
        raise OSError("poll failed")

    connector.poll = broken
    with pytest.raises(OSError, match="poll failed"):
        sched.schedule()
    _ended_as_reported(sched, a, b, "")
    connector.poll = report  # it kept the copies it saw end, as poll()'s contract asks
    connector.report = TransferEvents(saved=("a",), loaded=("b",))
    connector.in_flight.clear()
    run_until_idle(sched)
    assert a.status == RequestStatus.FINISHED_LENGTH and sched.manager.num_free_blocks == 31
