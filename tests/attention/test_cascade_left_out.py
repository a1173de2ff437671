"""Requests whose queries' merge costs more than cascade saves on their reads are left out
of every level (jaxkv.cascade_left_out). The expected plans come from block counts read
from KVCacheManager.block_ids and the cost model's arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from jaxkv.cascade_left_out import left_out, merge_bytes_per_query
from tests.attention.test_cascade_group_choice import _groups, _shared
from tests.attention.test_cascade_planner import SHAPE, _decoding, _plan, _prefilled

# SHAPE: a token's KV is 2 x 2 x 64 x 2 = 512 bytes, a block of 4 tokens 2048; merging
# one query token costs 8 heads x 65 x 4 bytes x 3 = 6240 bytes (merge_cost_factor 1).
MERGE = 6240
SYSTEM = list(range(100, 140))  # 10 blocks of 4


def _with_prefill(m: KVCacheManager, decodes, prefill_tokens: list[int], queries: int):
    """The decoding requests and one request "p" whose last `queries` tokens are this
    step's prefill chunk; returns (requests, query_lens)."""
    reqs = [*decodes, _prefilled(m, "p", prefill_tokens + [7] * queries)]
    return reqs, [1] * len(decodes) + [queries]


def _suffix_of(plan, reqs, rid: str) -> int:
    ids = [reqs[int(i)].request_id for i in plan.order]
    return int(plan.suffix_start_blocks[ids.index(rid)])


@pytest.mark.parametrize(("queries", "joins"), [(3, True), (4, False)])
def test_a_prefill_chunk_joins_a_group_only_where_its_merge_costs_less_than_its_read(
    queries, joins
):
    # a0..a2 and b0..b2 decode under two 10-block system prompts; p prefills under a's.
    # In a's group p saves one read of 10 blocks (20480 bytes) and merges its queries:
    # 3 x 6240 = 18720 bytes (it pays) or 4 x 6240 = 24960 (it costs 4480 more than it
    # saves: p reads its prompt itself).
    m = KVCacheManager(256, 4, max_model_len=128)
    decodes = [
        _decoding(m, f"{p}{i}", [1000 * (p == "b") + t for t in SYSTEM] + [i, 50])
        for p in "ab"
        for i in range(3)
    ]
    reqs, query_lens = _with_prefill(m, decodes, SYSTEM, queries)
    ids = [r.request_id for r in reqs]
    assert _shared(m, ["a0", "p"]) == 10 and _shared(m, ids) == 0
    assert (queries * MERGE >= 10 * 2048) == (not joins)
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=1)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model), m, reqs, query_lens)
    got = sorted((sorted(members), b0, b1) for members, b0, b1 in _groups(plan, reqs))
    a = ["a0", "a1", "a2", "p"] if joins else ["a0", "a1", "a2"]
    assert got == [(a, 0, 10), (["b0", "b1", "b2"], 0, 10)]
    assert _suffix_of(plan, reqs, "p") == (10 if joins else 0)


@pytest.mark.parametrize(("queries", "levels"), [(3, ["global"]), (4, ["groups"])])
def test_a_prefill_chunk_merging_more_than_it_saves_drops_the_global_level_it_is_in(
    queries, levels
):
    # Four decodes and p share the 10-block prompt: the global level over the five saves
    # 4 x 20480 bytes for a call of 8 KiB and (4 + queries) x 6240 bytes of merge; the
    # group of the four from block 0 saves 3 x 20480 for the call and 4 x 6240. The
    # second weighs more by queries x 6240 - 20480: with 4 queries p is left out and
    # reads its prompt itself.
    m = KVCacheManager(256, 4, max_model_len=128)
    decodes = [_decoding(m, f"d{i}", SYSTEM + [i, 50]) for i in range(4)]
    reqs, query_lens = _with_prefill(m, decodes, SYSTEM, queries)
    assert _shared(m, [r.request_id for r in reqs]) == 10
    model = CascadeCostModel(launch_overhead_bytes=8192, merge_cost_factor=1)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model), m, reqs, query_lens)
    assert [lv.name for lv in plan.levels] == levels
    if levels == ["groups"]:
        assert _groups(plan, reqs) == [(["d0", "d1", "d2", "d3"], 0, 10)]
    assert _suffix_of(plan, reqs, "p") == (10 if levels == ["global"] else 0)


