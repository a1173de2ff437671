"""The safetensors file format, read and written with numpy alone (bfloat16 too, no torch).

A file is an 8-byte little-endian header length, a JSON header mapping each tensor's name
to its dtype, shape and byte range (and an optional "__metadata__" map of str to str),
then the tensors' bytes. Hugging Face checkpoints are such files: see
`jaxkv.models.hf_checkpoint`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxkv.models.checkpoint import CheckpointError, checked_path
from jaxkv.whole_file import write_whole

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file, as read-only arrays memory-mapped from disk.

    Raises CheckpointError naming the file (and tensor) if the header is unreadable, a
    tensor's byte range does not hold its shape and dtype within the file, or the ranges,
    in order, do not cover the data exactly (an overlap, a gap or trailing bytes: the
    format's reference reader refuses them, and an overlap would give two tensors one
    set of bytes), or a "__metadata__" entry (optional) is not a map of str to str.
    ValueError unless `path` is a str or os.PathLike.
    """
    checked_path(path)  # the Path aside: messages name `path` as given
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        try:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                raise ValueError(f"header of {header_len} bytes past the end of the file")
            header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        # RecursionError: arrays nested past Python's recursion limit, read by no reader.
        except (struct.error, ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: not a safetensors file ({e})") from e
    data_len = size - 8 - header_len
    if data_len > 0:
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    else:  # mmap refuses an empty range; only zero-size tensors can be read from it
        data = np.zeros(0, np.uint8)
        data.flags.writeable = False  # read-only, as the memory-mapped tensors are
    out = {}
    ranges = []  # (begin, end, name) of every tensor
    for name, info in header.items():
        if name == "__metadata__":  # optional, and a map of str to str (as the reference reads)
            if info is not None and not (
                isinstance(info, dict) and all(type(v) is str for v in info.values())
            ):
                raise CheckpointError(f"{path}: __metadata__={info!r} must be a map of str to str")
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"tensor {name!r} in {path}: bad header entry {info!r}") from e
        if not (
            isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and type(begin) is int
            and type(end) is int
        ):
            raise CheckpointError(f"tensor {name!r} in {path}: bad header entry {info!r}")
        if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {path}: dtype {dtype} unsupported")
        nbytes = math.prod(shape) * np.dtype(_ST_DTYPES[dtype]).itemsize  # no int64 wrap
        if not 0 <= begin <= end <= len(data) or end - begin != nbytes:
            raise CheckpointError(
                f"tensor {name!r} in {path}: bytes [{begin}, {end}) of {len(data)} cannot "
                f"hold {dtype} {shape} ({nbytes} bytes)"
            )
        try:
            out[name] = data[begin:end].view(_ST_DTYPES[dtype]).reshape(shape)
        except ValueError as e:  # a zero-size shape with a dimension numpy cannot hold
            raise CheckpointError(f"tensor {name!r} in {path}: shape {shape}: {e}") from e
        ranges.append((begin, end, name))
    _check_tiling(ranges, len(data), path)
    return out


def _check_tiling(ranges: list[tuple[int, int, str]], data_len: int, path) -> None:
    """CheckpointError unless the byte ranges, sorted, follow each other from 0 to
    data_len: each tensor's bytes are its own, and every byte belongs to a tensor."""
    covered = 0
    for begin, end, name in sorted(ranges):
        if begin != covered:
            what = "overlaps the tensor before it" if begin < covered else "leaves a gap before it"
            raise CheckpointError(
                f"tensor {name!r} in {path}: bytes [{begin}, {end}) {what} (bytes up to "
                f"{covered} belong to earlier tensors)"
            )
        covered = end
    if covered != data_len:
        raise CheckpointError(
            f"{path}: bytes [{covered}, {data_len}) after the last tensor belong to no tensor"
        )


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Write tensors in the safetensors format (any dtype `read_safetensors` reads, in
    either byte order: the file holds them little-endian, as the format asks), with the
    header's metadata {"format": "pt"}, which transformers before 4.48.2 requires. Raises
    ValueError naming the tensor, before writing anything, for any other dtype and for a
    name that is not a str or is "__metadata__" (the header's own key), and ValueError
    unless `tensors` is a mapping and `path` a str or os.PathLike. The file is written
    whole under a temporary name beside `path`, then renamed over it: a write stopped
    midway leaves the file that was there before, never a cut one."""
    path = checked_path(path)
    if not isinstance(tensors, Mapping):  # None or a list raised AttributeError: .items
        raise ValueError(f"tensors={type(tensors).__name__} must be a mapping of names to arrays")
    # As the reference writer for torch-saved files: transformers < 4.48.2 reads "format".
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    arrays = {}
    for name, value in tensors.items():
        # json.dumps wrote 7 as "7" (two tensors under one name, if "7" was there too),
        # and a "__metadata__" tensor was written where the reader skips it: either file
        # was refused by read_safetensors.
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} must be a str other than '__metadata__'")
        a = np.asarray(value)
        little = a.dtype.newbyteorder("<")
        if little not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no safetensors name")
        # (reshaped: np.ascontiguousarray makes a 0-d array 1-d, shape [1] in the header)
        arrays[name] = np.ascontiguousarray(a, dtype=little).reshape(a.shape)
    for name, a in arrays.items():
        header[name] = {
            "dtype": _ST_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the format asks for 8-byte-aligned data

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for a in arrays.values():
                f.write(a.tobytes())

    write_whole(path, write)
