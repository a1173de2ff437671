"""A shard index (model.safetensors.index.json) is refused by name unless its weight_map
maps tensor names to plain file names of shards in its own directory."""

from __future__ import annotations

import json

import pytest

from jaxkv.models import CheckpointError, load_hf_safetensors
from jaxkv.models.hf_checkpoint import write_safetensors
from tests.models.conftest import small_config
from tests.models.reference import random_hf_weights


@pytest.mark.parametrize(
    "index, error, match",
    [
        ({"weight_map": {"model.norm.weight": "gone.safetensors"}}, FileNotFoundError,
         r"names gone\.safetensors, which is not in"),
        ({"weight_map": {"model.norm.weight": "../m.safetensors"}}, CheckpointError,
         r"'\.\./m\.safetensors' is not a file name in"),
        ({"weights": {}}, CheckpointError, r"'weight_map' maps tensor names to file names"),
        ([1, 2], CheckpointError, r"'weight_map' maps tensor names to file names"),
        # One non-str value: it is the file name that is refused, not the index.
        ({"weight_map": {"model.norm.weight": 3}}, CheckpointError,
         r"index\.json: 3 is not a file name in"),
        ({"weight_map": {"model.norm.weight": None}}, CheckpointError,
         r"index\.json: None is not a file name in"),
        ({"weight_map": {"model.norm.weight": ["m.safetensors"]}}, CheckpointError,
         r"index\.json: .*'weight_map' maps tensor"),
        # A str and a number cannot be sorted together: the index as a whole is refused.
        ({"weight_map": {"model.norm.weight": "m.safetensors", "lm_head.weight": 3}},
         CheckpointError,
         r"index\.json: expected a JSON object whose 'weight_map' maps tensor names"),
        # Names of no file: the directory itself and its parent were looked up as files.
        ({"weight_map": {"model.norm.weight": ""}}, CheckpointError,
         r"index\.json: '' is not a file name in"),
        ({"weight_map": {"model.norm.weight": ".."}}, CheckpointError,
         r"index\.json: '\.\.' is not a file name in"),
    ],
)  # fmt: skip
def test_a_shard_index_naming_no_shard_of_its_directory_is_refused(tmp_path, index, error, match):
    cfg = small_config()
    (tmp_path / "ckpt").mkdir()
    write_safetensors(tmp_path / "m.safetensors", random_hf_weights(cfg))
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(error, match=match):
        load_hf_safetensors(tmp_path / "ckpt", cfg)
