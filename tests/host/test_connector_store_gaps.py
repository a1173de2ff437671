"""HostOffloadConnector around gaps in its store: it loads blocks stored behind a head the
store lost after a device-cache hit on that head, keeps blocks stored behind a failed
save linked, and a failed copy counts and demotes only what it concerned."""

from __future__ import annotations

import numpy as np

from jaxkv import Request, SamplingParams
from jaxkv.host_offload_connector import HostOffloadConnector
from tests.host._sched_util import FakeCopier

BS = 4
PROMPT = list(range(1, 14))  # three full blocks h0 h1 h2 and one token


def _stored_then_head_dropped() -> tuple[FakeCopier, HostOffloadConnector, np.ndarray]:
    """Stores PROMPT's three blocks (device blocks 1 2 3), then fails a load of h0 alone,
    which drops h0 from the store: h1 and h2 stay, demoted. Returns their saved KV."""
    copier = FakeCopier(16, BS)
    copier.device[1:4] = np.arange(3 * BS, dtype=np.float32).reshape(3, BS) + 1
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    saved = Request("saved", PROMPT, SamplingParams())
    saved.num_computed_tokens = len(PROMPT)
    assert connector.on_finish(saved, [1, 2, 3]) and connector.poll().saved == ("saved",)
    head = Request("head", PROMPT[: BS + 1], SamplingParams())
    assert connector.on_admission(head, 0) == BS
    copier.fail_loads = True
    connector.start_load(head, [5])
    assert connector.poll().failed_loads == ("head",)
    copier.fail_loads = False
    assert connector.stored_hashes() == saved.block_hashes[2:0:-1]  # h2 h1: h0 dropped
    return copier, connector, copier.device[2:4].copy()


def test_a_failed_load_counts_no_loaded_tokens_or_bytes():
    _, connector, _ = _stored_then_head_dropped()
    stats = connector.stats
    assert (stats.num_failed_loads, stats.num_loads) == (1, 0)
    assert (stats.num_loaded_tokens, stats.bytes_reloaded) == (0, 0)


def test_a_load_behind_a_device_hit_on_a_head_the_store_lost_lands():
    """start_load refreshes the whole prefix it extends, skipping the device hits the
    store does not hold, and loads the stored blocks' own KV."""
    copier, connector, expected = _stored_then_head_dropped()
    z = Request("z", PROMPT, SamplingParams())
    assert connector.on_admission(z, BS) == 2 * BS  # h0 hit on the device
    z.num_computed_tokens = BS
    connector.start_load(z, [7, 8])
    assert connector.poll().loaded == ("z",)
    np.testing.assert_array_equal(copier.device[7:9], expected)
    assert connector.stored_hashes() == z.block_hashes[2:0:-1]  # h1 refreshed last
    assert (connector.stats.num_loads, connector.stats.num_loaded_tokens) == (1, 2 * BS)


def test_blocks_stored_behind_a_failed_save_keep_their_links():
    """Blocks a save stores demoted, behind a head whose own save failed, are still linked
    to each other: when a failed load later drops one, the blocks behind it are demoted."""
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)
    x = Request("x", PROMPT[: BS + 1], SamplingParams())
    x.num_computed_tokens = BS + 1
    a = Request("a", PROMPT, SamplingParams())
    a.num_computed_tokens = len(PROMPT)
    copier.fail_saves = True
    assert connector.on_finish(x, [1])  # h0's save, failing
    copier.fail_saves = False
    assert connector.on_finish(a, [2, 3, 4])  # h1 h2 only: h0 is being saved
    assert connector.poll().saved == ("a",)
    y = Request("y", list(range(50, 55)), SamplingParams())
    y.num_computed_tokens = 5
    assert connector.on_finish(y, [5]) and connector.poll().saved == ("y",)
    h1, h2, hy = a.block_hashes[1], a.block_hashes[2], y.block_hashes[0]
    assert connector.stored_hashes() == [h2, h1, hy]  # behind the gap: next evicted
    both = Request("both", PROMPT, SamplingParams())
    both.num_computed_tokens = BS  # h0 hit on the device
    connector.start_load(both, [6, 7])
    assert connector.poll().loaded == ("both",)
    assert connector.stored_hashes() == [hy, h2, h1]
    one = Request("one", PROMPT[: 2 * BS + 1], SamplingParams())
    one.num_computed_tokens = BS
    copier.fail_loads = True
    connector.start_load(one, [8])
    assert connector.poll().failed_loads == ("one",)
    assert connector.stored_hashes() == [h2, hy]  # h1 dropped, h2 behind it demoted


