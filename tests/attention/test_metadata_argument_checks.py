"""build_attention_metadata refuses arguments of the wrong type, dtype or range by name.

Before these checks numpy's own errors leaked out (IndexError, TypeError, a
ZeroDivisionError) or, worse, a negative num_computed_tokens entry read column -1 of the
block table: a request holding every column of its row got slots in its last block.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KVCacheManager, Request
from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadePlanner
from jaxkv.cascade_plan import CascadePlan, make_level
from tests.attention.test_cascade_planner import ALWAYS, SHAPE, SYSTEM_A, _decoding

BUCKETS = BucketConfig(max_num_tokens=32, max_num_seqs=8, max_pages_per_seq=16)


def _three_decoding():
    m = KVCacheManager(64, 4, max_model_len=64)
    reqs = [_decoding(m, f"r{i}", SYSTEM_A[:12] + [i]) for i in range(3)]
    ids = [r.request_id for r in reqs]
    plan = CascadePlanner(SHAPE, cost_model=ALWAYS).plan(ids, np.full(3, 13), np.ones(3, int), m)
    assert plan.uses_cascade
    build = dict(
        block_table=m.block_table, plan=plan, query_lens=np.ones(3, int),
        num_computed_tokens=np.full(3, 13), block_size=4, buckets=BUCKETS,
    )  # fmt: skip
    return m, build


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("plan", None, "plan=NoneType must be a CascadePlan"),
        ("buckets", None, "buckets=NoneType must be a BucketConfig"),
        ("block_size", True, "block_size=True must be an int >= 1"),
        ("block_size", 0, "block_size=0 must be an int >= 1"),  # was ZeroDivisionError
        ("block_size", 4.0, "block_size=4.0 must be an int >= 1"),
        ("block_table", "list", "block_table .list.* must be a 2-D integer array"),
        ("block_table", "float", "block_table .* float64.* must be a 2-D integer array"),
        ("block_table", "row", "block_table .* must be a 2-D integer array"),
        ("query_lens", np.ones(3), "query_lens.dtype"),
        ("query_lens", np.ones(3, bool), "query_lens.dtype"),
        ("query_lens", np.array([1.5, 1, 1]), "query_lens.dtype"),  # was a casting TypeError
        ("num_computed_tokens", np.full(3, 13.0), "num_computed_tokens.dtype"),  # IndexError
        # A list of the wrong length raised AttributeError ('list' has no .shape) instead.
        ("num_computed_tokens", [13, 13], r"num_computed_tokens.shape=\(2,\) must be \(3,\)"),
        ("query_lens", [1, 1, 1, 1], r"query_lens.shape=\(4,\) .* must be \(3,\)"),
    ],
)
def test_an_argument_of_the_wrong_type_is_refused_by_name(field, value, match):
    m, build = _three_decoding()
    table = m.block_table
    if isinstance(value, str):
        value = {"list": table.tolist(), "float": table * 1.0, "row": table[0]}[value]
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(**{**build, field: value})


def test_a_negative_num_computed_tokens_entry_is_refused():
    # r holds all 4 columns of its row: position -4 used to read column -1, its last
    # block, and the token's KV slot landed among its last block's keys.
    m = KVCacheManager(16, 4, max_model_len=16)
    r = Request("r", list(range(16)))
    assert m.allocate_slots(r, 16) is not None
    plan = CascadePlanner(SHAPE, cost_model=ALWAYS).plan(["r"], [0], [16], m)
    build = dict(block_table=m.block_table, plan=plan, block_size=4, buckets=BUCKETS)
    build_attention_metadata(query_lens=np.array([16]), num_computed_tokens=np.array([0]), **build)
    with pytest.raises(ValueError, match="num_computed_tokens entry must be >= 0, got -4"):
        build_attention_metadata(
            query_lens=np.array([4]), num_computed_tokens=np.array([-4]), **build
        )


@pytest.mark.parametrize("planned", [True, False])
def test_a_block_table_too_narrow_or_of_another_manager_is_refused_by_name(planned):
    # A planner's plan knows its manager's table shape; a hand-made one is caught where
    # its rows or columns fall outside the table given.
    m, build = _three_decoding()
    if planned:
        match = "block_table.shape=.* must be that of the plan's manager's block_table"
    else:
        build["plan"] = dataclasses.replace(build["plan"], made_for=None)
        match = "outside block_table.shape=.*: the plan must come from the manager"
    with pytest.raises(ValueError, match=match):  # was an IndexError
        build_attention_metadata(**{**build, "block_table": m.block_table[:, :3]})
    with pytest.raises(ValueError, match=match):  # a smaller manager's table: fewer rows
        build_attention_metadata(**{**build, "block_table": m.block_table[:2]})


def test_a_block_table_on_the_device_is_refused_by_name():
    # jax clamps an index past an array where numpy raises: a hand-made plan's row past a
    # device copy of the table read its last row, another request's blocks, and the
    # request's KV slots landed in them, without an error.
    m, build = _three_decoding()
    build["plan"] = dataclasses.replace(build["plan"], made_for=None)
    match = r"block_table \(ArrayImpl, dtype int32\) must be a 2-D integer array .* in numpy"
    for table in (jnp.asarray(m.block_table), jnp.asarray(m.block_table[:2])):
        with pytest.raises(ValueError, match=match):
            build_attention_metadata(**{**build, "block_table": table})


def test_the_table_of_another_manager_of_the_same_shape_is_refused():
    """Its rows hold other requests' blocks: attention read them with no error (NaN or
    other requests' keys). A copy of the plan's manager's table is accepted."""
    m, build = _three_decoding()
    other = KVCacheManager(64, 4, max_model_len=64)
    for i in range(3):
        _decoding(other, f"r{i}", [90 + i] * 13)
    assert other.block_table.shape == m.block_table.shape
    with pytest.raises(ValueError, match="block_table: the plan's rows differ from its manager"):
        build_attention_metadata(**{**build, "block_table": other.block_table})
    copied = build_attention_metadata(**{**build, "block_table": m.block_table.copy()})
    assert copied.page_indices.tolist() == build_attention_metadata(**build).page_indices.tolist()


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_unsigned_counts_give_the_metadata_of_signed_ones(dtype):
    # Accepted as integer dtypes, unsigned counts used to fail numpy's casting rule in
    # the builder's in-place main-pass length update (flat and cascade plans alike).
    m, build = _three_decoding()
    want = build_attention_metadata(**build)
    got = build_attention_metadata(
        **{**build, "query_lens": np.ones(3, dtype), "num_computed_tokens": np.full(3, 13, dtype)}
    )
    assert want.levels and got.kv_lens.tolist() == want.kv_lens.tolist()
    for name in ("slot_mapping", "positions", "cu_q_lens", "page_indices", "logits_indices"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name


@pytest.mark.parametrize("dtype", [np.int8, np.int16])
def test_narrow_signed_counts_give_the_metadata_of_int64_ones(dtype):
    # A decode at position 127 in int8: the main pass's 128 keys overflowed to -128 and
    # attention read no key at all (out 0, lse -inf), silently.
    m = KVCacheManager(64, 16, max_model_len=256)
    for i in range(2):
        assert m.allocate_slots(Request(f"r{i}", list(range(100 * i, 100 * i + 128))), 128)
    plan = CascadePlanner(SHAPE, enable_cascade=False).plan(["r0", "r1"], [127, 127], [1, 1], m)
    build = dict(block_table=m.block_table, plan=plan, block_size=16, buckets=BUCKETS)
    want = build_attention_metadata(query_lens=[1, 1], num_computed_tokens=[127, 127], **build)
    got = build_attention_metadata(
        query_lens=np.ones(2, dtype), num_computed_tokens=np.full(2, 127, dtype), **build
    )
    assert got.kv_lens.tolist() == want.kv_lens.tolist() and want.kv_lens[:2].tolist() == [128] * 2
    for name in ("positions", "slot_mapping", "page_indices"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name


def test_an_empty_batch_given_as_lists_builds_as_empty_arrays_do():
    m = KVCacheManager(16, 4, max_model_len=16)
    plan = CascadePlanner(SHAPE).plan([], [], [], m)
    build = dict(block_table=m.block_table, plan=plan, block_size=4, buckets=BUCKETS)
    want = build_attention_metadata(
        query_lens=np.zeros(0, np.int32), num_computed_tokens=np.zeros(0, np.int32), **build
    )
    got = build_attention_metadata(query_lens=[], num_computed_tokens=[], **build)  # TypeError
    assert got.num_seqs.tolist() == want.num_seqs.tolist() == [0]
    assert got.cu_q_lens.tolist() == want.cu_q_lens.tolist()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("backend", "gpu", "backend='gpu' must be one of"),  # failed in paged_attention
        ("interpret", "no", "interpret='no' must be a bool"),  # would interpret, by truthiness
        ("levels", 5, "levels=5 must be None or a tuple of LevelMetadata"),  # was TypeError
    ],
)
def test_backend_interpret_and_levels_are_checked_by_the_builder(field, value, match):
    _, build = _three_decoding()
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(**{**build, field: value})


