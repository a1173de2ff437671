"""Weights on disk: jaxkv's own checkpoint format and Hugging Face Llama safetensors.

jaxkv format: a directory with `config.json` (`LlamaConfig.to_json`) and `params.msgpack`
(flax msgpack of a flat `{"layers.0.self_attn.q_proj.kernel": array, ...}` dict). One file,
no async machinery, readable with `flax.serialization.msgpack_restore` alone.

Hugging Face format: one or more `*.safetensors` files with the `LlamaForCausalLM` parameter
names (`model.layers.{i}.self_attn.q_proj.weight`, ...), read by a small reader here so that
bfloat16 files load without torch. Linear weights are stored `[out, in]` there and transposed
into flax kernels `[in, out]`; RoPE is rotate-half in both, so no permutation is needed.

Every load checks that the file holds exactly the model's parameters, each with the model's
shape, and raises `CheckpointError` (a ValueError) naming the parameter and both shapes before
building anything.
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx, serialization

from jaxkv.models.config import LlamaConfig
from jaxkv.models.llama import Llama

CONFIG_FILE = "config.json"
PARAMS_FILE = "params.msgpack"


class CheckpointError(ValueError):
    """A checkpoint does not match the model: missing, unexpected or mis-shaped parameters."""


# --- flat parameter dicts ----------------------------------------------------------------


def flat_params(model: Llama) -> dict[str, jax.Array]:
    """The model's parameters keyed by dotted path, e.g. `layers.0.mlp.up_proj.kernel`."""
    out: dict[str, jax.Array] = {}

    def visit(prefix: str, node: Mapping) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                visit(name + ".", value)
            else:
                out[name] = value

    visit("", nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return out


def _unflatten(flat: Mapping[str, object]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = [int(p) if p.isdigit() else p for p in name.split(".")]
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _check_names_and_shapes(
    expected: Mapping[str, tuple[int, ...]],
    given: Mapping[str, object],
    source: str,
    *,
    kind: str,
) -> None:
    """CheckpointError unless `given` holds exactly the names of `expected`, each with its
    shape; names the missing, unexpected or mis-shaped ones ("parameter" or "tensor")."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match the model: missing {missing}, unexpected {unexpected}"
        )
    for name, want in expected.items():
        got = tuple(np.shape(given[name]))
        if got != tuple(want):
            raise CheckpointError(
                f"{kind} {name!r} in {source}: shape {got} does not match the model's {tuple(want)}"
            )


def build_with_params(
    config: LlamaConfig, params: Mapping[str, np.ndarray], *, source: str = "checkpoint"
) -> Llama:
    """A `Llama(config)` holding exactly `params` (flat dotted names, model orientation).

    Raises CheckpointError if a parameter is missing, unexpected or has the wrong shape.
    Values are cast to `config.dtype`. No random initialisation is run.
    """
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    expected = {k: v.shape for k, v in flat_params(abstract).items()}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"{source} holds a {type(params).__name__}, not a parameter dict")
    _check_names_and_shapes(expected, params, source, kind="parameter")
    dtype = jnp.dtype(config.dtype)
    graphdef, state = nnx.split(abstract)
    values = {k: jnp.asarray(v, dtype=dtype) for k, v in params.items()}
    nnx.replace_by_pure_dict(state, _unflatten(values))
    return nnx.merge(graphdef, state)


# --- jaxkv format ------------------------------------------------------------------------


def save_checkpoint(model: Llama, path: str | os.PathLike) -> Path:
    """Write `model` to directory `path` (created if needed); returns the directory.

    Both files are written in full under temporary names first and only then renamed into
    place, weights before config: an exception or crash while writing (the long part)
    leaves a checkpoint already in `path` whole, its config and weights still a pair.
    """
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    params = {k: np.asarray(v) for k, v in flat_params(model).items()}
    staged = []
    try:
        for name, data in (
            (PARAMS_FILE, serialization.msgpack_serialize(params)),
            (CONFIG_FILE, (model.config.to_json() + "\n").encode()),
        ):
            tmp = directory / (name + ".tmp")
            staged.append((tmp, directory / name))
            tmp.write_bytes(data)
    except BaseException:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in staged:
        tmp.replace(final)
    return directory


def load_config(path: str | os.PathLike) -> LlamaConfig:
    """The LlamaConfig in directory `path`; CheckpointError if it is not a valid one."""
    file = Path(path) / CONFIG_FILE
    text = file.read_text()
    try:
        return LlamaConfig.from_dict(json.loads(text))
    except (ValueError, TypeError, AttributeError) as e:  # bad JSON, fields or values
        raise CheckpointError(f"{file}: not a valid LlamaConfig: {e}") from e


def load_checkpoint(path: str | os.PathLike) -> Llama:
    """Load a model saved by `save_checkpoint`. Raises FileNotFoundError for a missing
    file and CheckpointError (naming the file) for a corrupt or mismatched one."""
    directory = Path(path)
    config = load_config(directory)
    file = directory / PARAMS_FILE
    data = file.read_bytes()
    try:
        params = serialization.msgpack_restore(data)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for corrupt bytes
        raise CheckpointError(f"{file}: not a msgpack checkpoint ({type(e).__name__}: {e})") from e
    return build_with_params(config, params, source=str(file))


# --- safetensors -------------------------------------------------------------------------

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

    Raises CheckpointError naming the file (and tensor) if the header is unreadable or a
    tensor's byte range does not hold its shape and dtype within the file.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        try:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                raise ValueError(f"header of {header_len} bytes past the end of the file")
            header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (struct.error, ValueError) as e:
            raise CheckpointError(f"{path}: not a safetensors file ({e})") from e
    data_len = size - 8 - header_len
    if data_len > 0:
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    else:  # mmap refuses an empty range; only zero-size tensors can be read from it
        data = np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
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
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {path}: dtype {dtype} unsupported")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[dtype]).itemsize
        if not 0 <= begin <= end <= len(data) or end - begin != nbytes:
            raise CheckpointError(
                f"tensor {name!r} in {path}: bytes [{begin}, {end}) of {len(data)} cannot "
                f"hold {dtype} {shape} ({nbytes} bytes)"
            )
        out[name] = data[begin:end].view(_ST_DTYPES[dtype]).reshape(shape)
    return out


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray]) -> None:
    """Write tensors in the safetensors format (any dtype `read_safetensors` reads)."""
    header: dict[str, dict] = {}
    offset = 0
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    for name, a in arrays.items():
        header[name] = {
            "dtype": _ST_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the format asks for 8-byte-aligned data
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for a in arrays.values():
            f.write(a.tobytes())


# --- Hugging Face names --------------------------------------------------------------------

_HF_LAYER = re.compile(
    r"model\.layers\.(\d+)\.(?:"
    r"(?P<linear>(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.weight|"
    r"(?P<norm>input_layernorm|post_attention_layernorm)\.weight)$"
)


def hf_to_jaxkv_name(hf_name: str) -> tuple[str, bool] | None:
    """(jaxkv name, needs transpose) for a Hugging Face Llama tensor; None if it is a buffer.

    Raises CheckpointError for a name that is neither a Llama parameter nor a known buffer.
    """
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # a recomputable buffer some older checkpoints store
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.embedding", False
    if hf_name == "model.norm.weight":
        return "norm.weight", False
    if hf_name == "lm_head.weight":
        return "lm_head.kernel", True
    m = _HF_LAYER.match(hf_name)
    if m is None:
        raise CheckpointError(f"tensor {hf_name!r} is not a Hugging Face Llama parameter")
    if m["linear"]:
        return f"layers.{m[1]}.{m['linear']}.kernel", True
    return f"layers.{m[1]}.{m['norm']}.weight", False


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _iter_hf_tensors(files: list[Path]) -> Iterator[tuple[str, np.ndarray]]:
    for file in files:
        yield from read_safetensors(file).items()


def load_hf_safetensors(
    path: str | os.PathLike, config: LlamaConfig | None = None, *, dtype: str | None = None
) -> Llama:
    """Load a Hugging Face Llama checkpoint (a `.safetensors` file or a directory of them).

    `config` defaults to the directory's `config.json` read with `LlamaConfig.from_hf_dict`;
    `dtype` overrides the parameter dtype. With tied embeddings a stored `lm_head.weight` is
    ignored (it is the embedding). Raises CheckpointError on any name or shape mismatch.
    """
    path = Path(path)
    if config is None:
        config_dir = path if path.is_dir() else path.parent
        hf_config = json.loads((config_dir / "config.json").read_text())
        config = LlamaConfig.from_hf_dict(hf_config, dtype=dtype)
    elif dtype is not None:
        config = LlamaConfig.from_dict({**config.to_dict(), "dtype": dtype})
    return from_hf_tensors(
        config,
        _iter_hf_tensors(_safetensors_files(path)),
        source=str(path),
    )


def from_hf_tensors(
    config: LlamaConfig,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    *,
    source: str = "Hugging Face tensors",
) -> Llama:
    """A `Llama(config)` holding `tensors` given under Hugging Face names and orientation.

    The inverse of `to_hf_tensors`. Raises CheckpointError naming the Hugging Face tensor
    (and its shape as given, `[out, in]`) if one is missing, unexpected, given twice or
    mis-shaped.
    """
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    tied = config.tie_word_embeddings
    expected = {
        jaxkv_to_hf_name(name): shape[::-1] if name.endswith(".kernel") else shape
        for name, shape in _param_shapes(config)
    }
    given: dict[str, np.ndarray] = {}
    for hf_name, tensor in items:
        if hf_name in given:
            raise CheckpointError(f"tensor {hf_name!r} appears twice in {source}")
        if hf_to_jaxkv_name(hf_name) is not None and not (tied and hf_name == "lm_head.weight"):
            given[hf_name] = tensor
    _check_names_and_shapes(expected, given, source, kind="tensor")
    params = {}
    for hf_name, tensor in given.items():
        name, transpose = hf_to_jaxkv_name(hf_name)
        params[name] = tensor.T if transpose else tensor
    return build_with_params(config, params, source=source)


@functools.lru_cache(maxsize=8)
def _param_shapes(config: LlamaConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return tuple((k, tuple(v.shape)) for k, v in flat_params(abstract).items())


def jaxkv_to_hf_name(name: str) -> str:
    """The Hugging Face name of a jaxkv parameter (kernels are stored transposed there)."""
    if name == "embed_tokens.embedding":
        return "model.embed_tokens.weight"
    if name == "lm_head.kernel":
        return "lm_head.weight"
    return "model." + name.removesuffix(".kernel").removesuffix(".weight") + ".weight"


def to_hf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and orientation (inverse of loading)."""
    out = {}
    for name, value in flat_params(model).items():
        a = np.asarray(value)
        out[jaxkv_to_hf_name(name)] = a.T if name.endswith(".kernel") else a
    return out
