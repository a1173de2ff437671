"""SamplingParams' presence, frequency and repetition penalties (jaxkv.penalties).

End to end against a dense oracle that penalises by its own loop (vLLM's rule written
out in numpy), in batches the cascade planner reorders, under preemption and n > 1;
apply_penalties against the same rule on random logits; the penalty table's rows under
a permutation; raw logprobs; bad input; compile accounting.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

from jaxkv import SamplingParams
from jaxkv.penalties import NO_TOKEN, TokenPenalties, apply_penalties, table_width
from jaxkv.request import Request
from tests.engine._util import (
    MIN_MARGIN,
    TIGHT_BLOCKS,
    assert_all_blocks_free,
    dense_logits,
    make_engine,
    prompts_for,
    recording_orders,
)


def _penalised(logits, prompt, output, params: SamplingParams) -> np.ndarray:
    """vLLM's penalties on one row, by a loop over the vocabulary (float32, as the sampler)."""
    out = np.array(logits, np.float32)
    rep = np.float32(params.repetition_penalty)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        n = np.float32(output.count(t))
        out[t] -= np.float32(params.frequency_penalty) * n + np.float32(params.presence_penalty)
    return out


def _dense_greedy_penalised(prompts, params_list, max_tokens) -> list[list[int]]:
    """Greedy continuations by the dense model, whole sequences recomputed per token, with
    each prompt's penalties applied by _penalised."""
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        rows = dense_logits([list(p) + o for p, o in zip(prompts, outputs, strict=True)])
        for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            row = _penalised(rows[i], list(prompt), outputs[i], params)
            top2 = np.sort(row)[-2:]
            assert top2[1] - top2[0] > MIN_MARGIN, "oracle near-tie: pick another prompt"
            outputs[i].append(int(np.argmax(row)))
    return outputs


PARAMS = [
    SamplingParams(max_tokens=12, repetition_penalty=1.8),
    SamplingParams(max_tokens=12, presence_penalty=1.5),
    SamplingParams(max_tokens=12, frequency_penalty=0.7, repetition_penalty=0.6),
    SamplingParams(max_tokens=12),  # no penalty, in the same batches
    SamplingParams(max_tokens=12, presence_penalty=-1.0, frequency_penalty=2.0),
]


@pytest.mark.parametrize("num_blocks", [None, TIGHT_BLOCKS])
def test_greedy_requests_with_penalties_equal_the_dense_oracle(num_blocks):
    prompts = (prompts_for("two_groups", seed=4) + prompts_for("shared", seed=4))[:10]
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]
    expected = _dense_greedy_penalised(prompts, params, 12)
    plain = _dense_greedy_penalised(prompts, [SamplingParams()] * len(prompts), 12)
    assert sum(e != p for e, p in zip(expected, plain, strict=True)) >= 5  # 8 penalised
    engine = make_engine() if num_blocks is None else make_engine(num_blocks=num_blocks)
    orders = recording_orders(engine)
    outs = engine.generate(prompts, params, progress=False)
    assert [list(o.output_token_ids) for o in outs] == expected
    assert any(order is not None for order in orders), "no step reordered its rows"
    if num_blocks is not None:
        assert engine.metrics.num_preemptions > 0
    assert len(engine._sampling._penalties) == 0  # every request left the table
    assert_all_blocks_free(engine)


def test_each_sample_of_n_counts_its_own_output_and_logprobs_stay_raw():
    prompt = prompts_for("none", seed=5)[0]
    params = SamplingParams(max_tokens=8, n=2, seed=3, temperature=0.8, logprobs=2,
                            frequency_penalty=2.0, repetition_penalty=1.5)  # fmt: skip
    engine = make_engine()
    samples = engine.generate([prompt], params, progress=False)
    assert len(samples) == 2 and samples[0].output_token_ids != samples[1].output_token_ids
    for sample in samples:
        tokens = list(sample.output_token_ids)
        raw = dense_logits([list(prompt) + tokens[:i] for i in range(len(tokens))])
        for i, token in enumerate(tokens):
            z = raw[i].astype(np.float64) - raw[i].max()
            want = z[token] - np.log(np.exp(z).sum())  # of the raw logits, as vLLM's
            assert sample.logprobs[i][token].logprob == pytest.approx(want, abs=1e-4)
    assert_all_blocks_free(engine)


