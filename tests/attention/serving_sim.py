"""Random serving runs through the real scheduler, with KV content that names its context.

No model runs. Each step goes schedule -> CascadePlanner.plan -> the engine's own
metadata path (Engine._step_inputs) -> a host "KV write" through the metadata's
slot_mapping -> update_from_output with random tokens. The KV written at position p of
a request is a fingerprint of that request's tokens 0..p, so reading another request's
block (same position, another context), a block twice, a stale block or a padding slot
changes what a query "sees". `reads_of` lists, per valid query token, the fingerprints
every pass of the metadata lets it attend to (main pass causally, each cascade level
without a mask); the oracle is the fingerprints of the request's own tokens up to the
query's position, computed from the token ids alone, with no paging logic.

Holders outside the scheduled set come from a connector that keeps finished requests'
blocks for a few steps and serves KV loads (landed loads hold blocks past their
computed tokens), from running requests the token budget leaves out, and from
preemption under a small pool.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from jaxkv.cascade import CascadePlan, CascadePlanner
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxkv.engine import Engine
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.kv_transfer import KVConnector, TransferEvents
from jaxkv.prompt_logprobs import PromptLogprobs
from jaxkv.request import Request, SamplingParams
from jaxkv.scheduler import Scheduler, SchedulerOutput

MAX_MODEL_LEN = 64
UNWRITTEN = -1  # content of a slot no step wrote (and of the null block)
PADDING = -2  # content padded tokens write (into the null block)


def fingerprint(tokens) -> int:
    """The KV "content" of the last of `tokens` given all before it: exact in float32."""
    return hash(tuple(int(t) for t in tokens)) % (1 << 23)


class HoldingConnector(KVConnector):
    """Keeps some finished requests' blocks for 1-3 steps; serves some prompts' KV.

    A claimed load lands (its KV written into `store`) 1-2 polls after it starts, or
    fails (the scheduler then frees the blocks and recomputes).
    """

    def __init__(self, rng: np.random.Generator, store: np.ndarray, block_size: int) -> None:
        self.rng, self.store, self.block_size = rng, store, block_size
        self.now = 0
        self.num_landed = 0
        self.saves: dict[str, int] = {}  # req_id -> poll that reports it saved
        self.loads: dict[str, tuple[int, Request, list[int], bool]] = {}

    def on_finish(self, request: Request, block_ids) -> bool:
        if self.rng.random() < 0.5:
            return False
        self.saves[request.request_id] = self.now + int(self.rng.integers(1, 4))
        return True

    def on_admission(self, request: Request, num_computed_tokens: int) -> int:
        bs = self.block_size
        most = (request.num_tokens - 1) // bs * bs - num_computed_tokens
        if most < bs or num_computed_tokens % bs or self.rng.random() < 0.7:
            return 0
        return int(self.rng.integers(1, most // bs + 1)) * bs

    def start_load(self, request: Request, block_ids) -> None:
        fails = self.rng.random() < 0.2
        land = self.now + int(self.rng.integers(1, 3))
        self.loads[request.request_id] = (land, request, list(block_ids), fails)

    def poll(self) -> TransferEvents:
        self.now += 1
        saved = [r for r, t in self.saves.items() if t <= self.now]
        for r in saved:
            del self.saves[r]
        loaded, failed = [], []
        for rid, (land, request, block_ids, fails) in list(self.loads.items()):
            if land > self.now:
                continue
            del self.loads[rid]
            if fails:
                failed.append(rid)
                continue
            loaded.append(rid)
            self.num_landed += 1
            bs, first = self.block_size, request.num_computed_tokens
            tokens = request.all_token_ids
            for k, block in enumerate(block_ids):
                for o in range(bs):
                    pos = first + k * bs + o
                    self.store[block, o] = fingerprint(tokens[: pos + 1])
        return TransferEvents(saved=tuple(saved), loaded=tuple(loaded), failed_loads=tuple(failed))

    def has_pending(self) -> bool:
        return bool(self.saves or self.loads)


@dataclasses.dataclass
class Serving:
    """A scheduler over a manager, the engine's step-input path, and the KV content."""

    scheduler: Scheduler
    config: EngineConfig
    store: np.ndarray  # i64[num_blocks, block_size] content of every KV slot
    rng: np.random.Generator
    # What Engine._step_inputs reads of an Engine, one per planner (each keeps the level
    # metadata of its own last plan, as an engine does).
    inputs: dict[int, types.SimpleNamespace] = dataclasses.field(default_factory=dict)

    @property
    def manager(self) -> KVCacheManager:
        return self.scheduler.manager

    def step_inputs(self, out: SchedulerOutput, plan: CascadePlan, planner: int = 0):
        """(order, metadata, input_ids): the engine's own path from a plan to jit inputs,
        for the plans of planner number `planner`."""
        engine = self.inputs.get(planner)
        if engine is None:
            engine = self.inputs[planner] = types.SimpleNamespace(
                manager=self.manager,
                buckets=self.config.buckets,
                backend=self.config.backend,
                config=self.config,
                _sampling=types.SimpleNamespace(
                    step_arrays=lambda requests, order, rows, pos: (),
                    prompt_logprobs=PromptLogprobs(0),  # nobody asks: no prompt rows
                ),
            )
        order, md, input_ids, _, _ = Engine._step_inputs(engine, out, plan)
        return order, md, input_ids


