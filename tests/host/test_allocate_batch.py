"""allocate_slots_batch: the same state as allocate_slots one by one, or nothing at all."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager, Request, block_table
from tests.host._util import make_request, prefill, snapshot


def _running(seed: int, enable_prefix_caching: bool = True):
    """A manager and prefilled requests of random lengths (some sharing a prefix)."""
    rng = np.random.default_rng(seed)
    m = KVCacheManager(400, 4, max_model_len=128, enable_prefix_caching=enable_prefix_caching)
    shared = list(range(500, 512))
    requests = []
    for i in range(int(rng.integers(2, 12))):
        own = rng.integers(0, 400, int(rng.integers(1, 14))).tolist()
        r = make_request(f"r{i}", (shared if rng.random() < 0.6 else []) + own)
        assert prefill(m, r) is not None
        requests.append(r)
    return m, requests, rng


@pytest.mark.parametrize("scalar_writes", [True, False])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_batch_equals_one_by_one(seed, enable_prefix_caching, scalar_writes, monkeypatch):
    if not scalar_writes:  # the block table's numpy path for many single-block appends
        monkeypatch.setattr(block_table, "_SCALAR_WRITES_MAX", 0)
    batched, reqs_a, rng = _running(seed, enable_prefix_caching)
    single, reqs_b, _ = _running(seed, enable_prefix_caching)
    for _ in range(12):  # decode steps and the odd multi-token chunk
        counts = [int(rng.choice([1, 1, 1, 3, 6])) for _ in reqs_a]
        for r_a, r_b, n in zip(reqs_a, reqs_b, counts, strict=True):
            tokens = rng.integers(0, 400, n).tolist()
            r_a.append_output_token_ids(tokens)
            r_b.append_output_token_ids(tokens)
        assert batched.allocate_slots_batch(reqs_a, counts)
        for r, n in zip(reqs_b, counts, strict=True):
            assert single.allocate_slots(r, n) is not None
        for r_a, r_b, n in zip(reqs_a, reqs_b, counts, strict=True):
            r_a.num_computed_tokens += n
            r_b.num_computed_tokens += n
        batched.check_integrity()
        state_a, state_b = snapshot(batched), snapshot(single)
        del state_a["prefix_ids"], state_b["prefix_ids"]  # opaque ids, numbered in call order
        assert state_a == state_b
        ids = [r.request_id for r in reqs_a]
        assert batched.num_common_prefix_blocks(ids) == single.num_common_prefix_blocks(ids)


def test_not_enough_blocks_changes_nothing():
    m = KVCacheManager(12, 4, max_model_len=64)
    a, b = make_request("a", range(8)), make_request("b", range(20, 28))
    prefill(m, a)
    prefill(m, b)
    before = snapshot(m)
    assert not m.allocate_slots_batch([a, b], [40, 40])
    assert snapshot(m) == before
    m.check_integrity()


def test_a_batch_that_needs_every_free_block_fits_and_one_more_does_not():
    # 11 usable blocks, 4 held: the batch may take exactly the 7 free ones.
    m = KVCacheManager(12, 4, max_model_len=64)
    a, b = make_request("a", range(8)), make_request("b", range(20, 28))
    prefill(m, a)
    prefill(m, b)
    assert m.num_free_blocks == 7
    before = snapshot(m)
    assert m.allocate_slots_batch([a, b], [16, 13]) is False  # 4 + 4 blocks: one too many
    assert snapshot(m) == before
    assert m.allocate_slots_batch([a, b], [16, 12]) is True  # 4 + 3 blocks
    assert m.block_ids("a") == [1, 2, 5, 6, 7, 8] and m.block_ids("b") == [3, 4, 9, 10, 11]
    assert m.num_free_blocks == 0
    m.check_integrity()


@pytest.mark.parametrize(
    "counts, match",
    [([1, -1], "num_new_tokens=-1"), ([1, 1.5], "num_new_tokens=1.5"), ([1, 200], "max_model_len")],
)
def test_bad_input_raises_and_changes_nothing(counts, match):
    m = KVCacheManager(64, 4, max_model_len=64)
    a, b = make_request("a", range(8)), make_request("b", range(20, 28))
    prefill(m, a)
    prefill(m, b)
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        m.allocate_slots_batch([a, b], counts)
    with pytest.raises(ValueError, match="distinct"):
        m.allocate_slots_batch([a, a], [1, 1])
    twin = make_request("a", range(8))  # another object with a's id
    twin.num_computed_tokens = a.num_computed_tokens
    for batch in ([a, b, twin], [twin, b]):  # twin's own tokens would be cached in a's blocks
        with pytest.raises(ValueError, match="'a' holds blocks allocated for another Request"):
            m.allocate_slots_batch(batch, [1] * len(batch))
    with pytest.raises(ValueError, match="holds no blocks"):
        m.allocate_slots_batch([a, make_request("c", [1, 2])], [1, 1])
    assert snapshot(m) == before


def test_computed_tokens_past_a_requests_tokens_are_refused_as_one_by_one():
    # Within the blocks it holds, b's 7 computed of its 6 tokens were taken, where
    # allocate_slots refuses them: its blocks would be cached for tokens it lacks.
    m = KVCacheManager(64, 4, max_model_len=64)
    a, b = make_request("a", range(8)), make_request("b", range(20, 26))
    prefill(m, a)
    prefill(m, b)
    b.num_computed_tokens = 7  # its two blocks hold 8
    before = snapshot(m)
    with pytest.raises(ValueError, match="exceeds its 6 tokens"):
        m.allocate_slots(b, 1)
    with pytest.raises(
        ValueError, match=r"request 'b': request.num_computed_tokens=7 exceeds its 6"
    ):
        m.allocate_slots_batch([a, b], [1, 1])
    assert snapshot(m) == before
    b.num_computed_tokens = 6
    assert m.allocate_slots_batch([a, b], [1, 1])


def test_each_check_names_the_first_request_of_the_batch_it_refuses():
    # The checks run over the whole batch at once; the request named is the first one in
    # batch order that fails, with its own counts, as a one-by-one loop would meet it.
    m = KVCacheManager(64, 4, max_model_len=16)
    a, b, c = (make_request(name, range(k, k + 8)) for name, k in (("a", 0), ("b", 20), ("c", 40)))
    for request in (a, b, c):
        prefill(m, request)
    for request in (b, c):
        request.append_output_token_ids([1, 2])  # 10 tokens, 8 of them in its 2 blocks
    for computed, counts, match in (
        (11, [1, 1, 1], r"request 'b': request.num_computed_tokens=11 exceeds its 10 tokens"),
        (9, [1, 1, 1], r"request 'b': num_computed_tokens=9 exceeds the 8 tokens"),
        (
            8,
            [1, 9, 10],
            r"request 'b' would hold 17 tokens > max_model_len=16 "
            r"\(num_computed_tokens=8 \+ num_new_tokens=9\)",
        ),
    ):
        b.num_computed_tokens = c.num_computed_tokens = computed
        before = snapshot(m)
        with pytest.raises(ValueError, match=match):
            m.allocate_slots_batch([a, b, c], counts)
        assert snapshot(m) == before
    assert m.allocate_slots_batch([a, b, c], [1, 1, 1])


class _TaggedRequest(Request):
    """A Request subclass, as a serving layer may keep its own fields on."""


def test_requests_of_a_request_subclass_are_allocated_and_other_objects_refused():
    # The exact-type fast path falls back to a check per item, which takes a subclass.
    m = KVCacheManager(64, 4, max_model_len=64)
    a, b = make_request("a", range(8)), _TaggedRequest("b", list(range(20, 28)))
    prefill(m, a)
    prefill(m, b)
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"request='c' must be a Request"):
        m.allocate_slots_batch([a, b, "c"], [1, 1, 1])
    assert snapshot(m) == before
    assert m.allocate_slots_batch([b, a], [1, 1])
    assert m.block_ids("b")[-1] != 0 and len(m.block_ids("b")) == len(m.block_ids("a")) == 3


@pytest.mark.parametrize("counts", [[1], [1, 1, 1]], ids=["fewer", "more"])
def test_counts_of_another_length_than_the_requests_are_refused(counts):
    # Unchecked, extra counts were ignored and too few failed inside zip() instead.
    m = KVCacheManager(64, 4, max_model_len=64)
    a, b = make_request("a", range(8)), make_request("b", range(20, 28))
    prefill(m, a)
    prefill(m, b)
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"len\(requests\)=2 must equal len\(counts\)="):
        m.allocate_slots_batch([a, b], counts)
    assert snapshot(m) == before


def test_an_empty_batch_fits():
    m = KVCacheManager(4, 4, max_model_len=16)
    assert m.allocate_slots_batch([], []) is True
    assert m.num_free_blocks == 3


def test_two_requests_filling_equal_blocks_cache_the_first_ones_block():
    # One by one, the block of the batch's first request (b) enters the cache and a's
    # stays an uncached duplicate; the batch must cache the same one.
    m = KVCacheManager(16, 4, max_model_len=64)
    a, b = make_request("a", [1, 2, 3]), make_request("b", [1, 2, 3])
    prefill(m, a)
    prefill(m, b)  # 3 tokens fill no block: no hit, b holds its own block
    for r in (a, b):
        r.append_output_token_ids([4, 9])
    assert m.allocate_slots_batch([b, a], [2, 2])
    assert m.block_ids("a") == [1, 4] and m.block_ids("b") == [2, 3]
    probe = make_request("probe", [1, 2, 3, 4, 5])
    assert m.get_computed_blocks(probe, count=False) == ([2], 4)
    m.check_integrity()


def test_fresh_blocks_for_many_tokens_leave_the_sharing_version():
    # Only frees and cache hits may move it (the cascade planner reuses its plan until
    # then); fresh blocks, one or several per request, are held by no other request.
    m = KVCacheManager(64, 4, max_model_len=64)
    a, b = make_request("a", range(8)), make_request("b", range(20, 28))
    prefill(m, a)
    prefill(m, b)
    version = m.sharing_version
    a.append_output_token_ids(list(range(30, 39)))
    b.append_output_token_ids([40])
    assert m.allocate_slots_batch([a, b], [9, 1])  # 3 fresh blocks for a, 1 for b
    assert len(m.block_ids("a")) == 5 and len(m.block_ids("b")) == 3
    assert m.sharing_version == version


def test_without_prefix_caching_a_request_hashed_elsewhere_is_allocated_as_one_by_one():
    # Without prefix caching its hashes are never read: allocate_slots takes it, and so
    # must the batch, filling a block included.
    m = KVCacheManager(16, 4, max_model_len=64, enable_prefix_caching=False)
    a, b = make_request("a", range(3)), make_request("b", range(10, 13))
    for r in (a, b):
        r.update_block_hashes(8, seed=1)  # as if hashed for another manager
        prefill(m, r)
        r.append_output_token_ids([7, 8])
    assert m.allocate_slots(a, 2) == [3]
    assert m.allocate_slots_batch([b], [2])
    assert m.block_ids("b") == [2, 4]
    m.check_integrity()


def test_a_request_hashed_elsewhere_is_refused_only_once_it_fills_a_block():
    # With prefix caching the batch reads a request's hashes only to cache a block it
    # fills: tokens that stay inside a partly filled block are allocated; filling it is
    # refused with nothing changed.
    m = KVCacheManager(16, 4, max_model_len=64)
    a = make_request("a", range(2))
    assert m.allocate_slots(a, 2) == [1]  # no full block: no hashes read yet
    a.num_computed_tokens = 2
    a.update_block_hashes(8, seed=1)  # as if hashed for another manager
    a.append_output_token_ids([7])
    assert m.allocate_slots_batch([a], [1])  # 3 tokens: block 1 not yet full
    a.num_computed_tokens = 3
    a.append_output_token_ids([8])
    before = snapshot(m)
    with pytest.raises(ValueError, match="block_size, seed"):
        m.allocate_slots_batch([a], [1])  # the 4th token fills block 1
    assert snapshot(m) == before
