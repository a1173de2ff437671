"""RoPE keys of Hugging Face configs that transformers reads one way or another, refused
rather than read as some other RoPE (tests/models/test_hf_files.py reads the rest)."""

from __future__ import annotations

import pytest

from jaxkv.models import LlamaConfig, RopeScaling

REQUIRED = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)


@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
def test_a_rope_dict_whose_type_and_rope_type_disagree_is_refused(where):
    """transformers 4.x reads "type" over "rope_type", 5.x "rope_type" over "type": this
    dict was read as llama3 RoPE, which 4.x runs as linear. Equal ones are read."""
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    both = {"rope_type": "llama3", "type": "linear", **scaling}
    with pytest.raises(ValueError, match="rope_type='llama3' and type='linear'"):
        LlamaConfig.from_hf_dict({**REQUIRED, where: both})
    same = {**both, "type": "llama3"}
    assert LlamaConfig.from_hf_dict({**REQUIRED, where: same}).rope_scaling == RopeScaling(
        **scaling
    )


@pytest.mark.parametrize("where", ["config", "rope_scaling", "rope_parameters"])
def test_a_partial_rotary_factor_is_refused_not_ignored(where):
    """transformers reads partial_rotary_factor at the top level or in the RoPE dict; this
    Llama rotated all of head_dim whatever it said. 1 (or null) is whole-head RoPE."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip

    def hf(factor):
        if where == "config":
            return {**REQUIRED, "partial_rotary_factor": factor}
        return {**REQUIRED, where: {**scaling, "partial_rotary_factor": factor}}

    for factor in (0.5, True, "1"):
        with pytest.raises(ValueError, match=f"{where}: partial_rotary_factor={factor!r} is not"):
            LlamaConfig.from_hf_dict(hf(factor))
    for factor in (1.0, 1, None):
        assert LlamaConfig.from_hf_dict(hf(factor)).head_dim == 8


@pytest.mark.parametrize("where", [None, "config", "rope_parameters"])
def test_a_rope_theta_inside_rope_scaling_that_disagrees_is_refused(where):
    """transformers 5 takes rope_scaling as its rope_parameters, theta included, over the
    top-level key; 4.x ignores a theta there. It was ignored here: a Llama 3 config whose
    theta sits only in rope_scaling loaded with theta 10000, not 500000. Equal ones read."""
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)  # fmt: skip
    top = {"config": {"rope_theta": 1e6}, "rope_parameters": {"rope_parameters": scaling}}
    hf = {**REQUIRED, **top.get(where, {}), "rope_scaling": {**scaling, "rope_theta": 5e5}}
    with pytest.raises(ValueError, match=r"^Hugging Face rope_scaling: rope_theta=500000.0 dis"):
        LlamaConfig.from_hf_dict(hf)
    agreeing = {**REQUIRED, "rope_theta": 5e5, "rope_scaling": {**scaling, "rope_theta": 5e5}}
    assert LlamaConfig.from_hf_dict(agreeing).rope_theta == 5e5
