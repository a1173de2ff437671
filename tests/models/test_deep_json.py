"""JSON nested past Python's recursion limit, in each file a checkpoint load reads.

json.loads raises RecursionError for such a document; the loaders let it through bare,
naming no file. Each is refused as a CheckpointError naming the file instead.
"""

from __future__ import annotations

import json
import struct

import pytest
from flax import nnx

from jaxkv.models import (
    CheckpointError,
    Llama,
    load_checkpoint,
    load_hf_safetensors,
    save_checkpoint,
)
from jaxkv.models.hf_checkpoint import read_safetensors, write_safetensors
from tests.models.conftest import hf_config_dict, small_config
from tests.models.reference import random_hf_weights

DEEP = "[" * 100_000 + "]" * 100_000
CONFIG = small_config()


def _hf_dir(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", random_hf_weights(CONFIG))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(CONFIG)))
    return tmp_path


def test_a_safetensors_header_nested_too_deeply_is_refused_naming_the_file(tmp_path):
    file = tmp_path / "deep.safetensors"
    header = DEEP.encode()
    file.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="deep.safetensors: not a safetensors file"):
        read_safetensors(file)


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("config.json", DEEP, "config.json: JSON nested too deeply"),
        ("config.json", '{"vocab_size": ' + DEEP + "}", "config.json: JSON nested too deeply"),
        ("generation_config.json", DEEP, "generation_config.json: JSON nested too deeply"),
    ],
)
def test_hf_json_files_nested_too_deeply_are_refused_naming_the_file(tmp_path, name, text, match):
    directory = _hf_dir(tmp_path)
    (directory / name).write_text(text)
    with pytest.raises(CheckpointError, match=match):
        load_hf_safetensors(directory)


def test_a_shard_index_nested_too_deeply_is_refused_naming_it(tmp_path):
    directory = _hf_dir(tmp_path)
    (directory / "model.safetensors").rename(directory / "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: expected a JSON"):
        load_hf_safetensors(directory)


def test_a_jaxkv_config_nested_too_deeply_is_refused_naming_the_file(tmp_path):
    save_checkpoint(Llama(CONFIG, rngs=nnx.Rngs(0)), tmp_path)
    (tmp_path / "config.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match="config.json: not a valid LlamaConfig"):
        load_checkpoint(tmp_path)
