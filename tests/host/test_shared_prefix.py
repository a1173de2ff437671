"""Exact shared-prefix detection: the two reference-count traps and friends.

The answer must come from the scheduled requests only. Holders outside the scheduled set
(finished requests still copying KV out, requests receiving KV, running requests not
scheduled this step, preempted ones that kept their blocks) raise reference counts but
must neither add to nor subtract from num_common_prefix_blocks.
"""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager, RequestStatus
from tests.host._util import decode, make_request, prefill, ref_counts

X = list(range(4))  # one full block of shared prefix (block_size 4)


def _manager() -> KVCacheManager:
    return KVCacheManager(32, 4, max_model_len=64)


def test_trap_false_positive_finished_holder_shares_only_with_a():
    # A and C share prefix block X; B does not. C finished and still offloads its KV.
    m = _manager()
    a = make_request("A", [*X, 10, 11])
    c = make_request("C", [*X, 30, 31])
    b = make_request("B", [90, 91, 92, 93, 20, 21])
    for r in (a, c, b):
        prefill(m, r)
    c.status = RequestStatus.FINISHED_TRANSFERRING
    x = m.block_ids("A")[0]
    assert m.block_ids("C")[0] == x and m.block_ids("B")[0] != x
    # The wrong rule (ref_cnt == number of running requests) would call X common here.
    assert ref_counts(m)[x] == 2 == len(["A", "B"])
    assert m.num_common_prefix_blocks(["A", "B"]) == 0
    assert m.num_common_prefix_blocks(["A", "C"]) == 1


def test_trap_false_negative_finished_holder_shares_with_both():
    # A, B and C share X; C finished and still offloads its KV.
    m = _manager()
    a = make_request("A", [*X, 10, 11])
    b = make_request("B", [*X, 20, 21])
    c = make_request("C", [*X, 30, 31])
    for r in (a, b, c):
        prefill(m, r)
    c.status = RequestStatus.FINISHED_TRANSFERRING
    x = m.block_ids("A")[0]
    # The wrong rule would see ref_cnt 3 != 2 running and turn cascade off.
    assert ref_counts(m)[x] == 3
    assert m.num_common_prefix_blocks(["A", "B"]) == 1
    m.free(c)  # the copy landed
    assert m.num_common_prefix_blocks(["A", "B"]) == 1


def test_running_but_unscheduled_holders_do_not_count():
    m = _manager()
    long_prefix = list(range(12))  # three full blocks
    reqs = {
        "A": [*long_prefix, 1, 2],
        "B": [*long_prefix, 3, 4],
        "D": [*long_prefix[:8], 77, 78, 79, 80, 5],  # shares two blocks only
        "E": [*long_prefix, 6, 7],
        "F": [60, 61, 62, 63, 64],  # shares nothing
    }
    for rid, tokens in reqs.items():
        prefill(m, make_request(rid, tokens))
    assert m.num_common_prefix_blocks(["A", "B"]) == 3  # D, E, F running, not scheduled
    assert m.num_common_prefix_blocks(["A", "B", "E"]) == 3
    assert m.num_common_prefix_blocks(["A", "B", "D"]) == 2
    assert m.num_common_prefix_blocks(["B", "D", "A"]) == 2  # order does not matter
    assert m.num_common_prefix_blocks(["A", "F"]) == 0
    assert m.num_common_prefix_blocks(["A"]) == 4  # a lone request shares all its blocks
    assert m.num_common_prefix_blocks([]) == 0


def test_remote_kv_and_preempted_holders_do_not_count():
    m = _manager()
    prefix = list(range(8))
    a, b = make_request("A", [*prefix, 1]), make_request("B", [*prefix, 2])
    remote = make_request("R", [*prefix, 3])  # receiving KV: holds blocks, not scheduled
    kept = make_request("P", prefix[:4] + [9, 9, 9, 9, 9])  # preempted, kept its blocks
    for r in (a, b, remote, kept):
        prefill(m, r)
    remote.status = RequestStatus.WAITING_FOR_REMOTE_KV
    kept.status = RequestStatus.PREEMPTED
    assert m.num_common_prefix_blocks(["A", "B"]) == 2
    m.free(remote)
    m.free(kept)
    assert m.num_common_prefix_blocks(["A", "B"]) == 2