def test_apply_penalties_equals_the_rule_on_random_rows():
    rng = np.random.default_rng(0)
    vocab, rows = 50, 6
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    table = TokenPenalties()
    reqs, params = [], []
    for i in range(rows - 1):
        p = SamplingParams(presence_penalty=float(rng.uniform(-2, 2)),
                           frequency_penalty=float(rng.uniform(-2, 2)),
                           repetition_penalty=float(rng.uniform(0.3, 3)))  # fmt: skip
        req = Request(f"r{i}", rng.integers(0, vocab, 7).tolist())
        req.append_output_token_ids(rng.integers(0, vocab, int(rng.integers(0, 9))).tolist())
        table.add(req.request_id, p)
        reqs.append(req)
        params.append(p)
    reqs.append(Request("plain", [1, 2, 3]))  # no penalty: its row must stay as it was
    params.append(SamplingParams())
    table.arrays(reqs, None, rows + 2)
    for req in reqs[:-1]:  # more output after a step: counted on, the lists grow past 16
        req.append_output_token_ids(rng.integers(0, vocab, int(rng.integers(10, 40))).tolist())
    arrays = table.arrays(reqs, None, rows + 2)
    assert arrays[0].shape[1] >= 32
    padded = np.concatenate([logits, np.ones((2, vocab), np.float32)])
    got = np.asarray(jax.jit(apply_penalties)(padded, arrays))
    for i, (req, p) in enumerate(zip(reqs, params, strict=True)):
        want = _penalised(logits[i], list(req.prompt_token_ids), req.output_token_ids, p)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[rows - 1 :], padded[rows - 1 :])
    # The same check rejects a table that lost one count (a broken input).
    broken = list(arrays)
    broken[1] = arrays[1].copy()
    broken[1][0, 0] += 1
    assert not np.allclose(np.asarray(apply_penalties(padded, tuple(broken)))[0], got[0])


def test_penalty_rows_follow_the_batch_permutation_and_count_new_outputs():
    table = TokenPenalties()
    reqs = [Request(f"r{i}", [4, 5, 4]) for i in range(3)]
    table.add("r0", SamplingParams(presence_penalty=1.0))
    table.add("r1", SamplingParams(repetition_penalty=2.0))
    table.add("r2", SamplingParams())  # nothing to apply: not held
    assert len(table) == 2 and table.arrays(reqs[2:], None, 4) is None
    # Before any output a presence penalty lists nothing: the batch runs without a table.
    assert table.arrays(reqs[:1], None, 4) is None
    reqs[0].append_output_token_ids([9, 9, 7])
    order = np.array([2, 0, 1])  # batch row i holds reqs[order[i]]
    tokens, counts, presence, frequency, repetition = table.arrays(reqs, order, 5)
    pad = NO_TOKEN
    assert tokens.shape == counts.shape == (5, 64)
    assert tokens[:, :2].tolist() == [[pad] * 2, [9, 7], [4, 5], [pad] * 2, [pad] * 2]
    assert counts[:, :2].tolist() == [[0, 0], [2, 1], [0, 0], [0, 0], [0, 0]]
    assert (tokens[:, 2:] == pad).all() and not counts[:, 2:].any()
    assert presence.tolist() == [0, 1, 0, 0, 0] and frequency.tolist() == [0] * 5
    assert repetition.tolist() == [1, 1, 2, 1, 1]
    reqs[1].append_output_token_ids([5, 6])  # prompt token 5 is now an output token too
    reqs[0].append_output_token_ids(7)
    tokens, counts, *_ = table.arrays(reqs, None, 3)
    assert tokens[:, :4].tolist() == [[9, 7, pad, pad], [4, 5, 6, pad], [pad] * 4]
    assert counts[:, :4].tolist() == [[2, 2, 0, 0], [0, 1, 1, 0], [0] * 4]
    table.add("r0", SamplingParams())  # params without a penalty replace the entry
    table.discard("r1")
    assert len(table) == 0 and table.arrays(reqs, None, 3) is None
    # A reused id starts afresh, in a row of the table another request held.
    table.add("r1", SamplingParams(frequency_penalty=1.0))
    tokens, counts, *_ = table.arrays(reqs[1:2], None, 1)
    assert tokens[0, :3].tolist() == [5, 6, pad] and counts[0, :3].tolist() == [1, 1, 0]


