"""A shard index whose weight_map values are not all file names is refused by name."""

from __future__ import annotations

import json

import pytest

from jaxkv.models import CheckpointError, load_hf_safetensors
from jaxkv.models.hf_checkpoint import write_safetensors
from tests.models.conftest import small_config
from tests.models.reference import random_hf_weights


@pytest.mark.parametrize(
    "weight_map, match",
    [
        # One non-str value: it is the file name that is refused, not the index.
        ({"model.norm.weight": 3}, r"index\.json: 3 is not a file name in"),
        ({"model.norm.weight": None}, r"index\.json: None is not a file name in"),
        ({"model.norm.weight": ["m.safetensors"]}, r"index\.json: .*'weight_map' maps tensor"),
        # A str and a number cannot be sorted together: the index as a whole is refused.
        ({"model.norm.weight": "m.safetensors", "lm_head.weight": 3},
         r"index\.json: expected a JSON object whose 'weight_map' maps tensor names"),
        # Names of no file: the directory itself and its parent were looked up as files.
        ({"model.norm.weight": ""}, r"index\.json: '' is not a file name in"),
        ({"model.norm.weight": ".."}, r"index\.json: '\.\.' is not a file name in"),
    ],
)  # fmt: skip
def test_a_weight_map_value_that_is_not_a_file_name_is_refused(tmp_path, weight_map, match):
    cfg = small_config()
    write_safetensors(tmp_path / "m.safetensors", random_hf_weights(cfg))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=match):
        load_hf_safetensors(tmp_path, cfg)
