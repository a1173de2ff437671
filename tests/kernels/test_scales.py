"""kernels_pallas.scales at its bounds: the float32 normal range, ends included."""

from __future__ import annotations

import numpy as np

from kernels_pallas.scales import check_folded_scales, is_positive_finite

F32 = np.finfo(np.float32)


def test_is_positive_finite_answers_a_bool_and_takes_the_normal_float32_range():
    for good in (float(F32.tiny), 1.0, 3, float(F32.max), np.float32(0.5)):
        assert is_positive_finite(good) is True, good
    bad = (True, None, "1", -1.0, 0, float("nan"), float("inf"), 1e39, 1e-40, 10**400)
    for value in bad:
        assert is_positive_finite(value) is False, value


def test_folded_factors_at_either_end_of_the_normal_range_are_taken():
    check_folded_scales(float(F32.tiny), None, None)  # sm_scale itself is a folded factor
    check_folded_scales(float(F32.max), 1.0, None)  # sm_scale / soft_cap = the float32 max
