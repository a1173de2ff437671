"""hf_to_jaxkv_name maps only Hugging Face's own spelling of a Llama tensor name."""

from __future__ import annotations

import pytest

from jaxkv.models import CheckpointError
from jaxkv.models.hf_checkpoint import hf_to_jaxkv_name


def test_a_layer_number_in_other_digits_is_not_a_llama_parameter():
    # An Arabic-Indic 3: "\\d" matched it, and the name mapped to "layers.\u0663...".
    with pytest.raises(CheckpointError, match="is not a Hugging Face Llama parameter"):
        hf_to_jaxkv_name("model.layers.\u0663.mlp.up_proj.weight")


@pytest.mark.parametrize(
    "hf_name, expected",
    [
        ("model.embed_tokens.weight", ("embed_tokens.embedding", False)),
        ("model.norm.weight", ("norm.weight", False)),
        ("lm_head.weight", ("lm_head.kernel", True)),
        ("model.layers.0.self_attn.q_proj.weight", ("layers.0.self_attn.q_proj.kernel", True)),
        ("model.layers.12.mlp.down_proj.weight", ("layers.12.mlp.down_proj.kernel", True)),
        ("model.layers.3.input_layernorm.weight", ("layers.3.input_layernorm.weight", False)),
        (
            "model.layers.1.post_attention_layernorm.weight",
            ("layers.1.post_attention_layernorm.weight", False),
        ),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
    ],
)
def test_each_kind_of_name_maps_to_its_jaxkv_name_and_transpose_flag(hf_name, expected):
    """Only linear weights ([out, in] there) need a transpose; embeddings and norms do not,
    and a stored rotary inv_freq buffer maps to None."""
    assert hf_to_jaxkv_name(hf_name) == expected
