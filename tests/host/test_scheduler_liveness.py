"""Every request the scheduler accepts finishes, with its own tokens, whatever the pool.

Random arrivals and aborts over small pools, with the host offload connector saving
finished requests' KV and loading it back (copies landing late, or at once), prefix
caching on and off, long prefills capped per step or not, steps that fail and are
discarded, and aborts between a schedule() and its step. The run must go idle within a
bound (no deadlock, no livelock), free every block, keep the manager's integrity after
every step, give every scheduled request its own KV (checked by the step driver), and
produce for each request that was not aborted exactly the tokens it would produce alone.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from jaxkv import RequestStatus
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, add, make_scheduler, step

pytestmark = pytest.mark.slow  # a long randomised run: its file runs first

BS = 4
MAX_MODEL_LEN = 32


def _alone(prompt: list[int], max_tokens: int) -> list[int]:
    """The fake sampler's tokens (tests.host._sched_util.token_of) for a request alone."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        t = (sum(tokens) * 31 + len(tokens)) % 97 + 100
        tokens.append(t)
        out.append(t)
    return out


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.sampled_from([9, 12, 24]),
    prefix_caching=st.booleans(),
    host_blocks=st.sampled_from([0, 6, 64]),
    delay=st.integers(0, 3),
    auto_complete=st.booleans(),
    budget=st.sampled_from([8, 16]),
    threshold=st.sampled_from([0, 0, 3, 5]),
)
def test_every_accepted_request_finishes_with_its_own_tokens(
    seed, num_blocks, prefix_caching, host_blocks, delay, auto_complete, budget, threshold
):
    rng = np.random.default_rng(seed)
    copier = FakeCopier(num_blocks, BS, auto_complete=auto_complete)
    connector = HostOffloadConnector(host_blocks * copier.bytes_per_block, copy_delay_steps=delay)
    connector.bind(copier, block_size=BS, hash_seed=0)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=BS,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=prefix_caching,
        connector=connector,
        long_prefill_token_threshold=threshold,
    )
    capacity = min((num_blocks - 1) * BS, MAX_MODEL_LEN)
    prefixes = [rng.integers(0, 90, 12).tolist() for _ in range(2)]  # store hits recur
    requests, aborted, reasons = {}, set(), {}
    for i in range(24):
        prefix = prefixes[int(rng.integers(2))][: int(rng.integers(0, 13))]
        prompt = prefix + rng.integers(0, 90, int(rng.integers(1, 9))).tolist()
        max_tokens = int(rng.integers(1, capacity - len(prompt) + 1))
        requests[f"r{i}"] = (prompt, max_tokens)
    pending, added = list(requests), {}
    for _ in range(600):
        while pending and rng.random() < 0.4:
            req_id = pending.pop(0)
            added[req_id] = add(sched, req_id, requests[req_id][0], max_tokens=requests[req_id][1])
        live = [r for r, req in sched.requests.items() if not req.is_finished()]
        if live and rng.random() < 0.04:
            victim = live[int(rng.integers(len(live)))]
            assert sched.abort(victim)
            aborted.add(victim)
        if not pending and not sched.has_unfinished_requests():
            if not sched.has_pending_transfers():
                break

        def abort_between(out):
            if not out.request_ids or rng.random() >= 0.05:
                return []
            victim = out.request_ids[int(rng.integers(out.num_requests))]
            aborted.add(victim)
            return [victim]

        _, results = step(sched, copier, abort_between=abort_between, fail=rng.random() < 0.08)
        reasons.update({r.request_id: r.finish_reason for r in results if r.finished})
        if not auto_complete and rng.random() < 0.5:
            copier.complete()
    else:
        stuck = [(r.request_id, r.status.name) for r in sched.requests.values()]
        raise AssertionError(f"the scheduler never went idle: {stuck}")
    assert not sched.requests and sched.manager.num_free_blocks == num_blocks - 1
    sched.manager.check_integrity()
    assert set(reasons) | aborted == set(requests) and not set(reasons) & aborted
    for req_id, request in added.items():
        if req_id not in aborted:
            assert reasons[req_id] == "length"
            assert request.output_token_ids == _alone(*requests[req_id]), req_id
        else:
            assert request.status == RequestStatus.FINISHED_ABORTED
