"""benchmarks/reference_errors.py: the verdict the kernel benchmarks exit on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.reference_errors import LSE_TOLERANCE, OUT_TOLERANCE, errors_against_reference


def _pair(rows: int = 3):
    out = np.linspace(-2.0, 2.0, rows * 4, dtype=np.float32).reshape(rows, 2, 2)
    lse = np.linspace(-1.0, 3.0, rows * 2, dtype=np.float32).reshape(rows, 2)
    return out, lse


def test_identical_results_have_no_error():
    want = _pair()
    assert errors_against_reference(want, want) == {
        "max_abs_out_err": 0.0, "nan_outputs": 0, "max_abs_lse_err": 0.0, "ok": True,
    }  # fmt: skip


def test_the_output_tolerance_is_relative_to_one_plus_the_wanted_value():
    out, lse = _pair()
    out[0, 0, 0], out[1, 0, 0] = 0.0, 10.0
    # Within 2e-2 * (1 + |want|) of both: 0.015 off 0 and 0.2 off 10 pass.
    near = out.copy()
    near[0, 0, 0] += 0.015
    near[1, 0, 0] += 0.2
    got = errors_against_reference((near, lse), (out, lse))
    assert got["ok"] and math.isclose(got["max_abs_out_err"], 0.2, rel_tol=1e-5)
    for row, err in ((0, 0.025), (1, 0.23)):  # past it by a little, each alone
        far = out.copy()
        far[row, 0, 0] += err
        assert not errors_against_reference((far, lse), (out, lse))["ok"], row
    assert OUT_TOLERANCE == 2e-2


def test_an_lse_error_alone_fails_the_check():
    out, lse = _pair()
    bad = lse.copy()
    bad[2, 1] += 2 * LSE_TOLERANCE * (1 + abs(lse[2, 1]))
    got = errors_against_reference((out, bad), (out, lse))
    assert not got["ok"] and got["max_abs_out_err"] == 0.0
    assert math.isclose(got["max_abs_lse_err"], bad[2, 1] - lse[2, 1], rel_tol=1e-5)


def test_a_nan_output_is_an_infinite_error_never_skipped():
    out, lse = _pair()
    nan = out.copy()
    nan[1, 1, 0] = np.nan
    got = errors_against_reference((nan, lse), (out, lse))
    assert got["max_abs_out_err"] == math.inf and got["nan_outputs"] == 1 and not got["ok"]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # -inf - -inf, masked
def test_rows_without_keys_must_keep_an_lse_of_minus_infinity():
    out, lse = _pair()
    lse[0, :] = -np.inf
    assert errors_against_reference((out, lse), (out, lse))["ok"]
    for value in (0.0, np.inf, np.nan):
        got_lse = lse.copy()
        got_lse[0, 1] = value
        got = errors_against_reference((out, got_lse), (out, lse))
        assert not got["ok"], value
        assert got["max_abs_lse_err"] == 0.0  # the error figure covers rows with keys


def test_only_the_first_valid_rows_are_judged():
    out, lse = _pair(4)
    junk_out, junk_lse = out.copy(), lse.copy()
    junk_out[3], junk_lse[3] = np.nan, 1e6  # padding rows past the batch
    assert not errors_against_reference((junk_out, junk_lse), (out, lse))["ok"]
    got = errors_against_reference((junk_out, junk_lse), (out, lse), valid_rows=3)
    assert got == errors_against_reference((out[:3], lse[:3]), (out[:3], lse[:3]))
    assert got["ok"] and got["nan_outputs"] == 0


def test_the_lse_tolerance_is_5e_3_relative_to_one_plus_the_wanted_lse():
    """0.3 off a wanted lse of 100 passes (5e-3 * 101 = 0.505); 0.01 off 0 fails."""
    out, lse = _pair()
    lse[0, 0], lse[1, 0] = 100.0, 0.0
    near = lse.copy()
    near[0, 0] += 0.3
    assert errors_against_reference((out, near), (out, lse))["ok"]
    far = lse.copy()
    far[1, 0] += 0.01
    assert not errors_against_reference((out, far), (out, lse))["ok"]
    assert LSE_TOLERANCE == 5e-3


def test_the_output_tolerance_follows_the_wanted_value_not_the_kernels():
    """2.04 above a wanted 100 fails (2e-2 * 101 = 2.02) though 2.04 <= 2e-2 * (1 + 102.04)."""
    out, lse = _pair()
    out[0, 0, 0] = 100.0
    high = out.copy()
    high[0, 0, 0] += 2.04
    assert not errors_against_reference((high, lse), (out, lse))["ok"]


def test_every_nan_is_counted_and_an_lse_below_the_reference_is_a_positive_error():
    out, lse = _pair()
    nan = out.copy()
    nan[0, 0, 0] = nan[2, 1, 1] = np.nan
    low = lse.copy()
    low[1, 1] -= 0.5
    got = errors_against_reference((nan, low), (out, lse))
    assert got["nan_outputs"] == 2
    assert math.isclose(got["max_abs_lse_err"], 0.5, rel_tol=1e-5)


def test_valid_rows_judges_the_first_row_too():
    out, lse = _pair()
    bad = out.copy()
    bad[0, 0, 0] += 1.0
    assert not errors_against_reference((bad, lse), (out, lse), valid_rows=2)["ok"]
