"""TransferTracker paths the connector tests leave out, driven through the Scheduler."""

from __future__ import annotations

from jaxkv import RequestStatus
from jaxkv.kv_transfer import HostOffloadConnector
from tests.host._sched_util import FakeCopier, add, make_scheduler, run_until_idle, step

BS = 4


def test_abort_while_loading_then_the_load_fails_releases_the_blocks_once():
    copier = FakeCopier(64, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(num_blocks=64, block_size=BS, connector=connector)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks stored, then reloaded
    add(sched, "a", prompt, max_tokens=1)
    step(sched, copier)
    copier.complete()
    run_until_idle(sched, copier)
    assert sched.manager.reset_prefix_cache()
    copier.fail_loads = True
    b = add(sched, "b", prompt, max_tokens=3)
    step(sched, copier)
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KV
    held = sched.manager.block_ids("b")
    assert sched.abort("b") and sched.transferring == {"b": b}
    step(sched, copier)
    assert sched.manager.block_ids("b") == held  # the failing load may still write them
    copier.complete()
    out, _ = step(sched, copier)
    assert out.finished_request_ids == ("b",) and "b" not in sched.requests
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_pending_transfers() and not sched.has_unfinished_requests()
    assert sched.manager.num_free_blocks == 63
    assert connector.stats.num_failed_loads == 1
