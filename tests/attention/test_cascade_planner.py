"""CascadePlanner on hand-built manager states: exact prefixes, caps, groups, cost model."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlanner
from tests.attention.workload import allocate_after_hit

SHAPE = AttentionShape(num_q_heads=8, num_kv_heads=2, head_dim=64, kv_itemsize=2)
ALWAYS = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0)


def _prefilled(manager: KVCacheManager, rid: str, tokens) -> Request:
    request = Request(rid, list(tokens))
    allocate_after_hit(manager, request)
    request.num_computed_tokens = request.num_tokens
    return request


def _decoding(manager: KVCacheManager, rid: str, tokens) -> Request:
    """A fully computed request that schedules one decode token."""
    request = _prefilled(manager, rid, tokens)
    request.append_output_token_ids([7])
    assert manager.allocate_slots(request, 1) is not None
    return request


def _plan(planner, manager, requests, query_lens=None):
    query_lens = np.ones(len(requests), int) if query_lens is None else np.asarray(query_lens)
    computed = np.array([r.num_tokens for r in requests]) - query_lens
    plan = planner.plan([r.request_id for r in requests], computed, query_lens, manager)
    plan.check()  # the planner skips it; its plans must pass it
    return plan


SYSTEM_A = list(range(100, 132))  # 8 blocks of 4
SYSTEM_B = list(range(200, 224))  # 6 blocks of 4


def test_one_shared_prefix_is_one_global_level():
    m = KVCacheManager(128, 4, max_model_len=128)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A + [i, i + 1]) for i in range(4)]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    assert plan.num_common_prefix_blocks == 8
    assert [lv.name for lv in plan.levels] == ["global"]
    assert plan.levels[0].block_ends.tolist() == [8]
    assert plan.suffix_start_blocks.tolist() == [8, 8, 8, 8]


def test_trap_false_positive_finished_holder_does_not_add_sharing():
    # A and B are scheduled; C finished but still holds its blocks (KV being copied out).
    # A and C share the prefix block X, B does not: ref_cnt(X) == 2 == number scheduled,
    # yet nothing is shared by the scheduled set.
    m = KVCacheManager(64, 4, max_model_len=64)
    a = _decoding(m, "A", SYSTEM_A[:8] + [1])
    c = _prefilled(m, "C", SYSTEM_A[:8] + [2])
    b = _decoding(m, "B", SYSTEM_B[:8] + [3])
    assert m.block_ids("A")[:2] == m.block_ids("C")[:2]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, [a, b])
    assert plan.num_common_prefix_blocks == 0
    assert not plan.uses_cascade
    del c


def test_trap_false_negative_finished_holder_does_not_remove_sharing():
    # A, B and the finished-but-transferring C all hold X; ref_cnt(X) == 3 != 2
    # scheduled, yet every scheduled request shares X: cascade must stay on.
    m = KVCacheManager(64, 4, max_model_len=64)
    a = _decoding(m, "A", SYSTEM_A + [1])
    b = _decoding(m, "B", SYSTEM_A + [2])
    _prefilled(m, "C", SYSTEM_A + [3])
    _decoding(m, "D_running_not_scheduled", SYSTEM_A + [4])
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, [a, b])
    assert plan.num_common_prefix_blocks == 8
    assert plan.levels[0].block_ends.tolist() == [8]


@pytest.mark.parametrize("block_size, expected_blocks", [(1, 3), (2, 1)])
def test_prefix_capped_at_smallest_computed_then_rounded_to_blocks(block_size, expected_blocks):
    # Request 1 has 3 computed tokens and queries [D, E, X]; request 2 has 4 computed and
    # queries [E, Y]; both hold [A, B, C, D, E] in shared blocks. The non-causal prefix
    # pass may cover at most 3 tokens (request 1's D is a query), then whole blocks:
    # block_size 1 -> 3 blocks; block_size 2 -> floor(3 / 2) = 1 block.
    a, b, c, d, e, x, y = 1, 2, 3, 4, 5, 6, 7
    m = KVCacheManager(64, block_size, max_model_len=64)
    r2 = _prefilled(m, "r2", [a, b, c, d, e, y, 9, 9])
    r1 = _prefilled(m, "r1", [a, b, c, d, e, x, 8, 8])
    shared = 5 // block_size
    assert m.block_ids("r1")[:shared] == m.block_ids("r2")[:shared]
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan = planner.plan(["r1", "r2"], np.array([3, 4]), np.array([3, 2]), m)
    assert plan.levels[0].block_ends.tolist() == [expected_blocks]
    assert plan.suffix_start_blocks.tolist() == [expected_blocks] * 2
    del r1, r2


@pytest.mark.parametrize("block_size, expected_blocks", [(1, 3), (2, 1)])
def test_group_prefix_capped_at_its_smallest_computed_then_rounded_to_blocks(
    block_size, expected_blocks
):
    # The same cap inside a groups level: r1 and r2 share [A..E] but r1's D is a query, so
    # their group may cover 3 tokens; r3 and r4 form a second group (nothing is global).
    a, b, c, d, e, x, y = 1, 2, 3, 4, 5, 6, 7
    m = KVCacheManager(64, block_size, max_model_len=64)
    r2 = _prefilled(m, "r2", [a, b, c, d, e, y, 9, 9])
    r1 = _prefilled(m, "r1", [a, b, c, d, e, x, 8, 8])
    r3 = _prefilled(m, "r3", [20, 21, 22, 23, 24, 25, 26, 27])
    r4 = _prefilled(m, "r4", [20, 21, 22, 23, 24, 25, 28, 29])
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    plan = planner.plan(["r1", "r2", "r3", "r4"], np.array([3, 4, 7, 7]), np.array([3, 2, 1, 1]), m)
    (level,) = plan.levels
    assert level.name == "groups" and plan.order.tolist() == [0, 1, 2, 3]
    assert level.block_ends.tolist() == [expected_blocks, 6 // block_size]
    assert plan.suffix_start_blocks.tolist() == [expected_blocks] * 2 + [6 // block_size] * 2
    del r1, r2, r3, r4


def _two_group_plan():
    """Six decoding requests, alternately under SYSTEM_A and SYSTEM_B; every level pays."""
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = []
    for i in range(6):
        system = SYSTEM_A if i % 2 == 0 else SYSTEM_B
        reqs.append(_decoding(m, f"r{i}", system + [i, 50 + i, 60 + i]))
    return _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)


def test_two_system_prompts_make_two_groups():
    plan = _two_group_plan()
    assert plan.num_common_prefix_blocks == 0
    (level,) = plan.levels
    assert level.name == "groups" and level.num_groups == 2
    # Groups are contiguous in the new batch order, each over its own system prompt.
    assert plan.order.tolist() == [0, 2, 4, 1, 3, 5]
    assert level.group_starts.tolist() == [0, 3] and level.group_ends.tolist() == [3, 6]
    assert level.block_ends.tolist() == [8, 6]
    assert plan.suffix_start_blocks.tolist() == [8, 8, 8, 6, 6, 6]


def test_groups_under_a_shared_header_that_does_not_pay():
    # All six share one header block, which alone does not pay for a level; under it,
    # two system prompts do. The batch splits past the header into two groups.
    m = KVCacheManager(256, 4, max_model_len=128)
    header = [1, 2, 3, 4]
    reqs = []
    for i in range(6):
        system = SYSTEM_A if i % 2 == 0 else SYSTEM_B
        reqs.append(_decoding(m, f"r{i}", header + system + [i, 50 + i, 60 + i]))
    # Saving (n - 1) copies of the prefix at 512 bytes per token: the header saves
    # 5 * 4 * 512 = 10240 bytes, each group at least 2 * 28 * 512 = 28672.
    model = CascadeCostModel(launch_overhead_bytes=20000, merge_cost_factor=0)
    planner = CascadePlanner(SHAPE, cost_model=model)
    assert not planner.pays(6, 4, 6) and planner.pays(3, 28, 3)
    plan = _plan(planner, m, reqs)
    assert plan.num_common_prefix_blocks == 1
    (level,) = plan.levels
    assert level.name == "groups" and level.num_groups == 2
    assert plan.order.tolist() == [0, 2, 4, 1, 3, 5]
    assert level.block_starts.tolist() == [0, 0] and level.block_ends.tolist() == [9, 7]
    assert plan.suffix_start_blocks.tolist() == [9, 9, 9, 7, 7, 7]


def test_global_prefix_plus_groups_make_two_levels():
    m = KVCacheManager(256, 4, max_model_len=160)
    shots = {0: list(range(300, 316)), 1: list(range(400, 412))}
    reqs = [_decoding(m, f"r{i}", SYSTEM_A + shots[i % 2] + [i, 70 + i, 80 + i]) for i in range(6)]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    assert [lv.name for lv in plan.levels] == ["global", "groups"]
    assert plan.levels[0].block_ends.tolist() == [8]
    assert plan.levels[1].block_starts.tolist() == [8, 8]
    assert plan.levels[1].block_ends.tolist() == [12, 11]


def test_nothing_shared_plans_flat():
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, f"r{i}", [i * 100 + t for t in range(9)]) for i in range(4)]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    assert not plan.uses_cascade and plan.num_common_prefix_blocks == 0
    assert plan.order.tolist() == [0, 1, 2, 3]


def test_sliding_window_never_plans_cascade():
    m = KVCacheManager(128, 4, max_model_len=128)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A + [i]) for i in range(4)]
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS, sliding_window=16)
    assert not _plan(planner, m, reqs).uses_cascade


def test_default_cost_model_declines_short_prefix_and_takes_long_one():
    m = KVCacheManager(4096, 16, max_model_len=4096)
    short = [_decoding(m, f"s{i}", list(range(16)) + [1000 + i]) for i in range(4)]
    assert not _plan(CascadePlanner(SHAPE), m, short).uses_cascade
    long_prompt = list(range(5000, 5000 + 2048))
    long = [_decoding(m, f"l{i}", long_prompt + [2000 + i]) for i in range(32)]
    assert _plan(CascadePlanner(SHAPE), m, long).uses_cascade


def test_planning_changes_nothing_and_unknown_id_raises():
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A[:12] + [i]) for i in range(3)]
    before = m.block_table.copy()
    _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    np.testing.assert_array_equal(before, m.block_table)
    with pytest.raises(ValueError, match="nope"):
        CascadePlanner(SHAPE).plan(["r0", "nope"], np.array([1, 1]), np.array([1, 1]), m)
    with pytest.raises(ValueError, match="must be"):
        CascadePlanner(SHAPE).plan(["r0"], np.array([1, 1]), np.array([1]), m)
    m.check_integrity()


def test_metadata_pads_with_null_block_and_null_slots():
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A[:12] + [i]) for i in range(3)]
    plan = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, reqs)
    buckets = BucketConfig(max_num_tokens=32, max_num_seqs=8, max_pages_per_seq=16)
    md = build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=np.ones(3, int),
        num_computed_tokens=np.full(3, 13), block_size=4, buckets=buckets,
    )  # fmt: skip
    assert md.max_num_tokens == 8 and md.max_num_seqs == 4 and md.max_q_len == 1
    assert md.num_seqs.tolist() == [3]
    assert np.all(md.page_indices[3:] == 0) and np.all(md.slot_mapping[3:] == 0)
    # Suffix pass starts after the 3 shared blocks: 14 - 12 = 2 keys in the 4th block.
    assert md.kv_lens[:3].tolist() == [2, 2, 2]
    assert md.page_indices[:3, 0].tolist() == [m.block_ids(r.request_id)[3] for r in reqs]
    assert md.positions[:3].tolist() == [13, 13, 13]
    (level,) = md.levels
    assert level.cu_q_lens.tolist()[:2] == [0, 3] and level.kv_lens[0] == 12
    assert level.page_indices[0, :3].tolist() == m.block_ids("r0")[:3]
    # The level metadata of the same plan and query lengths can be handed back in.
    again = build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=np.ones(3, int),
        num_computed_tokens=np.full(3, 14), block_size=4, buckets=buckets, levels=md.levels,
    )  # fmt: skip
    assert again.levels is md.levels and again.positions[:3].tolist() == [14, 14, 14]
    with pytest.raises(ValueError, match="levels"):
        build_attention_metadata(
            block_table=m.block_table, plan=plan, query_lens=np.ones(3, int),
            num_computed_tokens=np.full(3, 13), block_size=4, buckets=buckets, levels=(),
        )  # fmt: skip
    # A token past its request's blocks would write its KV into the null block.
    with pytest.raises(ValueError, match="position 16 .* past the blocks it holds"):
        build_attention_metadata(
            block_table=m.block_table, plan=plan, query_lens=np.ones(3, int),
            num_computed_tokens=np.array([13, 16, 13]), block_size=4, buckets=buckets,
        )  # fmt: skip


def _plan_fields(plan) -> tuple:
    levels = tuple(
        (lv.name, *(a.tolist() for a in (lv.group_starts, lv.group_ends, lv.block_starts,
                                         lv.block_ends, lv.leader_rows)))
        for lv in plan.levels
    )  # fmt: skip
    return (plan.order.tolist(), plan.rows.tolist(), plan.suffix_start_blocks.tolist(),
            levels, plan.num_common_prefix_blocks)  # fmt: skip


def test_a_planner_reused_over_decode_steps_plans_what_a_fresh_one_plans():
    # The planner skips the group search and reuses its last plan for a repeated batch
    # whose sharing cannot have changed; every step must still equal a fresh planner's.
    m = KVCacheManager(512, 4, max_model_len=256)
    reused = CascadePlanner(SHAPE, cost_model=ALWAYS)
    batch = [_decoding(m, f"a{i}", SYSTEM_A + [i, i + 1]) for i in range(3)]
    seen_levels, reused_plans, previous = set(), 0, None
    for step in range(30):
        if step == 8:  # a second system prompt joins: groups appear
            batch += [_decoding(m, f"b{i}", SYSTEM_A[:12] + SYSTEM_B + [i]) for i in range(3)]
        if step == 16:  # it leaves again
            for r in batch[3:]:
                m.free(r)
            batch = batch[:3]
        if step == 22:  # the id list stays, but a request is freed and re-admitted
            gone = batch[-1]
            m.free(gone)
            batch[-1] = _decoding(m, gone.request_id, SYSTEM_A[:8] + [5, 5])
        got = _plan(reused, m, batch)
        want = _plan(CascadePlanner(SHAPE, cost_model=ALWAYS), m, batch)
        assert _plan_fields(got) == _plan_fields(want), step
        reused_plans += got is previous
        previous = got
        seen_levels.add(tuple(lv.name for lv in got.levels))
        for r in batch:  # the next decode token; fresh blocks every 4 tokens
            r.num_computed_tokens = r.num_tokens
            r.append_output_token_ids([7])
            assert m.allocate_slots(r, 1) is not None
    assert {("global",), ("global", "groups")} <= seen_levels
    assert reused_plans >= 10


def test_a_repeated_batch_with_fewer_computed_tokens_is_replanned():
    m = KVCacheManager(512, 4, max_model_len=256)
    batch = [_decoding(m, f"a{i}", SYSTEM_A + [i] * 6) for i in range(3)]
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS)
    ids = [r.request_id for r in batch]
    computed = np.array([r.num_tokens - 1 for r in batch])
    ones = np.ones(len(batch), int)

    def check(expected_levels):
        got = planner.plan(list(ids), computed, ones, m)
        fresh = CascadePlanner(SHAPE, cost_model=ALWAYS).plan(ids, computed, ones, m)
        assert _plan_fields(got) == _plan_fields(fresh)
        assert [(lv.name, lv.block_ends.tolist()) for lv in got.levels] == expected_levels
        return got

    first = check([("global", [8])])
    assert check([("global", [8])]) is first  # a repeated batch reuses its plan
    computed[:2] = 5  # same batch and sharing, but the prefix is capped at one block
    check([("global", [1])])
    computed[1] = batch[1].num_tokens - 1  # a1 and a2 now share 7 blocks past the cap
    check([("global", [1]), ("groups", [8])])


PADDED = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, reads_padded_pages=True)


@pytest.mark.parametrize(
    ("page_buckets", "narrower"),
    [
        ((4, 8, 16), True),  # flat pads 10 pages to 16, the suffix pass 2 pages to 4
        ((16,), False),  # one bucket: the suffix pass pads to as many pages as flat
        ((1, 9), True),  # 1 and 9 pages fill their buckets exactly: no padding either way
        ((8, 16), True),  # flat's 35 tokens are 9 pages (a partial one), past bucket 8
        (None, True),  # buckets unknown: the byte model alone decides
    ],
)
def test_padded_page_backends_cascade_only_when_the_suffix_pass_pads_narrower(
    page_buckets, narrower
):
    m = KVCacheManager(128, 4, max_model_len=128)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A + [i, i + 1]) for i in range(4)]
    planner = CascadePlanner(SHAPE, cost_model=PADDED, page_buckets=page_buckets)
    plan = _plan(planner, m, reqs)
    assert plan.uses_cascade == narrower
    assert plan.num_common_prefix_blocks == 8  # detection is the same either way


def test_padded_page_rule_applies_to_group_levels():
    m = KVCacheManager(256, 4, max_model_len=128)
    reqs = [_decoding(m, f"a{i}", SYSTEM_A + [i]) for i in range(3)]
    reqs += [_decoding(m, f"b{i}", SYSTEM_B + [i]) for i in range(3)]
    grouped = _plan(CascadePlanner(SHAPE, cost_model=PADDED, page_buckets=(2, 4, 8, 16)), m, reqs)
    assert [lv.name for lv in grouped.levels] == ["groups"]
    assert grouped.suffix_start_blocks.tolist() == [8, 8, 8, 6, 6, 6]
    pinned = _plan(CascadePlanner(SHAPE, cost_model=PADDED, page_buckets=(16,)), m, reqs)
    assert not pinned.uses_cascade


def test_cost_models_that_do_not_read_padded_pages_ignore_page_buckets():
    m = KVCacheManager(128, 4, max_model_len=128)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A + [i, i + 1]) for i in range(4)]
    planner = CascadePlanner(SHAPE, cost_model=ALWAYS, page_buckets=(16,))
    assert _plan(planner, m, reqs).uses_cascade


@pytest.mark.parametrize("max_groups", [0, 2.0, "2", True])
def test_a_max_groups_that_is_no_int_above_zero_is_refused_on_construction(max_groups):
    # A float used to pass and make every plan() raise TypeError (a float slice bound).
    with pytest.raises(ValueError, match="max_groups"):
        CascadePlanner(SHAPE, cost_model=ALWAYS, max_groups=max_groups)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_buckets=(16, 8)), "page_buckets"),  # padded_size assumes ascending sizes
        (dict(page_buckets=(0, 8)), "page_buckets"),
        (dict(page_buckets=(4.0,)), "page_buckets"),
        (dict(backend=["xla"]), "backend"),  # was a TypeError (unhashable)
        (dict(backend="tpu"), "backend"),
    ],
)
def test_bad_page_buckets_or_backend_are_refused_on_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CascadePlanner(SHAPE, **kwargs)
    assert CascadePlanner(SHAPE, page_buckets=(np.int64(4), 8)).page_buckets == (4, 8)
