"""Checks of configuration fields shared by the frozen configs and dataclasses.

Each raises ValueError naming the field and what was expected. A bool is never taken for
a number: True as a size or a cost is a caller's mistake, not 1. A numpy integer (or a
0-d integer array of numpy or JAX) is taken for an int and stored as one, so a config
built from array arithmetic equals, hashes and prints as one built from Python ints;
likewise for real numbers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

import numpy as np

_BOOLS = {bool, np.bool_}


def is_unordered(value) -> bool:
    """Whether `value` is a set or a mapping: its iteration order is not one its caller
    wrote (a set's is its hashes', a dict's are its keys), so its items cannot stand for
    positions (a request's blocks, a batch's rows, prompts paired with outputs)."""
    return isinstance(value, (AbstractSet, Mapping))


def names_a_dtype(value) -> bool:
    """Whether `value` stands for a dtype rather than holding one: a str (np.str_ too), a
    numpy dtype or a scalar type (np.float32, jnp.bfloat16). np.dtype and jnp.dtype also
    read the dtype of a value given in its place (np.float16(1.0), an array), which a
    dtype argument must refuse."""
    return isinstance(value, (str, np.dtype, type))


def is_integer(value) -> bool:
    """An integer (int, numpy integer, 0-d integer array of numpy or JAX), not a bool."""
    if isinstance(value, numbers.Integral):
        return not isinstance(value, bool)
    return _scalar_kind(value) in ("i", "u")


def is_bool(value) -> bool:
    """A bool, numpy bool or 0-d bool array (numpy's or JAX's: np.asarray reads
    [jnp.array(True), 2] as [1, 2])."""
    if type(value) in _BOOLS:
        return True
    dtype = getattr(value, "dtype", None)
    return getattr(dtype, "kind", None) == "b"


def as_int(value) -> int | None:
    """`value` as a Python int if it is an integer (is_integer); else None."""
    return int(value) if is_integer(value) else None


def ints_as_python(values) -> list:
    """`values` with each integer (is_integer) as a Python int, the rest as they are:
    numpy reads int64 and uint64 together as float64, Python ints of both as int64."""
    return [v if (i := as_int(v)) is None else i for v in values]


def is_real(value) -> bool:
    """A real number (int, float, numpy scalar, 0-d integer or float array of numpy or
    JAX), not a bool."""
    if isinstance(value, numbers.Real):
        return not isinstance(value, bool)
    return _scalar_kind(value) in ("i", "u", "f")


def _scalar_kind(value) -> str | None:
    """The numpy dtype kind of a 0-d array (numpy's or JAX's), else None."""
    dtype = getattr(value, "dtype", None)
    if getattr(value, "ndim", None) != 0 or not hasattr(dtype, "kind"):
        return None
    return dtype.kind


def int_fields(
    owner: object, *names: str, minimum: int | None = None, maximum: int | None = None
) -> None:
    """ValueError unless each named attribute of `owner` is an integer (see `as_int`) in
    [`minimum`, `maximum`] (None: unbounded); each is stored back as a Python int (frozen
    dataclasses too)."""
    for name in names:
        value = checked_int(name, getattr(owner, name), minimum=minimum, maximum=maximum)
        object.__setattr__(owner, name, value)


def checked_int(
    name: str, raw: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """`raw` as a Python int if it is an integer (see `as_int`) in [`minimum`, `maximum`]
    (None: unbounded); else ValueError naming `name` (int_fields for one value)."""
    value = as_int(raw)
    if (
        value is None
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        if maximum is not None:
            bound = f" in [{minimum}, {maximum}]"
        else:
            bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name}={raw!r} must be an int{bound}")
    return value


def positive_int_fields(owner: object, *names: str) -> None:
    """ValueError unless each named attribute of `owner` is an integer >= 1; each is
    stored back as a Python int."""
    int_fields(owner, *names, minimum=1)


def bool_fields(owner: object, *names: str) -> None:
    """ValueError unless each named attribute of `owner` is a bool."""
    # A flag read from text ("false") or left None would otherwise switch by truthiness.
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be a bool")


def increasing_sizes(values) -> tuple[int, ...] | None:
    """`values` as a tuple of ints if it is a collection of strictly increasing integers
    >= 1 (numpy integers too, bools not; possibly empty), else None."""
    try:
        sizes = tuple(values)
    except TypeError:  # an int, e.g. one bound meant as (bound,)
        return None
    if not all(map(is_integer, sizes)):
        return None  # a float bound would reach the kernels as a static size
    sizes = tuple(int(n) for n in sizes)
    if any(n < 1 for n in sizes) or any(a >= b for a, b in zip(sizes, sizes[1:], strict=False)):
        return None
    return sizes


def as_float(value) -> float:
    """A real number (not a bool) as a Python float; NaN for anything else, and for one
    too large for a float (10**400)."""
    if not is_real(value):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.nan


def is_finite_number(value) -> bool:
    """A finite real number (not a bool); False for an int too large for a float (10**400,
    where math.isfinite raises OverflowError)."""
    if not is_real(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
