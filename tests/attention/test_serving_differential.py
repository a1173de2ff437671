"""Random serving runs: scheduler -> planner -> the engine's metadata path -> attention.

Host part (no JAX): every step of random runs through the real scheduler (chunked
prefill, n samples of one prompt, prompts of exactly one block, cache hits covering all
but the last token, preemption under a small pool, finished requests still holding
blocks for a KV save, KV loads that land or fail, running requests the budget leaves
out) is planned by six planners (two-group cap, eight-group cap, the xla backend's own
cost model and page-bucket rule, no groups, a call that groups may pay only together, a
merge cost that leaves long prefill chunks out: serving_sim.check_left_out).
Each plan must give the exact common prefix of the scheduled set, identical blocks
across every group and no prefix over a member's query token; where every level pays,
none may be left out (serving_sim.check_complete); a planner reused across
steps must plan what a fresh one plans; and through the metadata every valid query must
attend to exactly the KV of its own context (serving_sim.reads_of against fingerprints
of its tokens). Runs in which some steps fail before writing KV (Scheduler.discard,
cancelling the loads those steps started) must read the same way: a cache hit on a
block a failed step was to write reads unwritten content.

Device part: steps of such a run with each level structure go through
jaxkv.attention.paged_attention on the 'xla' backend and the Pallas GPU kernel in
interpret mode, as built and with every padding entry poisoned, against float64 softmax
over each request's own keys, looked up by the fingerprint of its tokens (no block
table, no paging).
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import paged_attention
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlan, CascadePlanner
from tests.attention import serving_sim as sim
from tests.kernels.harness import INTERPRET_GPU, INTERPRET_TPU

# The kernels run compiled on their own device, interpreted elsewhere.
INTERPRET = {"xla": False, "pallas_gpu": INTERPRET_GPU, "pallas_tpu": INTERPRET_TPU}

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
SM_SCALE = HEAD_DIM**-0.5
SHAPE = AttentionShape(NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, kv_itemsize=4)
ALWAYS = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0)
TOGETHER = CascadeCostModel(launch_overhead_bytes=3000, merge_cost_factor=0)
# A query's merge (204 bytes) costs less than a token's KV read (256): only prefill chunks
# are left out of cascade (serving_sim.check_left_out).
MERGING = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0.25)
NUM_STEPS = 40


def _planners(serving: sim.Serving) -> list[CascadePlanner]:
    pages = serving.config.buckets.page_buckets
    return [
        CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=2, page_buckets=pages),
        CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=8),
        CascadePlanner(SHAPE, backend="xla", page_buckets=pages),
        CascadePlanner(SHAPE, cost_model=ALWAYS, enable_groups=False),
        # A call costs about what a group of the runs saves: some groups pay only together.
        CascadePlanner(SHAPE, cost_model=TOGETHER),
        CascadePlanner(SHAPE, cost_model=MERGING),
    ]


def _plan_fields(plan: CascadePlan) -> tuple:
    levels = tuple(
        (lv.name, *(a.tolist() for a in (lv.group_starts, lv.group_ends, lv.block_starts,
                                         lv.block_ends, lv.leader_rows)))
        for lv in plan.levels
    )  # fmt: skip
    return plan.order.tolist(), plan.suffix_start_blocks.tolist(), levels


def _pays_alone(planner: CascadePlanner, out, plan: CascadePlan, *, bs: int) -> list[bool]:
    """Per group of the plan's groups level: whether it pays a call of its own."""
    level = plan.levels[-1]
    verdicts = []
    for g in range(level.num_groups):
        members = plan.order[level.group_starts[g] : level.group_ends[g]]
        queries = int(out.num_scheduled_tokens[members].sum())
        context = int(out.num_computed_tokens[members].sum()) + queries
        prefix = int(level.block_ends[g] - level.block_starts[g]) * bs
        verdicts.append(planner.pays(len(members), prefix, queries, context))
    return verdicts


