"""Seeded random runs of the Scheduler with a HostOffloadConnector over a small pool.

The copier's copies land after a random number of steps, or fail, or fail to start (its
start_save or start_load raises). Saves read their blocks when they land and loads
write theirs when they land (the blocks a load fills are poisoned with NaN when it
starts), so a block freed under a save stores the wrong KV, and a loaded block read
before its load lands reads NaN. The pool is small enough that running requests preempt
each other and cached blocks are evicted; prompts share prefixes (whole prompts repeat),
so requests hit the device prefix cache, blocks a save still holds, and the host store.
Requests arrive, some asking for prompt logprobs, and are aborted at any point (between
a schedule() and its step too), and steps fail and are discarded; the device prefix
cache is reset (refused while a block is held) and the store resized between steps.

After every schedule(): the num_common_prefix_blocks of the scheduled requests, and of
each leading run of them, equals a brute-force comparison of their block ids. After
every step: the manager's integrity, every block a copy in flight reads or writes is
held, every request holding blocks is running, loading, landed or held for a copy, and
the store keeps within its budget; the step driver checks that every scheduled request
reads its own KV. At the end every request finished or was aborted, every block is
free, no copy is in flight, and each stored block holds the KV of its hash.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import add, make_scheduler, step, store_link_faults

pytestmark = pytest.mark.slow  # about 150 random runs: its file runs first

BS = 4
MAX_MODEL_LEN = 32


class SlowCopier:
    """Device KV f32[num_blocks, BS]; each copy lands 0 to 3 ticks after it starts, or
    fails (p_fail), or its start raises (p_raise)."""

    def __init__(self, num_blocks: int, rng: np.random.Generator, p_fail: float, p_raise: float):
        self.device = np.zeros((num_blocks, BS), np.float32)
        self.bytes_per_block = BS * 4
        self.block_shape, self.dtype, self.num_blocks = (BS,), np.float32, num_blocks
        self.rng, self.p_fail, self.p_raise = rng, p_fail, p_raise
        self.pending: list[list] = []  # [ticks left, kind, block ids, future, blocks]

    def _start(self, kind: str, block_ids, blocks=None) -> Future:
        if self.rng.random() < self.p_raise:
            raise OSError(f"start_{kind} raised")
        future: Future = Future()
        self.pending.append([int(self.rng.integers(0, 4)), kind, list(block_ids), future, blocks])
        return future

    def start_save(self, block_ids) -> Future:
        return self._start("save", block_ids)

    def start_load(self, block_ids, blocks) -> Future:
        future = self._start("load", block_ids, np.array(blocks))
        self.device[list(block_ids)] = np.nan  # read before the load lands: NaN
        return future

    def in_flight(self) -> list[tuple[str, list[int]]]:
        return [(kind, ids) for _, kind, ids, _, _ in self.pending]

    def tick(self) -> None:
        """Lands (or fails) the copies whose time has come."""
        left = []
        for copy in self.pending:
            if copy[0] > 0:
                copy[0] -= 1
                left.append(copy)
                continue
            _, kind, ids, future, blocks = copy
            if self.rng.random() < self.p_fail:
                future.set_exception(OSError(f"{kind} failed"))
            elif kind == "save":
                future.set_result(self.device[ids].copy())
            else:
                self.device[ids] = blocks
                future.set_result(None)
        self.pending = left


def _brute_common(manager, request_ids) -> int:
    rows = [manager.block_ids(r) for r in request_ids]
    n = 0
    while rows and all(len(r) > n for r in rows) and len({r[n] for r in rows}) == 1:
        n += 1
    return n


def _check(sched, copier: SlowCopier, connector: HostOffloadConnector, host_blocks: int) -> None:
    m = sched.manager
    m.check_integrity()
    holders = set(m.request_ids)
    held = {b for rid in holders for b in m.block_ids(rid)}
    for kind, ids in copier.in_flight():
        assert set(ids) <= held, f"a {kind} in flight on blocks {ids}, held: {sorted(held)}"
    landed = {r.request_id for r in sched._transfers.landed()}
    for rid in holders:
        assert rid in sched.requests, f"{rid} holds blocks, forgotten by the scheduler"
        request = sched.requests[rid]
        assert (
            request in sched.running
            or rid in sched.transferring
            or rid in landed
            or request.status.name == "WAITING_FOR_REMOTE_KV"
        ), f"{rid} ({request.status.name}) holds blocks"
    assert connector.stats.num_stored_blocks <= host_blocks
    assert not store_link_faults(connector)


def _run(seed: int, num_blocks: int, host_blocks: int, seen: dict[str, int]) -> None:
    rng = np.random.default_rng(seed)
    copier = SlowCopier(num_blocks, rng, p_fail=0.15, p_raise=0.03)
    connector = HostOffloadConnector(
        host_blocks * copier.bytes_per_block, copy_delay_steps=int(rng.choice([0, 0, 1, 3]))
    )
    connector.bind(copier, block_size=BS, hash_seed=0)
    chunked = bool(rng.random() < 0.7)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=BS,
        max_num_batched_tokens=int(rng.choice([6, 8, 16])) if chunked else MAX_MODEL_LEN,
        max_num_seqs=int(rng.choice([2, 4, 6])),
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=bool(rng.random() < 0.85),
        long_prefill_token_threshold=int(rng.choice([0, 0, 3, 5])) if chunked else 0,
        connector=connector,
    )
    m = sched.manager
    capacity = min((num_blocks - 1) * BS, MAX_MODEL_LEN)
    prefixes = [rng.integers(0, 90, 16).tolist() for _ in range(2)]
    specs: dict[str, tuple[list[int], int]] = {}
    for i in range(20):
        if i and rng.random() < 0.2:  # an earlier request's prompt again
            prompt = specs[f"r{int(rng.integers(i))}"][0]
        else:
            prompt = prefixes[int(rng.integers(2))][: int(rng.integers(0, 17))]
            prompt = prompt + rng.integers(0, 90, int(rng.integers(1, 7))).tolist()
        max_tokens = int(rng.integers(1, max(2, min(10, capacity - len(prompt) + 1))))
        specs[f"r{i}"] = (prompt, max_tokens)
    pending, added, aborted, finished = list(specs), {}, set(), set()
    kv_of_hash = {}  # block hash -> the KV its tokens give (1000 * position + token)

    def count(what: str) -> None:
        seen[what] = seen.get(what, 0) + 1

    def abort_between(out):
        for k in range(2, out.num_requests + 1):
            ids = out.request_ids[:k]
            assert m.num_common_prefix_blocks(ids) == _brute_common(m, ids), ids
        saving = {
            b
            for r, q in sched.transferring.items()
            if q.status.name == "FINISHED_TRANSFERRING"
            for b in m.block_ids(r)
        }
        if any(saving & set(m.block_ids(r)) for r in out.request_ids):
            count("scheduled a block a save holds")
        if out.preempted_request_ids and any(k == "load" for k, _ in copier.in_flight()):
            count("preempted while a load is in flight")
        if not out.request_ids or rng.random() >= 0.06:
            return []
        victim = out.request_ids[int(rng.integers(out.num_requests))]
        aborted.add(victim)
        return [victim]

    for _ in range(800):
        while pending and rng.random() < 0.3:
            rid = pending.pop(0)
            logprobs = {"prompt_logprobs": 1} if rng.random() < 0.1 else {}
            added[rid] = add(sched, rid, specs[rid][0], max_tokens=specs[rid][1], **logprobs)
        live = [r for r, q in sched.requests.items() if not q.is_finished()]
        if live and rng.random() < 0.06:
            victim = live[int(rng.integers(len(live)))]
            count(f"aborted {sched.requests[victim].status.name}")
            assert sched.abort(victim)
            aborted.add(victim)
            _check(sched, copier, connector, host_blocks)
        if rng.random() < 0.04:  # refused while a block is held (a copy's too)
            held_any = m.pool.num_free_blocks != num_blocks - 1
            assert m.reset_prefix_cache() is not held_any
            count("reset refused" if held_any else "reset")
            _check(sched, copier, connector, host_blocks)
        if rng.random() < 0.04:  # the store shrinks (or grows back) at once
            connector.host_bytes = int(rng.integers(0, host_blocks + 1)) * copier.bytes_per_block
            assert connector.stats.stored_bytes <= connector.host_bytes
            connector.copy_delay_steps = int(rng.choice([0, 0, 1, 3]))
            _check(sched, copier, connector, host_blocks)
        if not (pending or sched.has_unfinished_requests() or sched.has_pending_transfers()):
            break
        try:
            _, results = step(sched, copier, abort_between=abort_between, fail=rng.random() < 0.05)
        except OSError:  # a copier's start_load raised: schedule() handed its batch back
            count("start_load raised")
            results = []
        finished.update(o.request_id for o in results if o.finished)
        for request in added.values():
            hashes = request.block_hashes
            for i in range(min(len(hashes), request.num_computed_tokens // BS)):
                pos = np.arange(i * BS, (i + 1) * BS)
                kv_of_hash[hashes[i]] = 1000 * pos + np.asarray(request.all_token_ids)[pos]
        _check(sched, copier, connector, host_blocks)
        copier.tick()
    else:
        stuck = [(r.request_id, r.status.name) for r in sched.requests.values()]
        raise AssertionError(f"seed {seed}: the scheduler never went idle: {stuck}")
    assert not sched.requests and not copier.pending
    assert m.num_free_blocks == num_blocks - 1
    assert finished | aborted == set(added) and not finished & aborted
    for h in connector.stored_hashes():
        assert np.array_equal(connector._store[h], kv_of_hash[h]), "a stored block's KV is wrong"
    stats = connector.stats
    for name in ("num_loads", "num_failed_loads", "num_saves", "num_failed_saves"):
        seen[name] = seen.get(name, 0) + getattr(stats, name)
    seen["preemptions"] = seen.get("preemptions", 0) + sched.stats.num_preemptions


@pytest.mark.parametrize(("num_blocks", "host_blocks"), [(9, 4), (10, 12), (14, 30)])
def test_offload_under_memory_pressure_keeps_every_block_accounted(num_blocks, host_blocks):
    seen: dict[str, int] = {}
    for seed in range(50):
        try:
            _run(seed, num_blocks, host_blocks, seen)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
    # The runs reached what they are for.
    for what in (
        "preemptions",
        "num_loads",
        "num_failed_loads",
        "num_failed_saves",
        "scheduled a block a save holds",
        "preempted while a load is in flight",
        "aborted WAITING_FOR_REMOTE_KV",
        "aborted RUNNING",
        "start_load raised",
        "reset",
        "reset refused",
    ):
        assert seen.get(what, 0) > 0, (what, seen)
