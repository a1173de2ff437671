"""A count given as a numpy integer among plain ints counts as its value."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager
from tests.host._util import make_request, snapshot


@pytest.mark.parametrize(
    "name", ["num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens"]
)
def test_one_numpy_int8_count_among_plain_ints_is_summed_as_a_python_int(name):
    # 100 computed elsewhere + 100 new + 100 lookahead tokens: 75 blocks of 4. Kept as an
    # int8, a sum with it would wrap past 127 and allocate too few blocks.
    def run(count):
        m = KVCacheManager(80, 4, max_model_len=512)
        counts = {
            "num_new_tokens": 100,
            "num_new_computed_tokens": 100,
            "num_lookahead_tokens": 100,
        }
        counts[name] = count(100)
        got = m.allocate_slots(make_request("a", range(200)), **counts)
        m.check_integrity()
        return got, snapshot(m)

    assert run(np.int8) == run(int)
    assert run(int)[0] == list(range(1, 76))