def test_answer_follows_decode_growth_and_shared_tail_blocks():
    m = _manager()
    a, b = make_request("A", range(8)), make_request("B", range(8))
    m.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    hit, n = m.get_computed_blocks(b)
    m.allocate_slots(b, 8 - n, num_new_computed_tokens=n, new_computed_blocks=hit)
    assert m.block_ids("A")[0] == m.block_ids("B")[0]
    assert m.block_ids("A")[1] != m.block_ids("B")[1]  # last prompt token recomputed
    assert m.num_common_prefix_blocks(["A", "B"]) == 1


def _brute_force_common(m: KVCacheManager, ids: list[str]) -> int:
    rows = [m.block_ids(i) for i in ids]
    k = 0
    while all(len(r) > k for r in rows) and len({r[k] for r in rows}) == 1:
        k += 1
    return k


def _b_holding_the_first_of_two_hit_blocks(m: KVCacheManager):
    """(A, B, B's hit): A holds two full blocks B's prompt also starts with; B has taken
    the first of them only (4 tokens computed)."""
    y = [5, 6, 7, 8]
    a = make_request("A", [*X, *y, 10])
    prefill(m, a)
    b = make_request("B", [*X, *y, 20])
    hit, n = m.get_computed_blocks(b)
    assert n == 8
    m.allocate_slots(b, 0, num_new_computed_tokens=4, new_computed_blocks=hit[:1])
    b.num_computed_tokens = 4
    return a, b, hit


def test_reused_answer_follows_cache_hit_appends_frees_and_reused_ids():
    # Repeating an id list reuses the previous answer; every change that can alter it
    # (a cache hit appended to a member, a free, an id reused for another request) must
    # be seen, and fresh decode blocks must leave it unchanged.
    m = _manager()
    a, b, hit = _b_holding_the_first_of_two_hit_blocks(m)
    ids = ["A", "B"]
    assert m.num_common_prefix_blocks(ids) == 1 == _brute_force_common(m, ids)
    m.allocate_slots(b, 1, num_new_computed_tokens=4, new_computed_blocks=hit[1:])
    b.num_computed_tokens = 9
    assert m.num_common_prefix_blocks(list(ids)) == 2 == _brute_force_common(m, ids)
    for token in range(12):  # fresh blocks on both rows
        decode(m, a, 100 + token)
        decode(m, b, 200 + token)
        assert m.num_common_prefix_blocks(list(ids)) == 2 == _brute_force_common(m, ids)
        assert m.num_common_prefix_blocks(["A"]) == len(m.block_ids("A"))
    m.free(b)
    other = make_request("B", [50, 51, 52, 53, 54])  # the same id, nothing shared
    prefill(m, other)
    assert m.num_common_prefix_blocks(list(ids)) == 0 == _brute_force_common(m, ids)
    m.check_integrity()


def test_reused_answer_follows_a_single_cache_hit_block_and_the_sharing_version_moves():
    # A cache hit of one block (no fresh block with it) takes the table's one-block write
    # path; it must change the sharing version and the reused answer all the same.
    m = _manager()
    a, b, hit = _b_holding_the_first_of_two_hit_blocks(m)
    assert m.num_common_prefix_blocks(["A", "B"]) == 1
    version = m.sharing_version
    assert m.allocate_slots(b, 0, num_new_computed_tokens=4, new_computed_blocks=hit[1:]) == []
    b.num_computed_tokens = 8
    assert m.block_ids("B") == hit == m.block_ids("A")[:2]
    assert m.sharing_version != version
    assert m.num_common_prefix_blocks(["A", "B"]) == 2 == _brute_force_common(m, ["A", "B"])
    m.check_integrity()


def test_one_id_repeated_follows_its_growth():
    # One row repeated shares all its blocks with itself, so fresh blocks change the
    # answer: the reused answer of distinct rows must not apply to it.
    m = _manager()
    a = make_request("A", [*X, 5, 6])
    prefill(m, a)
    for ids in (["A", "A"], ["A", "A", "A"]):
        for token in range(6):  # the same list each step, as a reused answer needs
            assert m.num_common_prefix_blocks(list(ids)) == len(m.block_ids("A"))
            decode(m, a, 100 + token)
    m.check_integrity()


