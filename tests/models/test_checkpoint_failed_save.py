"""A save_checkpoint that fails while writing leaves no temporary files behind, re-raises
the error, and leaves the checkpoint already in the directory loadable and unchanged."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from jaxkv.models import load_checkpoint, save_checkpoint
from jaxkv.models.checkpoint import flat_params
from tests.models.conftest import random_model, small_config


def test_a_save_failing_at_the_weights_file_leaves_no_temporary_files(tmp_path, monkeypatch):
    old = random_model(small_config())
    save_checkpoint(old, tmp_path)
    before = sorted(os.listdir(tmp_path))
    real_write = pathlib.Path.write_bytes

    def write_bytes(self, data):
        if self.name.startswith("params"):
            raise OSError("disk full")
        return real_write(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(random_model(small_config(), seed=1), tmp_path)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == before
    loaded = flat_params(load_checkpoint(tmp_path))
    for name, value in flat_params(old).items():
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(value), err_msg=name)