def make_serving(
    seed: int,
    *,
    block_size: int,
    num_blocks: int,
    max_tokens: int = 32,
    max_seqs: int = 8,
    max_model_len: int = MAX_MODEL_LEN,
    max_groups: int = 2,
) -> Serving:
    rng = np.random.default_rng((seed, 1))  # a stream of its own, not the caller's
    config = EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs, max_model_len=max_model_len
        ),
        backend="xla",
        max_cascade_groups=max_groups,
        min_num_tokens_bucket=max_tokens,
        min_num_seqs_bucket=max_seqs,
        min_pages_bucket=max_model_len // block_size,
        q_len_buckets=(max_tokens,),
        pad_cascade_levels=True,
    )
    manager = KVCacheManager(num_blocks, block_size, max_model_len=max_model_len)
    store = np.full((num_blocks, block_size), UNWRITTEN, np.int64)
    scheduler = Scheduler(config.scheduler, manager, HoldingConnector(rng, store, block_size))
    return Serving(scheduler, config, store, rng)


def add_requests(serving: Serving, serial: int, count: int) -> int:
    """Queues `count` requests: under shared system prompts, n samples of one prompt,
    prompts of exactly one or two blocks; returns the next serial."""
    rng, bs = serving.rng, serving.manager.block_size
    limit = serving.config.scheduler.max_model_len
    systems = [[1000 + 7 * i + j for j in range(n)] for i, n in enumerate((3 * bs, 2 * bs + 1))]
    header = [900 + j for j in range(bs)]
    for _ in range(count):
        kind = int(rng.integers(5))
        if kind == 0:  # exactly one or two blocks
            prompt = rng.integers(0, 500, bs * int(rng.integers(1, 3))).tolist()
        elif kind == 1:  # a shared header, then one of two system prompts
            prompt = header + systems[int(rng.integers(2))] + rng.integers(0, 500, 3).tolist()
        else:
            system = systems[int(rng.integers(2))][: int(rng.integers(bs, 3 * bs + 1))]
            prompt = system + rng.integers(0, 500, int(rng.integers(1, 2 * bs + 2))).tolist()
        prompt = prompt[: limit - 8]
        params = SamplingParams(max_tokens=int(rng.integers(1, 13)))
        copies = int(rng.integers(2, 4)) if rng.random() < 0.25 else 1  # n samples
        for _ in range(copies):
            serving.scheduler.add_request(Request(f"q{serial}", prompt, params))
            serial += 1
    return serial


def batch_tokens(out: SchedulerOutput, order) -> list[tuple[Request, int]]:
    """(request, position) of every scheduled token, in batch order (`order` None:
    schedule order)."""
    order = np.arange(out.num_requests) if order is None else order
    tokens = []
    for s in order.tolist():
        request, start = out.requests[s], int(out.num_computed_tokens[s])
        tokens += [(request, start + k) for k in range(int(out.num_scheduled_tokens[s]))]
    return tokens


