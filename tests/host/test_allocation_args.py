"""The allocation checks called directly: each refuses only past its limit.

KVCacheManager calls them only once its own test has found a count past the limit, so
that a check's own comparison is the one that decides at the limit itself."""

from __future__ import annotations

import pytest

from jaxkv.allocation_args import (
    check_computed_within_held,
    check_computed_within_tokens,
    check_total_fits,
    manager_args,
)
from tests.host._util import make_request


def test_computed_tokens_up_to_the_requests_tokens_pass_and_one_more_is_refused():
    request = make_request("r", range(6))
    assert check_computed_within_tokens(request, 6) is None
    with pytest.raises(ValueError, match=r"request 'r': .* = 7 exceeds its 6 tokens"):
        check_computed_within_tokens(request, 7)


def test_computed_tokens_up_to_the_held_blocks_pass_and_one_more_is_refused():
    assert check_computed_within_held("r", 8, 2, 4) is None
    with pytest.raises(ValueError, match=r"request 'r': num_computed_tokens=9 exceeds the 8"):
        check_computed_within_held("r", 9, 2, 4)


def test_a_total_up_to_max_model_len_passes_and_one_more_is_refused():
    assert check_total_fits("r", 16, 16, num_new_tokens=16) is None
    with pytest.raises(ValueError, match=r"'r' would hold 17 tokens > max_model_len=16 \(n=17\)"):
        check_total_fits("r", 17, 16, n=17)


def test_the_most_blocks_a_pool_takes_are_refused_past_2_to_the_31_token_slots():
    # Checked before any pool is built: a pool of 2**31 - 1 blocks would not fit in memory.
    assert manager_args(2**31 - 1, 1, 8, 0) == (2**31 - 1, 1, 8, 0)
    with pytest.raises(ValueError, match="num_blocks=2147483647 times block_size=2 must be"):
        manager_args(2**31 - 1, 2, 8, 0)
