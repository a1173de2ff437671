"""A planner that reuses its group searches across decode steps (SearchReads, PlanMemo)
plans what a fresh planner plans, field for field, at every step of random serving runs
through the real scheduler: n samples of one prompt and single requests under shared
system prompts, contexts crossing block boundaries, requests finishing, joining and
aborted, preemption under a small pool, finished requests still holding blocks, under
every backend's cost model (xla's page-bucket rule included) and cost models scaled to
the runs so that verdicts turn as contexts grow. And over one batch whose computed
tokens grow at random rates from random starts (prompts read in chunks beside decodes),
so that each kind of read the search makes turns in some step."""

from __future__ import annotations

import numpy as np

import jaxkv.cascade_groups as cascade_groups
from jaxkv.buckets import pow2_buckets
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlan, CascadePlanner
from jaxkv.config import SchedulerConfig
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.request import Request, SamplingParams
from jaxkv.scheduler import Scheduler
from tests.attention.serving_sim import HoldingConnector
from tests.attention.test_cascade_planner import _decoding

SHAPES = (
    AttentionShape(4, 2, 16, kv_itemsize=4),
    AttentionShape(4, 2, 32, kv_itemsize=4),
    AttentionShape(8, 8, 64, kv_itemsize=2),
)


def plan_fields(plan: CascadePlan) -> tuple:
    """Every field of a plan, with its arrays' dtypes."""
    arrays = lambda *xs: tuple((x.tolist(), x.dtype.str) for x in xs)  # noqa: E731
    levels = tuple(
        (lv.name, arrays(lv.group_starts, lv.group_ends, lv.block_starts, lv.block_ends,
                         lv.leader_rows))
        for lv in plan.levels
    )  # fmt: skip
    return (
        arrays(plan.order, plan.rows, plan.suffix_start_blocks), levels,
        plan.num_common_prefix_blocks, plan.keeps_order, plan.made_for,
    )  # fmt: skip


