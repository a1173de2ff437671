"""What save_checkpoint writes: config.json as LlamaConfig.to_json lays it out plus the
weights' digest, in a directory made with its parents where needed."""

from __future__ import annotations

import hashlib
import json

from jaxkv.models import load_checkpoint, save_checkpoint
from tests.models.conftest import random_model, small_config


def test_config_json_is_the_configs_json_with_the_digest_among_its_sorted_keys(tmp_path):
    cfg = small_config(eos_token_ids=(1, 2))
    save_checkpoint(random_model(cfg), tmp_path)
    digest = hashlib.sha256((tmp_path / "params.msgpack").read_bytes()).hexdigest()
    want = json.dumps({**cfg.to_dict(), "params_sha256": digest}, indent=2, sort_keys=True)
    text = (tmp_path / "config.json").read_text()
    assert text == want + "\n"
    lines = text.splitlines()
    assert lines[1] == '  "dtype": "float32",' and f'  "params_sha256": "{digest}",' in lines
    assert [line for line in lines if "params_sha256" not in line] == cfg.to_json().splitlines()


def test_a_directory_whose_parents_do_not_exist_is_made_with_them(tmp_path):
    path = tmp_path / "runs" / "a" / "ckpt"
    model = random_model(small_config())
    assert save_checkpoint(model, path) == path
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "params.msgpack"]
    assert load_checkpoint(str(path)).config == model.config
