"""HostOffloadConnector loads blocks stored behind a gap (their head left the store) after
a device-cache hit on that head, and a failed load counts nothing it did not copy."""

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
