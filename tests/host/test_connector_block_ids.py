"""HostOffloadConnector's on_finish and start_load refuse block_ids that are not distinct
integer block ids with a ValueError naming block_ids, copying and changing nothing: one
block saved under two hashes, or loaded twice, would hold the wrong KV for one of them.
bytes iterate as small integers, so b"\\x01\\x02" must be refused, not read as [1, 2]."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import Request, SamplingParams
from tests.host._sched_util import bound_host_connector, computed_request

BS = 4
BAD = {
    "bytes": b"\x01\x02",
    "str": "12",
    "twice": [1, 1],
    "not iterable": 3,
    "a float": [1, 2.5],
    "a None": [1, None],
}


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_on_finish_refuses_block_ids_that_are_not_distinct_ids(bad):
    copier, connector = bound_host_connector()
    with pytest.raises(ValueError, match=r"on_finish\('r'\): block_ids="):
        connector.on_finish(computed_request("r", list(range(1, 9))), bad)
    assert copier.saved_block_ids == [] and not connector.has_pending()
    assert connector.stored_hashes() == [] and connector.stats.num_saves == 0


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_start_load_refuses_block_ids_that_are_not_distinct_ids(bad):
    copier, connector = bound_host_connector()
    assert connector.on_finish(computed_request("saved", list(range(1, 13))), [1, 2, 3])
    connector.poll()
    order = connector.stored_hashes()
    b = Request("b", list(range(1, 14)), SamplingParams())
    with pytest.raises(ValueError, match=r"start_load\('b'\): block_ids="):
        connector.start_load(b, bad)
    assert copier.loaded_block_ids == [] and not connector.has_pending()
    assert connector.stored_hashes() == order  # nothing refreshed either


def test_numpy_integer_block_ids_are_taken():
    copier, connector = bound_host_connector()
    assert connector.on_finish(computed_request("r", list(range(1, 9))), np.array([3, 4]))
    connector.poll()
    assert copier.saved_block_ids == [[3, 4]] and len(connector.stored_hashes()) == 2