def test_table_widths_grow_by_powers_of_four_from_64():
    assert [table_width(n) for n in (1, 64, 65, 256, 257, 1025)] == [64, 64, 256, 256, 1024, 4096]
    table = TokenPenalties()
    req = Request("r", list(range(300)))
    table.add("r", SamplingParams(repetition_penalty=1.3))
    tokens, *_ = table.arrays([req], None, 2)
    assert tokens.shape == (2, 1024) and sorted(tokens[0, :300].tolist()) == list(range(300))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty=2.5 must be a number in"),
        ({"frequency_penalty": -2.01}, "frequency_penalty=-2.01 must be a number in"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
        ({"presence_penalty": True}, "presence_penalty=True"),
        ({"presence_penalty": "1"}, "presence_penalty='1'"),
        ({"repetition_penalty": 0}, "repetition_penalty=0 must be a number > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty=inf"),
        ({"repetition_penalty": None}, "repetition_penalty=None"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty=1e-39 must be .* normal"),
        # float16's own comparison rounded the float32 bounds to 0 and inf: both passed.
        ({"repetition_penalty": np.float16(0)}, r"repetition_penalty=np.float16\(0.0\)"),
        ({"repetition_penalty": np.float16("inf")}, r"repetition_penalty=np.float16\(inf\)"),
        ({"presence_penalty": 10**400}, "presence_penalty=1000"),
    ],
)
def test_bad_penalties_are_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**args)


