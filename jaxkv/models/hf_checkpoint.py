"""Hugging Face Llama weights: safetensors files and the `LlamaForCausalLM` names.

One or more `*.safetensors` files with the `LlamaForCausalLM` parameter names
(`model.layers.{i}.self_attn.q_proj.weight`, ...), read by `jaxkv.models.safetensors_file`
so that bfloat16 files load without torch. Linear weights are stored `[out, in]` there and
transposed into flax kernels `[in, out]`; RoPE is rotate-half in both, so no permutation is
needed.

Every load checks that the files hold exactly the model's parameters, each with the model's
shape, and raises `CheckpointError` (a ValueError) naming the tensor and both shapes before
building anything.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from jaxkv.models.checkpoint import (
    CheckpointError,
    build_with_params,
    check_copy,
    check_float_dtypes,
    check_names_and_shapes,
    checked_path,
    flat_params,
)
from jaxkv.models.config import LlamaConfig, check_config
from jaxkv.models.llama import Llama, check_model
from jaxkv.models.safetensors_file import read_safetensors
from jaxkv.models.safetensors_file import write_safetensors as write_safetensors  # re-export

# --- Hugging Face names --------------------------------------------------------------------

_HF_LAYER = re.compile(
    r"model\.layers\.([0-9]+)\.(?:"  # not \d, which matches other scripts' digits too
    r"(?P<linear>(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.weight|"
    r"(?P<norm>input_layernorm|post_attention_layernorm)\.weight)"
)


def hf_to_jaxkv_name(hf_name: str) -> tuple[str, bool] | None:
    """(jaxkv name, needs transpose) for a Hugging Face Llama tensor; None if it is a buffer.

    Raises CheckpointError for a name that is neither a Llama parameter nor a known buffer
    (one that is not a str included).
    """
    if not isinstance(hf_name, str):  # .endswith raised AttributeError
        raise CheckpointError(f"tensor name {hf_name!r} is not a str")
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # a recomputable buffer some older checkpoints store
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.embedding", False
    if hf_name == "model.norm.weight":
        return "norm.weight", False
    if hf_name == "lm_head.weight":
        return "lm_head.kernel", True
    m = _HF_LAYER.fullmatch(hf_name)  # .match's "$" also matched before a final "\n"
    if m is None:
        raise CheckpointError(f"tensor {hf_name!r} is not a Hugging Face Llama parameter")
    if m["linear"]:
        return f"layers.{m[1]}.{m['linear']}.kernel", True
    return f"layers.{m[1]}.{m['norm']}.weight", False


_SINGLE_FILE = "model.safetensors"
_SHARD_INDEX = "model.safetensors.index.json"


def _safetensors_files(path: Path) -> list[Path]:
    """The files a checkpoint's weights are in, as Hugging Face picks them: `path` itself,
    a directory's `model.safetensors`, else the shards its `model.safetensors.index.json`
    maps weights to, else every `*.safetensors` file in it. Other files next to the
    model's (a LoRA adapter's, say) are left alone where the first three apply."""
    if path.is_file():
        return [path]
    if (path / _SINGLE_FILE).is_file():
        return [path / _SINGLE_FILE]
    index = path / _SHARD_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(
                f"{index}: expected a JSON object whose 'weight_map' maps tensor names to "
                f"file names ({type(e).__name__}: {e})"
            ) from None
        files = []
        for name in names:
            if type(name) is not str or name in ("", ".", "..") or Path(name).name != name:
                raise CheckpointError(f"{index}: {name!r} is not a file name in {path}")
            if not (path / name).is_file():
                raise FileNotFoundError(f"{index} names {name}, which is not in {path}")
            files.append(path / name)
        return files
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
    """Load a Hugging Face Llama checkpoint (a `.safetensors` file or a directory of them:
    its `model.safetensors`, else the shards `model.safetensors.index.json` lists, else
    every `*.safetensors` file).

    `config` defaults to the directory's `config.json` read with `LlamaConfig.from_hf_dict`,
    its eos_token_ids joined by those of `generation_config.json` where there is one (as
    vLLM stops at both: Llama 3 Instruct names its end of turn only there); `dtype`
    overrides the parameter dtype (one is refused, naming the tensor, where a weight is
    past its range, float16's say: it would load as inf). With tied embeddings a stored
    `lm_head.weight` must be a copy of the embedding. Raises CheckpointError on any name
    or shape mismatch or such a head, and naming the file when config.json or
    generation_config.json is not a JSON object (truncated, say) or holds a value
    from_hf_dict refuses (a key missing, say), or when the shard index is not a JSON
    object whose weight_map maps tensor names to plain file names (no directory part, not
    '', '.' or '..'); FileNotFoundError for a shard the index names that is not in the
    directory; ValueError for a `path` that is not a str or os.PathLike, or a `config`
    that is not a LlamaConfig.
    """
    if config is not None:  # a dict raised AttributeError, after the files were found
        check_config(config)
    path = checked_path(path)
    if not path.exists():  # else the parent's config.json was read, or reported missing
        raise FileNotFoundError(f"{path}: no such file or directory")
    if config is None:
        config_dir = path if path.is_dir() else path.parent
        file = config_dir / "config.json"
        try:
            config = LlamaConfig.from_hf_dict(_read_json_object(file))
        except CheckpointError:
            raise
        except ValueError as e:  # a bad or missing key: which file says it
            raise CheckpointError(f"{file}: {e}") from None
        generation = config_dir / "generation_config.json"
        if generation.exists():
            given = _read_json_object(generation).get("eos_token_id")  # int, list or None
            try:
                eos = dataclasses.replace(config, eos_token_ids=given).eos_token_ids  # checked
            except ValueError:
                raise CheckpointError(
                    f"{generation}: eos_token_id={given!r} must be token ids in "
                    f"[0, vocab_size={config.vocab_size})"
                ) from None
            joined = tuple(dict.fromkeys(config.eos_token_ids + eos))  # in order, once each
            config = dataclasses.replace(config, eos_token_ids=joined)
    if dtype is not None:  # the caller's: refused as dtype=, not blamed on config.json
        config = dataclasses.replace(config, dtype=dtype)
    return from_hf_tensors(
        config,
        _iter_hf_tensors(_safetensors_files(path)),
        source=str(path),
    )


def _read_json_object(file: Path) -> dict:
    """The JSON object in `file`; CheckpointError naming the file when it is not valid
    JSON (truncated, say), is nested past Python's recursion limit (a bare RecursionError
    named no file) or holds something else than an object."""
    try:
        value = json.loads(file.read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    except RecursionError as e:
        raise CheckpointError(f"{file}: JSON nested too deeply to read ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: holds a {type(value).__name__}, not a JSON object")
    return value


def from_hf_tensors(
    config: LlamaConfig,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    *,
    source: str = "Hugging Face tensors",
) -> Llama:
    """A `Llama(config)` holding `tensors` given under Hugging Face names and orientation.

    The inverse of `to_hf_tensors`. Raises CheckpointError naming the Hugging Face tensor
    (and its shape as given, `[out, in]`) if one is missing, unexpected, given twice,
    mis-shaped or not floating-point (its dtype none numpy reads, or nested lists making
    no array), or is a tied model's `lm_head.weight` that is no copy of the embedding
    (shape or values), and ValueError unless `config` is a LlamaConfig and `tensors` a
    mapping or an iterable of (name, array) pairs.
    """
    check_config(config)  # a dict raised AttributeError
    pairs = "a mapping or an iterable of (name, array) pairs"
    try:
        items = iter(tensors.items() if isinstance(tensors, Mapping) else tensors)
    except TypeError:  # None: "object is not iterable", naming nothing
        raise ValueError(f"tensors={type(tensors).__name__} must be {pairs}") from None
    tied = config.tie_word_embeddings
    expected = {
        jaxkv_to_hf_name(name): shape[::-1] if name.endswith(".kernel") else shape
        for name, shape in _param_shapes(config)
    }
    given: dict[str, np.ndarray] = {}
    head = {}  # a tied checkpoint's stored lm_head.weight: some exporters write a copy
    seen: set[str] = set()  # ignored tensors too: a second copy means mixed-up files
    for entry in items:
        try:
            hf_name, tensor = entry
        except (TypeError, ValueError):  # a name alone: "too many values to unpack"
            raise ValueError(f"tensors must be {pairs}, got {repr(entry)[:80]}") from None
        ours = hf_to_jaxkv_name(hf_name)  # first: it refuses a name that is not a str
        if hf_name in seen:
            raise CheckpointError(f"tensor {hf_name!r} appears twice in {source}")
        seen.add(hf_name)
        if tied and hf_name == "lm_head.weight":
            head[hf_name] = tensor
        elif ours is not None:
            given[hf_name] = tensor
    check_names_and_shapes(expected, given, source, kind="tensor")
    check_float_dtypes({**given, **head}, source, kind="tensor")
    # A head unequal to the embedding it is tied to: the files and the config disagree
    # (an untied model's files, say), and dropping it would serve another model.
    for name, tensor in head.items():
        embed = "model.embed_tokens.weight"
        why = "with tie_word_embeddings=True it must be a copy of it, or be left out"
        check_copy(name, tensor, embed, given[embed], source, why=why)
    params = {}
    for hf_name, tensor in given.items():
        name, transpose = hf_to_jaxkv_name(hf_name)
        if not hasattr(tensor, "T"):  # nested lists pass the checks above: no .T
            tensor = np.asarray(tensor)
        params[name] = tensor.T if transpose else tensor
    return build_with_params(config, params, source=source, kind="tensor", name_of=jaxkv_to_hf_name)


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
    """The model's weights under Hugging Face names and orientation (inverse of loading);
    ValueError unless `model` is a Llama (None gave {}, an empty checkpoint)."""
    check_model(model)
    out = {}
    for name, value in flat_params(model).items():
        a = np.asarray(value)
        out[jaxkv_to_hf_name(name)] = a.T if name.endswith(".kernel") else a
    return out
