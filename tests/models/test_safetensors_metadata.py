"""The safetensors header's "__metadata__" entry: written as the reference writer writes
it for torch-saved files, read (and checked) when present, and optional when reading.

transformers before 4.48.2 reads metadata["format"] and refuses a file without it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from jaxkv.models import CheckpointError, safetensors_file
from jaxkv.models.hf_checkpoint import read_safetensors, write_safetensors

TENSORS = {"b": np.arange(3, dtype=np.float32), "a": np.ones((2, 2), np.float16)}


def _header(path) -> dict:
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])


def test_written_files_carry_the_format_metadata_transformers_reads(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, TENSORS)
    assert _header(path)["__metadata__"] == {"format": "pt"}
    with safe_open(str(path), framework="numpy") as f:  # the reference reader
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == ["a", "b"]
    got = read_safetensors(path)
    assert sorted(got) == ["a", "b"]
    for name, value in TENSORS.items():
        np.testing.assert_array_equal(got[name], value)


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"format": "np", "x": "y"}])
def test_files_with_or_without_metadata_are_read(tmp_path, metadata):
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(TENSORS, str(path), metadata=metadata)
    assert ("__metadata__" in _header(path)) == (metadata is not None)
    got = read_safetensors(path)
    assert sorted(got) == ["a", "b"]
    np.testing.assert_array_equal(got["b"], TENSORS["b"])


@pytest.mark.parametrize(
    "metadata", [{"format": 1}, ["format", "pt"], "pt", {"format": None}, {"format": ["pt"]}]
)
def test_metadata_that_is_not_a_map_of_str_to_str_is_refused_naming_it(tmp_path, metadata):
    # The format's reference reader refuses such a header; it was skipped here unread.
    header = {
        "__metadata__": metadata,
        "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }
    blob = json.dumps(header).encode()
    path = tmp_path / "w.safetensors"
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(8))
    with pytest.raises(CheckpointError, match=r"w\.safetensors: __metadata__=.* must be a "
                       "map of str to str"):  # fmt: skip
        read_safetensors(path)


def test_a_zero_dimensional_tensor_keeps_its_shape_through_a_round_trip(tmp_path):
    path = tmp_path / "scalar.safetensors"
    write_safetensors(path, {"s": np.float32(2.5), "v": np.ones(3, np.float32)})
    read = read_safetensors(path)
    assert read["s"].shape == () and read["s"] == np.float32(2.5)
    assert safetensors.numpy.load_file(path)["s"].shape == ()


@pytest.mark.parametrize("others", [{}, {"x": np.ones(2, np.float32)}])
def test_tensors_are_read_only_also_from_a_file_without_data_bytes(tmp_path, others):
    path = tmp_path / "empty.safetensors"
    write_safetensors(path, {"e": np.zeros((0, 3), np.float32), **others})
    assert not any(a.flags.writeable for a in read_safetensors(path).values())


def test_a_write_stopped_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    # The file was written in place: a write stopped after its header left a cut file,
    # and the weights that were there were lost.
    path = tmp_path / "w.safetensors"
    write_safetensors(path, TENSORS)
    before = path.read_bytes()

    class CutFile:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            self.file.write(data)
            raise KeyboardInterrupt

    monkeypatch.setattr(
        safetensors_file, "open", lambda p, mode: CutFile(open(p, mode)), raising=False
    )
    with pytest.raises(KeyboardInterrupt):
        write_safetensors(path, {"c": np.zeros(4, np.float32)})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
