"""write_kv's slot_mapping narrowing and argument forms, and its donated cache.

int32_slots turns a numpy slot_mapping of a 64-bit integer dtype into int32, every slot
outside int32's range -1 (dropped); anything else passes as given, to write_kv's own
checks. slot_mapping may come by position or keyword; the cache (only it) is donated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import int32_slots, write_kv

INT32_MAX = 2**31 - 1


def test_int32_slots_makes_only_slots_outside_int32_minus_one():
    for dtype in (np.int64, np.uint64):
        wide = np.array([0, 7, INT32_MAX, INT32_MAX + 1, 2**32 + 6], dtype)
        got = int32_slots(wide)
        assert got.dtype == np.int32 and got.tolist() == [0, 7, INT32_MAX, -1, -1]
    got = int32_slots(np.array([-1, -5, 3], np.int64))
    assert got.tolist() == [-1, -1, 3]


def test_int32_slots_passes_anything_else_as_given():
    narrow = np.array([-5, 3], np.int32)
    assert int32_slots(narrow) is narrow  # write_kv drops -5 itself
    for other in (np.array([1.0, 2.0]), np.array([2**40], np.float64), [1, 2], jnp.arange(2)):
        assert int32_slots(other) is other


def _cache_and_kv():
    return jnp.zeros((3, 4, 2, 8), jnp.float32), jnp.ones((2, 1, 8), jnp.float32)


@pytest.mark.parametrize("slots", [[5, 6], np.array([5.0, 6.0]), np.array([5.0, 6.0], np.float32)])
def test_a_slot_mapping_that_is_no_integer_array_is_refused_by_name(slots):
    # A float64 one was narrowed to int32 like an int64 one, and written.
    pages, k = _cache_and_kv()
    with pytest.raises(ValueError, match="slot_mapping must be an integer array"):
        write_kv(pages, k, k, slots)


def test_slot_mapping_by_keyword_is_narrowed_as_by_position():
    slots = np.array([5, 2**32 + 6], np.int64)  # the second, wrapped, would hit slot 6
    pages, k = _cache_and_kv()
    want = np.asarray(write_kv(pages, k, k, slots))
    pages, k = _cache_and_kv()
    np.testing.assert_array_equal(np.asarray(write_kv(pages, k, k, slot_mapping=slots)), want)
    assert want[1, 1].all() and not want[1, 2].any()


def test_a_scale_by_position_is_refused_not_dropped():
    pages, k = _cache_and_kv()
    with pytest.raises(TypeError):
        write_kv(pages, k, k, np.array([5, 6], np.int32), 0.5)


def test_write_kv_donates_the_cache_and_only_it():
    pages, k = _cache_and_kv()
    v = jnp.full_like(k, 2.0)
    slots = jnp.array([5, 6], jnp.int32)
    out = write_kv(pages, k, v, slots)
    assert pages.is_deleted()
    assert not (k.is_deleted() or v.is_deleted() or slots.is_deleted() or out.is_deleted())


def test_lowering_checks_the_caches_dtype_at_trace_time():
    # .lower skips the check on the arguments as given: the traced body names the dtype.
    spec = jax.ShapeDtypeStruct
    kv = spec((2, 1, 8), jnp.float32)
    with pytest.raises(ValueError, match="kv_pages.dtype=uint8 must be float32, bfloat16"):
        write_kv.lower(spec((3, 4, 2, 8), jnp.uint8), kv, kv, spec((2,), jnp.int32))
