"""Weights on disk in jaxkv's own format; the parameter checks every loader shares.

jaxkv format: a directory with `config.json` (`LlamaConfig.to_json`, plus the SHA-256 of
the weights file as `params_sha256`) and `params.msgpack` (flax msgpack of a flat
`{"layers.0.self_attn.q_proj.kernel": array, ...}` dict). One file, no async machinery,
readable with `flax.serialization.msgpack_restore` alone. Hugging Face safetensors are
read and written by `jaxkv.models.hf_checkpoint`.

Every load checks that the file holds exactly the model's parameters, each with the model's
shape and of a floating-point dtype, and raises `CheckpointError` (a ValueError) naming the
parameter (and both shapes, or its dtype) before building anything; loading into a
narrower dtype (float16; bfloat16 or float32 from wider weights), a finite weight past its
range is refused by name too (it would load as inf).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, serialization

from jaxkv.field_checks import names_a_dtype
from jaxkv.models.config import LlamaConfig
from jaxkv.models.llama import Llama, check_model

CONFIG_FILE = "config.json"
PARAMS_FILE = "params.msgpack"

# The trained `tiny` byte-level Llama (jaxkv/data/tiny/README.md), installed with the
# package: `load_checkpoint(TINY_CHECKPOINT)` works from any directory, checkout or not.
TINY_CHECKPOINT = Path(__file__).resolve().parents[1] / "data" / "tiny"


class CheckpointError(ValueError):
    """A checkpoint does not match the model: missing, unexpected, mis-shaped or
    non-floating-point parameters."""


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


def check_names_and_shapes(
    expected: Mapping[str, tuple[int, ...]],
    given: Mapping[str, object],
    source: str,
    *,
    kind: str,
) -> None:
    """CheckpointError unless `given` holds exactly the names of `expected`, each with its
    shape; names the missing, unexpected or mis-shaped ones ("parameter" or "tensor"),
    and one that makes no array (nested lists of ragged lengths)."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected), key=repr)  # a file's keys may be any type
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match the model: missing {missing}, unexpected {unexpected}"
        )
    for name, want in expected.items():
        try:
            got = tuple(np.shape(given[name]))
        except ValueError as e:  # numpy's message names no tensor
            raise CheckpointError(f"{kind} {name!r} in {source}: makes no array ({e})") from None
        if got != tuple(want):
            raise CheckpointError(
                f"{kind} {name!r} in {source}: shape {got} does not match the model's {tuple(want)}"
            )


def check_float_dtypes(given: Mapping[str, object], source: str, *, kind: str) -> None:
    """CheckpointError naming the first of `given` ("parameter" or "tensor") whose values
    are not floating-point: integer, bool or complex weights mean mixed-up files, and the
    cast to the model's dtype would turn them into other numbers without a word. So is
    one whose `dtype` numpy does not read (a name it does not know, another library's
    dtype object, an abstract type such as np.floating, or a value such as np.float32(1)
    in place of a dtype), or, without a dtype, one that makes no array."""
    for name, value in given.items():
        what = f"{kind} {name!r} in {source}"
        given_dtype = getattr(value, "dtype", None)
        dtype = None
        if given_dtype is None:
            try:
                dtype = np.asarray(value).dtype  # a list, say
            except (TypeError, ValueError) as e:  # numpy's message names no tensor
                raise CheckpointError(f"{what}: makes no array ({e})") from None
        elif names_a_dtype(given_dtype):  # np.dtype reads a value's too: np.float32(1)
            try:
                dtype = np.dtype(given_dtype)
            except TypeError:
                pass
        if dtype is None:
            raise CheckpointError(
                f"{what}: dtype {given_dtype!r} is no dtype numpy reads (give numpy or JAX arrays)"
            )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise CheckpointError(f"{what}: dtype {dtype} is not a floating-point type")


