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


def test_a_null_rope_theta_is_refused_unless_rope_parameters_gives_one():
    # transformers computes RoPE of base None (1 / None ** ...) and fails building the
    # model, in 4.x from the top-level key and in 5.x from rope_parameters too; a null
    # was read here as 10000. transformers 5 takes the theta of rope_parameters over a
    # null beside it, and so does this reading.
    match = r"rope_theta=null must be a number: transformers builds no model of it; leave"
    with pytest.raises(ValueError, match="^Hugging Face config: " + match):
        LlamaConfig.from_hf_dict({**REQUIRED, "rope_theta": None})
    for params in ({"rope_type": "default", "rope_theta": None}, {"rope_theta": None}):
        with pytest.raises(ValueError, match="^Hugging Face rope_parameters: " + match):
            LlamaConfig.from_hf_dict({**REQUIRED, "rope_parameters": params})
    given = {"rope_type": "default", "rope_theta": 5e5}
    cfg = LlamaConfig.from_hf_dict({**REQUIRED, "rope_theta": None, "rope_parameters": given})
    assert cfg.rope_theta == 5e5
