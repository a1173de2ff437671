"""The edges of what a config accepts: RopeScaling takes a factor of exactly 1 (no stretch)
and refuses anything below, and an original context length only within int32 positions,
as LlamaConfig its max_position_embeddings; sizes and lengths of 1, an EOS of id 0, and
the least rope_theta whose angles stay finite are accepted, just past them refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxkv.models.config import LlamaConfig, RopeScaling
from jaxkv.models.llama import rope_inv_freq
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


def test_the_frequency_band_needs_a_positive_low_factor_below_the_high_one():
    # Hugging Face divides by high - low and by low: both must be nonzero.
    for low, high in ((0.0, 4.0), (4.0, 4.0), (-1.0, 4.0)):
        with pytest.raises(ValueError, match=r"need 0 < self.low_freq_factor="):
            RopeScaling(low_freq_factor=low, high_freq_factor=high)
    assert RopeScaling(low_freq_factor=3.999, high_freq_factor=4.0).low_freq_factor == 3.999


def test_the_least_lengths_and_sizes_are_accepted():
    assert RopeScaling(original_max_position_embeddings=1).original_max_position_embeddings == 1
    assert small_config(max_position_embeddings=1).max_position_embeddings == 1
    one = LlamaConfig(
        vocab_size=1, hidden_size=2, intermediate_size=1, num_layers=1, num_heads=1, num_kv_heads=1
    )
    assert (one.head_dim, one.q_size, one.kv_size) == (2, 2, 2)
    assert small_config(eos_token_ids=0).eos_token_ids == (0,)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_heads=0, head_dim=8), r"self.num_heads=0 and self.num_kv_heads=2 must be"),
        (dict(num_heads=-4, head_dim=8), r"self.num_heads=-4 and"),
        (dict(num_kv_heads=0), r"self.num_kv_heads=0 must be positive"),
        (dict(rope_scaling=[8.0]), r"rope_scaling=\[8.0\] must be a RopeScaling or None"),
        (dict(rope_scaling="llama3"), r"rope_scaling='llama3' must be a RopeScaling or None"),
        (dict(tie_word_embeddings=1), r"tie_word_embeddings=1 must be a bool"),
        (dict(tie_word_embeddings="false"), r"tie_word_embeddings='false' must be a bool"),
    ],
)
def test_head_counts_rope_scaling_and_tying_of_the_wrong_kind_are_refused(overrides, match):
    with pytest.raises(ValueError, match=match):
        small_config(**overrides)


@pytest.mark.parametrize("length, least", [(2048, 1.0940518329541762e-47), (2, 4.2093e-52)])
def test_the_least_rope_theta_is_the_one_the_refusal_states(length, least):
    # head_dim 8: the largest inverse frequency is theta ** -0.75, the last position
    # length - 1, and their product must stay below float32's largest finite value.
    exact = math.exp(-(math.log(float(np.finfo(np.float32).max)) - math.log(length - 1)) / 0.75)
    assert exact == pytest.approx(least, rel=1e-4)
    cfg = small_config(max_position_embeddings=length, rope_theta=exact * (1 + 1e-9))
    angles = np.arange(length, dtype=np.float32)[:, None] * rope_inv_freq(cfg)
    assert np.isfinite(angles).all()
    with pytest.raises(
        ValueError, match=f"below max_position_embeddings={length} .* >= {exact:.3g}$"
    ):
        small_config(max_position_embeddings=length, rope_theta=exact * (1 - 1e-9))
    # One position: the inverse frequency itself must be finite.
    if length == 2:
        assert small_config(max_position_embeddings=1, rope_theta=exact * (1 + 1e-9))
        with pytest.raises(ValueError, match="below max_position_embeddings=1 "):
            small_config(max_position_embeddings=1, rope_theta=exact * (1 - 1e-9))
