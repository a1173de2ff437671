"""SamplingParams.min_tokens: stop tokens (EOS too) are banned until a request has that many.

End to end against a dense oracle that bans the same tokens by its own loop, in batches
the cascade planner reorders; the sampler's ban in sampled rows; the ban table's rows
under a permutation; the update loop's guard; bad input; compile accounting.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv import SamplingParams
from jaxkv.batch_rows import NO_TOKEN
from jaxkv.engine import Engine
from jaxkv.min_tokens import StopTokenBans
from jaxkv.models import Llama
from jaxkv.request import Request
from jaxkv.sampler import sample, sampling_arrays, sampling_row
from tests.engine._util import (
    VOCAB,
    _dense_logits,
    assert_all_blocks_free,
    dense_greedy,
    engine_config,
    make_engine,
    prompts_for,
    recording_orders,
    tiny_model,
)
from tests.host._sched_util import add, make_scheduler

ORACLE_ROWS = 8


def _dense_greedy_banned(prompt, max_tokens, stop, min_tokens) -> list[int]:
    """Greedy decoding by the dense model, one whole sequence per token: `stop` tokens
    get -inf logits while fewer than `min_tokens` tokens exist; stops after one."""
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        tokens = np.zeros((ORACLE_ROWS, 64), np.int32)
        tokens[0, : len(seq)] = seq
        lengths = np.array([len(seq)] + [1] * (ORACLE_ROWS - 1), np.int32)
        logits = np.asarray(_dense_logits()(tokens, lengths))[0].astype(np.float64)
        if len(out) < min_tokens:
            logits[list(stop)] = -np.inf
        top2 = np.sort(logits)[-2:]
        assert top2[1] - top2[0] > 2e-5, "oracle near-tie: pick another prompt"
        token = int(np.argmax(logits))
        out.append(token)
        seq.append(token)
        if token in stop:
            break
    return out


def test_greedy_requests_skip_their_stop_tokens_until_min_tokens_in_reordered_batches():
    prompts = prompts_for("two_groups", seed=3) + prompts_for("shared", seed=3)[:2]
    greedy = dense_greedy(prompts, 3)
    engine = make_engine()
    orders = recording_orders(engine)
    cases = []
    for i, (prompt, first) in enumerate(zip(prompts, greedy, strict=True)):
        # Every request's stop list holds the token it would pick first, so without the
        # ban each would stop at once. Odd ones ask for no minimum: they must still stop.
        stop = (first[0], first[1], (first[0] + 1) % VOCAB)
        min_tokens = 0 if i % 2 else 2 + i % 3
        params = SamplingParams(max_tokens=6, stop_token_ids=stop, min_tokens=min_tokens)
        expected = _dense_greedy_banned(prompt, 6, stop, min_tokens)
        cases.append((engine.add_request(prompt, params), expected, min_tokens))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert any(order is not None for order in orders), "no step reordered its rows"
    for rid, expected, min_tokens in cases:
        assert outs[rid] == expected, rid
        assert len(outs[rid]) > min_tokens or len(outs[rid]) == 6
        if min_tokens == 0:
            assert len(outs[rid]) == 1  # stopped at its first token, as without the ban
    assert len(engine._sampling._bans) == 0  # every request left the ban table
    assert_all_blocks_free(engine)


def test_sampled_requests_never_draw_a_banned_token_before_min_tokens():
    rng = np.random.default_rng(0)
    stop = tuple(sorted(rng.choice(VOCAB, 100, replace=False).tolist()))  # a 128-wide ban
    engine = make_engine()
    params = [
        SamplingParams(max_tokens=8, temperature=1.5, seed=s, stop_token_ids=stop, min_tokens=6)
        for s in range(8)
    ]
    prompts = prompts_for("shared", seed=4) + prompts_for("two_groups", seed=4)[:2]
    outs = engine.generate(prompts * 2, params * 2, progress=False)
    for out in outs:
        tokens = list(out.output_token_ids)
        assert not set(tokens[:6]) & set(stop), tokens
        assert len(tokens) >= 7
        if out.finish_reason == "stop":
            assert tokens[-1] in stop and not set(tokens[:-1]) & set(stop)
    # With 100 of 256 tokens stopping and T=1.5, tokens 7-8 stop some requests: the ban
    # was lifted at min_tokens, not kept.
    assert any(o.finish_reason == "stop" for o in outs)
    assert_all_blocks_free(engine)


def test_eos_is_banned_until_min_tokens_also_for_a_request_that_ignores_it():
    prompt = prompts_for("none", seed=5)[0]
    first = dense_greedy([prompt], 1)[0][0]
    # The same weights (tiny_model's seed) with the greedy first token as the model's EOS.
    config = dataclasses.replace(tiny_model().config, eos_token_ids=(first,))
    engine = Engine(Llama(config, rngs=nnx.Rngs(0)), None, engine_config())
    params = [
        SamplingParams(max_tokens=4),
        SamplingParams(max_tokens=4, min_tokens=3),
        SamplingParams(max_tokens=4, min_tokens=3, ignore_eos=True),  # vLLM bans EOS here too
        SamplingParams(max_tokens=2, ignore_eos=True),
    ]
    outs = engine.generate([prompt] * 4, params, progress=False)
    assert list(outs[0].output_token_ids) == [first] and outs[0].finish_reason == "stop"
    banned = _dense_greedy_banned(prompt, 4, (first,), 3)
    assert list(outs[1].output_token_ids) == banned
    assert list(outs[2].output_token_ids)[:3] == banned[:3]
    assert len(outs[2].output_token_ids) == 4 and outs[2].finish_reason == "length"
    assert outs[3].output_token_ids[0] == first and outs[3].finish_reason == "length"


def test_sample_bans_only_in_vocab_ids_of_each_row():
    logits = np.tile(np.linspace(1.0, 0.0, 8, dtype=np.float32), (4, 1))  # argmax 0, then 1
    temperature, top_k, top_p, seeds, streams = sampling_arrays(
        [sampling_row(SamplingParams(), 0)] * 4, 4
    )
    banned = np.array(
        [[0, NO_TOKEN], [0, 1], [-8, NO_TOKEN], [8, 2**31 - 1]], np.int32
    )  # -8 would wrap to token 0; 8 is past the vocabulary
    args = (temperature, top_k, top_p, seeds, streams, np.zeros(4, np.int32))
    tokens = np.asarray(jax.jit(sample)(logits, *args, banned))
    assert tokens.tolist() == [1, 2, 0, 0]
    assert np.asarray(jax.jit(sample)(logits, *args)).tolist() == [0, 0, 0, 0]


def test_sampled_rows_draw_the_rest_in_proportion():
    n = 4000
    logits = np.tile(np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32)), (n, 1))
    arrays = sampling_arrays([sampling_row(SamplingParams(temperature=1.0, seed=1), 0)] * n, n)
    positions = np.arange(n, dtype=np.int32)
    banned = np.full((n, 1), 0, np.int32)
    tokens = np.asarray(jax.jit(sample)(logits, *arrays, positions, banned))
    counts = np.bincount(tokens, minlength=4) / n
    assert counts[0] == 0
    np.testing.assert_allclose(counts[1:], [0.6, 0.3, 0.1], atol=0.03)


def test_ban_rows_follow_the_batch_permutation_and_leave_at_min_tokens():
    bans = StopTokenBans()
    reqs = [Request(f"r{i}", [1, 2]) for i in range(4)]
    bans.add("r0", SamplingParams(stop_token_ids=(5,), min_tokens=1))
    bans.add("r1", SamplingParams(stop_token_ids=(6, 7, 9), min_tokens=2))
    bans.add("r2", SamplingParams(min_tokens=3))  # nothing to ban
    bans.add("r3", SamplingParams(stop_token_ids=(8,)))  # no minimum
    assert len(bans) == 2
    order = np.array([3, 1, 0, 2])  # batch row i holds reqs[order[i]]
    got = bans.array(reqs, order, 6)
    pad = NO_TOKEN
    assert got.tolist() == [
        [pad] * 4, [6, 7, 9, pad], [5, pad, pad, pad], [pad] * 4, [pad] * 4, [pad] * 4,
    ]  # fmt: skip
    reqs[0].append_output_token_ids(11)  # r0 reached min_tokens=1: it leaves
    assert bans.array(reqs, None, 4).tolist()[:2] == [[pad] * 4, [6, 7, 9, pad]]
    assert len(bans) == 1
    bans.discard("r1")
    assert bans.array(reqs, None, 4).shape == (4, 0)
    assert bans.array(reqs, order, 4) is bans.array(reqs, None, 4)  # one empty per size


def test_ignore_eos_bans_the_models_eos_ids_besides_the_requests_own_stop_tokens():
    """Under ignore_eos a request's own stop_token_ids stay banned until min_tokens, and
    the model's EOS ids are banned after them (each once); without ignore_eos the params
    already list EOS (SamplingParams.stopping_at) and only they are banned."""
    bans = StopTokenBans(eos_token_ids=(2, 7))
    reqs = [Request(f"r{i}", [1]) for i in range(3)]
    bans.add("r0", SamplingParams(stop_token_ids=(5, 7), min_tokens=2, ignore_eos=True))
    bans.add("r1", SamplingParams(stop_token_ids=(9,), min_tokens=2))
    bans.add("r2", SamplingParams(min_tokens=2, ignore_eos=True))
    pad = NO_TOKEN
    assert bans.array(reqs, None, 3).tolist() == [
        [5, 7, 2, pad],
        [9, pad, pad, pad],
        [2, 7, pad, pad],
    ]


def test_a_stop_token_sampled_before_min_tokens_does_not_stop():
    # The sampler bans it; should a row have had nothing else left, the scheduler still
    # does not stop the request before min_tokens.
    sched = make_scheduler()
    a = add(sched, "a", [1, 2], max_tokens=5, stop_token_ids=(7,), min_tokens=2)
    for token, finished in ((7, False), (7, False), (7, True)):
        out = sched.schedule()
        (result,) = sched.update_from_output(out, [token])
        assert result.finished is finished
    assert a.output_token_ids == [7, 7, 7] and result.finish_reason == "stop"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"min_tokens": -1}, "min_tokens=-1 must be an int >= 0 and <= max_tokens=16"),
        ({"min_tokens": 1.5}, "min_tokens=1.5"),
        ({"min_tokens": True}, "min_tokens=True"),
        ({"min_tokens": "3"}, "min_tokens='3'"),
        ({"min_tokens": None}, "min_tokens=None"),
        ({"max_tokens": 4, "min_tokens": 5}, "<= max_tokens=4"),
    ],
)
def test_bad_min_tokens_is_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("+", r"\+")):
        SamplingParams(**args)


def test_min_tokens_accepts_numpy_ints_and_no_max_tokens():
    assert SamplingParams(min_tokens=np.int64(3)).min_tokens == 3
    assert type(SamplingParams(min_tokens=np.int64(3)).min_tokens) is int
    assert SamplingParams(max_tokens=None, min_tokens=10**6).min_tokens == 10**6
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_ban_widths_are_counted_as_programs():
    prompt = prompts_for("none", seed=6)[0]
    engine = make_engine(cascade=False)
    engine.generate([prompt], SamplingParams(max_tokens=2), progress=False)
    base = engine.num_compiles
    stop = dense_greedy([prompt], 1)[0]
    banned = SamplingParams(max_tokens=2, stop_token_ids=tuple(stop), min_tokens=2)
    engine.generate([prompt], banned, progress=False)
    assert engine.num_compiles == base + 1  # the same shapes with a 1-wide ban
    engine.generate([prompt], banned, progress=False)
    assert engine.num_compiles == base + 1


def test_adding_params_that_ban_nothing_drops_the_requests_earlier_ban():
    """add replaces an earlier add's entry, also by none when the new params ban nothing."""
    bans = StopTokenBans()
    reqs = [Request("r0", [1, 2])]
    bans.add("r0", SamplingParams(stop_token_ids=(5,), min_tokens=2))
    assert bans.array(reqs, None, 1).tolist() == [[5]]
    bans.add("r0", SamplingParams(stop_token_ids=(5,)))  # no minimum any more
    assert len(bans) == 0
    assert bans.array(reqs, None, 1).shape == (1, 0)


@pytest.mark.parametrize(("longest", "width"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8)])
def test_ban_width_is_the_longest_stop_list_rounded_up_to_a_power_of_two(longest, width):
    bans = StopTokenBans()
    reqs = [Request("r0", [1]), Request("r1", [1])]
    bans.add("r0", SamplingParams(stop_token_ids=tuple(range(10, 10 + longest)), min_tokens=1))
    bans.add("r1", SamplingParams(stop_token_ids=(9,), min_tokens=1))
    got = bans.array(reqs, None, 2)
    assert got.shape == (2, width)
    assert got[0, :longest].tolist() == list(range(10, 10 + longest))
    assert (got[0, longest:] == NO_TOKEN).all() and got[1].tolist()[:1] == [9]
