"""Token ids of one step laid out in the plan's batch order (jaxkv.step_inputs)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from jaxkv import Request, SamplingParams
from jaxkv.batch import AttentionMetadata, LevelMetadata
from jaxkv.cascade import AttentionShape, CascadeCostModel, CascadePlanner
from jaxkv.prompt_logprobs import PromptLogprobs, PromptRows
from jaxkv.step_inputs import (
    batch_inputs,
    coarsen_metadata,
    gather_input_ids,
    in_schedule_order,
    pad_level,
    program_key,
)
from tests.attention import serving_sim as sim


def _metadata(query_lens_in_batch_order: np.ndarray, max_num_tokens: int):
    cu = np.zeros(len(query_lens_in_batch_order) + 3, np.int32)
    np.cumsum(query_lens_in_batch_order, out=cu[1 : len(query_lens_in_batch_order) + 1])
    cu[len(query_lens_in_batch_order) + 1 :] = cu[len(query_lens_in_batch_order)]
    return types.SimpleNamespace(max_num_tokens=max_num_tokens, cu_q_lens=cu)


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_tokens_follow_the_batch_order(seed, decode_only):
    rng = np.random.default_rng(seed)
    num_requests = int(rng.integers(1, 20))
    lens = np.ones(num_requests, np.int32)
    if not decode_only:
        lens = rng.integers(1, 9, num_requests).astype(np.int32)
    per_request = [[1000 * (i + 1) + j for j in range(n)] for i, n in enumerate(lens)]
    token_ids = [t for tokens in per_request for t in tokens]
    order = (
        rng.permutation(num_requests).astype(np.int32)
        if seed % 3
        else np.arange(num_requests, dtype=np.int32)
    )
    total = int(lens.sum())
    md = _metadata(lens[order], total + 5)
    ids = gather_input_ids(token_ids, lens, order, md)
    expected = [t for i in order for t in per_request[i]]
    assert ids.dtype == np.int32 and ids.shape == (total + 5,)
    assert ids[:total].tolist() == expected
    assert not ids[total:].any()


def test_a_wrong_order_is_seen():
    # The same check rejects a layout that ignores the plan's order.
    lens = np.array([2, 1, 3], np.int32)
    token_ids = [10, 11, 20, 30, 31, 32]
    order = np.array([2, 0, 1], np.int32)
    ids = gather_input_ids(token_ids, lens, order, _metadata(lens[order], 8))
    assert ids[:6].tolist() == [30, 31, 32, 10, 11, 20]
    assert ids[:6].tolist() != token_ids


def _level(cu: list[int], kv: list[int], pages: list[list[int]], max_q_len: int) -> LevelMetadata:
    return LevelMetadata(
        cu_q_lens=np.array(cu, np.int32),
        kv_lens=np.array(kv, np.int32),
        page_indices=np.array(pages, np.int32),
        num_seqs=np.array([len(kv)], np.int32),
        max_q_len=max_q_len,
    )


def _main(max_q_len: int, levels: tuple[LevelMetadata, ...]) -> AttentionMetadata:
    """Two requests of 3 and 2 query tokens in 8 token slots (only the static bounds and the
    levels matter to coarsen_metadata)."""
    return AttentionMetadata(
        slot_mapping=np.zeros(8, np.int32),
        positions=np.zeros(8, np.int32),
        logits_indices=np.array([2, 4, 0, 0], np.int32),
        cu_q_lens=np.array([0, 3, 5, 5, 5], np.int32),
        kv_lens=np.array([7, 6, 0, 0], np.int32),
        page_indices=np.array([[3, 4], [3, 5], [0, 0], [0, 0]], np.int32),
        num_seqs=np.array([2], np.int32),
        levels=levels,
        block_size=4,
        max_q_len=max_q_len,
        backend="xla",
        interpret=False,
    )


def test_pad_level_appends_empty_sequences_and_keeps_the_valid_ones():
    # A gap of 2 tokens, then one group of 3 tokens over shared blocks 3 and 4.
    level = _level([0, 2, 5], [0, 8], [[0, 0], [3, 4]], max_q_len=3)
    padded = pad_level(level, 4)
    # Empty slots: no query tokens (the last offset repeated), no keys, the null block.
    assert padded.cu_q_lens.tolist() == [0, 2, 5, 5, 5]
    assert padded.kv_lens.tolist() == [0, 8, 0, 0]
    assert padded.page_indices.tolist() == [[0, 0], [3, 4], [0, 0], [0, 0]]
    assert int(padded.num_seqs[0]) == 2 and padded.max_q_len == 3
    assert pad_level(level, 2) is level and pad_level(level, 1) is level
    one_more = pad_level(level, 3)  # exactly one slot missing: padded too
    assert one_more.kv_lens.tolist() == [0, 8, 0] and one_more.cu_q_lens.tolist() == [0, 2, 5, 5]


def test_coarsen_rounds_each_query_bound_up_to_its_bucket_and_pads_levels_on_its_own():
    levels = (_level([0, 5], [8], [[3, 0]], max_q_len=5), _level([0, 1, 3], [0, 4], [[0], [4]], 2))
    md = _main(3, levels)
    assert coarsen_metadata(md, None, None) is md
    only_q = coarsen_metadata(md, (1, 4, 8), None)
    assert only_q.max_q_len == 4 and [lv.max_q_len for lv in only_q.levels] == [8, 4]
    assert [lv.kv_lens.shape[0] for lv in only_q.levels] == [1, 2]  # sequence slots as built
    only_seqs = coarsen_metadata(md, None, 4)
    assert only_seqs.max_q_len == 3 and [lv.max_q_len for lv in only_seqs.levels] == [5, 2]
    assert [lv.cu_q_lens.tolist() for lv in only_seqs.levels] == [[0, 5, 5, 5, 5], [0, 1, 3, 3, 3]]
    assert [lv.kv_lens.tolist() for lv in only_seqs.levels] == [[8, 0, 0, 0], [0, 4, 0, 0]]
    # A bound already at a bucket stays; decode (1) keeps its own bucket.
    assert coarsen_metadata(_main(4, ()), (1, 4, 8), None).max_q_len == 4
    assert coarsen_metadata(_main(1, ()), (1, 4, 8), None).max_q_len == 1
    # Never past the step's 8 token slots, as the builder caps it (a kernel's tiles follow
    # the bound): a bucket of 256 over them is 8, for the main pass and each level alike.
    wide = coarsen_metadata(md, (1, 256), None)
    assert wide.max_q_len == 8 and [lv.max_q_len for lv in wide.levels] == [8, 8]
    with pytest.raises(ValueError, match=r"max_q_len \(q_len_buckets\)=5 exceeds the largest"):
        coarsen_metadata(md, (1, 4), None)  # the first level's 5


def test_coarsen_pads_each_longest_query_not_the_power_of_two_bound_built_for_it():
    # The builder pads a 3-token query's bound to 4 and a 5-token group's to 8 (powers of
    # two); buckets between those powers must hold the queries themselves: 3 and 6, where
    # padding the built bounds again gave 8 and 8 (more rows of attention per sequence).
    md = _main(4, (_level([0, 5], [8], [[3, 0]], max_q_len=8),))
    coarse = coarsen_metadata(md, (1, 3, 6, 8), None)
    assert coarse.max_q_len == 3 and coarse.levels[0].max_q_len == 6
    padded = coarsen_metadata(md, (1, 3, 6, 8), 4)  # padded levels: empty slots add nothing
    assert padded.levels[0].max_q_len == 6
    # Never below a query, nor above the bound as built.
    assert coarsen_metadata(_main(4, ()), (1, 2, 8), None).max_q_len == 8
    assert coarsen_metadata(_main(1, ()), (1, 3, 8), None).max_q_len == 1


def test_coarsen_pads_a_two_token_query_to_a_bucket_of_2():
    # The builder bounds a 2-token query by 8 (its token buckets start there); a bucket of
    # 2 just below holds it, as a bucket of 3 or more would.
    md = _main(4, (_level([0, 2], [8], [[3, 0]], max_q_len=8),))
    assert coarsen_metadata(md, (1, 2, 8), None).levels[0].max_q_len == 2
    assert coarsen_metadata(md, (1, 3, 8), None).levels[0].max_q_len == 3


def test_program_key_tells_apart_every_padded_shape_and_static_field():
    # Engine.num_compiles and StepStats.new_program count distinct keys: metadata padded
    # to another token, sequence or page bucket needs another program.
    md = _main(3, (_level([0, 5], [8], [[3, 0]], max_q_len=5),))
    pages = md.page_indices
    tokens16 = np.zeros(16, np.int32)  # the same batch padded to the next token bucket
    others = [
        dataclasses.replace(md, slot_mapping=tokens16, positions=tokens16),
        dataclasses.replace(md, page_indices=np.zeros((8, pages.shape[1]), np.int32)),
        dataclasses.replace(md, page_indices=np.zeros((pages.shape[0], 4), np.int32)),
        dataclasses.replace(md, block_size=8),
        dataclasses.replace(md, backend="pallas"),
        dataclasses.replace(md, interpret=True),
        dataclasses.replace(md, num_blocks=64),  # a meta field: part of the jit cache key
        dataclasses.replace(md, max_q_len=4),
        dataclasses.replace(md, levels=(pad_level(md.levels[0], 2),)),
        dataclasses.replace(md, levels=(dataclasses.replace(md.levels[0], max_q_len=8),)),
    ]
    keys = [program_key(m) for m in (md, *others)]
    assert len(set(keys)) == len(keys)
    assert program_key(dataclasses.replace(md, kv_lens=np.ones(4, np.int32))) == keys[0]
    # The logprob width is a static argument of the step program: another program.
    assert program_key(md, num_logprobs=None) == keys[0]
    widths = {program_key(md, num_logprobs=20), program_key(md, num_logprobs=0)}
    assert len({*widths, *keys}) == len(keys) + 2


def test_program_key_tells_apart_sampling_shapes_and_prompt_row_counts():
    """Each sampling argument's shape (a tuple's shapes, None) and the prompt rows count."""
    md = _main(3, ())
    a4, a8 = np.zeros(4, np.int32), np.zeros(8, np.int32)
    keys = [
        program_key(md, (a4,)),
        program_key(md, (a8,)),
        program_key(md, ((a4, a4),)),
        program_key(md, ((a4, a8),)),
        program_key(md, (None,)),
        program_key(md, (a4,), prompt_rows=PromptRows(a4, a4)),
        program_key(md, (a4,), prompt_rows=PromptRows(a8, a8)),
    ]
    assert len(set(keys)) == len(keys)
    assert program_key(md, (np.ones(4, np.int32),)) == keys[0]


def test_in_schedule_order_undoes_the_batch_permutation():
    """Batch row i is request order[i]: a 3-cycle (not its own inverse) tells it apart."""
    rows = np.array([[10], [20], [30], [99]])
    order = np.array([2, 0, 1])
    assert in_schedule_order(rows, 3, order).tolist() == [[20], [30], [10]]
    assert in_schedule_order(rows, 3, None).tolist() == [[10], [20], [30]]


def test_batch_inputs_reorder_the_sampled_positions_and_pad_levels_to_the_largest_bucket():
    """Four decodes under two system prompts, scheduled interleaved: the plan groups them,
    each sampled token's position (what seeded sampling draws from) follows its request
    to its batch row, and pad_cascade_levels pads the level to level_seq_buckets[-1]."""
    serving = sim.make_serving(0, block_size=4, num_blocks=64)
    systems = [list(range(100, 108)), list(range(200, 208))]
    for i, system in enumerate((0, 1, 1, 0)):
        prompt = systems[system] + [50] * (i + 1)
        serving.scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=8)))
    out = serving.scheduler.schedule()
    while out.num_requests < 4 or (out.num_scheduled_tokens != 1).any():
        serving.scheduler.update_from_output(out, np.arange(out.num_requests) + 7)
        out = serving.scheduler.schedule()
    ids = ["r0", "r1", "r2", "r3"]  # systems 0, 1, 1, 0: interleaved
    at = [out.request_ids.index(rid) for rid in ids]
    out = dataclasses.replace(
        out, requests=[out.requests[i] for i in at], request_ids=ids,
        num_scheduled_tokens=out.num_scheduled_tokens[at],
        num_computed_tokens=out.num_computed_tokens[at],
        token_ids=[out.token_ids[i] for i in at],
    )  # fmt: skip
    always = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0)
    planner = CascadePlanner(AttentionShape(8, 2, 64, kv_itemsize=2), cost_model=always)
    plan = planner.plan(ids, out.num_computed_tokens, out.num_scheduled_tokens, serving.manager)
    assert not plan.keeps_order and [lv.name for lv in plan.levels] == ["groups"]
    seen = {}

    def step_arrays(requests, order, num_rows, positions):
        seen["positions"] = positions.copy()
        return ()

    config = serving.config
    assert config.pad_cascade_levels
    order, md, input_ids, _, _ = batch_inputs(
        out, plan, manager=serving.manager, buckets=config.buckets, config=config,
        backend="xla", sampling_rows=types.SimpleNamespace(
            step_arrays=step_arrays, prompt_logprobs=PromptLogprobs(0)
        ),
    )  # fmt: skip
    assert order.tolist() == plan.order.tolist()
    want = [r.num_tokens for r in out.requests]  # each is one past its last token
    assert seen["positions"].tolist() == [want[i] for i in order] + [0] * 4
    assert input_ids[:4].tolist() == [out.token_ids[i] for i in order]
    (level,) = md.levels
    assert level.kv_lens.shape == (config.buckets.level_seq_buckets[-1],)
