"""config.json records the SHA-256 of params.msgpack: a torn or damaged pair is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.models import CheckpointError, load_checkpoint, make_dense_forward, save_checkpoint
from tests.models.conftest import drop_weights_digest, random_model, small_config

TORN = "params.msgpack: its SHA-256 is not the params_sha256 that config.json records"


def _logits(model) -> np.ndarray:
    return np.asarray(make_dense_forward(model)(jnp.arange(5)[None]))[0]


def test_config_json_records_the_sha256_of_the_weights_file(tmp_path):
    save_checkpoint(random_model(small_config()), tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    weights = (tmp_path / "params.msgpack").read_bytes()
    assert fields["params_sha256"] == hashlib.sha256(weights).hexdigest()


def test_weights_of_another_save_beside_the_config_are_refused(tmp_path):
    # A crash between save_checkpoint's two renames leaves the new weights beside the old
    # config. With equal shapes the pair used to load without complaint.
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    save_checkpoint(random_model(small_config(), seed=1), old_dir)
    save_checkpoint(random_model(small_config(rope_theta=500.0), seed=2), new_dir)
    (old_dir / "params.msgpack").write_bytes((new_dir / "params.msgpack").read_bytes())
    with pytest.raises(CheckpointError, match=TORN):
        load_checkpoint(old_dir)
    drop_weights_digest(old_dir)  # the check the digest made: without it, the pair loads
    assert load_checkpoint(old_dir).config.rope_theta == 10000.0


def test_a_save_cut_between_its_renames_is_refused_even_over_a_config_without_digest(
    tmp_path, monkeypatch
):
    # The new config.json lands first and names the new weights' digest, so the old
    # weights beside it are refused. Renaming the weights first left new weights beside
    # an old config; one without a digest (written by hand) loaded that pair unchecked.
    save_checkpoint(random_model(small_config(), seed=1), tmp_path)
    drop_weights_digest(tmp_path)
    renames = []
    real_replace = Path.replace

    def replace_then_crash(self, target):
        if renames:
            raise KeyboardInterrupt  # the process dies after the first rename
        renames.append(target)
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace_then_crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(random_model(small_config(rope_theta=500.0), seed=2), tmp_path)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=TORN):
        load_checkpoint(tmp_path)


def test_a_damaged_weights_file_is_refused_by_its_digest(tmp_path):
    save_checkpoint(random_model(small_config()), tmp_path)
    data = bytearray((tmp_path / "params.msgpack").read_bytes())
    data[-3] ^= 1  # one bit of a weight: still valid msgpack of the right shapes
    (tmp_path / "params.msgpack").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=TORN):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("digest", [7, ["ab"], None])
def test_a_digest_that_is_not_a_str_is_refused_or_absent(tmp_path, digest):
    model = random_model(small_config())
    save_checkpoint(model, tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**fields, "params_sha256": digest}))
    if digest is None:  # null: as absent, nothing to check
        np.testing.assert_array_equal(_logits(load_checkpoint(tmp_path)), _logits(model))
        return
    with pytest.raises(CheckpointError, match="not a valid LlamaConfig.*params_sha256"):
        load_checkpoint(tmp_path)
