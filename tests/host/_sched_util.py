"""Helpers for scheduler and KV-transfer host tests: a fake device copier and a step driver."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future

import numpy as np

from jaxkv import KVCacheManager, Request, SamplingParams
from jaxkv.config import SchedulerConfig
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.kv_transfer import KVConnector, TransferEvents
from jaxkv.scheduler import Scheduler, SchedulerOutput


class FakeCopier:
    """Device KV as a numpy array f32[num_blocks, block_size]; copies complete on demand.

    With auto_complete the Futures are done at once; otherwise complete() lands them.
    fail_saves / fail_loads make the next copies fail.
    """

    def __init__(self, num_blocks: int, block_size: int, *, auto_complete: bool = True) -> None:
        self.device = np.zeros((num_blocks, block_size), np.float32)
        self.bytes_per_block = block_size * 4
        self.auto_complete = auto_complete
        self.fail_saves = False
        self.fail_loads = False
        self.pending: list[tuple[Future, object]] = []
        self.saved_block_ids: list[list[int]] = []
        self.loaded_block_ids: list[list[int]] = []

    def _finish(self, future: Future, work) -> None:
        if self.auto_complete:
            self._run(future, work)
        else:
            self.pending.append((future, work))

    @staticmethod
    def _run(future: Future, work) -> None:
        try:
            future.set_result(work())
        except Exception as e:  # noqa: BLE001
            future.set_exception(e)

    def complete(self) -> None:
        for future, work in self.pending:
            self._run(future, work)
        self.pending.clear()

    def start_save(self, block_ids):
        ids = list(block_ids)
        self.saved_block_ids.append(ids)
        snapshot = self.device[ids].copy()
        fail = self.fail_saves

        def work():
            if fail:
                raise OSError("injected save failure")
            return snapshot

        future: Future = Future()
        self._finish(future, work)
        return future

    def start_load(self, block_ids, blocks):
        ids = list(block_ids)
        self.loaded_block_ids.append(ids)
        fail = self.fail_loads

        def work():
            if fail:
                raise OSError("injected load failure")
            self.device[ids] = blocks

        future: Future = Future()
        self._finish(future, work)
        return future


class OracleLoadConnector(KVConnector):
    """Claims `claims[request_id]` tokens at a request's admission; its load writes the KV
    that the request's own computation would have (FakeCopier's 1000 * position + token,
    as step() checks) and lands at the next poll() that is not on `hold`, in start order."""

    def __init__(self, copier: FakeCopier, claims: dict[str, int]) -> None:
        self.copier, self.claims = copier, claims
        self.hold = False  # True: loads do not land yet
        self.started: list[str] = []  # request ids, one per load started
        self._pending: list[str] = []

    def on_admission(self, request: Request, num_computed_tokens: int) -> int:
        return self.claims.get(request.request_id, 0)

    def start_load(self, request: Request, block_ids) -> None:
        bs = self.copier.device.shape[1]
        for i, block in enumerate(block_ids):
            for j in range(bs):
                pos = request.num_computed_tokens + i * bs + j
                self.copier.device[block, j] = 1000 * pos + request.all_token_ids[pos]
        self._pending.append(request.request_id)
        self.started.append(request.request_id)

    def poll(self) -> TransferEvents:
        if self.hold:
            return TransferEvents()
        loaded, self._pending = tuple(self._pending), []
        return TransferEvents(loaded=loaded)


def bound_host_connector(block_size: int = 4) -> tuple[FakeCopier, HostOffloadConnector]:
    """A HostOffloadConnector of 64 blocks' room, bound to a FakeCopier of 16 blocks."""
    copier = FakeCopier(16, block_size)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=block_size, hash_seed=0)
    return copier, connector