def write_kv(serving: Serving, tokens: list[tuple[Request, int]], md) -> None:
    """Writes this step's KV through md.slot_mapping, as write_kv does on the device
    (padded tokens included); checks the positions on the way."""
    slots = md.slot_mapping
    bs = serving.manager.block_size
    assert md.positions[: len(tokens)].tolist() == [p for _, p in tokens]
    for t, (request, pos) in enumerate(tokens):
        serving.store[slots[t] // bs, slots[t] % bs] = fingerprint(request.all_token_ids[: pos + 1])
    for t in range(len(tokens), md.max_num_tokens):
        serving.store[slots[t] // bs, slots[t] % bs] = PADDING


def reads_of(md, store: np.ndarray, num_tokens: int) -> list[list[int]]:
    """Per valid token (batch order): the content of every key some pass lets it see."""
    bs = md.block_size
    seen: list[list[int]] = [[] for _ in range(num_tokens)]
    passes = [(md, True)] + [(lv, False) for lv in md.levels]
    for p, causal in passes:
        cu, kv_lens, pages = p.cu_q_lens, p.kv_lens, p.page_indices
        for s in range(int(p.num_seqs[0])):
            start, end, kv_len = int(cu[s]), int(cu[s + 1]), int(kv_lens[s])
            keys = np.arange(kv_len)
            content = store[pages[s, keys // bs], keys % bs]
            q_len = end - start
            for t in range(start, min(end, num_tokens)):
                visible = kv_len - q_len + (t - start) + 1 if causal else kv_len
                seen[t] += content[: max(visible, 0)].tolist()
    return seen


def check_reads(store: np.ndarray, tokens: list[tuple[Request, int]], md) -> list[int]:
    """Batch token indices whose reads through `md` of the KV `store` (i64[num_blocks,
    block_size]) differ from the fingerprints of their own context."""
    seen = reads_of(md, store, len(tokens))
    bad = []
    for t, (request, pos) in enumerate(tokens):
        ids = request.all_token_ids
        want = sorted(fingerprint(ids[: j + 1]) for j in range(pos + 1))
        if sorted(seen[t]) != want:
            bad.append(t)
    return bad


def brute_common_prefix(manager: KVCacheManager, request_ids: list[str]) -> int:
    """Leading block columns identical across every request's block ids (a plain loop)."""
    rows = [manager.block_ids(r) for r in request_ids]
    n = 0
    while all(len(r) > n for r in rows) and len({r[n] for r in rows}) == 1:
        n += 1
    return n if len(rows) > 1 else len(rows[0])


def check_plan(manager: KVCacheManager, out: SchedulerOutput, plan: CascadePlan) -> None:
    """The plan against the manager's rows and block ids: exact common prefix, rows, each
    group's blocks alike in its members and leader row, no prefix over a query token."""
    bs = manager.block_size
    ids = out.request_ids
    plan.check()  # the planner skips it; its plans must pass it (order a permutation)
    assert plan.rows.tolist() == manager.rows_of([ids[i] for i in plan.order]).tolist()
    assert plan.num_common_prefix_blocks == brute_common_prefix(manager, ids)
    for level in plan.levels:
        for g in range(level.num_groups):
            members = [ids[i] for i in plan.order[level.group_starts[g] : level.group_ends[g]]]
            b0, b1 = int(level.block_starts[g]), int(level.block_ends[g])
            read = manager.block_table[level.leader_rows[g], b0:b1].tolist()  # the level's
            blocks = {tuple(manager.block_ids(r)[b0:b1]) for r in members} | {tuple(read)}
            assert len(blocks) == 1 and len(next(iter(blocks))) == b1 - b0, (level.name, g)
            for r in members:
                computed = int(out.num_computed_tokens[ids.index(r)])
                assert b1 * bs <= computed, (level.name, g, r, b1, computed)


def check_complete(
    manager: KVCacheManager, out: SchedulerOutput, plan: CascadePlan, max_groups: int
) -> None:
    """For a planner whose every level pays (no cost, no page buckets): cascade is never
    left off where it is valid. The global level reads the exact common prefix capped at
    the least computed whole blocks; under each run of two or more requests holding the
    same blocks one column past it (and having computed that column), the groups are
    those that save most block reads (_best_groups) when they are at most `max_groups`
    in all. From block ids and counts alone, as brute_common_prefix."""
    bs = manager.block_size
    ids = out.request_ids
    if len(ids) < 2:
        assert not plan.levels
        return
    blocks = [manager.block_ids(r) for r in ids]
    computed = [int(n) // bs for n in out.num_computed_tokens]
    k0 = min(brute_common_prefix(manager, ids), min(computed))
    names = [lv.name for lv in plan.levels]
    if k0:
        assert names[:1] == ["global"] and int(plan.levels[0].block_ends[0]) == k0
    else:
        assert "global" not in names
    want = []
    for members in _runs(blocks, range(len(ids)), computed, k0):
        want += _best_groups(manager, ids, blocks, members, computed, k0)[1]
    if not want or len(want) > max_groups:
        return
    assert names[-1:] == ["groups"]
    level = plan.levels[-1]
    got = set()
    for g in range(level.num_groups):
        members = plan.order[level.group_starts[g] : level.group_ends[g]].tolist()
        got.add((tuple(sorted(members)), int(level.block_ends[g])))
    assert got == set(want), (got, want)


def _runs(blocks: list[list[int]], members, computed: list[int], column: int) -> list[list[int]]:
    """The runs of two or more `members` that have computed block `column` and hold the
    same block ids in columns 0..column."""
    runs: dict[tuple, list[int]] = {}
    for i in members:
        if computed[i] > column:
            runs.setdefault(tuple(blocks[i][: column + 1]), []).append(i)
    return [run for run in runs.values() if len(run) > 1]


def _best_groups(
    manager: KVCacheManager,
    ids: list[str],
    blocks: list[list[int]],  # each request's block ids
    members: list[int],
    computed: list[int],
    k0: int,
) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
    """(blocks saved, [(members, end)]) of the groups kept of a run when every level pays:
    one group of all `members`, ending where their shared and computed blocks end and
    saving (members - 1) x its blocks past k0, or, if they save more together, the
    groups kept of each run of those that computed past that end and hold the same
    blocks one column further (past a member's cut, or where some diverge from the
    rest) beside a group of the members in none of those (two or more: they still share
    the blocks up to that end); one group on ties."""
    shared = brute_common_prefix(manager, [ids[i] for i in members])
    end = min(shared, *(computed[i] for i in members))
    saved, groups = 0, []
    for run in _runs(blocks, members, computed, end):
        run_saved, run_groups = _best_groups(manager, ids, blocks, run, computed, k0)
        saved, groups = saved + run_saved, groups + run_groups
    grouped = {i for group, _ in groups for i in group}
    rest = [i for i in members if i not in grouped]
    if groups and len(rest) > 1:
        saved, groups = saved + (len(rest) - 1) * (end - k0), [*groups, (tuple(rest), end)]
    own = (len(members) - 1) * (end - k0)
    return (own, [(tuple(members), end)]) if own >= saved else (saved, groups)


def fresh_plan(planner: CascadePlanner, out: SchedulerOutput, manager: KVCacheManager):
    copy = CascadePlanner(
        planner.shape,
        cost_model=planner.cost_model,
        enable_groups=planner.enable_groups,
        max_groups=planner.max_groups,
        page_buckets=planner.page_buckets,
    )
    return copy.plan(out.request_ids, out.num_computed_tokens, out.num_scheduled_tokens, manager)


def left_out_requests(
    manager: KVCacheManager, out: SchedulerOutput, merge_per_query: float, kv_bytes_per_token: int
) -> list[int]:
    """Scheduled indices of the requests whose queries' merge (merge_per_query bytes per
    query token) costs at least the read of the blocks they could share in a level: their
    computed whole blocks, up to the longest prefix of block ids they hold alike with
    another scheduled request. From block ids and counts alone, as brute_common_prefix."""
    bs = manager.block_size
    ids = out.request_ids
    left = []
    for i, rid in enumerate(ids):
        shared = max(
            (brute_common_prefix(manager, [rid, other]) for other in ids if other != rid),
            default=0,
        )
        blocks = min(shared, int(out.num_computed_tokens[i]) // bs)
        queries = int(out.num_scheduled_tokens[i])
        if blocks and queries * merge_per_query >= blocks * bs * kv_bytes_per_token:
            left.append(i)
    return left


def check_left_out(
    manager: KVCacheManager,
    out: SchedulerOutput,
    plan: CascadePlan,
    merge_per_query: float,
    kv_bytes_per_token: int,
) -> list[int]:
    """The requests left_out_requests names join no group of a "groups" level (a global
    level spans the batch: one holds them all where the planner weighed it heavier than
    groups from block 0 without them). Returns them."""
    left = left_out_requests(manager, out, merge_per_query, kv_bytes_per_token)
    for level in plan.levels:
        if level.name == "groups":
            grouped = plan.order[level.group_starts[0] : level.group_ends[-1]].tolist()
            assert not set(left) & set(grouped), (left, grouped)
    return left
