"""RopeScaling takes a factor of exactly 1 (no stretch) and refuses anything below, and an
original context length only within int32 positions, as LlamaConfig its
max_position_embeddings."""

from __future__ import annotations

import pytest

from jaxkv.models.config import RopeScaling
from tests.models.conftest import small_config


def test_a_rope_scaling_factor_of_one_is_accepted_and_below_one_refused():
    assert RopeScaling(factor=1.0).factor == 1.0
    assert RopeScaling(factor=1).factor == 1
    with pytest.raises(ValueError, match="factor=0.999 must be >= 1"):
        RopeScaling(factor=0.999)


@pytest.mark.parametrize("length", [0, 2**31, 10**400])
def test_an_original_context_length_outside_int32_positions_is_refused(length):
    # 10**400 was accepted, then rope_inv_freq raised OverflowError at the first trace.
    with pytest.raises(ValueError, match=r"original_max_position_embeddings=.* must be an int in"):
        RopeScaling(original_max_position_embeddings=length)
    assert RopeScaling(original_max_position_embeddings=2**31 - 1).original_max_position_embeddings


@pytest.mark.parametrize("length", [0, 2**31, 10**400])
def test_a_context_length_outside_int32_positions_is_refused(length):
    # 10**400 raised OverflowError from the RoPE bound's math.exp (and with head_dim 2
    # would have divided by zero there); 2**31 positions do not fit the int32 ones.
    with pytest.raises(
        ValueError, match=r"max_position_embeddings=\d+ must be in \[1, 2\*\*31 - 1\]"
    ):
        small_config(max_position_embeddings=length)
    assert small_config(max_position_embeddings=2**31 - 1).max_position_embeddings == 2**31 - 1
