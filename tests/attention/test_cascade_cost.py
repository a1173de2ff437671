"""The cascade cost model: its arithmetic, its units (one device's heads under tensor
parallelism), one call for a whole groups level however many groups it holds, the
max_groups cap on that level, and the last context for which a level pays."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.cascade import DEFAULT_COST_MODELS, AttentionShape, CascadeCostModel, CascadePlanner
from jaxkv.config import EngineConfig
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, _decoding, _plan, _prefilled

LLAMA_8B = AttentionShape(num_q_heads=32, num_kv_heads=8, head_dim=128, kv_itemsize=2)


@pytest.mark.parametrize(
    "tp, heads",
    [(1, (32, 8)), (2, (16, 4)), (8, (4, 1)), (16, (2, 1)), (32, (1, 1))],
)
def test_per_device_heads_follow_the_sharding(tp, heads):
    # jaxkv.sharding splits query and KV heads evenly over the mesh, and gives every
    # device one (replicated) KV head once the mesh has more devices than KV heads.
    shape = LLAMA_8B.per_device(tp)
    assert (shape.num_q_heads, shape.num_kv_heads) == heads
    assert (shape.head_dim, shape.kv_itemsize) == (128, 2)


@pytest.mark.parametrize("tp", [0, 3, 64, 2.0, True])  # True was taken as 1
def test_per_device_refuses_a_size_that_cannot_split_the_query_heads(tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLAMA_8B.per_device(tp)


@pytest.mark.parametrize("kv_heads, tp", [(6, 4), (3, 4), (4, 6)])
def test_per_device_refuses_a_size_that_cannot_split_the_kv_heads(kv_heads, tp):
    # As jaxkv.sharding refuses such a mesh: 6 KV heads over 4 devices were taken as one
    # KV head a device, so the cost model weighed a shape no mesh runs.
    shape = AttentionShape(num_q_heads=12, num_kv_heads=kv_heads, head_dim=64, kv_itemsize=2)
    with pytest.raises(ValueError, match=f"must divide num_kv_heads={kv_heads} or be a multiple"):
        shape.per_device(tp)
    assert shape.per_device(kv_heads).num_kv_heads == 1


def test_a_prefix_that_pays_on_one_device_need_not_pay_per_device_of_eight():
    # Four requests sharing 1024 tokens save 3 * 1024 * 4 KiB = 12 MiB of KV reads on one
    # device, more than the 8 MiB a TPU call costs; split over 8 devices each saves
    # 1.5 MiB per call of its own, which does not pay.
    whole = CascadePlanner(LLAMA_8B, backend="pallas_tpu")
    per_device = CascadePlanner(LLAMA_8B.per_device(8), backend="pallas_tpu")
    assert DEFAULT_COST_MODELS["pallas_tpu"].launch_overhead_bytes == 8 << 20
    args = dict(num_requests=4, prefix_tokens=1024, num_query_tokens=4, context_tokens=4100)
    assert whole.pays(**args)
    assert not per_device.pays(**args)


def _system_prompt_batch(num_groups: int, per_group: int, prompt_tokens: int):
    """Decoding requests, `per_group` under each of `num_groups` system prompts."""
    manager = KVCacheManager(4096, 16, max_model_len=2048)
    requests = []
    for g in range(num_groups):
        system = list(range(10_000 * (g + 1), 10_000 * (g + 1) + prompt_tokens))
        for i in range(per_group):
            own = [5000 + 100 * g + i] * 3
            requests.append(_decoding(manager, f"r{g}_{i}", system + own))
    computed = np.array([r.num_tokens - 1 for r in requests])  # all but the decode token
    return manager, [r.request_id for r in requests], computed, np.ones(len(requests), int)


def test_groups_that_pay_only_together_share_the_levels_one_call():
    # Four system prompts of 512 tokens, four decoding requests under each: one group
    # saves 3 * 512 * 4 KiB = 6 MiB, less than the 8 MiB of a TPU call, but the groups
    # level is one call for all four groups, which together save 24 MiB.
    manager, ids, computed, query_lens = _system_prompt_batch(4, 4, 512)
    planner = CascadePlanner(LLAMA_8B, backend="pallas_tpu")
    assert not planner.pays(4, 512, 4, 4 * 516)
    plan = planner.plan(ids, computed, query_lens, manager)
    assert [lv.name for lv in plan.levels] == ["groups"]
    (level,) = plan.levels
    assert level.group_starts.tolist() == [0, 4, 8, 12]
    assert level.block_ends.tolist() == [32] * 4
    assert plan.suffix_start_blocks.tolist() == [32] * 16


def test_groups_that_do_not_pay_even_together_stay_flat():
    # Two prompts under two requests each: 2 x 2 MiB saved, less than one 8 MiB call.
    manager, ids, computed, query_lens = _system_prompt_batch(2, 2, 512)
    plan = CascadePlanner(LLAMA_8B, backend="pallas_tpu").plan(ids, computed, query_lens, manager)
    assert not plan.uses_cascade


def test_cost_model_arithmetic():
    model = CascadeCostModel(launch_overhead_bytes=1000, merge_cost_factor=0)
    # (4 - 1) requests' copies of 10 tokens at 2 * 1 * 8 * 2 = 32 bytes each = 960 bytes.
    kw = dict(num_query_tokens=4, num_q_heads=1, num_kv_heads=1, head_dim=8, kv_itemsize=2)
    assert not model.pays(num_requests=4, prefix_tokens=10, **kw)
    assert model.pays(num_requests=5, prefix_tokens=10, **kw)  # 1280 bytes
    # The merge reads two float32 partials (out and lse: head_dim + 1 values) and writes
    # one, per query token and head: 2 tokens x 4 heads x 9 x 4 bytes x 3 = 864 bytes.
    assert CascadeCostModel(0, merge_cost_factor=1.0).cost_bytes(2, 4, 8) == 864
    assert CascadeCostModel(100, merge_cost_factor=0.5).cost_bytes(2, 4, 8) == 100 + 432
    # min_saved_fraction compares bytes with bytes: 1 x 10 tokens saved out of the
    # requests' whole contexts (100 tokens: a tenth; 20, the two prefixes alone: a half).
    half = CascadeCostModel(0, merge_cost_factor=0, min_saved_fraction=0.5)
    kw = dict(num_query_tokens=1, num_q_heads=1, num_kv_heads=1, head_dim=8, kv_itemsize=2)
    assert not half.pays(num_requests=2, prefix_tokens=10, context_tokens=100, **kw)
    assert half.pays(num_requests=2, prefix_tokens=10, context_tokens=20, **kw)
    assert half.pays(num_requests=2, prefix_tokens=10, **kw)  # no context: no such test


def test_the_groups_level_keeps_the_max_groups_that_save_most():
    # Four system prompts of two blocks under 2, 3, 4 and 5 decoding requests: with
    # max_groups=2 the level keeps the groups of 5 and 4 requests.
    m = KVCacheManager(256, 4, max_model_len=64)
    reqs = []
    for p, count in enumerate((2, 3, 4, 5)):
        system = list(range(100 * (p + 1), 100 * (p + 1) + 8))
        reqs += [_decoding(m, f"p{p}r{i}", system + [i, 50 + i]) for i in range(count)]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=2), m, reqs)
    (level,) = plan.levels
    sizes = (level.group_ends - level.group_starts).tolist()
    assert sorted(sizes) == [4, 5]
    kept = {reqs[i].request_id[:2] for i in plan.order[: sum(sizes)]}
    assert kept == {"p2", "p3"}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"launch_overhead_bytes": float("nan")}, "launch_overhead_bytes=nan"),
        ({"launch_overhead_bytes": "1MiB"}, "launch_overhead_bytes='1MiB'"),
        ({"merge_cost_factor": -1.0}, "merge_cost_factor=-1.0"),
        ({"merge_cost_factor": float("inf")}, "merge_cost_factor=inf"),
        ({"min_saved_fraction": None}, "min_saved_fraction=None"),
        ({"min_saved_fraction": 1.5}, r"min_saved_fraction=1.5 must be in \[0, 1\)"),
        # Cascade saves (R - 1) of R copies of a prefix each context holds: never them all.
        ({"min_saved_fraction": 1}, r"min_saved_fraction=1.0 must be in \[0, 1\)"),
        ({"min_saved_fraction": -0.1}, "min_saved_fraction=-0.1"),
        ({"min_saved_fraction": True}, "min_saved_fraction=True"),
        ({"min_requests": 0}, "min_requests=0"),
        ({"min_requests": 1}, "min_requests=1 must be an int >= 2"),
        ({"min_requests": -3}, "min_requests=-3"),
        ({"min_requests": None}, "min_requests=None"),
        ({"launch_overhead_bytes": True}, "launch_overhead_bytes=True"),
        ({"min_requests": True}, "min_requests=True"),
        ({"min_requests": 2.0}, "min_requests=2.0"),
        ({"reads_padded_pages": "no"}, "reads_padded_pages='no'"),
    ],
)
def test_cost_model_fields_are_checked_on_construction(kwargs, match):
    # A NaN cost turned cascade off silently; a str was accepted by EngineConfig and then
    # failed inside the planner at every step.
    with pytest.raises(ValueError, match=match):
        CascadeCostModel(**kwargs)


@pytest.mark.parametrize(
    "name", ["launch_overhead_bytes", "merge_cost_factor", "min_saved_fraction"]
)
@pytest.mark.parametrize("value", [np.array(0.5), jnp.array(0.5), np.float32(0.5)])
def test_cost_model_stores_array_costs_as_floats_and_stays_hashable(name, value):
    # A 0-d array was stored as given: the model, and an EngineConfig holding it, could
    # not be hashed.
    model = CascadeCostModel(**{name: value})
    assert type(getattr(model, name)) is float
    assert model == CascadeCostModel(**{name: 0.5})
    assert hash(model) == hash(CascadeCostModel(**{name: 0.5}))
    assert hash(EngineConfig(cascade_cost_model=model)) == hash(
        EngineConfig(cascade_cost_model=CascadeCostModel(**{name: 0.5}))
    )


def test_cost_model_refuses_a_cost_too_large_for_a_float():
    # 10**400 passed the check (it compares below inf), then every pays() raised
    # OverflowError inside the planner.
    with pytest.raises(ValueError, match="launch_overhead_bytes=1000"):
        CascadeCostModel(launch_overhead_bytes=10**400)


@pytest.mark.parametrize(
    "args,match",
    [
        ((0, 1, 8), "num_q_heads=0"),
        ((4, 0, 8), "num_kv_heads=0"),
        ((4, 2, 8.0), "head_dim=8.0"),
        ((4, 2, True), "head_dim=True"),
        ((4, 3, 8), "multiple of"),
        ((4, 2, 8, -2), "kv_itemsize=-2"),
    ],
)
def test_attention_shape_fields_are_checked_on_construction(args, match):
    with pytest.raises(ValueError, match=match):
        AttentionShape(*args)


@pytest.mark.parametrize(("min_saved_fraction", "cascade"), [(0.2, True), (0.4, False)])
def test_min_saved_fraction_counts_the_query_tokens_flat_attention_reads(
    min_saved_fraction, cascade
):
    # Two requests share 4 blocks (16 tokens) and each prefills 16 more: flat attention
    # reads 2 x 32 tokens, so one copy of the prefix saved is a quarter of it (half of
    # the 32 computed tokens alone).
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_prefilled(m, f"r{i}", list(range(16)) + [100 * (i + 1)] * 16) for i in range(2)]
    model = CascadeCostModel(0, merge_cost_factor=0, min_saved_fraction=min_saved_fraction)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model), m, reqs, query_lens=[16, 16])
    assert plan.uses_cascade == cascade


def test_the_cost_model_boundaries_are_exact():
    # One head of one byte: a prefix token is 2 bytes (K and V); 2 requests sharing 4
    # tokens save 8 bytes, and flat attention over 16 context tokens reads 32.
    shape = dict(num_q_heads=1, num_kv_heads=1, head_dim=1, kv_itemsize=1, num_query_tokens=1)
    free = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0.0)
    assert free.pays(num_requests=2, prefix_tokens=4, **shape)  # min_requests=2 is enough
    assert not free.pays(num_requests=1, prefix_tokens=4, **shape)
    assert not free.pays(num_requests=2, prefix_tokens=0, **shape)

    def costing(launch: float) -> CascadeCostModel:
        return CascadeCostModel(launch_overhead_bytes=launch, merge_cost_factor=0.0)

    assert costing(7.5).pays(num_requests=2, prefix_tokens=4, **shape)
    assert not costing(8).pays(num_requests=2, prefix_tokens=4, **shape)  # saves only its cost

    def needing(fraction: float) -> CascadeCostModel:
        return CascadeCostModel(0, merge_cost_factor=0.0, min_saved_fraction=fraction)

    assert needing(0.25).pays(num_requests=2, prefix_tokens=4, context_tokens=16, **shape)
    assert not needing(0.26).pays(num_requests=2, prefix_tokens=4, context_tokens=16, **shape)


class _PaysOnly:
    """A cost model with nothing but the pays method CascadePlanner asks for."""

    def __init__(self, verdict: bool) -> None:
        self.verdict = verdict

    def pays(self, **_) -> bool:
        return self.verdict


def test_a_cost_model_with_only_a_pays_method_plans_flat_when_nothing_pays():
    # The planner accepts it; the groups search must not then ask it for cost_bytes.
    m = KVCacheManager(128, 4, max_model_len=128)
    reqs = [_decoding(m, f"r{i}", list(range(100, 132)) + [i, i + 1]) for i in range(4)]
    assert not _plan(CascadePlanner(SHAPE, cost_model=_PaysOnly(False)), m, reqs).uses_cascade


def test_no_cost_model_verdict_makes_a_level_for_one_request_or_over_no_block():
    planner = CascadePlanner(SHAPE, cost_model=_PaysOnly(True))
    m = KVCacheManager(128, 4, max_model_len=128)
    alone = [_decoding(m, "alone", list(range(100, 132)) + [1])]
    assert not _plan(planner, m, alone).uses_cascade
    apart = [_decoding(m, f"r{i}", [1000 * (i + 1) + t for t in range(9)]) for i in range(3)]
    assert not _plan(planner, m, apart).uses_cascade


def test_a_cost_model_with_only_a_pays_method_keeps_the_global_level_over_groups():
    # It has no costs to weigh dropping the global level for groups from block 0 with:
    # the level it pays stays, with the groups under it.
    m = KVCacheManager(256, 4, max_model_len=128)
    head = list(range(100, 108))  # 2 blocks under two 4-block prompts
    a, b = head + list(range(300, 316)), head + list(range(400, 416))
    reqs = [_decoding(m, f"a{i}", a + [i, i + 1]) for i in range(3)]
    reqs += [_decoding(m, f"b{i}", b + [i, i + 1]) for i in range(2)]
    plan = _plan(CascadePlanner(SHAPE, cost_model=_PaysOnly(True)), m, reqs)
    glob, groups = plan.levels
    assert (glob.name, glob.block_ends.tolist()) == ("global", [2])
    assert (groups.block_starts.tolist(), groups.block_ends.tolist()) == ([2, 2], [6, 6])


def test_a_cost_model_with_only_a_pays_method_keeps_the_group_saving_most_blocks_read():
    # Past max_groups, groups are weighed by the bytes they save: (members - 1) reads of
    # their prefix. Three requests over 6 blocks save 12 block reads, two over 10 save 10.
    m = KVCacheManager(256, 4, max_model_len=128)
    a, b = list(range(300, 324)), list(range(400, 440))
    reqs = [_decoding(m, f"a{i}", a + [i, i + 1]) for i in range(3)]
    reqs += [_decoding(m, f"b{i}", b + [i, i + 1]) for i in range(2)]
    plan = _plan(CascadePlanner(SHAPE, cost_model=_PaysOnly(True), max_groups=1), m, reqs)
    (level,) = plan.levels
    assert (level.name, level.block_ends.tolist()) == ("groups", [6])
    assert plan.rows[level.group_starts[0] : level.group_ends[0]].tolist() == [0, 1, 2]


PAYS_ARGS = dict(
    num_requests=4, prefix_tokens=10, num_query_tokens=4, num_q_heads=1, num_kv_heads=1,
    head_dim=8, kv_itemsize=2, context_tokens=60,
)  # fmt: skip


@pytest.mark.parametrize(
    "name, value, match",
    [
        # Each context holds the prefix: 4 x 10 tokens at least. 20 made the 3 x 10 tokens
        # saved a larger share of flat attention's reads than any batch can give.
        ("context_tokens", 39, r"context_tokens=39 must be None or at least .* = 40"),
        ("context_tokens", -1, "context_tokens=-1"),
        ("context_tokens", 60.0, "context_tokens=60.0"),
        ("num_requests", -4, "num_requests=-4 must be an int >= 0"),
        ("num_requests", 4.5, "num_requests=4.5"),
        ("num_requests", True, "num_requests=True"),
        ("prefix_tokens", "10", "prefix_tokens='10'"),
        ("num_query_tokens", -1, "num_query_tokens=-1"),  # a cheaper merge than none
        ("num_q_heads", 0, "num_q_heads=0 must be an int >= 1"),
        ("num_kv_heads", None, "num_kv_heads=None"),
        ("head_dim", 8.0, "head_dim=8.0"),
        ("kv_itemsize", 0, "kv_itemsize=0"),
    ],
)
def test_pays_refuses_bad_arguments_naming_them(name, value, match):
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, min_saved_fraction=0.5)
    with pytest.raises(ValueError, match=match):
        model.pays(**{**PAYS_ARGS, name: value})


def test_pays_takes_numpy_integers_and_a_context_of_exactly_the_prefixes():
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, min_saved_fraction=0.5)
    args = {name: np.int64(value) for name, value in PAYS_ARGS.items()}
    assert model.pays(**{**args, "context_tokens": np.int32(40)})  # 30 of 40 tokens saved
    assert not model.pays(**{**args, "context_tokens": 61})  # 30 of 61: under half
    assert model.pays(**{**args, "context_tokens": None})


class _Counting(CascadeCostModel):
    """A cost model whose pays counts its calls."""

    def pays(self, **kwargs) -> bool:
        self.__dict__["calls"] = self.__dict__.get("calls", 0) + 1
        return super().pays(**kwargs)


def test_the_planner_asks_an_overridden_pays_and_the_same_verdicts_unchecked():
    # The planner skips pays' checks for the cost model's own pays only.
    counting = _Counting(launch_overhead_bytes=1 << 20)
    assert CascadePlanner(LLAMA_8B, cost_model=counting).pays(4, 512, 4, 4 * 516)
    assert counting.__dict__["calls"] == 1
    planner = CascadePlanner(LLAMA_8B, backend="pallas_tpu")
    for requests, prefix, queries, context in (
        (4, 512, 4, 4 * 516), (4, 1024, 4, 4100), (2, 64, 2, None), (1, 512, 1, 513),
    ):  # fmt: skip
        checked = planner.cost_model.pays(
            num_requests=requests, prefix_tokens=prefix, num_query_tokens=queries,
            context_tokens=context, num_q_heads=32, num_kv_heads=8, head_dim=128, kv_itemsize=2,
        )  # fmt: skip
        assert planner.pays(requests, prefix, queries, context) == checked


def _pays(model: CascadeCostModel, context, **args) -> bool:
    return model.pays_unchecked(context_tokens=context, **args)


def test_max_context_tokens_is_the_last_context_that_pays():
    rng = np.random.default_rng(0)
    shapes = [SHAPE, AttentionShape(4, 2, 16, kv_itemsize=4), AttentionShape(32, 8, 128)]
    models = list(DEFAULT_COST_MODELS.values())
    for fraction in (0.0, 1e-300, 1e-9, 0.1, 0.3, 1 / 3, 0.45, 0.99):
        for launch in (0.0, 1000.0, float(1 << 20)):
            models.append(CascadeCostModel(launch, 0.5, min_saved_fraction=fraction))
    for _ in range(3000):
        model = models[int(rng.integers(len(models)))]
        s = shapes[int(rng.integers(len(shapes)))]
        args = dict(
            num_requests=int(rng.integers(0, 40)), prefix_tokens=int(rng.integers(-2, 5000)),
            num_query_tokens=int(rng.integers(0, 300)), num_q_heads=s.num_q_heads,
            num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, kv_itemsize=s.kv_itemsize,
        )  # fmt: skip
        limit = model.max_context_tokens(**args)
        drawn = rng.integers(0, 2 * min(max(limit, 9), 1 << 40), 4).tolist()
        probes = [-7, 0, 1, limit - 1, limit, limit + 1, *drawn]
        for context in probes:
            if context <= 2**63 - 1:
                want = limit >= 0 and context <= limit
                assert _pays(model, int(context), **args) == want, (model, args, limit, context)
        assert limit >= -1 and (limit >= 0) == _pays(model, None, **args)
    # A fraction of 0 never refuses: every context pays.
    args = dict(num_requests=4, prefix_tokens=64, num_query_tokens=4, **dataclasses.asdict(SHAPE))
    assert CascadeCostModel(0, 0).max_context_tokens(**args) == 2**63 - 1
