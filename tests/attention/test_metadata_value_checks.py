"""The value checks paged_attention runs on concrete metadata before its jit
(jaxkv.batch.check_query_bounds, check_values) leave what they cannot read, or what
another check names better, to that check."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import paged_attention
from jaxkv.batch import check_query_bounds
from tests.attention.test_attention_argument_checks import (
    H_KV,
    H_Q,
    D,
    _hand_made_two_sequences,
    _metadata,
)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"cu_q_lens": [0, 2, 4, 8, 12]}, "cu_q_lens must be a numpy or jax array, not list"),
        ({"num_seqs": [2]}, "num_seqs must be a numpy or jax array, not list"),
        # one past max_num_seqs: every entry of cu_q_lens would be read as a sequence's
        ({"num_seqs": np.array([5], np.int32)}, r"^metadata: num_seqs\[0\]=5 must be in"),
    ],
    ids=["cu_q_lens_list", "num_seqs_list", "num_seqs_past_max"],
)
def test_index_arrays_the_bound_check_cannot_read_are_named_by_the_kernels_checks(change, match):
    # Two valid sequences of 2 query tokens, two of 4 past them: max_q_len=2 holds the
    # valid ones only, and no AttributeError of a list's missing .ndim or .shape leaks.
    md = _hand_made_two_sequences(cu_q_lens=[0, 2, 4, 8, 12], max_q_len=2)
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages = jnp.zeros((3, 4, 2 * H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, pages, dataclasses.replace(md, **change), sm_scale=0.125)


@pytest.mark.parametrize("traced", ["cu_q_lens", "num_seqs"])
def test_the_query_bound_is_not_read_from_a_pass_with_one_traced_count(traced):
    # max_q_len=2 is short of sequence 0's 4 query tokens, but a traced array has no
    # values: the check passes instead of converting the tracer to numpy.
    md = _hand_made_two_sequences(cu_q_lens=[0, 4, 6, 6, 6], max_q_len=2)
    with pytest.raises(ValueError, match="sequence 0 has 4 query tokens"):
        check_query_bounds(md)

    def check(array):
        check_query_bounds(dataclasses.replace(md, **{traced: array}))
        return array

    jax.jit(check)(getattr(md, traced))


def test_pages_of_fewer_tokens_than_the_block_size_are_refused_for_it():
    # Pages of 1 token hold fewer keys than the metadata's pages of 4 address: the cache's
    # shape is named, not a kv_len past pages_per_seq * page_size that follows from it.
    md = _metadata()
    q = jnp.zeros((md.max_num_tokens, H_Q, D), jnp.float32)
    pages1 = jnp.zeros((64, 1, 2 * H_KV, D), jnp.float32)
    with pytest.raises(ValueError, match=r"must have pages of the metadata's .*block_size=4"):
        paged_attention(q, pages1, md, sm_scale=0.125)
