"""How cascade_attention splits a page table between its two passes.

suffix_page_indices shifts every row left by the prefix's pages and fills the freed tail
with the null page 0, so no column of a suffix row names a page of another position;
prefix_pass_inputs makes one sequence holding every query token over the prefix pages.
Both are checked against plain numpy on small tables.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.reference import prefix_pass_inputs, suffix_page_indices

TABLE = np.array([[7, 3, 9, 4], [7, 3, 5, 8], [7, 3, 2, 6]], np.int32)


def _shifted(table: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(table)
    out[:, : table.shape[1] - k] = table[:, k:]
    return out


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_suffix_rows_are_shifted_left_with_the_null_page_after_them(k):
    for num_prefix_pages in (k, jnp.int32(k)):
        got = suffix_page_indices(jnp.asarray(TABLE), num_prefix_pages)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), _shifted(TABLE, k))


def test_the_prefix_pass_is_one_sequence_over_every_query_token():
    cu_q_lens = jnp.array([0, 3, 4, 6, 0], jnp.int32)  # 3 valid sequences, padding 0
    kv_lens, pages, cu, num_seqs = prefix_pass_inputs(
        cu_q_lens, jnp.array([3], jnp.int32), jnp.asarray(TABLE[0, :2]), 2 * 16
    )
    assert kv_lens.tolist() == [32] and num_seqs.tolist() == [1]
    assert cu.tolist() == [0, 6] and pages.tolist() == [[7, 3]]
