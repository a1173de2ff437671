"""The scheduler's decode carry: a step after an all-decode step equals the full pass.

The carry (what update_from_output leaves for the next schedule() when every running
request decodes) must give exactly the batch, blocks and prefix-cache entries that
scheduling the running requests one by one gives, through admissions, finishes, stops,
aborts and preemptions.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from jaxkv import RequestStatus
from jaxkv.scheduler import Scheduler
from tests.host._sched_util import add, make_scheduler, step


class _NoCarryScheduler(Scheduler):
    """Always takes the full pass over running requests."""

    def schedule(self):
        self._decode_carry = None
        return super().schedule()


def _pair(**kwargs) -> tuple[Scheduler, Scheduler]:
    fast = make_scheduler(**kwargs)
    slow = make_scheduler(**kwargs)
    slow.__class__ = _NoCarryScheduler
    return fast, slow


def _cache(sched: Scheduler) -> dict:
    return {h: b.block_id for h, b in sched.manager.pool.cached_block_hash_to_block.items()}


def _run_pair(seed: int, *, prefix_caching: bool, num_blocks: int) -> int:
    """Drives both schedulers through one random workload; returns carried steps."""
    rng = np.random.default_rng(seed)
    fast, slow = _pair(
        num_blocks=num_blocks,
        block_size=4,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        max_model_len=40,
        enable_prefix_caching=prefix_caching,
    )
    carried = 0
    original = fast._schedule_decode

    def counting(*args):
        nonlocal carried
        carried += 1
        return original(*args)

    fast._schedule_decode = counting
    system = rng.integers(0, 50, 9).tolist()
    next_id = 0
    for _ in range(80):
        if rng.random() < 0.3:  # a new request, often sharing the system prompt
            own = rng.integers(0, 50, rng.integers(1, 6)).tolist()
            prompt = system[: rng.integers(0, 10)] + own
            params = dict(max_tokens=int(rng.integers(1, 12)))
            if rng.random() < 0.3:
                params["stop_token_ids"] = (int(rng.integers(100, 197)),)
            for sched in (fast, slow):
                add(sched, f"r{next_id}", prompt, **params)
            next_id += 1
        if fast.running and rng.random() < 0.1:  # abort a running request
            victim = fast.running[int(rng.integers(len(fast.running)))].request_id
            assert fast.abort(victim) and slow.abort(victim)
        out_f, res_f = step(fast)
        out_s, res_s = step(slow)
        assert out_f.request_ids == out_s.request_ids
        assert out_f.num_scheduled_tokens.tolist() == out_s.num_scheduled_tokens.tolist()
        assert out_f.num_computed_tokens.tolist() == out_s.num_computed_tokens.tolist()
        assert out_f.token_ids == out_s.token_ids
        assert out_f.preempted_request_ids == out_s.preempted_request_ids
        assert out_f.finished_request_ids == out_s.finished_request_ids
        assert res_f == res_s
        for r in fast.running:
            assert fast.manager.block_ids(r.request_id) == slow.manager.block_ids(r.request_id)
        assert _cache(fast) == _cache(slow)
    return carried


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    prefix_caching=st.booleans(),
    num_blocks=st.sampled_from([12, 20, 64]),
)
def test_decode_carry_equals_the_full_pass(seed, prefix_caching, num_blocks):
    _run_pair(seed, prefix_caching=prefix_caching, num_blocks=num_blocks)


def test_decode_carry_is_used_and_fills_blocks_into_the_cache():
    carried = sum(_run_pair(s, prefix_caching=True, num_blocks=64) for s in range(5))
    assert carried > 50  # the check above compared carried steps, not only full passes


def test_decode_carry_is_dropped_when_a_running_request_is_aborted():
    sched = make_scheduler(block_size=4)
    add(sched, "a", range(1, 6), max_tokens=9)
    add(sched, "b", range(1, 7), max_tokens=9)
    step(sched)
    step(sched)
    assert sched._decode_carry is not None
    assert sched.abort("a")
    assert sched._decode_carry is None
    out, _ = step(sched)
    assert out.request_ids == ["b"]
    assert sched.requests["b"].status == RequestStatus.RUNNING
