"""A number of config.json given as a JSON string ("1e-5") is refused by its key, as
transformers builds no working model of it; the same numbers as JSON numbers load."""

from __future__ import annotations

import pytest

from jaxkv.models import LlamaConfig
from tests.models.test_hf_files import REQUIRED

_LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)  # fmt: skip


@pytest.mark.parametrize(
    "given, match",
    [
        # The float keys were read through float(), which takes a str: these loaded.
        (dict(rms_norm_eps="1e-5"), "^Hugging Face config: rms_norm_eps='1e-5' must be a number$"),
        (dict(rope_theta="500000"), "^Hugging Face config: rope_theta='500000' must be a number$"),
        (dict(rope_theta=" 1e4 "), "^Hugging Face config: rope_theta=' 1e4 ' must be a number$"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": "10000"}),
         "^Hugging Face rope_parameters: rope_theta='10000' must be a number$"),
        (dict(rope_scaling={**_LLAMA3, "factor": "8"}),
         "^Hugging Face rope_scaling: factor='8' must be a number$"),
        (dict(rope_scaling={**_LLAMA3, "high_freq_factor": "4.0"}),
         "^Hugging Face rope_scaling: high_freq_factor='4.0' must be a number$"),
        (dict(rope_scaling={**_LLAMA3, "rope_theta": "10000"}),
         "^Hugging Face rope_scaling: rope_theta='10000' must be a number$"),
        (dict(rope_scaling={**_LLAMA3, "original_max_position_embeddings": "8192"}),
         "^Hugging Face rope_scaling: original_max_position_embeddings='8192' must be an integer$"),
        # The int keys were refused already, by LlamaConfig; a bool too.
        (dict(hidden_size="64"), "^Hugging Face config: hidden_size='64' must be an int$"),
        (dict(max_position_embeddings="2048"), "max_position_embeddings='2048' must be an int$"),
        (dict(num_hidden_layers=True), "num_hidden_layers=True must be an int "),
        (dict(rope_scaling={**_LLAMA3, "original_max_position_embeddings": True}),
         "original_max_position_embeddings=True must be an integer$"),
    ],
)  # fmt: skip
def test_a_number_given_as_a_string_is_refused_by_its_key(given, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf_dict({**REQUIRED, **given})


def test_the_same_numbers_as_json_numbers_load():
    config = LlamaConfig.from_hf_dict(
        {**REQUIRED, "rms_norm_eps": 1e-5, "rope_theta": 500000,
         "rope_scaling": {**_LLAMA3, "factor": 8, "original_max_position_embeddings": 8192.0}}
    )  # fmt: skip
    assert (config.rms_norm_eps, config.rope_theta) == (1e-5, 500000.0)
    assert (config.rope_scaling.factor, config.rope_scaling.original_max_position_embeddings) == (
        8.0,
        8192,
    )