def _unshared_pair():
    """Two requests that share no block (block size 4, 9 tokens, 8 computed each)."""
    m = KVCacheManager(32, 4, max_model_len=32)
    for rid, tokens in (("a", list(range(9))), ("b", list(range(100, 109)))):
        m.allocate_slots(Request(rid, tokens), 9)
    rows = m.rows_of(["a", "b"]).astype(np.int32)
    build = dict(
        block_table=m.block_table, query_lens=np.ones(2, int),
        num_computed_tokens=np.full(2, 8), block_size=4, buckets=BUCKETS,
    )  # fmt: skip
    return m, rows, build


@pytest.mark.parametrize("leader", [0, 1])
def test_a_hand_made_level_over_blocks_a_member_does_not_hold_is_refused(leader):
    # The level reads its leader row's blocks for every member: b (or a) would attend to
    # the other request's KV, a silently wrong row.
    m, rows, build = _unshared_pair()
    level = make_level("global", [0], [2], [0], [2], [rows[leader]])
    plan = CascadePlan(np.arange(2, dtype=np.int32), rows, np.full(2, 2, np.int32), (level,), 0)
    other = 1 - leader
    match = (
        rf"level 'global' reads block {m.block_table[rows[leader], 0]} \(column 0 of leader "
        rf"row {rows[leader]}\) for batch position {other}, whose row {rows[other]} holds "
        rf"block {m.block_table[rows[other], 0]} there"
    )
    with pytest.raises(ValueError, match=match):
        build_attention_metadata(plan=plan, **build)