def random_run(seed: int) -> tuple[np.random.Generator, sim.Serving]:
    """The random stream and serving setup of one random run (see random_steps)."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.choice([1, 2, 4]))
    # From barely a full-length request's blocks (preemption) to roomy.
    num_blocks = int(rng.choice([1.1, 1.6, 6.0]) * sim.MAX_MODEL_LEN / block_size) + 2
    serving = sim.make_serving(
        seed, block_size=block_size, num_blocks=num_blocks,
        max_tokens=int(rng.choice([8, 16, 32])), max_groups=8,
    )  # fmt: skip
    return rng, serving


def random_steps(rng: np.random.Generator, serving: sim.Serving, num_steps: int):
    """Yields the SchedulerOutput of each of `num_steps` schedule() calls that scheduled
    something, after random arrivals and aborts; the caller applies or discards each
    before the next."""
    scheduler = serving.scheduler
    serial = sim.add_requests(serving, 0, 4)
    for _ in range(num_steps):
        if rng.random() < 0.3:
            serial = sim.add_requests(serving, serial, int(rng.integers(1, 4)))
        if rng.random() < 0.05 and scheduler.running:
            victim = scheduler.running[int(rng.integers(len(scheduler.running)))]
            scheduler.abort(victim.request_id)
        out = scheduler.schedule()
        if out.num_requests:
            yield out


def serve(seed: int, visit=None) -> dict[str, int]:
    """One random run of NUM_STEPS steps with every check above; returns counts of what
    it exercised. `visit(serving, out, plan, md, tokens)` sees each step of the first
    planner after its KV is written."""
    seen: dict[str, int] = {}

    def count(name: str, happened=True) -> None:
        seen[name] = seen.get(name, 0) + bool(happened)

    rng, serving = random_run(seed)
    planners = _planners(serving)
    scheduler, manager = serving.scheduler, serving.manager
    block_size = manager.block_size
    for out in random_steps(rng, serving, NUM_STEPS):
        count("holders", len(manager.request_ids) > out.num_requests)
        count("partial", (out.num_computed_tokens % block_size).any())
        for k, planner in enumerate(planners):
            plan = planner.plan(
                out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens, manager
            )
            sim.check_plan(manager, out, plan)
            if k == 1:  # every level pays: none may be left out
                sim.check_complete(manager, out, plan, planner.max_groups)
            if k == 4 and plan.levels and plan.levels[-1].name == "groups":
                count("together", not all(_pays_alone(planner, out, plan, bs=block_size)))
            if k == 5:
                merge = MERGING.cost_bytes(1, NUM_Q_HEADS, HEAD_DIM)
                left = sim.check_left_out(manager, out, plan, merge, SHAPE.kv_bytes_per_token)
                count("left out", bool(left) and plan.levels)
            fresh = sim.fresh_plan(planner, out, manager)
            assert _plan_fields(plan) == _plan_fields(fresh), (seed, k)
            order, md, input_ids = serving.step_inputs(out, plan, k)
            tokens = sim.batch_tokens(out, order)
            want_ids = [request.all_token_ids[pos] for request, pos in tokens]
            assert input_ids[: len(tokens)].tolist() == want_ids
            if k == 0:  # the KV of this step's tokens lands before any pass reads it
                sim.write_kv(serving, tokens, md)
                count("+".join(lv.name for lv in plan.levels) or "flat")
                if visit is not None:
                    visit(serving, out, plan, md, tokens)
            assert sim.check_reads(serving.store, tokens, md) == [], (seed, k)
        scheduler.update_from_output(out, rng.integers(0, 500, out.num_requests))
    count("preemptions", scheduler.stats.num_preemptions)
    count("loads", scheduler.connector.num_landed)
    return seen


def test_random_serving_runs_read_exactly_their_own_context():
    totals: dict[str, int] = {}
    for seed in range(32):
        for name, n in serve(seed).items():
            totals[name] = totals.get(name, 0) + n
    # The runs exercised what they are for.
    names = ("global", "groups", "global+groups", "holders", "partial", "preemptions", "loads")
    for name in (*names, "together", "left out"):
        assert totals.get(name, 0) >= 3, totals


def serve_with_failed_steps(seed: int, num_steps: int = 60) -> tuple[int, int]:
    """A random run in which a fifth of the steps fail before writing any KV
    (Scheduler.discard, as Engine.step does); every step that runs must still read
    exactly its own context. Returns (failed steps, loads those failures cancelled)."""
    rng, serving = random_run(seed)
    planner = _planners(serving)[1]
    scheduler, manager = serving.scheduler, serving.manager
    failed = cancelled = 0
    for out in random_steps(rng, serving, num_steps):
        if rng.random() < 0.2:
            cancelled += len(scheduler._transfers._new_loads)  # loads this schedule started
            scheduler.discard(out)
            manager.check_integrity()
            failed += 1
            continue
        plan = planner.plan(
            out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens, manager
        )
        sim.check_plan(manager, out, plan)
        order, md, _ = serving.step_inputs(out, plan, 1)
        tokens = sim.batch_tokens(out, order)
        sim.write_kv(serving, tokens, md)
        assert sim.check_reads(serving.store, tokens, md) == [], seed
        scheduler.update_from_output(out, rng.integers(0, 500, out.num_requests))
    return failed, cancelled


def test_runs_with_failed_steps_never_read_kv_the_failed_steps_were_to_write():
    # A failed step's blocks leave the prefix cache and its new loads are cancelled; a
    # cache hit on any of them would show here as a read of UNWRITTEN content.
    totals = np.sum([serve_with_failed_steps(seed) for seed in range(40)], axis=0)
    assert totals[0] >= 100 and totals[1] >= 10, totals


def test_the_context_check_catches_a_short_level_and_a_foreign_block():
    found = []

    def visit(serving, out, plan, md, tokens):
        if not found and md.levels:
            found.append((serving.store.copy(), md, tokens))

    serve(0, visit)
    store, md, tokens = found[0]
    assert sim.check_reads(store, tokens, md) == []
    level = md.levels[-1]
    g = int(np.flatnonzero(level.kv_lens)[0])
    group_tokens = list(range(int(level.cu_q_lens[g]), int(level.cu_q_lens[g + 1])))
    # One key fewer in the level: exactly the group's tokens miss it.
    kv_lens = level.kv_lens.copy()
    kv_lens[g] -= 1
    short = dataclasses.replace(level, kv_lens=kv_lens)
    short_md = dataclasses.replace(md, levels=(*md.levels[:-1], short))
    assert sim.check_reads(store, tokens, short_md) == group_tokens
    # The level's first page replaced by a block no scheduled request reads there.
    pages = level.page_indices.copy()
    pages[g, 0] = next(b for b in range(1, len(store)) if b not in md.page_indices)
    foreign = dataclasses.replace(level, page_indices=pages)
    foreign_md = dataclasses.replace(md, levels=(*md.levels[:-1], foreign))
    assert sim.check_reads(store, tokens, foreign_md) == group_tokens


@functools.cache
def _key_vector(content: int) -> np.ndarray:
    """f64[2 * Hkv, D]: the K/V a KV slot of this content holds (NaN for never-written
    slots and padding), a function of the content only."""
    if content < 0:
        return np.full((2 * NUM_KV_HEADS, HEAD_DIM), np.nan)
    return np.random.default_rng(content).standard_normal((2 * NUM_KV_HEADS, HEAD_DIM))


def _dense(tokens, q: np.ndarray) -> np.ndarray:
    """f64[len(tokens), Hq, D]: causal softmax of each token over its own context's K/V,
    looked up by the fingerprints of its tokens."""
    group = NUM_Q_HEADS // NUM_KV_HEADS
    out = []
    for t, (request, pos) in enumerate(tokens):
        ids = request.all_token_ids
        kv = np.stack([_key_vector(sim.fingerprint(ids[: j + 1])) for j in range(pos + 1)])
        k = np.repeat(kv[:, 0::2], group, axis=1)
        v = np.repeat(kv[:, 1::2], group, axis=1)
        logits = np.einsum("hd,khd->hk", q[t].astype(np.float64), k) * SM_SCALE
        p = np.exp(logits - logits.max(-1, keepdims=True))
        out.append(np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), v))
    return np.stack(out)


def _recorded_steps() -> dict[str, tuple]:
    """The first step of each level structure in run 2: (metadata, tokens, KV store)."""
    steps = {}

    def visit(serving, out, plan, md, tokens):
        name = "+".join(lv.name for lv in plan.levels) or "flat"
        steps.setdefault(name, (md, tokens, serving.store.copy()))

    serve(2, visit)
    assert {"flat", "groups", "global+groups"} <= set(steps), set(steps)
    return steps


def _poisoned(md, num_blocks: int, rng: np.random.Generator):
    """md with every entry a pass must not read made adversarial (same shapes, so the
    same program): page-table entries past each sequence's keys and all of rows past
    num_seqs hold real block ids, and those rows get the longest length and unsorted
    token offsets."""

    def poison(p):
        n, bs = int(p.num_seqs[0]), md.block_size
        cu, kv_lens, pages = (np.array(a, np.int32) for a in (p.cu_q_lens, p.kv_lens,
                                                              p.page_indices))  # fmt: skip
        used = -(-kv_lens // bs)
        used[n:] = 0
        spare = np.arange(pages.shape[1])[None, :] >= used[:, None]
        pages[spare] = rng.integers(1, num_blocks, int(spare.sum()))
        kv_lens[n:] = pages.shape[1] * bs
        cu[n + 1 :] = np.resize([md.max_num_tokens, 0], len(cu) - n - 1)
        return dataclasses.replace(p, cu_q_lens=cu, kv_lens=kv_lens, page_indices=pages)

    return dataclasses.replace(poison(md), levels=tuple(poison(lv) for lv in md.levels))


@pytest.mark.parametrize(
    "backend, structures",
    [("xla", ("flat", "groups", "global+groups")), ("pallas_gpu", ("global+groups",))],
)
def test_attention_over_random_serving_steps_equals_the_dense_oracle(backend, structures):
    # Slots no step wrote, the null block and padded query rows hold NaN; the metadata
    # runs as built and with its padding poisoned.
    steps = _recorded_steps()
    rng = np.random.default_rng(0)
    for name in structures:
        md, tokens, store = steps[name]
        kv = np.stack([np.stack([_key_vector(int(c)) for c in row]) for row in store])
        q = rng.standard_normal((md.max_num_tokens, NUM_Q_HEADS, HEAD_DIM))
        q[len(tokens) :] = np.nan
        want = _dense(tokens, q)
        for metadata in (md, _poisoned(md, len(store), rng)):
            out = paged_attention(
                jnp.asarray(q, jnp.float32), jnp.asarray(kv, jnp.float32), metadata,
                sm_scale=SM_SCALE, backend=backend, interpret=INTERPRET[backend],
            )  # fmt: skip
            out = np.asarray(out, np.float64)
            np.testing.assert_allclose(out[: len(tokens)], want, atol=2e-5, rtol=2e-5, err_msg=name)
            assert not out[len(tokens) :].any(), name
