"""RopeScaling takes a factor of exactly 1 (no stretch) and refuses anything below."""

from __future__ import annotations

import pytest

from jaxkv.models.config import RopeScaling


def test_a_rope_scaling_factor_of_one_is_accepted_and_below_one_refused():
    assert RopeScaling(factor=1.0).factor == 1.0
    assert RopeScaling(factor=1).factor == 1
    with pytest.raises(ValueError, match="factor=0.999 must be >= 1"):
        RopeScaling(factor=0.999)
