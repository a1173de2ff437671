"""Static options of the kernels' entry points: checked and normalised before jit hashes
them.

jit keys its cache on static options by == and hash, under which 2.0, np.int64(2) and 2
are one key, as are 1 and True: an option refused when its program is traced (a float
block size, causal=1) ran another value's program unchecked once that was cached. Every
entry point (the kernels, the reference, jaxkv.attention.paged_attention) runs these
checks on each call, before its jit:

- `static_number_options`: a 0-d array scale (as `1 / jnp.sqrt(head_dim)` gives) as a
  Python float;
- `refuse_array_options`: any other option given as an array refused by name;
- `check_option_types`: each option that counts (INT_OPTIONS) an int or None and each
  flag (BOOL_OPTIONS) no number but a bool.
"""

from __future__ import annotations

import decimal
import functools
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# Options that are counts or sizes, across the entry points; None means "default".
INT_OPTIONS = (
    "sliding_window", "max_q_len", "block_m", "block_k", "num_kv_splits", "num_warps",
    "num_stages", "num_queries_per_block", "num_kv_pages_per_block", "num_kv_heads_per_block",
    "vmem_limit_bytes",
)  # fmt: skip
BOOL_OPTIONS = ("causal", "interpret", "return_lse")


def check_int_knobs(**knobs) -> None:
    """ValueError naming the first knob that is neither None nor an int (numpy ints too;
    bools are not: True would run as 1). A float block size or count fails deep in a
    pad, a scratch shape or the launch grid, naming nothing."""
    for name, value in knobs.items():
        is_int = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
        if value is not None and not is_int:
            raise ValueError(f"{name}={value!r} must be an int or None")


def check_option_types(options: dict) -> None:
    """ValueError naming the first of INT_OPTIONS in `options` that is neither None nor
    an int (check_int_knobs), or of BOOL_OPTIONS that is a number other than a bool
    (1 for True). Other values of a flag (None, a str, a pltpu.InterpretParams for the
    TPU kernel's interpret) hash apart from True and False and are left to the entry
    point's own check, as are the ranges of the counts."""
    check_int_knobs(**{name: options[name] for name in INT_OPTIONS if name in options})
    for name in BOOL_OPTIONS:
        value = options.get(name)
        if isinstance(value, (numbers.Number, np.generic)) and not isinstance(
            value, (bool, np.bool_)
        ):
            raise ValueError(f"{name}={value!r} must be a bool")


STATIC_NUMBER_OPTIONS = ("sm_scale", "soft_cap", "k_scale", "v_scale")


def static_number_options(options: dict) -> dict:
    """`options` with each of STATIC_NUMBER_OPTIONS that is a concrete 0-d array (numpy
    or jax, as `1 / jnp.sqrt(head_dim)` gives) as a Python float: jit's static
    arguments must be hashable, and a jax array is not. Raises ValueError naming the
    option for a traced value (a static option must be known when tracing), an array of
    more than one value or one of no real number (str, complex, date). A Fraction or
    Decimal becomes its float too (the kernels multiply arrays by it: a TypeError naming
    nothing), and so does a Python int (not a bool): JAX reads one as int32, so from
    2**31 on it failed inside the kernel with an OverflowError naming no option. Anything
    else, and one past float's range, is left for the option's own check."""
    converted = None
    for name in STATIC_NUMBER_OPTIONS:
        value = options.get(name)
        if value is None or type(value) in (float, bool):
            continue
        if isinstance(value, jax.core.Tracer):
            raise ValueError(f"{name} must be a static number, not a traced value")
        if isinstance(value, (np.ndarray, np.generic, jax.Array)):
            if np.ndim(value) != 0:
                raise ValueError(f"{name}={value!r} must be a single number")
            if value.dtype == bool:  # kept a bool: the option's own check refuses it
                number = value.item()
            elif jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(
                value.dtype, jnp.floating
            ):
                number = float(value)
            else:  # a str, complex or date would be read as some other number, or fail
                raise ValueError(f"{name}={value!r} must be a finite number > 0")
        elif isinstance(value, (numbers.Real, decimal.Decimal)):
            try:
                number = float(value)
            except (OverflowError, ValueError):  # Fraction(10**400), Decimal("sNaN")
                continue
        else:
            continue
        if converted is None:
            converted = dict(options)
        converted[name] = number
    return options if converted is None else converted


def refuse_array_options(options: dict, names: tuple[str, ...] | None = None) -> None:
    """ValueError naming the first of `names` (default: every option) given as a numpy
    or jax array, traced ones too, or as any other value but a number that does not hash
    (a list): jit hashes static options, and its own error ("Non-hashable static
    arguments", or a bare "unhashable type") names no argument. Numpy scalars hash; a
    number that does not (Decimal("sNaN")) is left to the option's own check."""
    for name in options if names is None else names:
        value = options.get(name)
        if isinstance(value, (np.ndarray, jax.Array)):
            raise ValueError(
                f"{name}={value!r} must be a static value (a Python or numpy scalar), not an array"
            )
        try:
            hash(value)
        except TypeError:
            if isinstance(value, numbers.Number):
                continue
            raise ValueError(
                f"{name}={value!r} must be a static value (a Python or numpy scalar), not "
                f"{type(value).__name__}"
            ) from None


class with_static_numbers:  # lower case: used as a decorator, like functools.wraps
    """`jitted`, called with static_number_options applied to its keyword options, then
    refuse_array_options run on the static options it knows (STATIC_NUMBER_OPTIONS,
    INT_OPTIONS, BOOL_OPTIONS) and check_option_types; its other attributes (lower,
    trace, _cache_size) are the jitted function's."""

    def __init__(self, jitted: Callable) -> None:
        self._jitted = jitted
        functools.update_wrapper(self, jitted)

    def __call__(self, *args, **options):
        options = static_number_options(options)
        refuse_array_options(options, STATIC_NUMBER_OPTIONS + INT_OPTIONS + BOOL_OPTIONS)
        check_option_types(options)
        return self._jitted(*args, **options)

    def __getattr__(self, name: str):
        if name == "_jitted":  # a copy before __init__ ran: no recursion through here
            raise AttributeError(name)
        return getattr(self._jitted, name)