def test_a_left_out_request_stays_in_the_global_level_where_groups_are_off():
    # As above with 4 queries, p merges more than it saves; with groups off there is no
    # plan of groups from block 0 to drop the global level for: it stays, p in it.
    m = KVCacheManager(256, 4, max_model_len=128)
    decodes = [_decoding(m, f"d{i}", SYSTEM + [i, 50]) for i in range(4)]
    reqs, query_lens = _with_prefill(m, decodes, SYSTEM, 4)
    model = CascadeCostModel(launch_overhead_bytes=8192, merge_cost_factor=1)
    planner = CascadePlanner(SHAPE, cost_model=model, enable_groups=False)
    plan = _plan(planner, m, reqs, query_lens)
    assert [(lv.name, lv.block_ends.tolist()) for lv in plan.levels] == [("global", [10])]
    assert _suffix_of(plan, reqs, "p") == 10


def _paired_decodes_plan(num_pairs: int):
    """(manager, requests, plan) of eight decodes over a 10-block header, the first
    2 x num_pairs of them in pairs sharing 10 blocks more, and p, a 4-token prefill over
    the header only; planned with no call cost and a merge cost factor of 1."""
    m = KVCacheManager(256, 4, max_model_len=128)
    decodes = [
        _decoding(
            m,
            f"d{i}",
            SYSTEM
            + [
                500 + t + 100 * (i // 2) if i < 2 * num_pairs else 9000 + 50 * i + t
                for t in range(40)
            ]
            + [i, 50],
        )  # fmt: skip
        for i in range(8)
    ]
    reqs, query_lens = _with_prefill(m, decodes, SYSTEM + [900] * 8, 4)
    assert _shared(m, [r.request_id for r in reqs]) == 10 and _shared(m, ["d0", "d1"]) == 20
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=1)
    return m, reqs, _plan(CascadePlanner(SHAPE, cost_model=model), m, reqs, query_lens)


def test_a_left_out_request_stays_in_a_global_level_that_weighs_more_than_groups_without_it():
    # Eight decodes share a 10-block header, in pairs sharing 10 blocks more; p shares the
    # header only and merges 4 x 6240 bytes, more than its 20480-byte read: left out of
    # any group. With no call cost the global level over all nine plus the pairs past it
    # (8 x 20480 - 12 x 6240 + 4 x (20480 - 2 x 6240) = 120960) outweighs the pairs from
    # block 0 without it (4 x (2 x 20480 - 2 x 6240) = 113920): p stays in the global level.
    _, reqs, plan = _paired_decodes_plan(num_pairs=4)
    assert [lv.name for lv in plan.levels] == ["global", "groups"]
    got = sorted((sorted(members), b0, b1) for members, b0, b1 in _groups(plan, reqs))
    assert got == [([f"d{i}", f"d{i + 1}"], 10, 20) for i in range(0, 8, 2)]
    assert _suffix_of(plan, reqs, "p") == 10


def test_left_out_compares_the_merge_with_the_read_of_shared_computed_blocks_only():
    # Rows 0 and 1 share 3 blocks; row 2 shares none. A merge worth 2 blocks leaves out a
    # request that could share 2 (its computed blocks, or the 3 it shares, cut at 2).
    prefix_ids = np.array([[1, 2, 3, 4, -1], [1, 2, 3, 5, 6], [7, 8, 9, 10, 11]])
    asked = []

    def shares(column: int) -> np.ndarray:
        asked.append(column)
        ids = prefix_ids[:, column]
        return np.array([(ids == i).sum() >= 2 for i in ids])

    block = 2048
    merge = 2 * block  # one query merges 2 blocks' read

    def got(computed, queries):
        return left_out(shares, np.array(computed), np.array(queries), merge, block, 4)

    assert got([16, 20, 20], [1, 1, 1]).tolist() == [False, False, True]  # 3 shared > 2
    assert asked == [2]  # one look-up for the three
    assert got([8, 20, 0], [1, 0, 5]).tolist() == [True, False, False]  # 2 computed blocks
    assert got([16, 20, 0], [1, 1, 9]) is None  # row 2 has computed no block
    assert got([16, 20, 20], [1, 2, 0]).tolist() == [False, True, False]  # 4 > 3 shared
    assert merge_bytes_per_query(CascadeCostModel(1 << 20, 2.0), SHAPE) == 2 * MERGE


