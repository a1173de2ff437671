"""SamplingParams' values: each field's default (a request that sets nothing gets one
greedy sample of 16 tokens, every filter, penalty and extra output off, as documented:
vLLM's defaults but the temperature), vLLM's -1 for no top-k cut stored as 0, and the
ends of the seed's and n's ranges, past which a value is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import SamplingParams


def test_every_field_defaults_to_its_documented_value():
    assert dataclasses.asdict(SamplingParams()) == {
        "max_tokens": 16,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "seed": None,
        "stop_token_ids": (),
        "ignore_eos": False,
        "min_tokens": 0,
        "logprobs": None,
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "prompt_logprobs": None,
        "stop": (),
        "include_stop_str_in_output": False,
        "stream_text": False,
        "skip_special_tokens": True,
        "min_p": 0.0,
    }


def test_top_k_minus_one_is_stored_as_zero():
    """-1 (vLLM's older "no top-k cut") and 0 are the same params."""
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)


def test_a_seed_just_past_either_end_of_its_range_is_refused():
    """Seeds in [-2**63, 2**64) are taken (64 bits, signed or not); one more either way
    would be cut to 64 bits by the sampler, drawing another seed's tokens."""
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    for seed in (2**64, -(2**63) - 1, 2**65, -(2**64)):
        with pytest.raises(ValueError, match=r"^seed=.* must be None or an int in"):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("n", [0, -1, 1.5, True, None, "2"])
def test_n_below_one_or_no_int_is_refused_by_name(n):
    """n = 0 would queue no sample at all; a float or a bool would pass for a count."""
    with pytest.raises(ValueError, match=rf"^n={n!r} must be an int >= 1"):
        SamplingParams(n=n)


def test_n_takes_numpy_ints_as_python_ints():
    assert SamplingParams(n=np.int64(3)).n == 3
    assert type(SamplingParams(n=np.uint8(2)).n) is int
