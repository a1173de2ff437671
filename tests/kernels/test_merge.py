"""merge_attn_states: the LSE merge of two partial attention results."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas.merge import merge_attn_states

INF = float("inf")


def _states(rng, lse_values, dtype=jnp.float32):
    lse = jnp.asarray(np.asarray(lse_values, np.float32).reshape(-1, 1))
    out = jnp.asarray(rng.standard_normal((lse.shape[0], 1, 4)), dtype)
    return out, lse


def test_merge_equals_attention_over_the_union():
    # Two disjoint key sets with logits a = (0, 1) and b = (2,), values (1, 2) and (5,).
    # Over the union: weights e^0, e^1, e^2; out = (1 + 2e + 5e^2) / (1 + e + e^2).
    e = math.e
    lse_a, out_a = math.log(1 + e), (1 + 2 * e) / (1 + e)
    lse_b, out_b = 2.0, 5.0
    out, lse = merge_attn_states(
        jnp.full((1, 1, 1), out_a), jnp.full((1, 1), lse_a),
        jnp.full((1, 1, 1), out_b), jnp.full((1, 1), lse_b),
    )  # fmt: skip
    np.testing.assert_allclose(float(out[0, 0, 0]), (1 + 2 * e + 5 * e * e) / (1 + e + e * e), 1e-6)
    np.testing.assert_allclose(float(lse[0, 0]), math.log(1 + e + e * e), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_one_side_empty_passes_the_other_through_exactly(dtype):
    rng = np.random.default_rng(0)
    out_a, lse_a = _states(rng, [0.3, -7.0, 80.0], dtype)
    nan_out = jnp.full(out_a.shape, jnp.nan, dtype)  # an empty side's output is never read
    empty = jnp.full(lse_a.shape, -INF)
    out, lse = merge_attn_states(out_a, lse_a, nan_out, empty)
    assert out.dtype == dtype  # out keeps out_a's dtype
    assert np.array_equal(np.asarray(out), np.asarray(out_a))
    assert np.array_equal(np.asarray(lse), np.asarray(lse_a))
    out, lse = merge_attn_states(nan_out, empty, out_a, lse_a)
    assert np.array_equal(np.asarray(out), np.asarray(out_a))
    assert np.array_equal(np.asarray(lse), np.asarray(lse_a))


def test_a_float64_side_passes_through_exactly_under_x64():
    with jax.enable_x64(True):
        out_a = jnp.full((2, 1, 4), 1 / 3, jnp.float64)
        lse_a = jnp.zeros((2, 1), jnp.float64)
        empty = jnp.full((2, 1), -INF, jnp.float64)
        out, _ = merge_attn_states(out_a, lse_a, jnp.full_like(out_a, jnp.nan), empty)
        assert out.dtype == jnp.float64 and np.array_equal(np.asarray(out), np.asarray(out_a))


def test_both_empty_gives_zero_and_minus_inf():
    nan_out = jnp.full((2, 1, 4), jnp.nan)
    empty = jnp.full((2, 1), -INF)
    out, lse = merge_attn_states(nan_out, empty, nan_out, empty)
    assert np.all(np.asarray(out) == 0.0)
    assert np.all(np.isneginf(np.asarray(lse)))


def test_very_different_magnitudes_and_infinities_give_no_nan():
    rng = np.random.default_rng(1)
    values = [-1e30, -80.0, 0.0, 80.0, 1e30, INF, -INF]
    grid_a, grid_b = np.meshgrid(values, values)
    out_a, lse_a = _states(rng, grid_a.ravel())
    out_b, lse_b = _states(rng, grid_b.ravel())
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert not np.any(np.isnan(np.asarray(out)))
    assert not np.any(np.isnan(np.asarray(lse)))
    # A side with a finite lse has keys, however far below the other: never "empty".
    either_finite = np.isfinite(np.maximum(grid_a.ravel(), grid_b.ravel()))
    assert np.all(np.isfinite(np.asarray(lse)[either_finite, 0]))
    # A side 1e30 below the other contributes nothing: out equals the larger side.
    big = (grid_a.ravel() == 1e30) & (grid_b.ravel() == -1e30)
    np.testing.assert_array_equal(np.asarray(out)[big], np.asarray(out_a)[big])


def test_outputs_near_float32_max_blend_to_a_finite_value_between_them():
    # Partial outputs past half of float32's max (value rows that large): weighting both
    # and dividing last overflowed to inf, where the blend itself is finite.
    rng = np.random.default_rng(3)
    top = float(np.finfo(np.float32).max)
    values = np.array([[top, top], [top, 0.9 * top], [3e38, 2e38], [-top, -top]], np.float32)
    sides = np.repeat(values, 256, axis=0)[:, :, None, None]  # [n, side, 1 head, 1 dim]
    lse_a, lse_b = (rng.normal(size=(len(sides), 1)).astype(np.float32) * 3 for _ in "ab")
    out, _ = merge_attn_states(
        jnp.asarray(sides[:, 0]), jnp.asarray(lse_a), jnp.asarray(sides[:, 1]), jnp.asarray(lse_b)
    )
    got = np.asarray(out, np.float64)[:, 0, 0]
    a, b = sides[:, 0, 0, 0].astype(np.float64), sides[:, 1, 0, 0].astype(np.float64)
    m = np.maximum(lse_a, lse_b)[:, 0].astype(np.float64)
    wa, wb = np.exp(lse_a[:, 0] - m), np.exp(lse_b[:, 0] - m)
    assert np.isfinite(got).all()
    assert ((got >= np.minimum(a, b)) & (got <= np.maximum(a, b))).all()
    np.testing.assert_allclose(got, (wa * a + wb * b) / (wa + wb), rtol=1e-6)


def test_a_side_of_tiny_weight_still_adds_its_share_of_a_large_output():
    # lse 0 and -30: denom = 1 + e^-30 rounds to 1 in float32, so the light side's share
    # must come from its own weight (9.4e-14), not from 1 minus the heavy side's (0).
    lse_b = -30.0
    out, _ = merge_attn_states(
        jnp.zeros((1, 1, 1)), jnp.zeros((1, 1)),
        jnp.full((1, 1, 1), 1e30), jnp.full((1, 1), lse_b),
    )  # fmt: skip
    wb = math.exp(lse_b)
    np.testing.assert_allclose(float(out[0, 0, 0]), wb * 1e30 / (1 + wb), rtol=1e-6)


def test_merge_is_symmetric_and_float32():
    rng = np.random.default_rng(2)
    out_a, lse_a = _states(rng, rng.normal(size=16) * 10)
    out_b, lse_b = _states(rng, rng.normal(size=16) * 10)
    ab = merge_attn_states(out_a, lse_a, out_b, lse_b)
    ba = merge_attn_states(out_b, lse_b, out_a, lse_a)
    np.testing.assert_allclose(np.asarray(ab[0]), np.asarray(ba[0]), rtol=1e-6, atol=1e-7)
    assert ab[1].dtype == jnp.float32


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="out_a.shape"):
        merge_attn_states(
            jnp.zeros((2, 1, 4)), jnp.zeros((2, 1)), jnp.zeros((3, 1, 4)), jnp.zeros((3, 1))
        )


@pytest.mark.parametrize("bad", ["out_a", "lse_a", "out_b", "lse_b"])
def test_an_argument_that_is_no_array_is_refused_by_name(bad):
    # A list failed with AttributeError: 'list' object has no attribute 'shape'.
    args = {"out_a": jnp.zeros((2, 1, 4)), "lse_a": jnp.zeros((2, 1))}
    args.update(out_b=args["out_a"], lse_b=args["lse_a"])
    args[bad] = np.asarray(args[bad]).tolist()
    with pytest.raises(ValueError, match=f"{bad} must be a numpy or jax array, not list"):
        merge_attn_states(**args)


def test_dtype_mismatch_raises():
    # The result takes out_a's dtype: with out_a empty, a float32 out_b would come out
    # rounded to bfloat16, not passed through bit for bit as the merge promises.
    with pytest.raises(ValueError, match="out_a.dtype=.* must equal out_b.dtype"):
        merge_attn_states(
            jnp.zeros((2, 1, 4), jnp.bfloat16),
            jnp.zeros((2, 1)),
            jnp.zeros((2, 1, 4)),
            jnp.zeros((2, 1)),
        )


@pytest.mark.parametrize("bad", ["out", "lse_a", "lse_b"])
def test_outputs_and_lses_of_no_floating_dtype_are_refused(bad):
    # int32 outputs were merged and truncated, a complex lse lost its imaginary part.
    out, lse = jnp.zeros((2, 1, 4)), jnp.zeros((2, 1))
    args = {"out": out, "lse_a": lse, "lse_b": lse}
    args[bad] = args[bad].astype(jnp.int32 if bad == "out" else jnp.complex64)
    name = "out_a" if bad == "out" else bad
    with pytest.raises(ValueError, match=f"{name}.dtype=.* must be a floating dtype"):
        merge_attn_states(args["out"], args["lse_a"], args["out"], args["lse_b"])


def test_bfloat16_lse_merges_in_float32():
    # lse = log(e^0 + e^(-0.01)): in bfloat16 arithmetic it would round to a multiple of 2^-8.
    ones = jnp.ones((1, 1, 4))
    out, lse = merge_attn_states(
        ones, jnp.zeros((1, 1), jnp.bfloat16), ones, jnp.full((1, 1), -0.01, jnp.bfloat16)
    )
    assert lse.dtype == jnp.float32
    want = math.log(1 + math.exp(float(jnp.bfloat16(-0.01))))
    np.testing.assert_allclose(float(lse[0, 0]), want, rtol=1e-6)


def test_bfloat16_outputs_blend_in_float32_and_round_once():
    # Rounding each weighted side to bfloat16 before the sum errs by up to a whole
    # bfloat16 step; one rounding of the float32 blend stays within half a step.
    rng = np.random.default_rng(0)
    out_a, out_b = (rng.standard_normal((4096, 1, 1)).astype(ml_dtypes.bfloat16) for _ in "ab")
    lse_a, lse_b = (rng.normal(size=(4096, 1)).astype(np.float32) for _ in "ab")
    out, _ = merge_attn_states(*map(jnp.asarray, (out_a, lse_a, out_b, lse_b)))
    assert out.dtype == jnp.bfloat16
    m = np.maximum(lse_a, lse_b).astype(np.float64)
    wa, wb = np.exp(lse_a - m)[..., None], np.exp(lse_b - m)[..., None]
    exact = (wa * out_a.astype(np.float64) + wb * out_b.astype(np.float64)) / (wa + wb)
    step = np.spacing(np.abs(exact).astype(np.float32)) * 2.0**16  # a bfloat16 step
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert (np.abs(got - exact) / step).max() <= 0.51


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 1, 4), (2, 2), (2, 1, 4), (2, 1)),  # lse_a
        ((2, 1, 4), (2, 1), (2, 1, 4), (1, 1)),  # lse_b
        ((2, 4), (2, 4), (2, 4), (2, 4)),  # no head axis
    ],
    ids=["lse_a", "lse_b", "rank"],
)
def test_lse_shape_and_rank_mismatch_raise(shapes):
    with pytest.raises(ValueError, match="must be|must both be"):
        merge_attn_states(*(jnp.zeros(s) for s in shapes))


def test_lses_of_a_narrower_float_dtype_are_merged_in_float32():
    # The merge's math runs in float32 and its lse is float32, whatever the inputs' dtype.
    rng = np.random.default_rng(3)
    out_a, lse_a = _states(rng, [1.0, -2.5, 7.25])
    out_b, lse_b = _states(rng, [1.5, 3.0, -0.75])
    want_out, want_lse = merge_attn_states(out_a, lse_a, out_b, lse_b)  # exact in bfloat16
    out, lse = merge_attn_states(
        out_a, lse_a.astype(jnp.bfloat16), out_b, lse_b.astype(jnp.bfloat16)
    )
    assert lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))


def test_lses_of_another_shape_are_refused_naming_both_and_the_expected_shape():
    out = jnp.zeros((2, 3, 4), jnp.float32)
    want = "lse_a.shape=(2, 3) and lse_b.shape=(3, 2) must both be (2, 3)"
    with pytest.raises(ValueError, match="^" + re.escape(want) + "$"):
        merge_attn_states(out, jnp.zeros((2, 3)), out, jnp.zeros((3, 2)))
