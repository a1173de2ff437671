"""kernels_pallas.validation called directly: each refusal names the argument and the
sizes as given.

validate_ragged_paged_attention_inputs is the shared trace-time check of every backend;
called on its own (not through an entry point's decorator) it refuses what the
decorator would, with the same messages.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.static_options import static_number_options, with_static_numbers
from kernels_pallas.validation import (
    output_dtype,
    validate_index_values,
    validate_ragged_paged_attention_inputs,
    validate_shared_prefix,
)

OPTIONS = dict(sm_scale=1.0, causal=True, sliding_window=None, soft_cap=None)
OPTIONS.update(k_scale=None, v_scale=None)


def _i32(a) -> np.ndarray:
    return np.asarray(a, np.int32)


# (argument, a value of the wrong shape) for the checks that leave shapes to the shape check
MALFORMED = [
    ("kv_lens", np.zeros((3, 1), np.int32)),
    ("cu_q_lens", np.zeros((3,), np.int32)),
    ("num_seqs", np.asarray(2, np.int32)),
    ("q", np.zeros((8, 64), np.float32)),
]


def _args(**change):
    """A valid batch: 8 token rows of 4 query heads over 2 KV heads of 16, 3 sequences
    of 2 pages of 4 tokens, 6 pages; `change` replaces arrays by name."""
    args = dict(
        q=np.zeros((8, 4, 16), np.float32), kv_pages=np.zeros((6, 4, 4, 16), np.float32),
        kv_lens=_i32([5, 3, 0]), page_indices=_i32([[1, 2], [3, 0], [0, 0]]),
        cu_q_lens=_i32([0, 2, 3, 3]), num_seqs=_i32([2]),
    )  # fmt: skip
    return {**args, **change}


def _refused(match: str, **change) -> None:
    with pytest.raises(ValueError, match=match):
        validate_ragged_paged_attention_inputs(**_args(**change), **OPTIONS)


def test_a_valid_batch_passes():
    validate_ragged_paged_attention_inputs(**_args(), **OPTIONS)


def test_an_argument_that_is_no_array_or_of_a_dtype_no_kernel_takes_is_refused_by_name():
    _refused("q must be a numpy or jax array, not list", q=np.zeros((8, 4, 16)).tolist())
    _refused("q.dtype=dtype.'float64'. must be one of", q=np.zeros((8, 4, 16)))
    _refused(r"kv_lens.dtype=int64 must be int32", kv_lens=np.asarray([5, 3, 0]))


def test_shape_refusals_name_the_sizes_as_given():
    want = "kv_pages.shape=(6, 4, 4, 32) head_dim must equal q.shape[2]=16"
    _refused("^" + re.escape(want), kv_pages=np.zeros((6, 4, 4, 32), np.float32))
    want = "q.shape[1]=3 (query heads) must be a multiple of num_kv_heads=2"
    _refused("^" + re.escape(want), q=np.zeros((8, 3, 16), np.float32))
    want = "cu_q_lens.shape=(3,) must be (4,) = (max_num_seqs + 1,)"
    _refused("^" + re.escape(want), cu_q_lens=np.asarray([0, 2, 3], np.int32))


def test_output_dtype_is_q_dtype_unless_one_is_given():
    q = np.zeros((1, 1, 1), jnp.bfloat16)
    assert output_dtype(q, None) == jnp.bfloat16
    assert output_dtype(q, jnp.float32) == jnp.float32
    assert output_dtype(q, "float16") == jnp.float16


@pytest.mark.parametrize(
    "name, value", [("page_indices", np.zeros((3, 2, 1), np.int32)), *MALFORMED]
)
def test_index_values_leave_malformed_shapes_to_the_shape_check(name, value):
    # Read anyway, they raised numpy's unpacking or broadcasting errors, naming nothing.
    assert validate_index_values(**_args(**{name: value})) is None


def test_the_shared_prefix_check_refuses_fewer_keys_than_queries_by_name():
    # Its index check is the causal one: a prefix pass's sequences are the main pass's.
    args = _args(kv_lens=np.asarray([1, 3, 0], np.int32))  # sequence 0: 2 queries, 1 key
    with pytest.raises(
        ValueError, match=r"kv_lens\[0\]=1 must be >= the sequence's query length 2"
    ):
        validate_shared_prefix(**args, num_prefix_pages=0)


def _index_refused(match: str, **change) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(match)):
        validate_index_values(**_args(**change))


def test_index_values_name_the_first_bad_entry_and_its_bounds():
    three = dict(num_seqs=_i32([3]), kv_lens=_i32([5, 3, 4]))
    # cu_q_lens[2] falls below cu_q_lens[1] and cu_q_lens[3] past the 8 token rows.
    _index_refused(
        "cu_q_lens[2]=1 must be in [3, max_num_tokens=8]", **three, cu_q_lens=_i32([0, 3, 1, 9])
    )
    _index_refused("kv_lens[1]=9 must be in [0, 8]", **{**three, "kv_lens": _i32([5, 9, 9])})
    _index_refused(
        "kv_lens[0]=1 must be >= the sequence's query length 2",
        **{**three, "kv_lens": _i32([1, 0, 4]), "cu_q_lens": _i32([0, 2, 3, 5])},
    )


def test_a_valid_sequence_may_read_page_zero():
    # Page ids lie in [0, num_pages): 0 is a page like any other to the kernels.
    page_indices = np.asarray([[0, 2], [0, 0], [0, 0]], np.int32)
    assert validate_index_values(**_args(page_indices=page_indices)) is None
    # Two pages past the 6 of the cache: the first is named.
    page_indices = np.asarray([[1, 7], [9, 0], [0, 0]], np.int32)
    _index_refused("page_indices[0, 1]=7 must be in [0, num_pages=6)", page_indices=page_indices)


def test_the_shared_prefix_check_does_nothing_on_traced_index_arrays():
    def traced(kv_lens):
        validate_shared_prefix(**_args(kv_lens=kv_lens), num_prefix_pages=1)
        return kv_lens

    jax.jit(traced)(jnp.asarray([5, 3, 0], jnp.int32))


def _cascade_args(**change):
    """_args as a valid cascade batch for one shared page: sequences 0 and 1 (2 and 1
    queries) start with page 1 and have their first queries at 6 and 5, past its 4 keys."""
    cascade = dict(kv_lens=_i32([8, 6, 0]), page_indices=_i32([[1, 2], [1, 3], [0, 0]]))
    return _args(**{**cascade, **change})


def _prefix_refused(want: str, num_prefix_pages, **change) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(want) + "$"):
        validate_shared_prefix(**_cascade_args(**change), num_prefix_pages=num_prefix_pages)


def test_the_shared_prefix_check_takes_no_prefix_and_every_page_as_bounds():
    assert validate_shared_prefix(**_cascade_args(), num_prefix_pages=1) is None
    # No prefix pages holds for any batch, shared or not.
    unshared = np.asarray([[1, 2], [4, 3], [0, 0]], np.int32)
    assert (
        validate_shared_prefix(**_cascade_args(page_indices=unshared), num_prefix_pages=0) is None
    )
    # Every page of a row (pages_per_seq=2, not max_num_seqs=3), with no query token.
    no_queries = dict(cu_q_lens=np.zeros(4, np.int32))
    assert validate_shared_prefix(**_cascade_args(**no_queries), num_prefix_pages=2) is None
    for k in (-1, 3):
        _prefix_refused(f"num_prefix_pages={k} must be in [0, pages_per_seq=2]", k, **no_queries)


def test_the_shared_prefix_check_names_the_first_query_inside_the_prefix():
    # Sequence 1 has a single query, at position 3 of the 4 prefix tokens, and sequence 0
    # its first at 4, the first key past them; with sequence 0's at 3 too, it is named.
    tail = " lies inside the 4 tokens of num_prefix_pages=1: the non-causal prefix pass"
    tail += " would show it keys after itself"
    _prefix_refused("sequence 1's first query position 3" + tail, 1, kv_lens=_i32([6, 4, 0]))
    _prefix_refused("sequence 0's first query position 3" + tail, 1, kv_lens=_i32([5, 4, 0]))


def test_the_shared_prefix_check_names_the_first_row_that_does_not_share_it():
    # Rows 1 and 2 (one query each, row 2 the last valid one) start with other pages.
    three = dict(num_seqs=_i32([3]), kv_lens=_i32([8, 6, 6]), cu_q_lens=_i32([0, 2, 3, 4]))
    tail = ": num_prefix_pages=1 pages must be shared by every sequence with query tokens"
    tail += " (the prefix pass reads sequence 0's)"
    pages = _i32([[1, 2], [4, 3], [5, 0]])
    _prefix_refused("page_indices[1, 0]=4 must equal page_indices[0, 0]=1" + tail, 1, **three,
                    page_indices=pages)  # fmt: skip
    pages = _i32([[1, 2], [1, 3], [5, 0]])
    _prefix_refused("page_indices[2, 0]=5 must equal page_indices[0, 0]=1" + tail, 1, **three,
                    page_indices=pages)  # fmt: skip


def test_static_number_options_leave_what_is_no_number_for_the_options_own_check():
    # A str after a converted array stays itself: it is refused by name later, where it
    # had taken the array's number before it.
    options = dict(sm_scale=jnp.float32(0.125), soft_cap="5", causal=True)
    converted = static_number_options(options)
    assert converted == dict(sm_scale=0.125, soft_cap="5", causal=True)
    assert type(converted["sm_scale"]) is float and options["sm_scale"] == jnp.float32(0.125)
    unchanged = dict(sm_scale="0.125", k_scale=[2.0], v_scale=None)
    assert static_number_options(unchanged) is unchanged


def _scaled(x, *, sm_scale):
    return x * sm_scale


def test_with_static_numbers_is_the_jitted_function_with_its_options_converted():
    jitted = jax.jit(_scaled, static_argnames="sm_scale")
    wrapped = with_static_numbers(jitted)
    assert wrapped.__wrapped__ is jitted and wrapped.__name__ == "_scaled"
    x = np.ones(2, np.float32)
    np.testing.assert_array_equal(wrapped(x, sm_scale=jnp.float32(2.0)), [2.0, 2.0])
    # Its other attributes are the jitted function's.
    assert wrapped._cache_size() == 1
    assert "multiply" in wrapped.lower(x, sm_scale=2.0).as_text()
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute
    # A copy before __init__ ran has no function to forward to: no recursion.
    with pytest.raises(AttributeError, match="_jitted"):
        _ = with_static_numbers.__new__(with_static_numbers)._jitted


@pytest.mark.parametrize("name, value", MALFORMED)
def test_the_shared_prefix_check_leaves_malformed_shapes_to_the_shape_check(name, value):
    # A 0-d num_seqs raised numpy's IndexError, a 2-D kv_lens a refusal naming "first
    # query position [-2 -1]", before cascade_attention's passes named the shape.
    args = _cascade_args(**{name: value})
    assert validate_shared_prefix(**args, num_prefix_pages=1) is None
    with pytest.raises(ValueError, match=f"^{name}.shape="):
        validate_ragged_paged_attention_inputs(**args, **OPTIONS)