def test_a_failed_save_demotes_nothing_behind_the_stored_blocks_it_only_refreshed():
    """A failed save ends only the saves it started: the blocks stored behind the chain's
    stored head (another prompt's branch) keep their place."""
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(64 * copier.bytes_per_block)
    connector.bind(copier, block_size=BS, hash_seed=0)

    def finished(request_id: str, tokens: list[int]) -> Request:
        request = Request(request_id, tokens, SamplingParams())
        request.num_computed_tokens = len(tokens)
        return request

    b = finished("b", [1, 2, 3, 4, 20, 21, 22, 23, 24])  # h0 and b's own hb1
    assert connector.on_finish(b, [1, 2]) and connector.poll().saved == ("b",)
    y = finished("y", list(range(50, 55)))
    assert connector.on_finish(y, [3]) and connector.poll().saved == ("y",)
    assert not connector.on_finish(b, [1, 2])  # both stored: refreshed, nothing copied
    h0, hb1, hy = b.block_hashes[0], b.block_hashes[1], y.block_hashes[0]
    assert connector.stored_hashes() == [hy, hb1, h0]
    a = finished("a", [1, 2, 3, 4, 30, 31, 32, 33, 34])  # h0 stored, ha1 copied
    copier.fail_saves = True
    assert connector.on_finish(a, [4, 5]) and connector.poll().failed_saves == ("a",)
    assert copier.saved_block_ids[-1] == [5]
    assert connector.stored_hashes() == [hy, hb1, h0]  # hb1 is not behind ha1


def test_a_failed_load_keeps_a_copy_of_its_hash_saved_again_while_it_was_in_flight():
    """A load's hash evicted and saved again by another request while the load is in
    flight: the load's failure drops the copy it read (gone already), not the new one."""
    copier = FakeCopier(16, BS)
    connector = HostOffloadConnector(copier.bytes_per_block)  # room for one block
    connector.bind(copier, block_size=BS, hash_seed=0)
    prompt = PROMPT[: BS + 1]  # one full block h0
    first = Request("first", prompt, SamplingParams())
    first.num_computed_tokens = BS + 1
    assert connector.on_finish(first, [1]) and connector.poll().saved == ("first",)
    loader = Request("loader", prompt, SamplingParams())
    assert connector.on_admission(loader, 0) == BS
    copier.auto_complete, copier.fail_loads = False, True
    connector.start_load(loader, [5])  # in flight, to fail
    copier.auto_complete, copier.fail_loads = True, False
    other = Request("other", list(range(50, 55)), SamplingParams())
    other.num_computed_tokens = 5
    assert connector.on_finish(other, [2]) and connector.poll().saved == ("other",)
    assert connector.stored_hashes() == other.block_hashes  # h0 evicted
    again = Request("again", prompt, SamplingParams())
    again.num_computed_tokens = BS + 1
    assert connector.on_finish(again, [3]) and connector.poll().saved == ("again",)
    assert connector.stored_hashes() == first.block_hashes  # h0 stored again
    copier.complete()
    assert connector.poll().failed_loads == ("loader",)
    assert connector.stored_hashes() == first.block_hashes  # the new copy stays
    assert connector.on_admission(Request("next", prompt, SamplingParams()), 0) == BS