def test_groups_from_block_0_without_the_left_out_request_are_searched_not_assumed():
    # Eight decodes and p share one 16-token block and nothing more; p, prefilling 2
    # tokens, merges 2 x 6240 bytes, more than that block's 8192-byte read: left out.
    # The global level over all nine saves 8 x 8192 for 10 x 6240 of merge (3136); the
    # group of the eight from block 0 saves 7 x 8192 for 8 x 6240 (7424): p reads the
    # block itself. The groups without p come from a search of the eight that computed
    # the block: a whole-batch candidate over p too would weigh what the global level
    # does and keep it.
    m = KVCacheManager(256, 16, max_model_len=128)
    header = list(range(100, 116))
    decodes = [_decoding(m, f"d{i}", header + [200 + i] * 3) for i in range(8)]
    reqs, query_lens = _with_prefill(m, decodes, header, 2)
    assert _shared(m, [r.request_id for r in reqs]) == 1
    assert _shared(m, ["d0", "d1"]) == 1
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=1)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model), m, reqs, query_lens)
    assert [lv.name for lv in plan.levels] == ["groups"]
    assert _groups(plan, reqs) == [([f"d{i}" for i in range(8)], 0, 1)]
    assert _suffix_of(plan, reqs, "p") == 0


def test_a_request_whose_merge_equals_the_read_of_its_computed_blocks_is_left_out():
    # d0..d3 and p hold the 10-block prompt; each has computed 6 of its blocks (loading
    # the rest). p's 2 queries merge 12480 bytes: the read of its 6 blocks (12288) and
    # no more, so p is left out. The four from block 0 then weigh 3 x 12288 - 4 x 6240
    # (11904), more than the global level over all five (4 x 12288 - 6 x 6240 = 11712).
    m = KVCacheManager(256, 4, max_model_len=128)
    decodes = [_decoding(m, f"d{i}", SYSTEM + [i, 50]) for i in range(4)]
    reqs, query_lens = _with_prefill(m, decodes, SYSTEM, 2)
    ids = [r.request_id for r in reqs]
    assert _shared(m, ids) == 10
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=1)
    computed = np.full(len(reqs), 6 * 4)
    plan = CascadePlanner(SHAPE, cost_model=model).plan(ids, computed, query_lens, m)
    plan.check()
    assert [lv.name for lv in plan.levels] == ["groups"]
    assert _groups(plan, reqs) == [(["d0", "d1", "d2", "d3"], 0, 6)]
    assert _suffix_of(plan, reqs, "p") == 0


def test_groups_under_the_global_level_count_in_its_weight_against_groups_without_it():
    # Eight decodes share a 10-block header, d0..d5 in pairs 10 blocks more; p
    # shares the header and is left out (4 queries). From block 0 without p the eight
    # over the header weigh 7 x 20480 - 8 x 6240 = 93440; the global level over all
    # nine weighs 8 x 20480 - 12 x 6240 = 88960, and with the three pairs past it
    # (3 x (20480 - 2 x 6240)) 112960: the global level stays, with the pairs.
    m, reqs, plan = _paired_decodes_plan(num_pairs=3)
    assert _shared(m, ["d6", "d7"]) == 10
    assert [lv.name for lv in plan.levels] == ["global", "groups"]
    got = sorted((sorted(members), b0, b1) for members, b0, b1 in _groups(plan, reqs))
    assert got == [([f"d{i}", f"d{i + 1}"], 10, 20) for i in range(0, 6, 2)]
    assert _suffix_of(plan, reqs, "p") == 10


def test_a_left_out_request_joins_no_group_where_only_its_context_would_let_one_pay():
    # d0..d3 and p share the 10-block prompt; p's 4 queries merge more than its read:
    # left out. min_saved_fraction 0.8: the global level saves 4 x 20480 of a 216-token
    # context (0.74), the four d from block 0 3 x 20480 of 172 tokens (0.70): neither
    # pays, and the plan is flat. A group of all five counted without p's 40 computed
    # tokens (0.91) would pay, over p's queries too.
    m = KVCacheManager(256, 4, max_model_len=128)
    decodes = [_decoding(m, f"d{i}", SYSTEM + [i, 50]) for i in range(4)]
    reqs, query_lens = _with_prefill(m, decodes, SYSTEM, 4)
    assert _shared(m, [r.request_id for r in reqs]) == 10
    model = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=1, min_saved_fraction=0.8)
    plan = _plan(CascadePlanner(SHAPE, cost_model=model), m, reqs, query_lens)
    assert plan.levels == () and plan.num_common_prefix_blocks == 10