def computed_request(request_id: str, tokens: list[int]) -> Request:
    """A Request of prompt `tokens`, all computed (as when it finishes)."""
    request = Request(request_id, tokens, SamplingParams())
    request.num_computed_tokens = len(tokens)
    return request


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    connector: KVConnector | None = None,
    long_prefill_token_threshold: int = 0,
) -> Scheduler:
    manager = KVCacheManager(
        num_blocks,
        block_size,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    return Scheduler(config, manager, connector)


def add(sched: Scheduler, request_id: str, tokens, **params) -> Request:
    request = Request(request_id, list(tokens), SamplingParams(**params))
    sched.add_request(request)
    return request


def outputs_fed(sched: Scheduler, output) -> dict[str, list]:
    """Steps `sched` until idle, each request sampling output[i] as its i-th token; the
    RequestOutputs of each request, in order, by request id."""
    results: dict[str, list] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        tokens = [output[len(r.output_token_ids)] for r in out.requests]
        for o in sched.update_from_output(out, tokens):
            results.setdefault(o.request_id, []).append(o)
    return results


def token_of(request: Request) -> int:
    """A deterministic fake sample: depends only on the request's tokens so far."""
    return (sum(request.all_token_ids) * 31 + request.num_tokens) % 97 + 100


def step(
    sched: Scheduler,
    copier: FakeCopier | None = None,
    *,
    abort_between: Callable[[SchedulerOutput], Iterable[str]] | None = None,
    fail: bool = False,
):
    """One schedule + update with fake tokens; writes KV of computed tokens into the copier.

    Each computed token's fake KV value is 1000 * position + token id, so a load can be
    checked against what the request's own computation would have written.
    `abort_between(out)` names requests to abort after schedule(), before the step runs
    (the step still writes their KV, as a model running the scheduled batch does).
    `fail`: the step fails before writing any KV and the batch is discarded.
    """
    out: SchedulerOutput = sched.schedule()
    assert out.num_computed_tokens.tolist() == [r.num_computed_tokens for r in out.requests]
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert out.num_requests <= sched.config.max_num_seqs
    assert out.token_ids == [
        t
        for req, n, start in zip(
            out.requests, out.num_scheduled_tokens, out.num_computed_tokens, strict=True
        )
        for t in req.all_token_ids[start : start + n]
    ]
    block_ids = {r.request_id: sched.manager.block_ids(r.request_id) for r in out.requests}
    for req_id in abort_between(out) if abort_between else ():
        assert sched.abort(req_id)
    if fail:
        sched.discard(out)
        sched.manager.check_integrity()
        return out, []
    if copier is not None:
        # The model writes the KV of every scheduled token (aborted requests' too), then
        # attention reads each request's first num_computed + n positions: its own KV,
        # computed, loaded, hit in the prefix cache, or written in this very step (a hit
        # on a block another request of the batch fills now).
        bs = sched.manager.block_size
        batch = list(
            zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens, strict=True)
        )
        for req, n, start in batch:
            ids, pos = block_ids[req.request_id], np.arange(start, start + n)
            kv = 1000 * pos + np.asarray(req.all_token_ids[start : start + n])
            copier.device[np.asarray(ids, np.int64)[pos // bs], pos % bs] = kv
        for req, n, start in batch:
            if req.is_finished():
                continue  # aborted after schedule()
            ids, pos = block_ids[req.request_id], np.arange(start + n)
            kv = copier.device[np.asarray(ids, np.int64)[pos // bs], pos % bs]
            expected = 1000 * pos + np.asarray(req.all_token_ids[: start + n])
            assert np.array_equal(kv, expected), f"{req.request_id}: attention reads wrong KV"
    results = sched.update_from_output(out, [token_of(r) for r in out.requests])
    sched.manager.check_integrity()
    bs = sched.manager.block_size
    sampled = {o.request_id for o in results}
    for r in sched.running:  # the invariant the scheduler's decode carry relies on
        held, needed = len(sched.manager.block_ids(r.request_id)), -(-r.num_computed_tokens // bs)
        if r.request_id in sampled:  # all its tokens are computed
            assert held == needed, r
        else:  # a landed load holds blocks for all its tokens until they are computed
            assert needed <= held <= max(needed, -(-r.num_tokens // bs)), r
    return out, results


def run_until_idle(sched: Scheduler, copier: FakeCopier | None = None, max_steps: int = 500):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests() and not sched.has_pending_transfers():
            return finished
        _, results = step(sched, copier)
        for r in results:
            if r.finished:
                finished[r.request_id] = r.finish_reason
        if copier is not None and not copier.auto_complete:
            copier.complete()
    raise AssertionError("scheduler did not go idle")


def store_link_faults(connector) -> list[str]:
    """What is wrong with a HostOffloadConnector store's parent links: each stored block
    must be listed under its parent, and each parent listed must have a stored child."""
    store = connector._store
    faults = [
        f"{h.hex()[:8]} not under its parent"
        for h in store
        if store.parent_of(h) is not None and h not in store._children[store.parent_of(h)]
    ]
    for parent, children in store._children.items():
        if not children or not all(c in store for c in children):
            faults.append(
                f"parent {parent.hex()[:8]} lists {len(children)} children, not all stored"
            )
    return faults
