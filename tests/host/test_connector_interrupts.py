"""A Ctrl-C at any line of HostOffloadConnector's own code, as the scheduler saves
finished requests' blocks and loads them back: a copy the copier started is recorded by
both the connector and the scheduler, its blocks held until it lands, and the run goes on.
Only the copier's calls (user code) are stopped at once."""

from __future__ import annotations

from jaxkv import RequestStatus
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._line_interrupts import LineInterrupts, fired_in, raised_at_once
from tests.host._sched_util import FakeCopier, add, make_scheduler, step

BS = 4
FILES = {"host_offload_connector.py", "offload_transfers.py", "host_block_store.py"}
# The copier's calls, and the line after each (where a tracer, unlike a signal, can run
# before the flag is reset); on the old code, the lines that named them.
USER_CALLS = ("call(*args)", "copier.start_save(", "copier.start_load(", "user_code.runs = False")


class _Recording(FakeCopier):
    """Copies land on complete(); `copies` lists each one's (Future, block ids)."""

    def __init__(self) -> None:
        super().__init__(32, BS, auto_complete=False)
        self.copies = []

    def start_save(self, block_ids):
        future = super().start_save(block_ids)
        self.copies.append((future, list(block_ids)))
        return future

    def start_load(self, block_ids, blocks):
        future = super().start_load(block_ids, blocks)
        self.copies.append((future, list(block_ids)))
        return future


def _assert_copies_recorded(sched, connector, copier):
    """Each copy in flight holds its blocks, and each one the connector reports is one the
    scheduler waits for (else the next schedule() raises ValueError)."""
    blocks = sched.manager.pool.blocks
    for future, block_ids in copier.copies:
        if not future.done():
            assert all(blocks[b].ref_cnt for b in block_ids), block_ids
    assert set(connector._saves) <= set(sched.transferring)
    assert set(connector._loads) <= set(sched._transfers._loading)


def _run(at):
    """a and b finish and are saved; c, a's prompt and more, loads a's blocks back (the
    device prefix cache is off); a SIGINT at the `at`-th line of the connector's code."""
    copier = _Recording()
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(
        num_blocks=32, block_size=BS, connector=connector, enable_prefix_caching=False
    )
    add(sched, "a", range(1, 10), max_tokens=1)
    add(sched, "b", range(20, 29), max_tokens=1)
    lines, interrupt = LineInterrupts(at, FILES), None
    for n in range(20):
        if n == 1:
            c = add(sched, "c", [*range(1, 10), 50], max_tokens=2)
        if n and not sched.has_unfinished_requests() and not sched.has_pending_transfers():
            break
        try:
            with lines:
                step(sched, copier)  # checks that c reads the KV it loaded
        except KeyboardInterrupt as e:
            assert interrupt is None and lines.fired
            interrupt = e
            sched.discard_unapplied()
        if lines.fired is None or not fired_in(lines.fired, USER_CALLS):
            _assert_copies_recorded(sched, connector, copier)
        copier.complete()
    assert not sched.requests and not sched.has_pending_transfers()
    assert c.status is RequestStatus.FINISHED_LENGTH
    assert sched.manager.num_free_blocks == 31
    if lines.fired is None or not fired_in(lines.fired, USER_CALLS):
        assert not connector.has_pending()
    return lines.fired, interrupt, connector.stats.num_loads


def test_a_ctrl_c_in_the_connector_never_loses_a_copy_it_started():
    # Let through after the copier started a save, before on_finish returned True, a
    # Ctrl-C freed the blocks under the save; once its record was kept, the save's report
    # named a request the scheduler had released, and the next schedule() raised.
    *_, num_loads = _run(None)
    assert num_loads == 1
    at = 0
    while True:
        at += 1
        fired, interrupt, _ = _run(at)  # checks each copy is recorded, unless in the copier
        if fired is None:
            break
        assert interrupt is not None, fired
        # At once in the copier's calls; in the connector's own code once the scheduler's
        # update or schedule() is done (poll()'s report is applied whole either way).
        in_copier = fired_in(fired, USER_CALLS)
        assert not raised_at_once(interrupt) or in_copier, fired
        assert raised_at_once(interrupt) or not in_copier, fired
    assert at > 300  # every line of the connector's code in the run was tried
