"""Bad input raises a clear error naming the problem and leaves every piece of state as it was."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager, UnknownRequestError
from tests.host._util import make_request, prefill, snapshot


@pytest.fixture
def busy() -> KVCacheManager:
    """A manager with two live requests sharing a block and one freed request."""
    m = KVCacheManager(12, 4, max_model_len=16)
    prefill(m, make_request("a", range(9)))
    prefill(m, make_request("b", [*range(4), 50, 51]))
    prefill(m, make_request("gone", range(100, 105)))
    m.free("gone")
    m.check_integrity()
    return m


def _assert_unchanged(m: KVCacheManager, before: dict) -> None:
    m.check_integrity()
    assert snapshot(m) == before


def test_prompt_longer_than_max_model_len(busy):
    before = snapshot(busy)
    long = make_request("long", range(17))
    with pytest.raises(ValueError, match="num_prompt_tokens=17 exceeds max_model_len=16"):
        busy.get_computed_blocks(long)
    with pytest.raises(ValueError, match="num_prompt_tokens=17"):
        busy.allocate_slots(long, 17)
    with pytest.raises(ValueError, match="num_prompt_tokens=17"):
        busy.count_prefix_lookup(long, 0)  # used to count a lookup get_computed_blocks refuses
    _assert_unchanged(busy, before)
    assert busy.prefix_cache_stats.requests == 3  # the refused lookup was not counted


def test_growing_past_max_model_len(busy):
    a = make_request("a2", range(16))
    prefill(busy, a)
    before = snapshot(busy)
    a.append_output_token_ids([1])
    with pytest.raises(ValueError, match="17 tokens > max_model_len=16"):
        busy.allocate_slots(a, 1)
    _assert_unchanged(busy, before)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"num_new_tokens": -1}, "num_new_tokens"),
        ({"num_new_tokens": 1, "num_lookahead_tokens": -2}, "num_lookahead_tokens"),
        ({"num_new_tokens": 1, "num_new_computed_tokens": -4}, "num_new_computed_tokens"),
        # -1 with every other count a plain int: the common case's own check refuses it.
        ({"num_new_tokens": 1, "num_lookahead_tokens": -1}, "num_lookahead_tokens=-1 must be"),
        ({"num_new_tokens": 1, "num_new_computed_tokens": -1}, "num_new_computed_tokens=-1 must"),
        ({"num_new_tokens": 1.5}, "num_new_tokens"),
    ],
)
def test_negative_or_non_integer_token_counts(busy, kwargs, name):
    before = snapshot(busy)
    for req in (make_request("new", range(3)), make_request("a", range(9))):
        with pytest.raises(ValueError, match=name):
            busy.allocate_slots(req, **kwargs)
    _assert_unchanged(busy, before)


@pytest.mark.parametrize("request_id", ["gone", "never"])
def test_free_unknown_or_already_freed(busy, request_id):
    before = snapshot(busy)
    with pytest.raises(UnknownRequestError, match=repr(request_id)):
        busy.free(make_request(request_id, [1]))
    with pytest.raises(ValueError, match="holds no blocks"):
        busy.free(request_id)
    _assert_unchanged(busy, before)


def test_double_free(busy):
    busy.free("b")
    before = snapshot(busy)
    with pytest.raises(UnknownRequestError, match="'b'"):
        busy.free("b")
    _assert_unchanged(busy, before)


@pytest.mark.parametrize("bad", [123, None, ["a"]])
def test_free_and_uncache_take_a_request_or_its_id(busy, bad):
    before = snapshot(busy)
    with pytest.raises(ValueError, match="request=.* must be a Request or a request id"):
        busy.free(bad)
    with pytest.raises(ValueError, match="request=.* must be a Request or a request id"):
        busy.uncache_unwritten(bad, 0)
    _assert_unchanged(busy, before)


@pytest.mark.parametrize("bad", [-1, 4.0, True, "4", None])
def test_uncache_unwritten_refuses_a_written_count_that_is_no_count(busy, bad):
    # -1 would leave a negative number of cached blocks behind, True uncache them all.
    before = snapshot(busy)
    with pytest.raises(ValueError, match="num_written_tokens=.* must be an int >= 0"):
        busy.uncache_unwritten("a", bad)
    _assert_unchanged(busy, before)


def test_computed_tokens_past_the_request_are_refused(busy):
    # 100 computed tokens of a 9-token request would take 25 blocks for tokens it lacks.
    held = make_request("held", range(9))
    assert len(busy.allocate_slots(held, 4)) == 1  # holds a block, 0 tokens computed
    before = snapshot(busy)
    for req in (make_request("new", range(9)), held):
        with pytest.raises(ValueError, match="= 100 exceeds its 9 tokens"):
            busy.allocate_slots(req, 0, num_new_computed_tokens=100)
    _assert_unchanged(busy, before)
    req = make_request("new", range(9))  # all of its tokens computed elsewhere: fine
    assert len(busy.allocate_slots(req, 0, num_new_computed_tokens=9)) == 3
    busy.check_integrity()


def test_unknown_id_in_shared_prefix_queries(busy):
    before = snapshot(busy)
    for call in (busy.num_common_prefix_blocks, busy.rows_of, busy.num_blocks_of):
        with pytest.raises(UnknownRequestError, match="'gone'"):
            call(["a", "gone", "b"])
    with pytest.raises(KeyError):  # also a KeyError for dict-minded callers
        busy.num_common_prefix_blocks(["zzz"])
    with pytest.raises(ValueError, match="'never'"):
        busy.block_ids("never")
    a_request = make_request("a", range(9))  # the Request, not its id: a ValueError
    for bad, match in (
        (["a", ["b"]], r"\['b'\] is not a request id"),
        (None, "sequence"),
        (["b", a_request], r"Request\('a'.* is not a request id \(a str"),
        ([7], r"7 is not a request id"),
    ):
        for call in (busy.num_common_prefix_blocks, busy.rows_of):
            with pytest.raises(ValueError, match=f"request_ids.*{match}") as raised:
                call(bad)
            assert not isinstance(raised.value, UnknownRequestError)
    assert busy.num_common_prefix_blocks(["a", "b"]) == 1  # a failed call left no residue
    _assert_unchanged(busy, before)


def test_an_array_among_request_ids_is_refused_by_name_after_a_call_of_as_many_ids(busy):
    # The memo compares the list with the last call's: an array item made that == raise
    # numpy's "truth value of an array is ambiguous" instead of naming the item.
    before = snapshot(busy)
    for call in (busy.num_common_prefix_blocks, busy.rows_of):
        call(["a", "b"])
        named = r"request_ids: array\(\['b', 'c'\].* is not a request id"
        with pytest.raises(ValueError, match=named):
            call(["a", np.array(["b", "c"])])
    assert busy.num_common_prefix_blocks(["a", "b"]) == 1
    _assert_unchanged(busy, before)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([0, 99], r"rows=\[0, 99\] must lie in \[0, 16\)"),  # numpy's IndexError before
        ([16], "must lie in"),  # one past the last row
        (np.array([0, -1], np.int32), "must lie in"),  # read the table's last row before
        ([-1], "must lie in"),
        ([0.0, 1.0], "1-D sequence of block-table rows"),
        (np.array([True, False]), "1-D sequence of block-table rows"),  # a mask, not rows
        ([0, True], "1-D sequence of block-table rows"),  # True was taken as row 1
        ((np.int32(0), np.True_), "1-D sequence of block-table rows"),
        (None, "rows=None must be a 1-D"),  # num_blocks_of_rows gave a 2-D array
        (np.array(0), "1-D"),
        (np.zeros((1, 2), np.int32), "1-D"),  # rows_of's dtype, but 2-D
        (["a", "b"], "1-D"),
        ([[0], [0, 1]], r"rows=\[\[0\], \[0, 1\]\] must be a 1-D"),  # numpy: inhomogeneous
    ],
)
def test_rows_outside_the_block_table_are_refused(busy, rows, match):
    busy.rows_of(["a", "b"])  # a live rows_of answer does not wave other rows through
    before = snapshot(busy)
    for call in (busy.num_common_prefix_blocks_of_rows, busy.num_blocks_of_rows):
        with pytest.raises(ValueError, match=match):
            call(rows)
    _assert_unchanged(busy, before)
    rows = busy.rows_of(["a", "b"])
    for given in (rows, list(rows), np.asarray(rows, np.uint8)):  # still taken as rows
        assert busy.num_common_prefix_blocks_of_rows(given) == 1
        assert busy.num_blocks_of_rows(given).tolist() == [3, 2]
    assert busy.num_common_prefix_blocks_of_rows([]) == 0 and busy.num_blocks_of_rows([]).size == 0


def test_batch_allocation_reads_any_iterable_once_and_refuses_the_rest_by_name(busy):
    # A generator of requests used to be used up by the type check (then TypeError from
    # len()); None or one Request raised TypeError naming neither argument.
    a, b = busy._owner["a"], busy._owner["b"]
    before = snapshot(busy)
    for requests, counts, name in (
        (None, [1], "requests=None"),
        (a, [1], "requests=Request"),
        ([a], None, "num_new_tokens=None"),
        ([a, b], 5, "num_new_tokens=5"),
    ):
        with pytest.raises(ValueError, match=f"{name}.* must be a sequence"):
            busy.allocate_slots_batch(requests, counts)
    _assert_unchanged(busy, before)
    # Unordered: {4, 1} iterates as [1, 4], pairing 1 with a and 4 with b, without a word.
    for requests, counts, name in (([a, b], {4, 1}, "num_new_tokens="), ({a}, [1], "requests=")):
        with pytest.raises(ValueError, match=f"{name}.* must be a sequence \\(a set or mapping"):
            busy.allocate_slots_batch(requests, counts)
    with pytest.raises(ValueError, match="num_new_tokens=.* must be a sequence"):
        busy.allocate_slots_batch([a, b], {3: "a", 2: "b"})
    _assert_unchanged(busy, before)
    assert busy.allocate_slots_batch((r for r in (a, b)), (n for n in (3, 2)))
    ref = KVCacheManager(12, 4, max_model_len=16)
    for rid, tokens in (("a", range(9)), ("b", [*range(4), 50, 51]), ("gone", range(100, 105))):
        prefill(ref, make_request(rid, tokens))
    ref.free("gone")
    assert ref.allocate_slots_batch([ref._owner["a"], ref._owner["b"]], [3, 2])
    assert snapshot(busy) == snapshot(ref)
    busy.check_integrity()


def test_block_ids_take_a_request_or_its_id(busy):
    # An unhashable id raised TypeError; a Request was reported as holding no blocks.
    before = snapshot(busy)
    with pytest.raises(ValueError, match=r"request_id=\['a'\] must be a Request or a request id"):
        busy.block_ids(["a"])
    assert busy.block_ids(busy._owner["a"]) == busy.block_ids("a") == before["holders"]["a"]
    _assert_unchanged(busy, before)


@pytest.mark.parametrize("flag", ["no", None, 0, np.bool_(False)])
def test_the_count_flag_of_a_lookup_must_be_a_bool(busy, flag):
    # "no" used to count the lookup, by its truthiness.
    before, stats = snapshot(busy), busy.prefix_cache_stats
    with pytest.raises(ValueError, match="count=.* must be a bool"):
        busy.get_computed_blocks(make_request("c", range(9)), count=flag)
    _assert_unchanged(busy, before)
    assert busy.prefix_cache_stats == stats


def test_stale_cache_hit_is_refused(busy):
    req = make_request("c", [*range(8), 7])
    hit_ids, num_hit = busy.get_computed_blocks(req)
    assert len(hit_ids) == 2
    busy.free("a")  # a's blocks become evictable; fill the pool so they get reused
    for i, n in enumerate((16, 16, 4)):
        assert prefill(busy, make_request(f"f{i}", range(100 * i + 200, 100 * i + 200 + n)))
    assert busy.num_free_blocks == 0
    before = snapshot(busy)
    with pytest.raises(ValueError, match="stale cache hit"):
        busy.allocate_slots(req, 1, num_new_computed_tokens=num_hit, new_computed_blocks=hit_ids)
    _assert_unchanged(busy, before)


@pytest.mark.parametrize(
    "block_ids,match",
    [
        ([0], "invalid block id"),
        ([12], "invalid block id"),  # one past the pool: IndexError
        ([99], "invalid"),
        (None, "must be a sequence of block ids"),
    ],
)
def test_invalid_computed_block_ids(busy, block_ids, match):
    before = snapshot(busy)
    with pytest.raises(ValueError, match=match):
        busy.allocate_slots(
            make_request("c", range(9)), 1, num_new_computed_tokens=4, new_computed_blocks=block_ids
        )
    _assert_unchanged(busy, before)


@pytest.mark.parametrize("unordered", [set, frozenset, dict.fromkeys])
def test_cache_hit_given_as_a_set_or_mapping_is_refused(busy, unordered):
    req = make_request("c", range(9))  # as allocate_slots_batch: order is block positions
    hit_ids, num_hit = busy.get_computed_blocks(req)
    assert len(hit_ids) == 2 and list(hit := unordered(hit_ids)) == hit_ids  # order right
    before = snapshot(busy)
    with pytest.raises(ValueError, match=r"new_computed_blocks=.* has no order"):
        busy.allocate_slots(req, 1, num_new_computed_tokens=num_hit, new_computed_blocks=hit)
    _assert_unchanged(busy, before)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((1, 4), {"max_model_len": 8}, "num_blocks"),
        ((8, 0), {"max_model_len": 8}, "block_size"),
        ((8, 4), {"max_model_len": 0}, "max_model_len"),
        ((8, 4), {"max_model_len": 8, "hash_seed": 2**70}, "seed"),
        # Past int32 the device's block ids and positions overflow; 10**12 blocks also
        # hung in building the pool instead of being refused.
        ((10**12, 4), {"max_model_len": 8}, r"num_blocks=1000000000000 must be an int in \[2,"),
        ((2**31, 4), {"max_model_len": 8}, "num_blocks"),
        ((8, 2**31), {"max_model_len": 8}, "block_size"),
        ((8, 4), {"max_model_len": 2**31}, r"max_model_len=2147483648 must be an int in \[1,"),
        # As CacheConfig: past 2**31 token slots, build_attention_metadata's int32 slot ids
        # (block_id * block_size + offset) wrapped negative.
        ((3, 2**30), {"max_model_len": 8}, r"num_blocks=3 times block_size=1073741824 .* 2\*\*31"),
        ((8, 2**31 - 1), {"max_model_len": 8}, "num_blocks=8 times block_size=2147483647"),
        # One slot past 2**31; the fewest blocks a pool takes; a numpy count.
        ((3, 715827883), {"max_model_len": 8}, "num_blocks=3 times block_size=715827883"),
        ((2, 2**30 + 1), {"max_model_len": 8}, "num_blocks=2 times block_size=1073741825"),
        ((np.int64(3), 2**30), {"max_model_len": 8}, "num_blocks=3 times block_size=1073741824"),
    ],
)
def test_bad_constructor_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCacheManager(*args, **kwargs)


def test_sizes_at_either_end_of_their_range_are_taken():
    assert KVCacheManager(8, 1, max_model_len=1).block_size == 1
    # The largest block size that leaves 2 blocks (the null block and one more) within
    # 2**31 token slots, and the largest max_model_len: one block per request.
    top = KVCacheManager(2, 2**30, max_model_len=2**31 - 1)
    assert (top.block_size, top.max_model_len, top.max_blocks_per_seq) == (2**30, 2**31 - 1, 1)


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1])
def test_hash_seeds_at_either_end_of_64_bits_are_taken(seed):
    # Both ends of the signed 64-bit range hash and hit like any other seed.
    m = KVCacheManager(8, 4, max_model_len=8, hash_seed=seed)
    assert m.hash_seed == seed and prefill(m, make_request("a", range(5))) == [1, 2]
    assert m.get_computed_blocks(make_request("b", range(5))) == ([1], 4)


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64, np.int8, np.int64])
def test_numpy_integer_counts_count_as_their_value(dtype):
    # Unsigned counts must not wrap when negated, small ones must not overflow in sums.
    def run(count):
        m = KVCacheManager(40, 4, max_model_len=512)
        a, b = make_request("a", range(8)), make_request("b", range(20, 28))
        first = m.allocate_slots(a, count(8))
        prefill(m, b)
        a.num_computed_tokens = b.num_computed_tokens = 8
        # 108 tokens each: 25 more blocks each, 50 > 35 free
        fits = m.allocate_slots_batch([a, b], [count(100), count(100)])
        grew = m.allocate_slots_batch([b], [count(120)])  # 128 tokens: 32 blocks
        m.check_integrity()
        return first, fits, grew, snapshot(m)

    assert run(dtype) == run(int)
    assert run(int)[:3] == ([1, 2], False, True)


@pytest.mark.parametrize("count", [True, np.bool_(True)])
def test_a_bool_token_count_is_refused(busy, count):
    before = snapshot(busy)
    req = make_request("c", range(9))
    with pytest.raises(ValueError, match="num_new_tokens=.*must be an int"):
        busy.allocate_slots(req, count)
    with pytest.raises(ValueError, match="num_lookahead_tokens=.*must be an int"):
        busy.allocate_slots(req, 9, num_lookahead_tokens=count)
    with pytest.raises(ValueError, match="num_new_tokens=.*must be an int"):
        busy.allocate_slots_batch([req], [count])
    _assert_unchanged(busy, before)


def test_another_request_object_reusing_a_live_id_is_refused(busy):
    """A second Request with a live id would otherwise grow the first one's row and cache
    the first one's KV under its own tokens' hashes: a later hit on those tokens would
    read another request's KV. Once the id is freed, the new object may use it."""
    before = snapshot(busy)
    twin = make_request("a", [*range(4), 70, 71, 72, 73, 74])  # a's id, other tokens
    twin.num_computed_tokens = 9  # as a's, so only the object tells them apart
    refused = [
        lambda: busy.allocate_slots(twin, 1),
        # These acted on the owner's blocks: its caller meant its own request.
        lambda: busy.free(twin),
        lambda: busy.uncache_unwritten(twin, 0),
        lambda: busy.block_ids(twin),
    ]
    for call in refused:
        with pytest.raises(ValueError, match="'a' holds blocks allocated for another Request"):
            call()
        _assert_unchanged(busy, before)
    busy.free("a")
    twin.num_computed_tokens = 0
    assert busy.allocate_slots(twin, twin.num_tokens) is not None
    busy.check_integrity()
    hit = make_request("probe", [*range(4), 70, 71, 72, 73, 74, 75])
    hit_ids, num_hit = busy.get_computed_blocks(hit)
    assert num_hit == 8 and hit_ids[1] == busy.block_ids("a")[1]  # 70..73: twin's own block


def test_a_numpy_count_keeps_the_requests_computed_tokens():
    """A numpy count takes allocate_slots's checked path, which must read
    request.num_computed_tokens (8 here), not the lookahead count (0)."""

    def run(count):
        m = KVCacheManager(40, 4, max_model_len=512)
        a = make_request("a", range(16))
        m.allocate_slots(a, 8)
        a.num_computed_tokens = 8
        return m.allocate_slots(a, count(4)), snapshot(m)

    assert run(np.int64) == run(int)
    assert run(int)[0] == [3]  # 12 tokens: a third block
