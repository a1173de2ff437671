"""Inputs the manager cannot honour are refused up front, with nothing changed.

Each case here used to fail only after blocks were taken (an exception from hashing,
from a float count, from hashes of another block size), or to be accepted and poison the
prefix cache (fresh blocks cached as computed), or to be read as something else (one
str as a list of one-letter ids, True as block 1).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import (
    KVCacheManager,
    Request,
)
from tests.host._util import make_request, prefill, snapshot


def _busy() -> KVCacheManager:
    m = KVCacheManager(12, 4, max_model_len=32, enable_kv_cache_events=True)
    prefill(m, make_request("a", range(9)))
    prefill(m, make_request("b", [*range(4), 50, 51]))
    m.take_events()
    return m


def _request(m: KVCacheManager, request_id: str) -> Request:
    """The Request object `request_id`'s blocks were allocated for (the only one the
    manager lets grow them)."""
    return m._owner[request_id]


def _state(m: KVCacheManager) -> tuple:
    """Everything observable: pool, table, holders, stats, pending events."""
    events = m.take_events()
    m.pool._events.extend(events)  # put them back: reading must not consume them
    return snapshot(m), m.prefix_cache_stats, events, m.request_ids


def _refused(m: KVCacheManager, call, match: str, exc=ValueError) -> None:
    before = _state(m)
    with pytest.raises(exc, match=match):
        call()
    m.check_integrity()
    assert _state(m) == before


# ------------------------------------------------------------------ requests


@pytest.mark.parametrize("token", [2**63, np.uint64(2**64 - 1)])
def test_token_ids_past_int64_are_refused(token):
    # Hashes encode tokens as int64: such a token used to fail inside allocate_slots,
    # after its blocks were taken.
    with pytest.raises(ValueError, match="prompt_token_ids of 'r' must be <= 9223372036854775807"):
        Request("r", [1, token])
    req = Request("r", [1, 2])
    for bad in (token, [3, token]):
        with pytest.raises(ValueError, match="token_ids of 'r' must be <="):
            req.append_output_token_ids(bad)
    assert list(req.all_token_ids) == [1, 2]
    assert Request("r", [2**63 - 1]).update_block_hashes(1)  # the largest one hashes


@pytest.mark.parametrize("request_id", ["", 5, None, b"r"])
def test_a_request_id_must_be_a_non_empty_str(request_id):
    # "" was taken: it names nothing in a log, and its samples' ids ("0_") look malformed.
    with pytest.raises(ValueError, match="request_id=.* must be a non-empty str"):
        Request(request_id, [1])


@pytest.mark.parametrize("key", ["cache_salt", "adapter_id"])
def test_salt_and_adapter_must_be_str(key):
    # A lone surrogate is a str that UTF-8 cannot encode: hashing it raised later, inside
    # schedule() (every step failed) or allocate_slots (after taking the blocks).
    for bad in (5, b"x", ("x",), "tenant-\ud800"):
        with pytest.raises(ValueError, match=f"{key}=.* of 'r' must be None or a str"):
            Request("r", [1], **{key: bad})
    assert Request("r", [1], **{key: "tenant-é"}).update_block_hashes(1)


# -------------------------------------------------------------- allocation


def test_hashes_of_another_block_size_refused_before_allocating():
    m = _busy()
    req = make_request("c", range(9))
    req.update_block_hashes(8)  # hashed for a manager with block size 8
    _refused(m, lambda: m.allocate_slots(req, 9), "computed with \\(block_size, seed\\)=\\(8, 0\\)")
    assert len(req.block_hashes) == 1
    # The batch path: a running request that has filled no block yet is hashed elsewhere.
    late = make_request("d", range(3))
    m.allocate_slots(late, 3)
    late.num_computed_tokens = 3
    late.update_block_hashes(8, seed=1)
    late.append_output_token_ids([3, 4])  # fill block 0 and start block 1
    _refused(m, lambda: m.allocate_slots_batch([late], [2]), "computed with")
    _refused(m, lambda: m.allocate_slots(late, 2), "computed with")


@pytest.mark.parametrize("computed", [4.0, "4", np.float64(4), True, -1])
def test_num_computed_tokens_must_be_a_count(computed):
    # A float used to add the request's row, then fail taking blocks (check_integrity
    # then raised KeyError); True was 1.
    m = _busy()
    new = make_request("c", range(9))
    new.num_computed_tokens = computed
    _refused(m, lambda: m.allocate_slots(new, 4), "num_computed_tokens=.* must be an int >= 0")
    # Batch: a float used to fail after the requests before it had cached their blocks;
    # -1 and True were taken as counts.
    a, b = _request(m, "a"), _request(m, "b")
    a.num_computed_tokens, b.num_computed_tokens = 9, computed
    for r in (a, b):
        r.append_output_token_ids([60, 61, 62])  # a fills its third block
    _refused(m, lambda: m.allocate_slots_batch([a, b], [3, 4]), "num_computed_tokens=")


def test_numpy_num_computed_tokens_count_as_their_value():
    m, ref = _busy(), _busy()
    for manager, computed in ((m, np.int64(9)), (ref, 9)):
        a = _request(manager, "a")
        a.append_output_token_ids([9, 10, 11, 12])
        a.num_computed_tokens = computed
        assert len(manager.allocate_slots(a, 4)) == 1
        manager.check_integrity()
    assert snapshot(m) == snapshot(ref)


def test_computed_tokens_beyond_held_blocks_are_refused():
    # A request that kept num_computed_tokens after its blocks were freed (preempted and
    # not reset) used to get fresh blocks cached as holding its first 8 tokens: a later
    # request with the same prompt would then hit blocks nobody computed.
    m = _busy()
    req = make_request("c", [*range(20, 28), 5])
    req.num_computed_tokens = 8
    _refused(m, lambda: m.allocate_slots(req, 1), "num_computed_tokens=8 exceeds the 0 tokens")
    req.num_computed_tokens = 0
    assert m.allocate_slots(req, 2) is not None
    req.num_computed_tokens = 5
    _refused(m, lambda: m.allocate_slots(req, 1), "num_computed_tokens=5 exceeds the 4 tokens")
    # The batch path: 7 computed tokens in one 4-token block used to get a fresh block
    # that was then cached as holding tokens 4..7.
    a = _request(m, "a")
    req.num_computed_tokens = 7
    _refused(
        m,
        lambda: m.allocate_slots_batch([a, req], [1, 1]),
        "request 'c': num_computed_tokens=7 exceeds the 4 tokens",
    )


def test_cache_hit_must_start_where_computed_tokens_end():
    m = _busy()
    req = make_request("c", range(9))
    hit, num_hit = m.get_computed_blocks(req)
    assert num_hit == 8
    # Fewer computed tokens than the hit covers: the request would write into shared blocks.
    _refused(
        m,
        lambda: m.allocate_slots(req, 5, num_new_computed_tokens=4, new_computed_blocks=hit),
        "num_new_computed_tokens=4 must be at least 8",
    )


def test_cache_hit_after_a_partly_computed_block_is_refused():
    # The hit's positions and the computed tokens disagree: block 0 would be cached as
    # full while its tokens 2 and 3 were never computed.
    m = _busy()
    req = make_request("c", range(9))
    hit, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, 2) is not None
    req.num_computed_tokens = 2
    _refused(
        m,
        lambda: m.allocate_slots(req, 1, num_new_computed_tokens=4, new_computed_blocks=hit[1:]),
        "new_computed_blocks must start where .* num_computed_tokens=2",
    )


@pytest.mark.parametrize("as_type", [np.array, lambda h: [np.int32(b) for b in h], tuple])
def test_cache_hit_ids_may_be_numpy(as_type):
    m, ref = _busy(), _busy()
    for manager, convert in ((m, as_type), (ref, list)):
        req = make_request("c", range(9))
        hit, n = manager.get_computed_blocks(req)
        assert n == 8
        new = manager.allocate_slots(
            req, 1, num_new_computed_tokens=n, new_computed_blocks=convert(hit)
        )
        assert manager.block_ids("c") == [*hit, *new] and len(new) == 1
        manager.check_integrity()
    assert snapshot(m) == snapshot(ref)


@pytest.mark.parametrize("bad", [[1.0, 2.0], [True, 2], ["1", "2"], [np.float64(1), 2]])
def test_cache_hit_ids_must_be_ints(bad):
    m = _busy()
    req = make_request("c", range(9))
    m.get_computed_blocks(req)
    _refused(
        m,
        lambda: m.allocate_slots(req, 1, num_new_computed_tokens=8, new_computed_blocks=bad),
        "new_computed_blocks: .* must be a block id",
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": True}, "block_size"),
        ({"max_model_len": True}, "max_model_len"),
        ({"num_blocks": 12.0}, "num_blocks"),
        ({"hash_seed": True}, "hash_seed"),
        ({"block_size": 4.0}, "block_size"),
        ({"hash_seed": 2**64}, "hash_seed=18446744073709551616 must be an int that fits"),
        ({"hash_seed": 2**63}, "hash_seed=9223372036854775808 must be an int that fits"),
        ({"hash_seed": -(2**63) - 1}, "hash_seed=-9223372036854775809 must be an int"),
    ],
)
def test_constructor_refuses_bools_floats_and_seeds_past_64_bits(kwargs, match):
    args = {"num_blocks": 12, "block_size": 4, "max_model_len": 32, **kwargs}
    num_blocks, block_size = args.pop("num_blocks"), args.pop("block_size")
    with pytest.raises(ValueError, match=match):
        KVCacheManager(num_blocks, block_size, **args)


def test_constructor_takes_numpy_integers_as_ints():
    m = KVCacheManager(np.int64(12), np.int32(4), max_model_len=np.int64(32), hash_seed=np.uint8(3))
    ref = KVCacheManager(12, 4, max_model_len=32, hash_seed=3)
    for manager in (m, ref):
        assert type(manager.block_size) is int and type(manager.hash_seed) is int
        prefill(manager, make_request("a", range(9)))
        prefill(manager, make_request("b", range(9)))
    assert snapshot(m) == snapshot(ref)


def test_a_request_s_id_cannot_be_reassigned_while_it_holds_blocks():
    # Assignable, a renamed request's batch allocation took a fresh block and then raised
    # KeyError appending it to a row the new id lacks, allocate_slots gave it a second
    # row under the new id, and free(a) raised UnknownRequestError.
    m = KVCacheManager(12, 4, max_model_len=32)
    a = make_request("a", range(12))  # three full blocks: its next token needs a block
    prefill(m, a)
    before = snapshot(m)
    for new_id in ("z", "a"):  # another id, or its own
        with pytest.raises(AttributeError, match="request_id"):
            a.request_id = new_id
    assert a.request_id == "a" and snapshot(m) == before
    a.append_output_token_ids(7)
    assert m.allocate_slots_batch([a], [1]) and len(m.block_ids(a)) == 4
    m.free(a)
    m.check_integrity()


def test_one_str_is_not_a_list_of_ids():
    m = KVCacheManager(12, 4, max_model_len=32)
    for rid in "ab":
        prefill(m, make_request(rid, range(9)))
    assert m.num_common_prefix_blocks(["a", "b"]) == 2
    for call in (m.num_common_prefix_blocks, m.rows_of, m.num_blocks_of):
        _refused(m, lambda call=call: call("ab"), "must be a sequence of request ids")
        # Nor a set or a dict: its rows came back in an order the caller cannot know.
        for unordered in ({"b", "a"}, frozenset("ab"), dict.fromkeys("ba")):
            _refused(m, lambda call=call, u=unordered: call(u), "not a set or mapping")

    assert m.holds_row("a") and not m.holds_row("c")
    with pytest.raises(ValueError, match=r"request_id=\[\] must be a request id"):
        m.holds_row([])  # unhashable: a bare TypeError named nothing


@pytest.mark.parametrize("bad", ["request", None, 1])
def test_holds_row_takes_a_request_id_only(bad):
    # A Request that holds a row was answered False (its id was never looked up), as
    # were None and ints, where num_common_prefix_blocks refuses an item that is no id.
    m = KVCacheManager(12, 4, max_model_len=32)
    a = make_request("a", range(9))
    prefill(m, a)
    with pytest.raises(ValueError, match=r"request_id=.* must be a request id \(a str\)"):
        m.holds_row(a if bad == "request" else bad)
    assert m.holds_row("a")


def test_a_cache_hit_past_the_requests_full_blocks_is_refused():
    # "c" has two full blocks (8 of 9 tokens); a hit of three blocks runs past them.
    m = _busy()
    req = make_request("c", range(9))
    hit, _ = m.get_computed_blocks(req)
    extra = m.block_ids("b")[1]
    _refused(
        m,
        lambda: m.allocate_slots(
            req, 1, num_new_computed_tokens=12, new_computed_blocks=[*hit, extra]
        ),
        "run past the request's full blocks",
    )


def test_limits_are_refused_one_past_their_boundary():
    m = _busy()
    req = make_request("c", range(9))
    _refused(m, lambda: m.allocate_slots(req, 0, num_new_computed_tokens=10), "exceeds its 9")
    assert m.allocate_slots(req, 0, num_new_computed_tokens=9) is not None  # at the limit
    # The batch path: 31 computed tokens + 2 > max_model_len=32; + 1 is fine.
    long = make_request("d", range(31))
    long.num_computed_tokens = 0
    m2 = KVCacheManager(12, 4, max_model_len=32)
    assert m2.allocate_slots(long, 31) is not None
    long.num_computed_tokens = 31
    long.append_output_token_ids([1])
    _refused(m2, lambda: m2.allocate_slots_batch([long], [2]), "max_model_len=32")
    assert m2.allocate_slots_batch([long], [1])
    # Lookahead slots count too: 8 tokens + 25 lookahead > 32; + 24 is fine.
    m3 = KVCacheManager(12, 4, max_model_len=32)
    e = make_request("e", range(8))
    _refused(m3, lambda: m3.allocate_slots(e, 8, num_lookahead_tokens=25), "max_model_len=32")
    assert m3.allocate_slots(e, 8, num_lookahead_tokens=24) == list(range(1, 9))


@pytest.mark.parametrize("bad", ["a", "c", None])
def test_allocation_and_lookup_take_a_request_not_an_id(bad):
    # An id (or None) used to fail deep inside with AttributeError.
    m = _busy()
    _refused(m, lambda: m.get_computed_blocks(bad), "request=.* must be a Request")
    _refused(m, lambda: m.allocate_slots(bad, 1), "request=.* must be a Request")
    a = make_request("a", range(9))
    a.num_computed_tokens = 9
    _refused(m, lambda: m.allocate_slots_batch([a, bad], [1, 1]), "request=.* must be a Request")


@pytest.mark.parametrize("key", ["enable_prefix_caching", "enable_kv_cache_events"])
@pytest.mark.parametrize("flag", ["false", 0, None, np.bool_(False)])
def test_constructor_flags_must_be_bools(key, flag):
    # "false" used to switch prefix caching on (the pool read it by truthiness).
    with pytest.raises(ValueError, match=f"{key}=.* must be a bool"):
        KVCacheManager(12, 4, max_model_len=32, **{key: flag})


@pytest.mark.parametrize(
    "num_new, hit_order, match",
    [
        (20, (0, 1), None),  # no room: 5 fresh blocks wanted, 2 free
        (100, (0, 1), "max_model_len"),
        (1, (1, 0), "stale cache hit"),
    ],
)
def test_a_refused_allocation_leaves_the_requests_hashes_as_they_were(num_new, hit_order, match):
    # Checking a cache hit hashes the request's full blocks. A refusal after that (no
    # room, a later check, a stale hit) used to leave them hashed and pinned to this
    # manager's block size, so another manager's block size was then refused.
    m = KVCacheManager(6, 4, max_model_len=64)
    prefill(m, make_request("a", range(9)))
    hit = [m.block_ids("a")[i] for i in hit_order]
    req = make_request("c", range(9))
    before = snapshot(m)

    def call():
        return m.allocate_slots(req, num_new, num_new_computed_tokens=8, new_computed_blocks=hit)

    if match is None:
        assert call() is None
    else:
        with pytest.raises(ValueError, match=match):
            call()
    assert req.block_hashes == [] and snapshot(m) == before
    assert len(req.update_block_hashes(8)) == 1  # not pinned to block size 4
    m.check_integrity()
