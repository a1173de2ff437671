"""Scheduler calls it refuses, with nothing changed: add_request, abort, update_from_output
and the constructor given what they cannot honour."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import Request, SamplingParams, Scheduler
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, add, make_scheduler, run_until_idle, step


def test_add_request_rejects_duplicates_and_prompts_without_room():
    sched = make_scheduler(max_model_len=8)
    add(sched, "a", [1, 2])
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "a", [1, 2])
    with pytest.raises(ValueError, match="no room"):
        add(sched, "b", range(1, 9))
    out, _ = step(sched)
    assert out.request_ids == ["a"]


def test_one_request_object_is_served_by_one_scheduler():
    # Two schedulers used to take it: both appended tokens and advanced its computed
    # tokens (18 computed of 11), with no error and check_integrity passing on both.
    first, second = make_scheduler(), make_scheduler()
    request = Request("a", list(range(1, 10)), SamplingParams(max_tokens=3))
    first.add_request(request)
    with pytest.raises(ValueError, match="already queued by a scheduler"):
        second.add_request(request)
    assert not second.has_unfinished_requests() and "a" not in second.requests
    assert run_until_idle(first) == {"a": "length"} and request.num_tokens == 12


def test_a_request_hashed_for_another_block_size_is_refused_at_add():
    # It used to be queued, and then every schedule() raised on its block hashes: the
    # scheduler served nothing until the caller aborted it.
    sched = make_scheduler()
    foreign = Request("x", list(range(9)), SamplingParams(max_tokens=2))
    foreign.update_block_hashes(8)
    with pytest.raises(ValueError, match=r"'x' were computed with \(block_size, seed\)=\(8, 0\)"):
        sched.add_request(foreign)
    with pytest.raises(ValueError, match="request='x' must be a Request"):
        sched.add_request("x")
    assert not sched.requests and not sched.waiting
    add(sched, "a", [1, 2, 3], max_tokens=2)
    assert run_until_idle(sched) == {"a": "length"}
    assert sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1


def test_a_foreign_hashed_request_is_refused_at_add_with_prefix_caching_off_too():
    # The host offload connector reads block hashes whatever the manager's prefix
    # caching: such a request was queued, and once the store held a block every
    # schedule() raised on it, so no request ran until the caller aborted it.
    copier = FakeCopier(16, 4)
    connector = HostOffloadConnector(16 * copier.bytes_per_block)
    connector.bind(copier, block_size=4, hash_seed=0)
    sched = make_scheduler(num_blocks=16, enable_prefix_caching=False, connector=connector)
    add(sched, "a", range(1, 10), max_tokens=1)
    run_until_idle(sched, copier)
    assert connector.stats.num_stored_blocks == 2
    foreign = Request("x", list(range(9)), SamplingParams(max_tokens=2))
    foreign.update_block_hashes(8)
    with pytest.raises(ValueError, match=r"'x' were computed with \(block_size, seed\)=\(8, 0\)"):
        sched.add_request(foreign)
    assert not sched.requests and not sched.waiting
    add(sched, "b", [1, 2, 3], max_tokens=2)
    assert run_until_idle(sched, copier) == {"b": "length"}


@pytest.mark.parametrize("bad", [0, ["a"], None, "0\ud800"])
def test_abort_refuses_an_id_that_is_not_a_str(bad):
    # abort(0) for the request "0" used to return False and leave it running.
    sched = make_scheduler()
    add(sched, "0", [1, 2, 3], max_tokens=2)
    with pytest.raises(ValueError, match="request_id=.* must be a request id"):
        sched.abort(bad)
    assert sched.abort(sched.requests["0"].request_id)
    assert not sched.has_unfinished_requests()


def test_a_queued_request_s_id_cannot_be_reassigned():
    # Assignable, a renamed request made abort, preemption, discard and finishing act on
    # an id the scheduler and the manager did not hold it under (blocks held for good).
    sched = make_scheduler()
    a = add(sched, "a", range(1, 10), max_tokens=4)
    step(sched)
    with pytest.raises(AttributeError, match="request_id"):
        a.request_id = "z"
    assert a.request_id == "a" and sched.running == [a]
    sched.manager.check_integrity()
    assert sched.abort("a") and sched.manager.num_free_blocks == sched.manager.pool.num_blocks - 1


def test_a_request_the_pool_cannot_hold_is_refused_and_one_it_can_finishes():
    # 4 usable blocks of 4 tokens: 16 tokens of KV. Without the check, a request needing
    # 17 would preempt itself when it outgrew the pool and then wait forever. Its KV is one
    # token short of prompt plus max_tokens: the last sampled token is never fed back.
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=32, max_model_len=32)
    with pytest.raises(ValueError, match="'big': up to 17 tokens of KV .* 5 blocks of 4; the pool"):
        add(sched, "big", range(1, 9), max_tokens=10)
    assert not sched.requests and not sched.waiting
    whole = add(sched, "whole", range(1, 9), max_tokens=9)  # 16 tokens of KV: the whole pool
    assert run_until_idle(sched) == {"whole": "length"} and whole.num_output_tokens == 9
    assert sched.stats.num_preemptions == 0 and sched.manager.num_free_blocks == 4
    fits = [add(sched, f"r{i}", range(10 * i + 1, 10 * i + 9), max_tokens=8) for i in range(2)]
    assert run_until_idle(sched) == {"r0": "length", "r1": "length"}
    assert [r.num_output_tokens for r in fits] == [8, 8] and sched.stats.num_preemptions > 0
    assert sched.manager.num_free_blocks == 4


def test_update_refuses_a_stale_output_or_bad_tokens_and_changes_nothing():
    sched = make_scheduler()
    a, b = add(sched, "a", range(1, 6), max_tokens=5), add(sched, "b", range(1, 7), max_tokens=5)
    first = sched.schedule()

    def state():
        return [(r.num_computed_tokens, list(r.output_token_ids)) for r in (a, b)], {
            r: sched.manager.block_ids(r) for r in ("a", "b")
        }

    before = state()
    for bad, match in [
        (np.array([7.0, 8.0]), "float64 must be integers of shape \\(2,\\)"),
        ([[7, 8]], "\\(1, 2\\) int64"),
        ([7], "shape \\(2,\\)"),
        ([[7], [8, 9]], "shape \\(2,\\)"),  # ragged: numpy's own error used to escape
        ([7, -8], "-8..7 must lie in \\[0, 9223372036854775807\\]"),
        (np.array([7, 2**63], np.uint64), "7..9223372036854775808 must lie in"),  # not int64
    ]:
        with pytest.raises(ValueError, match=f"sampled_token_ids: .*{match}"):
            sched.update_from_output(first, bad)
        assert state() == before
    sched.update_from_output(first, [7, 8])
    after = state()
    with pytest.raises(ValueError, match="output: .*already applied"):
        sched.update_from_output(first, [9, 10])
    for call in (lambda: sched.update_from_output(None, []), lambda: sched.discard(None)):
        with pytest.raises(ValueError, match="output: not the latest"):  # none pending
            call()
    assert state() == after


@pytest.mark.parametrize(
    "args, match",
    [
        (lambda c, m: (None, m), "config=None must be a SchedulerConfig"),
        (lambda c, m: ({"max_model_len": 64}, m), "config=.* must be a SchedulerConfig"),
        (lambda c, m: (c, None), "manager=None must be a KVCacheManager"),
        (lambda c, m: (c, m, "offload"), "connector='offload' must be a KVConnector"),
    ],
)
def test_the_constructor_refuses_arguments_of_the_wrong_kind_by_name(args, match):
    # Each used to raise AttributeError, a connector only in the first schedule().
    made = make_scheduler()
    with pytest.raises(ValueError, match=match):
        Scheduler(*args(made.config, made.manager))


def test_update_refuses_a_bool_among_the_sampled_tokens():
    # numpy reads [True, 8] as the int array [1, 8]: True was appended as token 1.
    sched = make_scheduler()
    a, b = add(sched, "a", range(1, 6), max_tokens=5), add(sched, "b", range(1, 7), max_tokens=5)
    first = sched.schedule()
    for bad in ([True, 8], (7, np.False_), [np.array(True), 8]):
        with pytest.raises(ValueError, match="sampled_token_ids: .* bool"):
            sched.update_from_output(first, bad)
        assert [r.output_token_ids for r in (a, b)] == [[], []]
        sched.manager.check_integrity()
    sched.update_from_output(first, [7, 8])
    assert [r.output_token_ids for r in (a, b)] == [[7], [8]]


@pytest.mark.parametrize("tokens", [[7, np.uint64(8)], (np.int64(7), np.uint64(8))])
def test_update_takes_uint64_tokens_among_signed_ones(tokens):
    # numpy reads int64 and uint64 together as float64: each is still one integer token
    sched = make_scheduler()
    a, b = add(sched, "a", range(1, 6), max_tokens=5), add(sched, "b", range(1, 7), max_tokens=5)
    sched.update_from_output(sched.schedule(), tokens)
    assert (list(a.output_token_ids), list(b.output_token_ids)) == ([7], [8])
    assert [type(t) for t in (*a.output_token_ids, *b.output_token_ids)] == [int, int]


def test_a_request_the_pool_cannot_hold_is_refused_naming_the_usable_blocks():
    # 6 blocks, of which the null block is never handed out: 5 usable, where the
    # request's 21 tokens of KV need 6 (one token fewer needs 5: accepted).
    sched = make_scheduler(num_blocks=6, max_model_len=32)
    message = (
        "request 'big': up to 21 tokens of KV (prompt plus max_tokens less the last "
        "token, at most max_model_len - 1) need 6 blocks of 4; the pool has 5"
    )
    with pytest.raises(ValueError) as refused:
        add(sched, "big", range(1, 11), max_tokens=12)
    assert str(refused.value) == message and not sched.requests and not sched.waiting
    add(sched, "fits", range(1, 11), max_tokens=11)
    assert list(sched.requests) == ["fits"]
