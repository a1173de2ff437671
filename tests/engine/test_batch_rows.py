"""batch_rows: the batch row of each schedule index, under any reordering plan."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jaxkv.batch_rows import batch_rows


@st.composite
def orders_and_indices(draw):
    n = draw(st.integers(1, 12))
    order = np.array(draw(st.permutations(range(n))), np.int32)
    indices = draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    return order, indices


@given(orders_and_indices())
def test_each_row_holds_its_schedule_index(case):
    order, indices = case
    rows = batch_rows(indices, order)
    assert rows.dtype == np.intp and rows.shape == (len(indices),)
    np.testing.assert_array_equal(order[rows], indices)


def test_without_a_reordering_the_row_is_the_index():
    np.testing.assert_array_equal(batch_rows([3, 0, 2], None), [3, 0, 2])


def test_a_reversed_order_maps_index_to_its_mirror_row():
    np.testing.assert_array_equal(batch_rows([0, 1], np.array([2, 1, 0])), [2, 1])
