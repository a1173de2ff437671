"""read_safetensors at the edges of a file's layout: the header's length, a tensor's
byte range and shape, and a dtype name the format has but this reader lacks.

Each bad file is refused as a CheckpointError naming what is wrong, not read as other
tensors nor failing with a bare KeyError or numpy error; the smallest good file is read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxkv.models import CheckpointError
from jaxkv.models.hf_checkpoint import read_safetensors, write_safetensors


def _raw(path, header: dict, data: bytes = b"", header_len: int | None = None) -> None:
    blob = json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(n.to_bytes(8, "little") + blob + data)


def test_a_file_of_one_data_byte_is_read(tmp_path):
    """One byte of data is memory-mapped like any other; it was nearly taken as none,
    which refuses the tensor as lying past the end of the data."""
    path = tmp_path / "one.safetensors"
    write_safetensors(path, {"b": np.uint8(7)})
    got = read_safetensors(path)
    assert got["b"].shape == () and got["b"] == 7


def test_a_header_length_one_byte_past_the_file_is_refused_as_such(tmp_path):
    """A header that would end one byte after the file is named as such, not read short
    and refused later as JSON that does not parse."""
    path = tmp_path / "short.safetensors"
    header = {"w": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}
    _raw(path, header, header_len=len(json.dumps(header)) + 1)
    with pytest.raises(CheckpointError, match="short.safetensors: not a safetensors file "
                       r"\(header of \d+ bytes past the end of the file\)"):  # fmt: skip
        read_safetensors(path)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "U16", "C64"])
def test_a_dtype_name_this_reader_lacks_is_refused_naming_the_tensor(tmp_path, dtype):
    """The format has dtypes (fp8, unsigned 16-bit, ...) with no numpy name here: they
    are refused as unsupported, not looked up into a bare KeyError."""
    path = tmp_path / "w.safetensors"
    _raw(path, {"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(CheckpointError, match=f"tensor 'w' in .*: dtype {dtype} unsupported"):
        read_safetensors(path)


def test_a_negative_begin_offset_is_refused_naming_the_range(tmp_path):
    """Byte ranges start at 0 or later: [-1, 3) holds 4 bytes, but a slice from -1 is not
    those bytes, so the range is refused whatever its length."""
    path = tmp_path / "w.safetensors"
    _raw(path, {"w": {"dtype": "F32", "shape": [1], "data_offsets": [-1, 3]}}, bytes(4))
    with pytest.raises(CheckpointError, match=r"tensor 'w' in .*: bytes \[-1, 3\) of 4"):
        read_safetensors(path)


@pytest.mark.parametrize("shape", [[-1], [-1, -1]])
def test_a_negative_dimension_is_a_bad_header_entry(tmp_path, shape):
    """A dimension of -1 (numpy's "infer it") is refused as a bad header entry, before its
    negative or positive element count reaches the byte range check or reshape."""
    path = tmp_path / "w.safetensors"
    _raw(path, {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}, bytes(4))
    with pytest.raises(CheckpointError, match="tensor 'w' in .*: bad header entry"):
        read_safetensors(path)
