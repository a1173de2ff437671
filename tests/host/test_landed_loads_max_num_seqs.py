"""Requests whose KV loads landed are admitted first, but never past max_num_seqs."""

from __future__ import annotations

from jaxkv import RequestStatus
from tests.host._sched_util import FakeCopier, OracleLoadConnector, add, make_scheduler, step

BS = 4


def test_landed_loads_admitted_together_stop_at_max_num_seqs():
    """Two loads land in one step with one seat left: the first to land runs, the other
    keeps its blocks and waits for the next free seat."""
    copier = FakeCopier(64, BS)
    connector = OracleLoadConnector(copier, {"l1": 4, "l2": 4})
    sched = make_scheduler(max_num_seqs=2, connector=connector)
    add(sched, "d", [100], max_tokens=5)
    l1 = add(sched, "l1", range(1, 8), max_tokens=1)
    l2 = add(sched, "l2", range(20, 27), max_tokens=1)
    out, _ = step(sched, copier)  # d runs, both loads start
    assert out.request_ids == ["d"] and connector.started == ["l1", "l2"]
    out, _ = step(sched, copier)  # both land; one seat is left
    assert out.request_ids == ["d", "l1"]
    assert l2 in sched.waiting and sched.manager.holds_row("l2")
    assert l1 not in sched.waiting and l2.status != RequestStatus.RUNNING
