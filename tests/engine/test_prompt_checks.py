"""checked_prompt_ids returns a prompt as a list of Python ints, or raises ValueError
naming prompt_token_ids: bools are refused in tuples as in lists and as a bool array,
and an array-like numpy cannot read raises ValueError, not TypeError."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.prompt_checks import checked_prompt_ids
from tests.engine._util import VOCAB, make_engine


class _Unreadable:
    """An array-like numpy cannot convert (as a tensor on another device)."""

    def __array__(self, dtype=None, copy=None):
        raise TypeError("cannot convert a device tensor")


@pytest.mark.parametrize(
    "prompt, match",
    [
        ((5, True, 2), "a bool at index 1"),
        ((np.True_,), "a bool at index 0"),
        ([3, np.array(True)], "a bool at index 1"),  # numpy read it as [3, 1]
        ([jnp.array(False), 2], "a bool at index 0"),
        (np.array([True, False]), "must be integers, got dtype bool"),
        (_Unreadable(), "prompt_token_ids must be a 1-D sequence of ints"),
    ],
)
def test_bools_and_unreadable_prompts_are_refused_by_name(prompt, match):
    with pytest.raises(ValueError, match=match):
        checked_prompt_ids(prompt, limit=VOCAB)


def test_the_engine_refuses_a_tuple_holding_a_bool_and_queues_nothing():
    engine = make_engine()
    with pytest.raises(ValueError, match="a bool at index 1"):
        engine.add_request((5, True, 2))
    assert not engine.has_unfinished_requests()


def test_zero_d_int_arrays_in_a_list_are_taken_as_ids():
    assert checked_prompt_ids([np.array(3), jnp.array(4), np.int16(5)], limit=VOCAB) == [3, 4, 5]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16])
def test_arrays_of_ints_come_back_as_python_ints(dtype):
    ids = checked_prompt_ids(np.array([3, 0, VOCAB - 1], dtype), limit=VOCAB)
    assert ids == [3, 0, VOCAB - 1]
    assert [type(t) for t in ids] == [int, int, int]


@pytest.mark.parametrize("prompt", ["ab", b"ab", bytearray(b"ab")])
def test_text_and_bytes_are_refused_as_prompts(prompt):
    with pytest.raises(ValueError, match=f"token ids, not {type(prompt).__name__}"):
        checked_prompt_ids(prompt, limit=VOCAB)


@pytest.mark.parametrize("prompt", [5, np.int32(5), [[1, 2]], [1.0, 2.0], [-1, 2], [1, VOCAB]])
def test_scalars_nested_lists_floats_and_ids_out_of_range_are_refused(prompt):
    with pytest.raises(ValueError, match="prompt_token_ids must"):
        checked_prompt_ids(prompt, limit=VOCAB)


def test_ids_at_either_end_of_the_range_are_taken():
    assert checked_prompt_ids([0, VOCAB - 1], limit=VOCAB) == [0, VOCAB - 1]


def test_an_empty_prompt_is_refused_unless_allowed():
    with pytest.raises(ValueError, match="non-empty 1-D"):
        checked_prompt_ids([], limit=VOCAB)
    assert checked_prompt_ids([], limit=VOCAB, allow_empty=True) == []
    assert checked_prompt_ids(np.array([], np.int32), limit=VOCAB, allow_empty=True) == []


@pytest.mark.parametrize(
    "prompt",
    [[1, np.uint64(2)], (np.int64(1), np.uint64(2)), [np.uint64(1), jnp.array(2, jnp.int32)]],
)
def test_unsigned_64_bit_ids_among_signed_ones_are_taken(prompt):
    # numpy reads int64 and uint64 together as float64: each id is still an integer
    ids = checked_prompt_ids(prompt, limit=VOCAB)
    assert ids == [1, 2]
    assert [type(t) for t in ids] == [int, int]
