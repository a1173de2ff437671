"""CascadePlanner.plan() takes counts of any integer dtype and plans as for int64 ones.

The planner adds num_computed_tokens and query_lens to compare flat attention's padded
pages with the suffix pass's (a cost model with reads_padded_pages): int8 counts of
120 + 10 tokens wrapped to -126 there, and a global level that pays was planned flat.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import KVCacheManager
from jaxkv.cascade import CascadeCostModel, CascadePlanner
from tests.attention.test_cascade_planner import SHAPE, _prefilled

PADDED = CascadeCostModel(launch_overhead_bytes=0, merge_cost_factor=0, reads_padded_pages=True)
PAGE_BUCKETS = (4, 8, 16, 32, 64)
SHARED = list(range(1000, 1100))  # 25 blocks of 4


def _two_requests_past_127_tokens():
    """Two requests sharing 25 blocks, each with 120 computed tokens and 10 scheduled."""
    m = KVCacheManager(128, 4, max_model_len=256)
    for i in range(2):
        request = _prefilled(m, f"r{i}", SHARED + [2000 + 100 * i + j for j in range(20)])
        request.append_output_token_ids(list(range(10)))
        assert m.allocate_slots(request, 10) is not None
    return m


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.uint32])
def test_narrow_or_unsigned_counts_plan_as_int64_counts_do(dtype):
    m = _two_requests_past_127_tokens()
    planner = CascadePlanner(SHAPE, cost_model=PADDED, page_buckets=PAGE_BUCKETS)
    ids = ["r0", "r1"]
    want = planner.plan(ids, np.array([120, 120]), np.array([10, 10]), m)
    # 130 tokens pad flat attention to 64 pages; the suffix past 25 shared blocks to 8.
    assert [lv.name for lv in want.levels] == ["global"]
    assert want.suffix_start_blocks.tolist() == [25, 25]
    got = CascadePlanner(SHAPE, cost_model=PADDED, page_buckets=PAGE_BUCKETS).plan(
        ids, np.array([120, 120], dtype), np.array([10, 10], dtype), m
    )
    assert [lv.name for lv in got.levels] == ["global"]
    assert got.suffix_start_blocks.tolist() == want.suffix_start_blocks.tolist()
    assert got.levels[0].block_ends.tolist() == want.levels[0].block_ends.tolist()
