"""Null values in a Hugging Face config.json that transformers' LlamaConfig refuses are
refused saying why, not read as the default (tests/models/test_hf_files.py reads the
nulls it takes)."""

from __future__ import annotations

import pytest

from jaxkv.models import LlamaConfig

REQUIRED = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)


@pytest.mark.parametrize("key", ["rms_norm_eps", "max_position_embeddings"])
def test_a_null_that_transformers_refuses_is_refused_saying_why(key):
    # transformers 5's LlamaConfig (a strict dataclass) refuses null for these float and
    # int fields; 4.x kept None and failed at the first forward (eps) or read no length
    # limit (vLLM assumed 2048). A null eps used to load as 1e-6.
    with pytest.raises(
        ValueError,
        match=f"^Hugging Face config: {key}=null must be a number: transformers' LlamaConfig "
        r"refuses null \(.*\); leave the key out for its default (1e-06|2048)$",
    ):
        LlamaConfig.from_hf_dict({**REQUIRED, key: None})