def planner_settings(rng: np.random.Generator, block_size: int, max_model_len: int) -> list:
    """Each backend's own cost model, and four drawn near the runs' group sizes."""
    pages = pow2_buckets(4, -(-max_model_len // block_size))
    settings = [
        dict(backend=backend, page_buckets=pages if backend == "xla" else None)
        for backend in ("xla", "pallas_tpu", "pallas_gpu")
    ]
    block_bytes = SHAPES[0].kv_bytes_per_token * block_size
    for _ in range(4):
        model = CascadeCostModel(
            launch_overhead_bytes=float(rng.choice([0, 0.5, 2, 6, 20])) * block_bytes,
            merge_cost_factor=float(rng.choice([0, 0.05, 0.25, 1.0, 2.0])),
            min_saved_fraction=float(rng.choice([0, 0.1, 0.3, 0.45, 0.6])),
            reads_padded_pages=bool(rng.random() < 0.5),
        )
        settings.append(
            dict(
                cost_model=model, max_groups=int(rng.choice([1, 2, 3, 8])),
                page_buckets=pages if model.reads_padded_pages else None,
            )
        )  # fmt: skip
    return settings


def add_prompt(scheduler, rng, serial: int, systems: list, block_size: int, limit: int) -> int:
    """Queues 1-4 samples of one prompt (a system prompt's start and its own tokens, or
    tokens of its own); returns the next serial."""
    system = systems[int(rng.integers(len(systems)))]
    if rng.random() < 0.25:
        prompt = rng.integers(0, 500, int(rng.integers(1, 3 * block_size))).tolist()
    else:
        cut = int(rng.integers(block_size, len(system) + 1))
        own = int(rng.integers(1, 2 * block_size + 2))
        prompt = system[:cut] + rng.integers(0, 500, own).tolist()
    prompt = prompt[: limit // 2]
    params = SamplingParams(max_tokens=int(rng.integers(3, limit - len(prompt) - 2)))
    for _ in range(int(rng.choice([1, 1, 2, 3, 4, 4]))):
        scheduler.add_request(Request(f"q{serial}", prompt, params))
        serial += 1
    return serial


def run(seed: int, num_steps: int, counts: dict) -> None:
    """One random run: each step planned by every planner (kept across steps) and by a
    fresh one of the same settings."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 2, 4, 8, 16]))
    max_model_len = int(rng.choice([64, 128, 256]))
    max_seqs = int(rng.choice([8, 16, 32]))
    per_request = -(-max_model_len // bs)
    num_blocks = int(rng.choice([0.4, 1.0, 3.0]) * max_seqs * per_request / 2) + per_request + 2
    manager = KVCacheManager(num_blocks, bs, max_model_len=max_model_len)
    config = SchedulerConfig(
        # A small budget splits prompts into chunks of one size beside decodes.
        max_num_batched_tokens=max_seqs + int(rng.choice([3, 8, 32, 512])),
        max_num_seqs=max_seqs, max_model_len=max_model_len,
    )  # fmt: skip
    if rng.random() < 0.5:  # finished requests hold blocks for a few steps; loads land
        store = np.zeros((num_blocks, bs), np.int64)
        scheduler = Scheduler(config, manager, HoldingConnector(rng, store, bs))
    else:
        scheduler = Scheduler(config, manager)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    settings = planner_settings(rng, bs, max_model_len)
    planners = [CascadePlanner(shape, **s) for s in settings]
    systems = [[1000 + 7 * i + j for j in range(n)] for i, n in enumerate((3 * bs, 5 * bs + 1))]
    serial = 0
    for _ in range(int(rng.integers(2, 6))):
        serial = add_prompt(scheduler, rng, serial, systems, bs, max_model_len)
    arrivals = float(rng.choice([0.01, 0.05, 0.2]))
    for _ in range(num_steps):
        if rng.random() < arrivals or not (scheduler.running or scheduler.waiting):
            serial = add_prompt(scheduler, rng, serial, systems, bs, max_model_len)
        if rng.random() < 0.02 and scheduler.running:
            scheduler.abort(scheduler.running[int(rng.integers(len(scheduler.running)))].request_id)
        out = scheduler.schedule()
        if not out.num_requests:
            continue
        counts["steps"] += 1
        args = (out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens, manager)
        for planner, kwargs in zip(planners, settings, strict=True):
            plan = planner.plan(*args)
            fresh = CascadePlanner(shape, **kwargs).plan(*args)
            assert plan_fields(plan) == plan_fields(fresh), (seed, kwargs)
            counts["groups"] += any(lv.name == "groups" for lv in plan.levels)
        scheduler.update_from_output(out, rng.integers(0, 500, out.num_requests))
    counts["preemptions"] += scheduler.stats.num_preemptions


def test_reused_group_searches_plan_what_a_fresh_planner_plans(monkeypatch):
    counts = dict(steps=0, groups=0, preemptions=0, searches=0, asked=0)
    search, groups = cascade_groups.GroupSearch._search, cascade_groups.GroupSearch._groups

    def counting(name, method):
        def counted(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)

        return counted

    monkeypatch.setattr(cascade_groups.GroupSearch, "_search", counting("searches", search))
    monkeypatch.setattr(cascade_groups.GroupSearch, "_groups", counting("asked", groups))
    for seed in range(24):
        run(seed, 100, counts)
    # The runs exercised what they are for: groups levels, preemption, and searches of
    # the kept planners reused (a fresh planner searches whenever it is asked).
    assert counts["steps"] >= 1600 and counts["groups"] >= 600, counts
    assert counts["preemptions"] >= 5, counts
    assert counts["asked"] - counts["searches"] >= 0.2 * counts["asked"], counts


def sweep(seed: int, num_steps: int) -> int:
    """One batch of decoding requests (holding their blocks) planned at `num_steps` steps
    whose computed tokens grow at random rates, with query tokens that change now and
    then, by kept planners and fresh ones; returns the steps whose plans have groups."""
    rng = np.random.default_rng(seed)
    bs = int(rng.choice([1, 2, 4]))
    manager = KVCacheManager(1024, bs, max_model_len=256)
    systems = [list(range(100, 100 + 6 * bs)), list(range(300, 300 + 4 * bs + 1))]
    requests = []
    for _ in range(int(rng.integers(3, 8))):
        system = systems[int(rng.integers(2))]
        prompt = system[: int(rng.integers(bs, len(system) + 1))]
        prompt += rng.integers(0, 90, int(rng.integers(1, 3 * bs))).tolist()
        for _ in range(int(rng.choice([1, 2, 3, 4]))):
            requests.append(_decoding(manager, f"r{len(requests)}", prompt))
    ids = [r.request_id for r in requests]
    most = np.array([r.num_tokens - 1 for r in requests])  # slots held, less the query
    computed = rng.integers(0, most + 1)
    query_lens = np.ones(len(ids), np.int64)
    settings = planner_settings(rng, bs, 256)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    planners = [CascadePlanner(shape, **s) for s in settings]
    grouped = 0
    for _ in range(num_steps):
        computed = np.minimum(computed + rng.choice([0, 0, 1, bs], len(ids)), most)
        if rng.random() < 0.1:
            query_lens = rng.integers(1, 4, len(ids))
        for planner, kwargs in zip(planners, settings, strict=True):
            plan = planner.plan(ids, computed, query_lens, manager)
            fresh = CascadePlanner(shape, **kwargs).plan(ids, computed, query_lens, manager)
            assert plan_fields(plan) == plan_fields(fresh), (seed, kwargs)
            grouped += any(lv.name == "groups" for lv in plan.levels)
    return grouped


def test_reads_that_turn_as_contexts_grow_plan_what_a_fresh_planner_plans():
    assert sum(sweep(seed, 40) for seed in range(20)) >= 400
