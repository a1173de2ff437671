"""HostOffloadConnector's hooks called directly: what they save, claim, refuse and count."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier, bound_host_connector, computed_request

BS = 4


def _stored(connector: HostOffloadConnector, tokens: list[int]) -> None:
    """Saves the full blocks of `tokens` through block ids 1, 2, ... and lands the save."""
    block_ids = list(range(1, len(tokens) // BS + 1))
    assert connector.on_finish(computed_request("saved", tokens), block_ids)
    connector.poll()


def test_only_blocks_the_caller_names_are_saved():
    # Two computed blocks but one block id: the save covers that one block only.
    copier, connector = bound_host_connector()
    r = computed_request("r", list(range(1, 9)))
    assert connector.on_finish(r, [7])
    connector.poll()
    assert copier.saved_block_ids == [[7]] and connector.stored_hashes() == r.block_hashes[:1]


def test_a_claim_after_a_partial_block_is_zero():
    _, connector = bound_host_connector()
    _stored(connector, list(range(1, 13)))
    probe = Request("p", list(range(1, 14)), SamplingParams())
    assert connector.on_admission(probe, 0) == 3 * BS
    assert connector.on_admission(probe, BS) == 2 * BS
    for partial in (1, BS + 2):  # a claim from there would end inside a block
        assert connector.on_admission(probe, partial) == 0


def test_start_load_refuses_a_partial_block_start_and_no_block_ids():
    copier, connector = bound_host_connector()
    _stored(connector, list(range(1, 13)))
    b = Request("b", list(range(1, 14)), SamplingParams())
    b.num_computed_tokens = 2
    with pytest.raises(ValueError, match="1 block_ids do not cover whole prompt blocks after 2"):
        connector.start_load(b, [5])
    b.num_computed_tokens = 0
    with pytest.raises(ValueError, match="0 block_ids do not cover whole prompt blocks after 0"):
        connector.start_load(b, [])
    assert copier.loaded_block_ids == [] and not connector.has_pending()


def test_bytes_offloaded_counts_only_the_blocks_copied():
    # The second save's chain has three blocks, two already stored: one is copied.
    copier, connector = bound_host_connector()
    _stored(connector, list(range(1, 9)))
    assert connector.on_finish(computed_request("longer", list(range(1, 13))), [3, 4, 5])
    connector.poll()
    assert copier.saved_block_ids == [[1, 2], [5]]
    stats = connector.stats
    assert (stats.num_saves, stats.num_stored_blocks) == (2, 3)
    assert stats.bytes_offloaded == 3 * copier.bytes_per_block


def test_start_load_refuses_blocks_the_store_holds_only_in_part():
    copier, connector = bound_host_connector()
    _stored(connector, list(range(1, 5)))  # the first block only
    b = Request("b", list(range(1, 10)), SamplingParams())
    with pytest.raises(ValueError, match=r"start_load\('b'\): the store no longer holds"):
        connector.start_load(b, [5, 6])
    assert copier.loaded_block_ids == [] and not connector.has_pending()


def test_every_hook_hashes_with_the_bound_seed():
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=7)
    assert connector.on_finish(computed_request("saved", list(range(1, 9))), [1, 2])
    connector.poll()
    seeded = Request("s", list(range(1, 9)), SamplingParams()).update_block_hashes(BS, 7)
    assert connector.stored_hashes() == seeded[1::-1]
    probe = Request("p", list(range(1, 10)), SamplingParams())
    probe.update_block_hashes(BS, 7)  # as a manager with the same seed hashes it first
    assert connector.on_admission(probe, 0) == 2 * BS
    connector.start_load(probe, [5, 6])
    assert copier.loaded_block_ids == [[5, 6]]
    assert connector.poll().loaded == ("p",)


@pytest.mark.parametrize("bad", [-BS, -3 * BS, 4.0, True, None])
def test_a_claim_for_a_count_that_is_no_token_count_is_refused(bad):
    # A negative count was read from the prompt's end: -4 claimed the last stored block.
    _, connector = bound_host_connector()
    tokens = list(range(13))
    _stored(connector, tokens)
    r = Request("r", tokens, SamplingParams())
    assert connector.on_admission(r, 0) == 3 * BS
    with pytest.raises(ValueError, match="num_computed_tokens"):
        connector.on_admission(r, bad)


def test_a_byte_budget_between_whole_blocks_keeps_only_the_blocks_it_holds_whole():
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(5 * copier.bytes_per_block // 2)
    connector.bind(copier, block_size=BS, hash_seed=0)
    r = computed_request("r", list(range(1, 13)))
    assert connector.on_finish(r, [1, 2, 3])
    connector.poll()
    assert connector.stored_hashes() == r.block_hashes[1::-1]  # the tail is evicted
    assert connector.stats.stored_bytes <= connector.host_bytes


def test_a_claim_for_a_preempted_request_covers_its_output_tokens():
    """A preempted request's tokens include its outputs: stored blocks past its prompt
    are claimed up to, never including, its last token."""
    _, connector = bound_host_connector()
    _stored(connector, list(range(1, 13)))
    preempted = Request("pre", list(range(1, 6)), SamplingParams())
    preempted.append_output_token_ids(list(range(6, 14)))  # 13 tokens, 5 of them prompt
    assert connector.on_admission(preempted, 0) == 3 * BS
    assert connector.on_admission(preempted, BS) == 2 * BS


def test_stats_count_stored_blocks_only_once_their_save_lands():
    """num_stored_blocks and stored_bytes count the store, not the saves in flight."""
    copier = FakeCopier(16, BS, auto_complete=False)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    assert connector.on_finish(computed_request("r", list(range(1, 9))), [1, 2])
    connector.poll()
    stats = connector.stats
    assert (stats.num_stored_blocks, stats.stored_bytes, stats.num_saves) == (0, 0, 0)
    copier.complete()
    connector.poll()
    stats = connector.stats
    assert (stats.num_stored_blocks, stats.stored_bytes) == (2, 2 * copier.bytes_per_block)


def test_a_second_save_of_a_request_id_in_flight_is_refused_changing_nothing():
    # It replaced the first save's record: that save's hashes stayed marked as being
    # saved for good (no later request saved those blocks) and its end went unreported.
    copier, connector = bound_host_connector()
    first = computed_request("r", list(range(1, 9)))
    assert connector.on_finish(first, [1, 2])
    with pytest.raises(ValueError, match=r"on_finish\('r'\): a copy of that request is in"):
        connector.on_finish(computed_request("r", list(range(20, 28))), [3, 4])
    assert copier.saved_block_ids == [[1, 2]]
    assert connector.poll().saved == ("r",) and not connector.has_pending()
    assert set(connector.stored_hashes()) == set(first.block_hashes[:2])
    again = computed_request("r", list(range(20, 28)))  # its save has landed: taken now
    assert connector.on_finish(again, [3, 4]) and connector.poll().saved == ("r",)
    assert len(connector.stored_hashes()) == 4


def test_a_second_load_of_a_request_id_in_flight_is_refused_changing_nothing():
    copier, connector = bound_host_connector()
    copier.auto_complete = False
    tokens = list(range(1, 14))  # 3 full blocks, then one token: 3 blocks claimable
    _stored(connector, tokens)
    copier.complete()
    assert connector.poll().saved == ("saved",)
    r = Request("r", tokens, SamplingParams())
    assert connector.on_admission(r, 0) == 3 * BS
    connector.start_load(r, [5, 6, 7])
    with pytest.raises(ValueError, match=r"start_load\('r'\): a copy of that request is in"):
        connector.start_load(r, [8, 9, 10])
    assert copier.loaded_block_ids == [[5, 6, 7]] and len(connector.stored_hashes()) == 3
    copier.complete()
    assert connector.poll().loaded == ("r",) and not connector.has_pending()
    assert connector.stats.num_loads == 1 and connector.stats.num_failed_loads == 0


@pytest.mark.parametrize("bad", [None, "r", 3])
def test_each_hook_refuses_a_request_that_is_no_request_by_name_changing_nothing(bad):
    # Each raised AttributeError on the first attribute it read ('NoneType' object has
    # no attribute 'update_block_hashes'), and on_admission answered 0 for any object
    # while the store was empty.
    copier, connector = bound_host_connector()
    for hook, args in (("on_admission", (0,)), ("on_finish", ([1, 2],)), ("start_load", ([5],))):
        with pytest.raises(ValueError, match=rf"request={bad!r} must be a Request"):
            getattr(connector, hook)(bad, *args)
    _stored(connector, list(range(1, 13)))
    order = connector.stored_hashes()
    for hook, args in (("on_admission", (0,)), ("on_finish", ([1, 2],)), ("start_load", ([5],))):
        with pytest.raises(ValueError, match=rf"request={bad!r} must be a Request"):
            getattr(connector, hook)(bad, *args)
    assert connector.stored_hashes() == order and not connector.has_pending()
    assert copier.saved_block_ids == [[1, 2, 3]] and copier.loaded_block_ids == []


def test_start_load_refuses_blocks_that_reach_the_requests_last_token():
    # A prompt of whole blocks has its last token in its last stored block, which
    # on_admission never claims; start_load loaded it all the same, leaving the request
    # nothing to compute its logits from.
    copier, connector = bound_host_connector()
    tokens = list(range(1, 13))  # 3 full blocks, the last token in the third
    _stored(connector, tokens)
    order = connector.stored_hashes()
    r = Request("r", tokens, SamplingParams())
    assert connector.on_admission(r, 0) == 2 * BS
    with pytest.raises(ValueError, match=r"start_load\('r'\): 3 block_ids .* before its last"):
        connector.start_load(r, [5, 6, 7])
    assert copier.loaded_block_ids == [] and not connector.has_pending()
    assert connector.stored_hashes() == order and connector.stats.num_failed_loads == 0
    connector.start_load(r, [5, 6])
    assert connector.poll().loaded == ("r",) and copier.loaded_block_ids == [[5, 6]]


def test_on_finish_answers_false_itself_when_it_starts_no_save():
    # The scheduler logs a warning for any answer that is no bool: a store too small
    # for one block, and a request whose blocks are all stored already, answer False.
    copier, connector = bound_host_connector()
    tokens = list(range(1, 9))
    _stored(connector, tokens)
    assert connector.on_finish(computed_request("again", tokens), [3, 4]) is False
    connector.host_bytes = copier.bytes_per_block - 1
    assert connector.on_finish(computed_request("small", [5, 6, 7, 8]), [5]) is False
    assert not connector.has_pending() and copier.saved_block_ids == [[1, 2]]


def test_a_load_refreshes_only_the_blocks_it_reads_and_those_before_them():
    # The stored block that holds the request's last token is not loaded (its logits
    # must be computed), so it is not refreshed either: it stays next to be evicted.
    _, connector = bound_host_connector()
    tokens = list(range(1, 13))
    _stored(connector, tokens)
    c, b, a = connector.stored_hashes()  # the head most recently used
    other = computed_request("other", [90, 91, 92, 93])
    assert connector.on_finish(other, [5]) and connector.poll().saved == ("other",)
    x = connector.stored_hashes()[-1]
    assert connector.stored_hashes() == [c, b, a, x]
    p = Request("p", tokens, SamplingParams())
    assert connector.on_admission(p, 0) == 2 * BS
    connector.start_load(p, [6, 7])
    assert connector.stored_hashes() == [c, x, b, a]


def test_a_store_of_one_byte_blocks_holds_as_many_blocks_as_bytes():
    copier = FakeCopier(16, 1)
    copier.device = np.zeros((16, 1), np.uint8)  # one token of one byte a block
    copier.bytes_per_block = 1
    connector = HostOffloadConnector(2)
    connector.bind(copier, block_size=1, hash_seed=0)
    r = computed_request("r", [1, 2, 3])
    assert connector.on_finish(r, [1, 2, 3]) and connector.poll().saved == ("r",)
    assert connector.stored_hashes() == r.block_hashes[1::-1]  # the tail went first
    assert connector.stats.stored_bytes == 2
