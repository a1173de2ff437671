"""A count that would take a request past max_model_len is refused naming that count.

The refusal used to say only "would hold N tokens > max_model_len", so a caller passing
an oversized num_new_tokens or num_lookahead_tokens (2**70, say) could not tell which
argument was wrong. State is left as it was.
"""

from __future__ import annotations

import pytest

from jaxkv import KVCacheManager
from tests.host._util import make_request, prefill, snapshot


def _busy():
    m = KVCacheManager(12, 4, max_model_len=16)
    a = make_request("a", range(9))
    prefill(m, a)
    return m, a


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"num_new_tokens": 2**70}, f"num_new_tokens={2**70}"),
        ({"num_new_tokens": 1, "num_lookahead_tokens": 10**9}, "num_lookahead_tokens=1000000000"),
        ({"num_new_tokens": 8}, "num_computed_tokens=9 + num_new_tokens=8"),
    ],
)
def test_allocate_slots_names_the_count_past_max_model_len(kwargs, named):
    m, a = _busy()
    before = snapshot(m)
    with pytest.raises(ValueError, match="max_model_len=16") as refused:
        m.allocate_slots(a, **kwargs)
    assert named in str(refused.value)
    m.check_integrity()
    assert snapshot(m) == before


def test_batch_allocation_names_the_count_past_max_model_len():
    m, a = _busy()
    before = snapshot(m)
    with pytest.raises(ValueError, match="max_model_len=16") as refused:
        m.allocate_slots_batch([a], [2**40])
    assert f"num_computed_tokens=9 + num_new_tokens={2**40}" in str(refused.value)
    m.check_integrity()
    assert snapshot(m) == before
