"""Engine.metrics and Engine.last_step against what the steps did, counted independently.

Counters are checked against the per-step records a serving loop reads (Engine.last_step),
against token arithmetic (every computed token is a prompt token or a fed-back output
token), against exact prefix-cache hits of a repeated prompt, and against the queue and
transfer states the requests are known to be in.
"""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from jaxkv.metrics import EngineMetrics, StepStats, StepTotals
from tests.engine._util import BLOCK_SIZE, VOCAB, make_engine, prompts_for


def _step_all(engine) -> list:
    """Steps until idle; the StepStats of every step that ran the model."""
    steps = []
    while engine.has_unfinished_requests():
        if engine.step():
            steps.append(engine.last_step)
    return steps


def test_counters_add_up_the_steps_that_ran():
    engine = make_engine()
    prompts = prompts_for("shared")
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=3))
    m = engine.metrics
    assert (m.num_waiting, m.num_running, m.num_steps, m.kv_usage) == (len(prompts), 0, 0, 0.0)
    engine.step()
    m = engine.metrics
    assert m.num_running > 0 and m.num_running + m.num_waiting == len(prompts)
    assert m.kv_usage > 0
    steps = [engine.last_step, *_step_all(engine)]

    m = engine.metrics
    assert m.num_steps == len(steps) and m.num_waiting == m.num_running == 0
    assert m.host_time_s == pytest.approx(sum(s.host_s for s in steps), rel=1e-12)
    assert m.device_time_s == pytest.approx(sum(s.device_s for s in steps), rel=1e-12)
    assert m.update_time_s == pytest.approx(sum(s.update_s for s in steps), rel=1e-12)
    # The CPU time of each step's host part splits into scheduler, planner and the rest.
    for s in steps:
        parts = (s.schedule_cpu_s, s.plan_cpu_s, s.prepare_cpu_s)
        assert min(parts) >= 0 and sum(parts) == pytest.approx(s.host_cpu_s, abs=1e-9)
    # Every computed token is a prompt token or an output token fed back; each request's
    # last output is never fed back.
    assert m.num_generated_tokens == 3 * len(prompts)
    computed = m.num_prompt_tokens + m.num_generated_tokens - len(prompts)
    assert sum(s.num_tokens for s in steps) == computed
    cascade = [s for s in steps if s.cascade_levels]
    assert cascade, "the workload shares prefixes: some step must use cascade"
    assert m.cascade_steps == len(cascade)
    assert m.cascade_tokens == sum(s.num_tokens for s in cascade)
    assert dict(m.cascade_steps_by_levels) == collections.Counter(s.cascade_levels for s in cascade)
    assert all(s.cascade_levels in ("global", "groups", "global+groups") for s in cascade)
    # new_program marks the first step of each program this engine used.
    assert sum(s.new_program for s in steps) == engine.num_compiles == m.num_compiles >= 1
    assert steps[0].new_program


def test_prefix_cache_counters_of_a_repeated_prompt():
    engine = make_engine()
    prompt = np.random.default_rng(8).integers(0, VOCAB, 4 * BLOCK_SIZE + 2).tolist()
    for _ in range(2):
        engine.generate([prompt], SamplingParams(max_tokens=3), progress=False)
    m = engine.metrics
    # Each request looks its whole prompt up; the second finds the 4 full prompt blocks.
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (2 * len(prompt), 4 * BLOCK_SIZE)
    assert m.num_prompt_tokens == 2 * len(prompt) - 4 * BLOCK_SIZE


def test_last_step_counts_the_blocks_held_while_it_ran():
    engine = make_engine()
    # 2 blocks of prompt and one for the first output: allocated for the step, then
    # freed by the request that finishes in it, before step() returns.
    engine.add_request(list(range(1, 2 * BLOCK_SIZE + 1)), SamplingParams(max_tokens=1))
    assert engine.step() and not engine.has_unfinished_requests()
    assert engine.last_step.num_blocks_held == 2 and engine.metrics.kv_usage == 0.0
    # Two requests sharing their first block (cached by the first request): their KV
    # ends at 6 + 2 and 7 + 2 tokens, 2 and 3 blocks, the shared one held once.
    prompt = list(range(1, BLOCK_SIZE + 3))
    engine.add_request(prompt, SamplingParams(max_tokens=3))
    engine.add_request(prompt[:BLOCK_SIZE] + [9, 9, 9], SamplingParams(max_tokens=3))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.last_step.num_blocks_held)
    assert max(held) == held[-1] == 1 + 1 + 2 and engine.metrics.kv_usage == 0.0


def test_a_finished_request_copying_out_its_kv_is_counted_as_transferring():
    connector = HostOffloadConnector(1 << 24, copy_delay_steps=3)
    engine = make_engine(connector=connector)
    engine.generate([list(range(1, 10))], SamplingParams(max_tokens=1), progress=False)
    assert engine.has_pending_transfers() and engine.metrics.num_transferring == 1
    engine.drain_transfers()
    m = engine.metrics
    assert m.num_transferring == 0 and m.kv_usage == 0.0
    assert m.bytes_offloaded > 0 and m.bytes_offloaded % engine.copier.bytes_per_block == 0


