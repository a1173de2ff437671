"""widened_counts keeps int32 and int64 counts as given and widens every other integer
dtype (narrower signed ones, unsigned ones) to int64, values unchanged; checked_step_counts
refuses every negative num_computed_tokens entry, -1 included."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.count_arrays import checked_step_counts, widened_counts


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_int32_and_int64_counts_are_kept(dtype):
    counts = np.array([0, 5, 127], dtype)
    assert widened_counts(counts) is counts


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16, np.uint32, np.uint64])
def test_other_integer_counts_are_widened_to_int64(dtype):
    got = widened_counts(np.array([0, 1, 100], dtype))
    assert got.dtype == np.int64 and got.tolist() == [0, 1, 100]


def test_int16_counts_sum_past_int16_without_overflow():
    counts = widened_counts(np.array([32767, 1], np.int16))
    assert int(counts.sum()) == 32768 and int((counts + counts).max()) == 65534


def test_checked_step_counts_refuses_minus_one_and_takes_zero():
    # -1 is the first value numpy reads as a column from the table's end.
    query_lens, computed = checked_step_counts(np.array([1, 2]), np.array([0, 5]), 2)
    assert computed.tolist() == [0, 5] and query_lens.tolist() == [1, 2]
    with pytest.raises(ValueError, match="num_computed_tokens entry must be >= 0, got -1"):
        checked_step_counts(np.array([1, 2]), np.array([3, -1]), 2)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16])
def test_checked_step_counts_widens_narrow_or_unsigned_query_lens_too(dtype):
    """The builder sums query_lens as it sums num_computed_tokens: both come back int64."""
    query_lens, computed = checked_step_counts(np.array([100, 100], dtype), np.array([0, 1]), 2)
    assert query_lens.dtype == np.int64 and int(query_lens.sum()) == 200
    assert computed.dtype == np.array([0]).dtype