def test_a_planner_plan_given_a_level_by_dataclasses_replace_is_checked_as_hand_made():
    # The replaced plan keeps the planner's made_for (its stale-row check still applies)
    # but not the planner's construction: its level must be checked like any hand-made
    # one. Skipping that for every plan with made_for let b attend to a's KV.
    m, rows, build = _unshared_pair()
    flat = CascadePlanner(SHAPE, cost_model=ALWAYS).plan(["a", "b"], (8, 8), (1, 1), m)
    assert not flat.uses_cascade and flat.made_for is not None
    level = make_level("global", [0], [2], [0], [2], [rows[0]])
    plan = dataclasses.replace(flat, levels=(level,), suffix_start_blocks=np.full(2, 2, np.int32))
    assert plan.made_for == flat.made_for
    with pytest.raises(ValueError, match="level 'global' reads block .* for batch position 1"):
        build_attention_metadata(plan=plan, **build)


def test_a_hand_made_level_over_null_blocks_is_refused():
    # Both rows hold the null block 0 in column 0: equal ids there are no shared prefix.
    m, rows, build = _unshared_pair()
    table = m.block_table.copy()
    table[rows, 0] = 0
    level = make_level("groups", [0], [2], [0], [1], [rows[0]])
    plan = CascadePlan(np.arange(2, dtype=np.int32), rows, np.ones(2, np.int32), (level,), 0)
    with pytest.raises(ValueError, match="reads block 0 .* not be the null block 0"):
        build_attention_metadata(plan=plan, **{**build, "block_table": table})


def test_a_hand_made_level_over_shared_blocks_is_built():
    m = KVCacheManager(32, 4, max_model_len=32)
    requests = [Request(rid, list(range(8)) + [50 + i]) for i, rid in enumerate("ab")]
    for request in requests:
        hit, n = m.get_computed_blocks(request)
        m.allocate_slots(request, 9 - n, num_new_computed_tokens=n, new_computed_blocks=hit)
    rows = m.rows_of(["a", "b"]).astype(np.int32)
    level = make_level("global", [0], [2], [0], [2], [rows[1]])
    plan = CascadePlan(np.arange(2, dtype=np.int32), rows, np.full(2, 2, np.int32), (level,), 0)
    md = build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=np.ones(2, int),
        num_computed_tokens=np.full(2, 8), block_size=4, buckets=BUCKETS,
    )  # fmt: skip
    assert md.levels[0].page_indices[0, :2].tolist() == m.block_table[rows[0], :2].tolist()


def test_a_levels_tuple_holding_something_else_beside_level_metadata_is_refused():
    """Every entry of `levels` must be a LevelMetadata, not just one of them."""
    _, build = _three_decoding()
    (level,) = build_attention_metadata(**build).levels
    with pytest.raises(ValueError, match="must be None or a tuple of LevelMetadata"):
        build_attention_metadata(**build, levels=(level, "level"))


def test_a_decode_batch_with_a_request_of_no_query_token_is_refused():
    """A 0 among 1s is no decode batch: its request would sample another's logits."""
    _, build = _three_decoding()
    with pytest.raises(ValueError, match="every query_lens entry must be >= 1, got 0"):
        build_attention_metadata(**{**build, "query_lens": np.array([1, 0, 1])})


