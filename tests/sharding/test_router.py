"""PrefixAwareRouter over fake replicas: prefix affinity, load balance, bookkeeping.

The fake replicas (tests/sharding/_router_util.py) emit one token per step for every
request they hold, so the router is tested without engines or jax.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import SamplingParams, completion
from jaxkv.request import MAX_TOKEN_ID
from jaxkv.router import PrefixAwareRouter, Route
from tests.sharding._router_util import (
    BLOCK,
    FakeReplica,
    OffloadingReplica,
    make_router,
    rand_tokens,
)


def test_shared_prefix_requests_stay_together_and_loners_go_to_the_least_loaded():
    rng = np.random.default_rng(0)
    prefixes = [rand_tokens(rng, 2 * BLOCK + 1) for _ in range(3)]
    router, _ = make_router(4)
    groups: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    for i in range(24):
        before = router.num_outstanding
        if i % 2 == 0:  # every other request belongs to one of three prefix groups
            g = (i // 2) % 3
            prompt = prefixes[g] + rand_tokens(rng, int(rng.integers(0, 6)))
            replica = router.replica_of(router.add_request(prompt))
            if not groups[g]:  # a new prefix goes to the least loaded replica
                assert before[replica] == min(before), (before, replica)
            groups[g].add(replica)
        else:
            prompt = rand_tokens(rng, int(rng.integers(1, 3 * BLOCK)))
            replica = router.replica_of(router.add_request(prompt))
            assert before[replica] == min(before), (before, replica)
    assert all(len(g) == 1 for g in groups.values()), groups
    assert sum(router.num_outstanding) == 24
    assert min(router.num_outstanding) >= 4, router.num_outstanding


def test_longest_remembered_prefix_wins_and_partial_blocks_do_not_count():
    rng = np.random.default_rng(1)
    router, _ = make_router(3)
    a, b = rand_tokens(rng, BLOCK), rand_tokens(rng, BLOCK)
    r0 = router.replica_of(router.add_request(a + b))
    assert router.route(a + b + [7]) == Route(r0, 2)
    assert router.route(a + rand_tokens(rng, BLOCK)) == Route(r0, 1)  # shares the first block
    # Sharing BLOCK - 1 tokens is no shared block: the least loaded replica, not r0.
    other = router.route(a[:-1] + [501] + b)
    assert other.matched_blocks == 0 and other.replica != r0
    assert router.route(a[:2]) == Route(other.replica, 0)  # shorter than a block


def test_route_changes_nothing_and_add_request_remembers():
    router, _ = make_router(2)
    prompt = list(range(2 * BLOCK))
    assert router.route(prompt) == Route(0, 0)
    assert router.route(prompt) == Route(0, 0)
    assert router.num_outstanding == (0, 0)
    router.add_request(list(range(100, 100 + BLOCK)))  # replica 0 now busier
    assert router.route(prompt) == Route(1, 0)
    router.add_request(prompt)
    router.add_request(list(range(200, 200 + BLOCK)))  # (1, 1): tie -> replica 0
    router.add_request(list(range(300, 300 + BLOCK)))  # replica 1: now (2, 2)
    assert router.route(prompt + [1]) == Route(1, 2)


def test_steps_finish_requests_and_release_load():
    router, replicas = make_router(2)
    ids = [router.add_request([i] * BLOCK, SamplingParams(max_tokens=1 + i % 3)) for i in range(6)]
    assert router.num_outstanding == (3, 3)
    seen: dict[str, list[int]] = {rid: [] for rid in ids}
    finished = []
    while router.has_unfinished_requests():
        for o in router.step():
            seen[o.request_id].extend(o.new_token_ids)
            if o.finished:
                finished.append(o.request_id)
    assert sorted(finished) == sorted(ids)
    assert [len(seen[rid]) for rid in ids] == [1 + i % 3 for i in range(6)]
    assert router.num_outstanding == (0, 0)
    with pytest.raises(KeyError):
        router.replica_of(ids[0])
    assert sum(len(r.prompts) for r in replicas) == 6


def test_generate_returns_outputs_in_prompt_order():
    router, _ = make_router(3)
    prompts = [[i] * (i + 1) for i in range(7)]
    outs = router.generate(prompts, SamplingParams(max_tokens=3))
    assert [o.prompt_token_ids for o in outs] == [tuple(p) for p in prompts]
    assert all(len(o.output_token_ids) == 3 and o.finish_reason == "length" for o in outs)
    # The fake token encodes replica and prompt length: each output came from its prompt.
    assert [o.output_token_ids[0] % 1000 for o in outs] == [len(p) for p in prompts]
    with pytest.raises(ValueError, match="sampling_params: 1 for 7 prompts"):
        router.generate(prompts, [SamplingParams()])


def test_max_imbalance_lets_a_hot_prefix_spill_over():
    prompt = list(range(2 * BLOCK))
    strict, _ = make_router(2, max_imbalance=None)
    spill, _ = make_router(2, max_imbalance=1)
    default, _ = make_router(2)
    for router in (strict, spill, default):
        for i in range(20):
            router.add_request(prompt + [i])
    assert strict.num_outstanding == (20, 0)
    # The third request exceeds the imbalance and moves the prefix to replica 1, and so on.
    assert spill.num_outstanding == (10, 10)
    # By default the 18th leaves replica 0 (17 beyond replica 1's 0): a header that
    # every prompt opens with no longer holds the whole load on one replica.
    assert default.num_outstanding == (17, 3)


def test_prefix_table_is_bounded_least_recently_used_first():
    router, _ = make_router(2, max_tracked_prefixes=2, max_prefix_blocks=1)
    a, b, c = ([k] * BLOCK for k in (1, 2, 3))
    router.add_request(a)  # replica 0
    router.add_request(b)  # replica 1
    router.add_request(a + [9])  # replica 0; a is now the most recent
    router.add_request(c)  # replica 1 (2 vs 1 outstanding); evicts b
    assert router.route(a).matched_blocks == 1
    assert router.route(c).matched_blocks == 1
    assert router.route(b).matched_blocks == 0


def test_a_request_counts_until_its_finishing_output_only():
    router, _ = make_router(2)
    long = router.add_request([1] * BLOCK, SamplingParams(max_tokens=3))
    short = router.add_request([2] * BLOCK, SamplingParams(max_tokens=1))
    assert router.num_outstanding == (1, 1)
    router.step()  # long got its first token, short its last
    assert router.num_outstanding == (1, 0) and router.replica_of(long) == 0
    assert router.route([3] * BLOCK).replica == 1  # the load balance sees it
    router.step()
    assert router.num_outstanding == (1, 0)
    router.step()
    assert router.num_outstanding == (0, 0)
    with pytest.raises(KeyError):
        router.replica_of(short)


def test_a_refused_request_leaves_no_prefix_route():
    class Picky(FakeReplica):
        def add_request(self, prompt_token_ids, sampling_params=None, **kw):
            if 999 in prompt_token_ids:
                raise ValueError("token 999 is out of vocabulary")
            return super().add_request(prompt_token_ids, sampling_params, **kw)

    router = PrefixAwareRouter([Picky(0), Picky(1)], block_size=BLOCK)
    prompt = [5] * BLOCK + [999]
    with pytest.raises(ValueError, match="vocabulary"):
        router.add_request(prompt)
    router.add_request([6] * BLOCK)  # replica 0 is busier now
    assert router.route(prompt) == Route(1, 0)  # no route remembered for the refused prompt


def test_abort_reports_what_the_replica_says():
    router, replicas = make_router(2)
    rid = router.add_request([1, 2, 3])
    assert replicas[0].abort(rid)  # aborted behind the router's back
    assert router.abort(rid) is False


def test_abort_releases_load():
    router, replicas = make_router(2)
    rid = router.add_request([1, 2, 3])
    assert router.num_outstanding == (1, 0)
    assert router.abort(rid) is True
    assert router.num_outstanding == (0, 0) and not replicas[0].running
    assert router.abort(rid) is False
    assert router.abort("unknown") is False


def test_bad_input_leaves_the_router_unchanged():
    router, replicas = make_router(2)
    rid = router.add_request(list(range(BLOCK)), request_id="x")
    assert rid == "x"
    with pytest.raises(ValueError, match="already running"):
        router.add_request(list(range(BLOCK)), request_id="x")
    with pytest.raises(ValueError, match="1-D"):
        router.add_request([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="empty prompt"):  # raised by the replica
        router.add_request([])
    assert router.num_outstanding == (1, 0)
    assert sum(len(r.prompts) for r in replicas) == 1
    for kwargs in (
        {"block_size": 0},
        {"block_size": 4, "max_imbalance": -1},
        {"block_size": 4, "hash_seed": 2**64},
        {"block_size": True},  # bools were taken as 1 (max_imbalance=True as 1 too)
        {"block_size": 4, "max_prefix_blocks": True},
        {"block_size": 4, "max_tracked_prefixes": True},
        {"block_size": 4, "max_imbalance": True},
    ):
        with pytest.raises(ValueError, match=f"{list(kwargs)[-1].removeprefix('hash_')}="):
            PrefixAwareRouter(replicas, **kwargs)
    with pytest.raises(ValueError, match="empty"):
        PrefixAwareRouter([], block_size=4)
    for bad in (None, replicas[0], "ab"):  # TypeError from len() before; a str: 2 "replicas"
        with pytest.raises(ValueError, match="replicas=.* must be a sequence of replicas"):
            PrefixAwareRouter(bad, block_size=4)
    with pytest.raises(ValueError, match="replicas: None lacks one of the methods"):
        PrefixAwareRouter([replicas[0], None], block_size=4)  # AttributeError in add_request
    with pytest.raises(ValueError, match="replicas: .* is given twice"):
        PrefixAwareRouter([replicas[0], replicas[1], replicas[0]], block_size=4)  # stepped twice
    assert PrefixAwareRouter(iter(replicas), block_size=4).replicas == tuple(replicas)


def test_the_replicas_cannot_be_changed_under_the_router():
    # A public list: appending a replica left it without a count (IndexError in _route
    # once it was the least loaded), removing one shifted every request's replica index.
    router, replicas = make_router(2)
    rid = router.add_request([1] * BLOCK)
    assert router.replicas == tuple(replicas)
    with pytest.raises(AttributeError):
        router.replicas.append(FakeReplica(2))
    with pytest.raises(AttributeError):
        router.replicas = [*replicas, FakeReplica(2)]
    replicas.pop()  # the caller's own list: the router kept its own sequence
    assert len(router.replicas) == 2 and router.replica_of(rid) == 0
    assert router.num_outstanding == (1, 0) and router.add_request([2] * BLOCK) == "dp-1"
    assert router.replica_of("dp-1") == 1


def test_a_shared_short_prefix_outlives_the_longer_ones_it_starts():
    router, _ = make_router(2, max_tracked_prefixes=3, max_prefix_blocks=2)
    a = [1] * BLOCK
    router.add_request(a + [2] * BLOCK)
    router.add_request(a + [3] * BLOCK)
    router.add_request([4] * (2 * BLOCK))  # two more prefixes: the two longest a-ones go
    assert router.route(a + [5] * BLOCK).matched_blocks == 1
    assert router.route(a + [2] * BLOCK).matched_blocks == 1
    assert router.route([4] * (2 * BLOCK)).matched_blocks == 2


def test_drain_transfers_steps_until_every_replica_copy_landed():
    replicas = [OffloadingReplica(0, copy_steps=3), FakeReplica(1)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    outs = router.generate([[1] * BLOCK, [2] * BLOCK], SamplingParams(max_tokens=2))
    assert all(o.finish_reason == "length" for o in outs)
    assert router.has_pending_transfers() and not router.has_unfinished_requests()
    router.drain_transfers(timeout_s=5)
    assert not router.has_pending_transfers() and router.num_outstanding == (0, 0)
    replicas[0].copies = [10**9]  # a copy that never lands
    with pytest.raises(TimeoutError, match="pending"):
        router.drain_transfers(timeout_s=0.01)


def test_generate_with_a_progress_bar():
    router, _ = make_router(2)
    outs = router.generate([[1, 2], [3]], SamplingParams(max_tokens=2), progress=True)
    assert [len(o.output_token_ids) for o in outs] == [2, 2]


def test_max_imbalance_zero_is_accepted_and_balances_strictly():
    router, _ = make_router(2, max_imbalance=0)
    prefix = [7] * BLOCK
    a = router.add_request(prefix + [1], SamplingParams(max_tokens=5))
    b = router.add_request(prefix + [2], SamplingParams(max_tokens=5))
    # The prefix's replica would hold one more than the idle one: over 0, so b goes there.
    assert router.replica_of(a) != router.replica_of(b)


def test_a_route_matches_at_most_max_prefix_blocks():
    router, _ = make_router(2, max_prefix_blocks=1)
    prompt = list(range(3 * BLOCK))
    router.add_request(prompt)
    assert router.route(prompt).matched_blocks == 1


def test_drain_transfers_releases_requests_that_finish_meanwhile():
    router = PrefixAwareRouter([OffloadingReplica(0, copy_steps=5)], block_size=BLOCK)
    router.generate([[1] * BLOCK], SamplingParams(max_tokens=1), progress=False)
    assert router.has_pending_transfers()
    late = router.add_request([2] * BLOCK, SamplingParams(max_tokens=2))
    assert router.num_outstanding == (1,)
    router.drain_transfers(timeout_s=5)
    assert router.num_outstanding == (0,)
    with pytest.raises(KeyError):
        router.replica_of(late)


def test_engine_replicas_give_each_replica_its_own_seed(monkeypatch):
    import jaxkv.engine
    import jaxkv.sharding
    from jaxkv.config import EngineConfig
    from jaxkv.router import engine_replicas

    monkeypatch.setattr(jaxkv.sharding, "replica_meshes", lambda tp, devices: ["m0", "m1", "m2"])

    class _Engine:
        def __init__(self, model, params, config, mesh, tokenizer):
            self.config, self.mesh, self.tokenizer = config, mesh, tokenizer

    monkeypatch.setattr(jaxkv.engine, "Engine", _Engine)
    engines = engine_replicas(None, EngineConfig(seed=5), tokenizer="tok")
    assert [e.config.seed for e in engines] == [5, 6, 7]
    assert [e.mesh for e in engines] == ["m0", "m1", "m2"]
    assert [e.tokenizer for e in engines] == ["tok"] * 3  # each replica reads stop strings


def test_abort_refuses_an_id_that_is_not_a_str():
    # abort(7) for the request "7" used to return False and leave it running.
    router, replicas = make_router(2)
    router.add_request([1, 2, 3], request_id="7")
    with pytest.raises(ValueError, match="request_ids=7 must be a request id"):
        router.abort(7)
    assert sorted(router.num_outstanding) == [0, 1]
    assert router.abort("7") and router.num_outstanding == (0, 0)


def test_token_ids_a_block_hash_cannot_encode_are_refused_before_hashing():
    # They used to fail inside hashing with struct.error, which generate() did not catch
    # as a refused prompt: the prompts queued before it stayed queued, their outputs lost.
    router, replicas = make_router(2)
    huge = np.array([2**64 - 1] * BLOCK, np.uint64)
    with pytest.raises(ValueError, match="prompt_token_ids must lie in"):
        router.generate([[1, 2, 3], huge], SamplingParams(max_tokens=2), progress=False)
    assert router.num_outstanding == (0, 0)
    assert not any(r.running for r in replicas)
    for bad in ([-1] * BLOCK, "abcdefgh", huge, [1, True, 2, 3], bytearray(b"abcdefgh")):
        with pytest.raises(ValueError, match="prompt_token_ids must"):
            router.route(bad)
    assert router.generate([[1, 2, 3]], progress=False)[0].finish_reason == "length"
    # The bounds are exact: the largest token id a hash encodes is routed, and hashed.
    top = [MAX_TOKEN_ID] * BLOCK
    assert router.route(top).matched_blocks == 0
    with pytest.raises(ValueError, match="prompt_token_ids must lie in"):
        router.route([MAX_TOKEN_ID + 1] * BLOCK)
    router.add_request(top)
    assert router.route(top).matched_blocks == 1
    for seed in (-(2**63), 2**63 - 1):  # the ends of a signed 64-bit seed
        assert PrefixAwareRouter(replicas, block_size=4, hash_seed=seed).hash_seed == seed
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError, match="seed="):
            PrefixAwareRouter(replicas, block_size=4, hash_seed=seed)


def test_prompts_route_together_only_under_the_same_cache_salt():
    router, replicas = make_router(2)
    prompt = [7] * (3 * BLOCK)
    rid = router.add_request(prompt, cache_salt="tenant-a")
    home = router.replica_of(rid)
    assert replicas[home].salts[rid] == "tenant-a"  # the replica caches it under the salt
    assert router.route(prompt, cache_salt="tenant-a") == Route(home, 3)
    assert router.route(prompt) == Route(1 - home, 0)  # unsalted: no cached prefix anywhere
    assert router.route(prompt, cache_salt="tenant-b") == Route(1 - home, 0)
    with pytest.raises(ValueError, match="cache_salt"):
        router.add_request(prompt, cache_salt=b"tenant-a")
    assert router.num_outstanding == ((1, 0) if home == 0 else (0, 1))


def test_drain_transfers_steps_only_the_replicas_with_copies_in_flight():
    # It drops the outputs of what it steps: a busy replica without copies keeps its
    # tokens for the caller's steps.
    replicas = [FakeReplica(0), OffloadingReplica(1, copy_steps=3)]
    router = PrefixAwareRouter(replicas, block_size=BLOCK)
    busy = router.add_request([2] * BLOCK, SamplingParams(max_tokens=5))
    router.generate([[1] * BLOCK], SamplingParams(max_tokens=1), progress=False)  # busy: 1
    assert router.replica_of(busy) == 0 and router.has_pending_transfers()
    router.drain_transfers(timeout_s=5)
    tokens = []
    while router.has_unfinished_requests():
        tokens += [t for o in router.step() if o.request_id == busy for t in o.new_token_ids]
    assert len(tokens) == 4


def test_generate_draws_its_progress_bar_unless_told_not_to(monkeypatch):
    """As Engine.generate does: progress is True by default."""
    drawn: list[bool] = []
    monkeypatch.setattr(completion, "generate_progress_bar", lambda _, p: drawn.append(p))
    router, _ = make_router(2)
    router.generate([[1] * BLOCK])
    assert drawn == [True]
    router.generate([[2] * BLOCK], progress=False)
    assert drawn == [True]