def test_a_step_with_nothing_scheduled_runs_no_model():
    # step() returns [] without running the model: no StepStats, no step counted.
    engine = make_engine(connector=HostOffloadConnector(1 << 24, copy_delay_steps=3))
    assert engine.step() == [] and engine.last_step is None
    assert engine.metrics.num_steps == 0
    engine.generate([list(range(1, 10))], SamplingParams(max_tokens=1), progress=False)
    last, before = engine.last_step, engine.metrics
    engine.drain_transfers()  # steps while only a finished request's copy is in flight
    m = engine.metrics
    assert engine.last_step is last and m.num_steps == before.num_steps == 1
    assert m.num_compiles == before.num_compiles


def test_derived_rates_of_a_snapshot():
    m = EngineMetrics(
        num_steps=4, num_prompt_tokens=30, num_generated_tokens=10, host_time_s=0.5,
        device_time_s=1.0, update_time_s=0.5, prefix_cache_queries=40, prefix_cache_hits=10,
        cascade_steps_by_levels=(("global", 3), ("groups", 1)),
    )  # fmt: skip
    assert m.step_time_s == 2.0
    assert (m.generation_tokens_per_s, m.tokens_per_s) == (5.0, 20.0)
    assert m.prefix_cache_hit_rate == 0.25
    assert (m.host_time_per_step_ms, m.device_time_per_step_ms) == (125.0, 250.0)
    d = m.as_dict()
    assert d["cascade_steps_by_levels"] == {"global": 3, "groups": 1}
    assert (d["step_time_s"], d["tokens_per_s"], d["generation_tokens_per_s"]) == (2.0, 20.0, 5.0)
    assert (d["prefix_cache_hit_rate"], d["host_time_per_step_ms"]) == (0.25, 125.0)
    assert d["device_time_per_step_ms"] == 250.0 and d["num_steps"] == 4
    # Nothing measured yet: every rate is 0, not a division by zero.
    idle = EngineMetrics()
    assert idle.tokens_per_s == idle.prefix_cache_hit_rate == idle.host_time_per_step_ms == 0.0


def test_per_step_times_after_one_step_are_that_steps_times():
    """One step is already a mean: only no step at all gives 0."""
    m = EngineMetrics(num_steps=1, host_time_s=0.5, device_time_s=0.25)
    assert (m.host_time_per_step_ms, m.device_time_per_step_ms) == (500.0, 250.0)


def test_every_derived_rate_of_an_idle_snapshot_is_zero():
    """No step time or no step yet: each rate is 0.0, never a ZeroDivisionError."""
    idle = EngineMetrics(num_prompt_tokens=3, num_generated_tokens=2, prefix_cache_hits=0)
    rates = [k for k, v in vars(EngineMetrics).items() if isinstance(v, property)]
    assert len(rates) == 6
    assert {name: getattr(idle, name) for name in rates} == dict.fromkeys(rates, 0.0)
    assert {k: v for k, v in idle.as_dict().items() if k in rates} == dict.fromkeys(rates, 0.0)


def test_step_totals_list_the_cascade_levels_sorted_whatever_came_first():
    # EngineMetrics documents (levels, steps) sorted: snapshots of engines that saw the same
    # steps in another order compare equal.
    totals = StepTotals()
    steps = [("groups", 5), ("", 7), ("global+groups", 3), ("global", 2), ("groups", 1)]
    for levels, tokens in steps:
        totals.record(StepStats(0.1, 0.1, 0.2, 0.3, 1, tokens, levels, False))
    f = totals.fields()
    assert f["cascade_steps_by_levels"] == (("global", 1), ("global+groups", 1), ("groups", 2))
    assert (f["num_steps"], f["cascade_steps"], f["cascade_tokens"]) == (5, 4, 11)


def test_step_s_is_the_whole_step():
    s = StepStats(
        host_s=0.5, host_cpu_s=0.4, device_s=2.0, update_s=0.25, num_requests=3,
        num_tokens=7, cascade_levels="", new_program=False,
    )  # fmt: skip
    assert s.step_s == 2.75


def test_plan_cpu_time_is_counted_as_plan_not_as_schedule(monkeypatch):
    """A planner that burns CPU shows in last_step.plan_cpu_s, not in schedule_cpu_s."""
    engine = make_engine()
    plan = engine.planner.plan

    def slow_plan(*args, **kwargs):
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            pass
        return plan(*args, **kwargs)

    monkeypatch.setattr(engine.planner, "plan", slow_plan)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    engine.step()
    assert engine.last_step.plan_cpu_s >= 0.05 > engine.last_step.schedule_cpu_s