def test_penalties_are_stored_as_floats_and_no_op_values_hold_nothing():
    params = SamplingParams(presence_penalty=np.int64(2), repetition_penalty=np.float32(1.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a float16 compared with float32's bounds warned
        assert SamplingParams(repetition_penalty=np.float16(1.5)).repetition_penalty == 1.5
    assert type(params.presence_penalty) is float and params.presence_penalty == 2.0
    assert params.has_penalties and not SamplingParams(repetition_penalty=1).has_penalties
    assert SamplingParams(frequency_penalty=-2, presence_penalty=2).has_penalties


def test_penalty_widths_are_counted_as_programs():
    prompt = prompts_for("none", seed=6)[0]
    engine = make_engine(cascade=False)
    engine.generate([prompt], SamplingParams(max_tokens=2), progress=False)
    base = engine.num_compiles
    # One output token is listed at the second step: the same shapes with a 1-wide table.
    penalised = SamplingParams(max_tokens=2, presence_penalty=1.0)
    engine.generate([prompt], penalised, progress=False)
    assert engine.num_compiles == base + 1
    engine.generate([prompt], penalised, progress=False)
    assert engine.num_compiles == base + 1


def test_an_output_list_past_the_first_width_widens_the_table_and_keeps_every_count():
    """A request whose output holds more distinct tokens than the table's first width (64)
    widens the table (to 256) and counts every token: its penalised logits equal the rule."""
    table = TokenPenalties()
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    req = Request("r", [1, 2])
    table.add("r", params)
    outputs = list(range(100)) + list(range(0, 100, 3))
    req.append_output_token_ids(outputs[:10])
    table.arrays([req], None, 2)
    req.append_output_token_ids(outputs[10:])  # 90 new distinct tokens in one step
    arrays = table.arrays([req], None, 2)
    assert arrays[0].shape == (2, 256)
    logits = np.random.default_rng(3).normal(0, 3, (2, 128)).astype(np.float32)
    got = np.asarray(jax.jit(apply_penalties)(logits, arrays))
    np.testing.assert_allclose(got[0], _penalised(logits[0], [1, 2], outputs, params), atol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])


def test_listed_ids_outside_the_vocabulary_change_nothing():
    """apply_penalties ignores a listed id outside [0, vocab): a negative one would index
    from the end of the row, and one at or past vocab is the padding."""
    logits = np.float32([[1.0, -2.0, 3.0, 0.5], [0.25, 4.0, -1.0, 2.0]])
    tokens = np.int32([[-1, -4, 4, NO_TOKEN], [-1, 1, 7, NO_TOKEN]])
    arrays = (tokens, np.full((2, 4), 3, np.int32), *np.float32([[1, 1], [0.5, 0.5], [2, 2]]))
    got = np.asarray(jax.jit(apply_penalties)(logits, arrays))
    np.testing.assert_array_equal(got[0], logits[0])
    want_1 = np.float32(4.0) / 2 - 0.5 * 3 - 1  # token 1 alone: 4 / 2 - 0.5 * 3 - 1
    np.testing.assert_array_equal(got[1], [0.25, want_1, -1.0, 2.0])


def test_rows_past_the_tables_first_ones_keep_their_own_lists_and_freed_rows_are_reused():
    """260 penalised requests grow the table's rows from 64 to 512 (once past a widening
    to 256 columns, made while it held 128 rows); each lists its own tokens. Requests
    that come and go afterwards reuse a freed row: the table keeps its size."""
    table = TokenPenalties()
    reqs = [Request(f"r{i}", [1]) for i in range(260)]

    def add(some):
        for req in some:
            table.add(req.request_id, SamplingParams(frequency_penalty=1.0))
            req.append_output_token_ids([int(req.request_id[1:]) + 2] * 2)

    add(reqs[:65])
    reqs[0].append_output_token_ids(range(300, 400))  # 101 tokens listed: 256 columns
    assert table.arrays(reqs[:65], None, 65)[0].shape == (65, 256)
    add(reqs[65:])
    tokens, counts, _, frequency, _ = table.arrays(reqs, None, 260)
    assert tokens.shape == counts.shape == (260, 256) and frequency.tolist() == [1.0] * 260
    assert tokens[0, :101].tolist() == [2, *range(300, 400)] and counts[0, :2].tolist() == [2, 1]
    assert tokens[1:, 0].tolist() == list(range(3, 262)) and (tokens[1:, 1:] == NO_TOKEN).all()
    assert counts[1:, 0].tolist() == [2] * 259 and not counts[1:, 1:].any()
    table.add("x", SamplingParams(presence_penalty=1.0))
    table.discard("x")
    rows = len(table._ids)
    for i in range(600):
        table.add(f"x{i}", SamplingParams(presence_penalty=1.0))
        table.discard(f"x{i}")
    assert len(table._ids) == rows and len(table) == 260


def test_a_batch_of_short_lists_gets_their_width_after_a_long_list_widened_the_table():
    table = TokenPenalties()
    long, short = Request("l", [1]), Request("s", [1])
    for req in (long, short):
        table.add(req.request_id, SamplingParams(presence_penalty=1.0))
    long.append_output_token_ids(range(100))
    short.append_output_token_ids([7])
    assert table.arrays([long, short], None, 2)[0].shape == (2, 256)
    tokens, counts, *_ = table.arrays([short], None, 1)  # the table stays 256 wide
    assert tokens.shape == counts.shape == (1, 64)
    assert tokens[0, :2].tolist() == [7, NO_TOKEN] and counts[0, :2].tolist() == [1, 0]