def test_manager_many_scheduled_one_diverging_anywhere():
    m = KVCacheManager(400, 4, max_model_len=64)
    prefix = list(range(32))  # 8 shared blocks
    ids = []
    for i in range(100):
        own = [1000 + i, 2000 + i]
        tokens = prefix[: 12 if i == 77 else 32] + own  # request 77 shares 3 blocks only
        prefill(m, make_request(f"q{i}", tokens))
        ids.append(f"q{i}")
    assert m.num_common_prefix_blocks(ids) == 3
    assert m.num_common_prefix_blocks(ids[:77] + ids[78:]) == 8
    m.free("q0")
    assert m.num_common_prefix_blocks(ids[1:77] + ids[78:]) == 8
    with pytest.raises(ValueError, match="'q0'"):
        m.num_common_prefix_blocks(ids)


def test_manager_many_scheduled_sample_shares_one_block_one_diverges_at_zero():
    # The first request holds exactly the one shared block; a request outside the sample
    # shares nothing. The sampled bound is then 1 and the answer 0.
    m = KVCacheManager(200, 4, max_model_len=64)
    ids = []
    for i in range(40):
        tokens = X if i == 0 else ([90, 91, 92, 93] if i == 7 else X) + [100 + i]
        prefill(m, make_request(f"q{i}", tokens))
        ids.append(f"q{i}")
    assert m.num_common_prefix_blocks(ids) == 0
    assert m.num_common_prefix_blocks(ids[:7] + ids[8:]) == 1


def test_rows_entry_point_agrees_with_ids():
    m = KVCacheManager(400, 4, max_model_len=64)
    prefix = list(range(16))
    ids = []
    for i in range(50):
        tokens = (prefix[:8] if i == 31 else prefix) + [500 + i]
        prefill(m, make_request(f"q{i}", tokens))
        ids.append(f"q{i}")
    rows = m.rows_of(ids)
    assert m.num_common_prefix_blocks_of_rows(rows) == m.num_common_prefix_blocks(ids) == 2
    assert m.num_common_prefix_blocks_of_rows(rows[:31]) == 4
    assert m.num_common_prefix_blocks_of_rows(rows[:1]) == len(m.block_ids("q0"))
    assert m.num_common_prefix_blocks_of_rows(rows[:0]) == 0


def test_reused_answer_follows_a_cache_hit_on_a_request_that_held_no_block():
    # A request allocated nothing yet holds a row but no block; its first cache hit lands
    # at column 0 of that row and must move the sharing version and the reused answer.
    m = _manager()
    prefill(m, make_request("A", [*X, 5]))
    b = make_request("B", [*X, 6])
    assert m.allocate_slots(b, 0) == []
    assert m.block_ids("B") == []
    assert m.num_common_prefix_blocks(["A", "B"]) == 0 == _brute_force_common(m, ["A", "B"])
    version = m.sharing_version
    hit, n = m.get_computed_blocks(b)
    assert n == 4
    m.allocate_slots(b, 1, num_new_computed_tokens=n, new_computed_blocks=hit)
    assert m.sharing_version != version
    assert m.num_common_prefix_blocks(["A", "B"]) == 1 == _brute_force_common(m, ["A", "B"])
    m.check_integrity()


def test_sharing_version_changes_on_free_even_when_the_row_is_refilled_fresh():
    # Its documented rule: it changes whenever a request is freed. A caller that keys
    # the common prefix of ["a", "b"] on it must see that a new "a" in the same row,
    # holding fresh blocks only, shares nothing with b.
    m = KVCacheManager(32, 4, max_model_len=64)
    a, b = make_request("a", range(9)), make_request("b", range(9))
    prefill(m, a)
    prefill(m, b)  # a cache hit on a's two full blocks
    version = m.sharing_version
    assert m.num_common_prefix_blocks(["a", "b"]) == 2
    m.free(a)
    assert m.sharing_version != version
    prefill(m, make_request("a", [7] * 9))
    assert m.sharing_version != version
    assert m.num_common_prefix_blocks(["a", "b"]) == 0