def check_copy(name: str, value, of: str, original, source: str, *, why: str) -> None:
    """CheckpointError naming tensor `name` and `of` unless `value` has the shape and the
    values (NaNs included) of `original`, saying `why` it must. Compared a few million
    elements at a time: no temporary as large as a whole embedding is made."""
    a, b = np.asarray(value), np.asarray(original)
    if a.shape != b.shape:
        raise CheckpointError(
            f"tensor {name!r} in {source}: shape {a.shape} differs from {of!r} {b.shape}: {why}"
        )
    rows = max(1, (1 << 22) // max(1, math.prod(a.shape[1:])))
    for i in range(0, len(a), rows):
        if not np.array_equal(a[i : i + rows], b[i : i + rows], equal_nan=True):
            raise CheckpointError(f"tensor {name!r} in {source} differs from {of!r}: {why}")


def build_with_params(
    config: LlamaConfig,
    params: Mapping[str, np.ndarray],
    *,
    source: str = "checkpoint",
    kind: str = "parameter",
    name_of: Callable[[str], str] | None = None,
) -> Llama:
    """A `Llama(config)` holding exactly `params` (flat dotted names, model orientation).

    Raises CheckpointError if a parameter is missing, unexpected, has the wrong shape or
    is not floating-point (its dtype none numpy reads, or nested lists making no array).
    Values are cast to `config.dtype`; a finite value that it cannot hold (float16 past
    65504; bfloat16 or float32 past 3.4e38) raises CheckpointError naming the parameter
    (as `kind` `name_of(name)` where given: a Hugging Face tensor) instead of loading as
    inf. No random initialisation is run.
    """
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    expected = {k: v.shape for k, v in flat_params(abstract).items()}
    if not isinstance(params, Mapping):
        raise CheckpointError(f"{source} holds a {type(params).__name__}, not a parameter dict")
    check_names_and_shapes(expected, params, source, kind="parameter")
    check_float_dtypes(params, source, kind="parameter")
    dtype = jnp.dtype(config.dtype)
    graphdef, state = nnx.split(abstract)
    name_of = name_of or str
    values = {k: _cast(v, dtype, f"{kind} {name_of(k)!r}", source) for k, v in params.items()}
    nnx.replace_by_pure_dict(state, _unflatten(values))
    return nnx.merge(graphdef, state)


def _cast(value, dtype: np.dtype, what: str, source: str) -> jax.Array:
    """`value` as a `dtype` array; CheckpointError naming it (`what`) if a finite value
    overflows `dtype` (to float16 past 65504, to bfloat16 or float32 past 3.4e38): the
    narrowings the loaders make that turn weights into inf."""
    value = value if hasattr(value, "dtype") else np.asarray(value)  # a list, say
    if jnp.finfo(value.dtype).max <= jnp.finfo(dtype).max:
        return jnp.asarray(value, dtype=dtype)
    if isinstance(value, jax.Array):  # on the device: cast and look there
        cast = value.astype(dtype)
        suspect = bool(jnp.isinf(cast).any())
    else:  # on the host, as jnp.asarray casts; two integer reductions find an inf or NaN
        with np.errstate(over="ignore"):  # refused below, by name, instead
            cast = np.asarray(value, dtype=dtype)
        signed = np.dtype(f"i{cast.itemsize}")
        unsigned = np.dtype(f"u{cast.itemsize}")
        # +inf and NaN from +inf's bits up (as signed); -inf and NaN from -inf's (unsigned)
        pos_inf = np.array(np.inf, dtype).view(signed)
        neg_inf = np.array(-np.inf, dtype).view(unsigned)
        bits = cast.view(signed)
        suspect = cast.size > 0 and (bits.max() >= pos_inf or bits.view(unsigned).max() >= neg_inf)
    if suspect:  # an inf or NaN in the file stays one; only overflow is refused
        host = np.asarray(value)
        overflow = np.isinf(np.asarray(cast)) & np.isfinite(host)
        if overflow.any():
            largest = np.abs(host[overflow]).max()
            wider = [d for d in ("bfloat16", "float32") if jnp.finfo(d).max >= largest]
            hint = f"load it as {' or '.join(wider)}" if wider else "no dtype jaxkv loads holds it"
            raise CheckpointError(
                f"{what} in {source}: value {largest} overflows {jnp.dtype(dtype).name} "
                f"(largest finite {jnp.finfo(dtype).max}); {hint}"
            )
    return jnp.asarray(cast)


# --- jaxkv format ------------------------------------------------------------------------


DIGEST_KEY = "params_sha256"  # in config.json: the SHA-256 of params.msgpack, hex


def save_checkpoint(model: Llama, path: str | os.PathLike) -> Path:
    """Write `model` to directory `path` (created if needed); returns the directory.

    Both files are written in full under temporary names first and only then renamed into
    place, config before weights: an exception while writing (the long part) leaves a
    checkpoint already in `path` whole. The new config.json records the new weights'
    SHA-256, so a crash between the two renames, which pairs it with the old weights, is
    refused by load_checkpoint rather than loaded, whatever the old config held.
    """
    check_model(model)  # before the directory is made: nothing left behind
    directory = checked_path(path)
    directory.mkdir(parents=True, exist_ok=True)
    params = {k: np.asarray(v) for k, v in flat_params(model).items()}
    staged = []
    try:
        weights = serialization.msgpack_serialize(params)
        config = {**model.config.to_dict(), DIGEST_KEY: hashlib.sha256(weights).hexdigest()}
        for name, data in (
            (CONFIG_FILE, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()),
            (PARAMS_FILE, weights),
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


def _read_config(directory: Path) -> tuple[LlamaConfig, str | None]:
    """(config, recorded SHA-256 of the weights or None); CheckpointError if invalid."""
    file = directory / CONFIG_FILE
    try:
        fields = json.loads(file.read_text())  # UnicodeDecodeError is a ValueError
        digest = fields.pop(DIGEST_KEY, None) if isinstance(fields, dict) else None
        if digest is not None and not isinstance(digest, str):
            raise ValueError(f"{DIGEST_KEY}={digest!r} must be a hex str")
        return LlamaConfig.from_dict(fields), digest
    # Bad JSON (RecursionError: nested past Python's recursion limit), fields or values.
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{file}: not a valid LlamaConfig: {e}") from e


def checked_path(path) -> Path:
    """`path` as a Path; ValueError unless a str or os.PathLike (None raised TypeError;
    open() and os.stat take an int as a file descriptor: 3, or True, was read or written)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path={path!r} must be a str or os.PathLike")
    return Path(path)


def load_checkpoint(path: str | os.PathLike) -> Llama:
    """Load a model saved by `save_checkpoint`. Raises FileNotFoundError for a missing
    file and CheckpointError (naming the file) for a corrupt or mismatched one, weights
    whose SHA-256 is not the one config.json records (damaged, or from another save)
    included. A config.json without a digest (written by hand) is taken as it is."""
    directory = checked_path(path)
    config, digest = _read_config(directory)
    file = directory / PARAMS_FILE
    data = file.read_bytes()
    if digest is not None and hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(
            f"{file}: its SHA-256 is not the {DIGEST_KEY} that {CONFIG_FILE} records; the "
            "file is damaged, or the two files come from different saves"
        )
    try:
        params = serialization.msgpack_restore(data)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for corrupt bytes
        raise CheckpointError(f"{file}: not a msgpack checkpoint ({type(e).__name__}: {e})") from e
    return build_with_params(config, params, source=str(file))