def test_a_hand_made_group_is_checked_past_the_width_of_a_narrower_group():
    """Each group of a level is checked over all its columns, also where another group of
    the level spans fewer."""
    m = KVCacheManager(64, 4, max_model_len=32)
    prompts = {
        "a": list(range(8)) + [50],  # a and b share block 0 only
        "b": list(range(4)) + list(range(60, 64)) + [51],
        "c": list(range(100, 108)) + [52],  # c and d share block 0 only
        "d": list(range(100, 104)) + list(range(70, 74)) + [53],
    }
    for rid, tokens in prompts.items():
        request = Request(rid, tokens)
        hit, n = m.get_computed_blocks(request)
        m.allocate_slots(request, 9 - n, num_new_computed_tokens=n, new_computed_blocks=hit)
    rows = m.rows_of(list(prompts)).astype(np.int32)
    level = make_level("groups", [0, 2], [2, 4], [0, 0], [2, 1], [rows[0], rows[2]])
    suffix_start = np.array([2, 2, 1, 1], np.int32)
    plan = CascadePlan(np.arange(4, dtype=np.int32), rows, suffix_start, (level,), 0)
    with pytest.raises(
        ValueError, match=rf"\(column 1 of leader row {rows[0]}\) for batch position 1"
    ):
        build_attention_metadata(
            block_table=m.block_table, plan=plan, query_lens=np.ones(4, int),
            num_computed_tokens=np.full(4, 8), block_size=4, buckets=BUCKETS,
        )  # fmt: skip


def test_a_block_size_of_1_and_buckets_of_1_give_arrays_of_one_entry():
    """The first token of the only request, with one-token blocks and every bucket's
    minimum 1: one token slot, one sequence slot, one page, the token in its block."""
    m = KVCacheManager(4, 1, max_model_len=4)
    assert m.allocate_slots(Request("r", [5]), 1) is not None
    plan = CascadePlanner(SHAPE).plan(["r"], [0], [1], m)
    ones = BucketConfig(
        max_num_tokens=8, max_num_seqs=4, max_pages_per_seq=4,
        min_num_tokens=1, min_num_seqs=1, min_pages_per_seq=1,
    )  # fmt: skip
    md = build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=np.array([1]),
        num_computed_tokens=np.array([0]), block_size=1, buckets=ones,
    )  # fmt: skip
    (block,) = m.block_ids("r")
    assert md.slot_mapping.tolist() == [block] and md.positions.tolist() == [0]
    assert md.page_indices.tolist() == [[block]] and md.kv_lens.tolist() == [1]
    assert md.cu_q_lens.tolist() == [0, 1] and md.max_q_len == 1 and md.block_size == 1


def test_an_empty_batch_pads_to_the_smallest_buckets_with_a_decode_query_bound():
    m = KVCacheManager(16, 4, max_model_len=16)
    plan = CascadePlanner(SHAPE).plan([], [], [], m)
    md = build_attention_metadata(
        block_table=m.block_table, plan=plan, query_lens=np.zeros(0, int),
        num_computed_tokens=np.zeros(0, int), block_size=4, buckets=BUCKETS,
    )  # fmt: skip
    assert md.max_q_len == 1 and md.num_seqs.tolist() == [0] and md.levels == ()
    assert (md.max_num_tokens, md.max_num_seqs, md.page_indices.shape[1]) == (8, 4, 4)
    assert not md.cu_q_lens.any() and not md.slot_mapping.any() and not md.page_indices.any()


def test_the_metadata_is_for_compiled_kernels_unless_interpret_is_asked_for():
    _, build = _three_decoding()
    assert build_attention_metadata(**build).interpret is False
    assert build_attention_metadata(**build, interpret=True).interpret is True


def test_a_batch_of_no_query_tokens_at_all_is_refused():
    """Zeros everywhere are no decode batch either: each request would be given a token."""
    _, build = _three_decoding()
    with pytest.raises(ValueError, match="every query_lens entry must be >= 1, got 0"):
        build_attention_metadata(**{**build, "query_lens": np.zeros(3, int)})


def test_a_hand_made_level_led_by_a_row_outside_the_table_is_refused_by_name():
    """numpy's IndexError names neither the plan nor the table."""
    m, rows, build = _unshared_pair()
    outside = m.block_table.shape[0]
    level = make_level("global", [0], [2], [0], [2], [outside])
    plan = CascadePlan(np.arange(2, dtype=np.int32), rows, np.full(2, 2, np.int32), (level,), 0)
    with pytest.raises(ValueError, match="a scheduled token or plan row lies outside"):
        build_attention_metadata(plan=plan, **build)
