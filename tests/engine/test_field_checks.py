"""jaxkv.field_checks, the checks every config and dataclass field goes through: a bool
is never a number, numpy and JAX scalars are, and what is no finite number says so."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.field_checks import (
    as_float,
    as_int,
    increasing_sizes,
    int_fields,
    is_finite_number,
    is_integer,
    is_real,
)


def test_integers_are_ints_and_integer_scalars_but_never_bools():
    for value in (3, np.int8(3), np.uint64(3), np.array(3), jnp.asarray(3)):
        assert is_integer(value) and as_int(value) == 3 and type(as_int(value)) is int
    for value in (True, np.bool_(True), 3.0, np.float32(3), np.array([3]), "3", None):
        assert not is_integer(value) and as_int(value) is None


def test_reals_are_ints_floats_and_their_scalars_but_never_bools():
    for value in (2, 2.5, np.float16(2.5), np.int32(2), np.array(2.5), jnp.asarray(2.5)):
        assert is_real(value) and is_finite_number(value)
        assert as_float(value) == float(value) and type(as_float(value)) is float
    # 0-d unsigned arrays too: as for is_integer, an array's dtype kind "u" is an integer.
    for value in (np.array(2, np.uint8), jnp.asarray(2, jnp.uint32)):
        assert is_real(value) and is_finite_number(value)
        assert as_float(value) == float(value) and type(as_float(value)) is float
    for value in (True, False, np.bool_(True), np.array(True), 1j, "2", None, np.array([2.0])):
        assert not is_real(value) and not is_finite_number(value)
        assert math.isnan(as_float(value))


def test_numbers_a_float_cannot_hold_or_that_are_not_finite():
    assert math.isnan(as_float(10**400)) and not is_finite_number(10**400)
    assert as_float(math.inf) == math.inf and not is_finite_number(math.inf)
    assert math.isnan(as_float(math.nan)) and not is_finite_number(np.float32("nan"))
    assert is_finite_number(10**300) and as_float(10**300) == 1e300


def test_increasing_sizes_takes_strictly_increasing_integers_from_one():
    assert increasing_sizes([1, np.int64(4), 9]) == (1, 4, 9)
    assert increasing_sizes(()) == ()
    for values in (8, [0, 4], [4, 4], [8, 4], [1, 2.0], [True, 2], None):
        assert increasing_sizes(values) is None


@dataclasses.dataclass(frozen=True)
class _Sizes:
    a: object
    b: object = 1


def test_int_fields_store_python_ints_and_name_the_field_and_its_range():
    sizes = _Sizes(np.int16(5), jnp.asarray(2))
    int_fields(sizes, "a", "b", minimum=1)
    assert (sizes.a, sizes.b) == (5, 2) and {type(sizes.a), type(sizes.b)} == {int}
    with pytest.raises(ValueError, match=r"^a=0 must be an int >= 1$"):
        int_fields(_Sizes(0), "a", minimum=1)
    with pytest.raises(ValueError, match=r"^b=9 must be an int in \[0, 8\]$"):
        int_fields(_Sizes(1, 9), "a", "b", minimum=0, maximum=8)
    with pytest.raises(ValueError, match=r"^a=True must be an int$"):
        int_fields(_Sizes(True), "a")
