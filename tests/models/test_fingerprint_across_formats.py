"""One set of weights loaded from either format names one model to an engine's KV store;
one element changed names another."""

from __future__ import annotations

import numpy as np

from jaxkv.engine import Engine
from jaxkv.models import load_checkpoint, load_hf_safetensors, save_checkpoint
from jaxkv.models.hf_checkpoint import to_hf_tensors, write_safetensors
from tests.engine._util import engine_config
from tests.models.conftest import random_model, small_config


def _fingerprint(model) -> bytes:
    with Engine(model, None, engine_config()) as engine:
        return engine.copier.model_fingerprint


def test_jaxkv_and_safetensors_loads_of_one_model_share_a_fingerprint(tmp_path):
    config = small_config(tie_word_embeddings=False)
    model = random_model(config)
    save_checkpoint(model, tmp_path / "jaxkv")
    tensors = to_hf_tensors(model)
    write_safetensors(tmp_path / "a.safetensors", tensors)
    jaxkv_fp = _fingerprint(load_checkpoint(tmp_path / "jaxkv"))
    assert _fingerprint(load_hf_safetensors(tmp_path / "a.safetensors", config)) == jaxkv_fp

    changed = np.array(tensors["model.layers.0.mlp.down_proj.weight"])
    changed[1, 2] = np.nextafter(changed[1, 2], np.inf)  # one element, one ulp
    write_safetensors(
        tmp_path / "b.safetensors", {**tensors, "model.layers.0.mlp.down_proj.weight": changed}
    )
    assert _fingerprint(load_hf_safetensors(tmp_path / "b.safetensors", config)) != jaxkv_fp
