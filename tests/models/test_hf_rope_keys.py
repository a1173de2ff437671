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
