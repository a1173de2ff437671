"""allocate_slots without a cache hit on a request that holds a row, where no fresh block
is needed (most decode steps), returns [] after caching the blocks the new tokens fill,
without slot_allocation.commit: the same as commit with nothing to take.

The same random workload runs on two managers: one through allocate_slots, the other
with each such call made through slot_allocation.commit directly. Every call must return
the same ids and every step leave the same state (pool, cache, rows, hashes, events).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request, slot_allocation

from ._util import snapshot

BS = 4
MAX_LEN = 48


def _commit(manager: KVCacheManager, request: Request, n: int, lookahead: int):
    """allocate_slots(request, n, num_lookahead_tokens=lookahead) through commit."""
    held = manager._blocks[request.request_id]
    total = request.num_computed_tokens + n + lookahead
    num_new = max(0, -(-total // BS) - len(held))
    done = request.num_computed_tokens + n
    return slot_allocation.commit(manager, request, held, [], [], num_new, done)


@pytest.mark.parametrize("caching, events", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("seed", range(6))
def test_no_op_allocation_equals_commit(seed: int, events: bool, caching: bool) -> None:
    # Cache events exist only with prefix caching.
    rng = np.random.default_rng(seed)
    managers = [
        KVCacheManager(14, BS, max_model_len=MAX_LEN, enable_prefix_caching=caching, **kw)
        for kw in [dict(enable_kv_cache_events=events)] * 2
    ]
    system = rng.integers(0, 9, 10).tolist()
    live: dict[str, list[Request]] = {}
    for step in range(300):
        action = rng.random()
        if action < 0.2 or not live:
            rid = f"r{step}"
            prompt = system[: int(rng.integers(0, 11))] + rng.integers(0, 9, 3).tolist()
            pair = [Request(rid, prompt) for _ in managers]
            got = []
            for m, req in zip(managers, pair, strict=True):
                ids, n = m.get_computed_blocks(req)
                new = m.allocate_slots(
                    req, req.num_tokens - n, num_new_computed_tokens=n, new_computed_blocks=ids
                )
                if new is not None:
                    req.num_computed_tokens = req.num_tokens
                got.append(new)
            assert got[0] == got[1]
            if got[0] is not None:
                live[rid] = pair
        elif action < 0.3:
            rid = list(live)[int(rng.integers(len(live)))]
            for m in managers:
                m.free(rid)
            del live[rid]
        else:
            rid = list(live)[int(rng.integers(len(live)))]
            pair = live[rid]
            n, lookahead = int(rng.integers(0, 4)), int(rng.integers(0, 3))
            if pair[0].num_tokens + n + lookahead > MAX_LEN:
                continue
            tokens = rng.integers(0, 9, n).tolist()
            for req in pair:
                req.append_output_token_ids(tokens)
            fast = managers[0].allocate_slots(pair[0], n, num_lookahead_tokens=lookahead)
            full = _commit(managers[1], pair[1], n, lookahead)
            assert fast == full, step
            if fast is not None:
                for req in pair:
                    req.num_computed_tokens += n
        assert snapshot(managers[0]) == snapshot(managers[1]), step
    for m in managers:
        m.check_integrity()
