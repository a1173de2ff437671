"""hf_to_jaxkv_name maps only Hugging Face's own spelling of a Llama tensor name."""

from __future__ import annotations

import pytest

from jaxkv.models import CheckpointError
from jaxkv.models.hf_checkpoint import hf_to_jaxkv_name


def test_a_layer_number_in_other_digits_is_not_a_llama_parameter():
    # An Arabic-Indic 3: "\\d" matched it, and the name mapped to "layers.\u0663...".
    with pytest.raises(CheckpointError, match="is not a Hugging Face Llama parameter"):
        hf_to_jaxkv_name("model.layers.\u0663.mlp.up_proj.weight")
