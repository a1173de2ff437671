"""A Hugging Face Llama `config.json` dict read as a LlamaConfig (`LlamaConfig.from_hf_dict`).

Keys left out take transformers' `LlamaConfig` defaults, but for `eos_token_id`: left out
(or null) it gives no end token, not transformers' 2, which is Llama 2's EOS and any
token of another vocabulary (vLLM adds its tokenizer's EOS, which jaxkv has none of;
load_hf_safetensors adds generation_config.json's). Values this Llama cannot run, or
cannot run the way transformers would, are refused by name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxkv.field_checks import is_integer, is_real
from jaxkv.models.config import _DTYPES, LlamaConfig, RopeScaling


def llama_config_from_hf(hf: dict[str, Any], *, dtype: str | None = None) -> LlamaConfig:
    """`LlamaConfig.from_hf_dict`: see there."""
    if not isinstance(hf, dict):
        raise ValueError(f"Hugging Face config must be a dict, got {type(hf).__name__}")
    required = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads",
    )  # fmt: skip
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"Hugging Face config lacks {missing}")
    model_type = hf.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(f"{model_type=} is not supported (only 'llama')")
    if hf.get("sliding_window") is not None:
        raise ValueError(f"sliding_window={hf['sliding_window']!r}: this Llama attends to all")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ValueError(f"{key}={hf[key]!r}: this Llama's projections have no bias")
    for key, why in _NOT_NULL.items():
        if key in hf and hf[key] is None:
            raise ValueError(
                f"Hugging Face config: {key}=null must be a number: transformers' LlamaConfig "
                f"refuses null ({why}); leave the key out for its default {_DEFAULTS[key]}"
            )
    rope_theta, rope_scaling = _hf_rope(hf)
    act = hf.get("hidden_act", "silu")
    # transformers' ACT2FN maps "swish" to the same SiLU as "silu".
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r} is not supported (Llama's MLP is SwiGLU: 'silu')")
    # transformers >= 4.56 writes "dtype", older versions "torch_dtype"; as in
    # transformers, a null "dtype" is not given and "torch_dtype" then applies.
    torch_dtype = _hf_default(hf, "dtype", hf.get("torch_dtype")) or "float32"
    # Null: hidden_size // num_attention_heads, as in transformers. 0 is LlamaConfig's
    # "derive it", but in transformers a model of empty heads: refused, not derived.
    head_dim = hf.get("head_dim")
    if head_dim is not None and not (is_integer(head_dim) and head_dim > 0):
        raise ValueError(f"Hugging Face config: {head_dim=} must be a positive int or null")
    # Read before the try below, whose handler would prefix its error a second time.
    rms_norm_eps = _hf_value(hf, "rms_norm_eps", float, _DEFAULTS["rms_norm_eps"])
    try:
        config = LlamaConfig(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            # A null num_key_value_heads means as many as query heads, as in transformers.
            num_kv_heads=(
                hf["num_attention_heads"]
                if hf.get("num_key_value_heads") is None
                else hf["num_key_value_heads"]
            ),
            head_dim=0 if head_dim is None else head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=rms_norm_eps,
            # Absent or null: untied (transformers' default); anything but a bool is refused
            # by LlamaConfig: bool("false") would tie the head and drop lm_head.weight.
            tie_word_embeddings=_hf_default(hf, "tie_word_embeddings", False),
            max_position_embeddings=hf.get(
                "max_position_embeddings", _DEFAULTS["max_position_embeddings"]
            ),
            dtype=torch_dtype if torch_dtype in _DTYPES else "float32",
            eos_token_ids=hf.get("eos_token_id"),
        )
    except ValueError as e:  # LlamaConfig names its fields: name config.json's keys
        raise ValueError(_in_hf_keys(str(e))) from None
    # The caller's dtype, not config.json's: a bad one is refused as `dtype=`.
    return config if dtype is None else dataclasses.replace(config, dtype=dtype)


# transformers' LlamaConfig defaults for keys left out.
_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0}
# Keys whose null transformers' LlamaConfig refuses (5.x: a strict dataclass whose field
# is a float or an int), and what older versions or vLLM did with it; read as the
# default, a config.json transformers refuses loaded as a model it never ran.
_NOT_NULL = {
    "rms_norm_eps": "4.x took it and failed at the first forward",
    "max_position_embeddings": "4.x took it as no limit, vLLM assumes 2048: give the "
    "model's context length",
}


def _hf_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) of a Hugging Face config, from the top-level keys or
    `rope_parameters`; ValueError when the two are given and disagree (a rope_theta inside
    rope_scaling too), or when a `partial_rotary_factor` other than 1 is given (top level
    or in either dict)."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    rope_scaling = None if scaling is None else _hf_scaling(scaling, "rope_scaling")
    # transformers reads it at the top level or in the RoPE dict (5.x); RoPE over part of
    # head_dim is not what this Llama (nor transformers' Llama) runs: it rotated all.
    for where, d in (("config", hf), ("rope_scaling", scaling), ("rope_parameters", params)):
        factor = d.get("partial_rotary_factor") if isinstance(d, dict) else None
        if factor is not None and (isinstance(factor, bool) or factor != 1):
            raise ValueError(
                f"Hugging Face {where}: partial_rotary_factor={factor!r} is not supported "
                "(this Llama rotates all of head_dim)"
            )
    rope_theta = _hf_value(hf, "rope_theta", float, None)
    if params is not None:
        from_params = _hf_scaling(params, "rope_parameters", default_kind="default")
        theta = _hf_value(params, "rope_theta", float, None, "rope_parameters")
        if (scaling is not None and from_params != rope_scaling) or (
            None not in (theta, rope_theta) and theta != rope_theta
        ):
            raise ValueError(f"rope_parameters={params!r} disagree with rope_theta/rope_scaling")
        rope_scaling, rope_theta = from_params, rope_theta if theta is None else theta
    for where, d in (("config", hf), ("rope_parameters", params)):
        # Null and no number beside it: transformers (4.x and 5.x) computes RoPE of base
        # None and fails building the model, which was read here as 10000.
        if rope_theta is None and isinstance(d, dict) and d.get("rope_theta", 0) is None:
            raise ValueError(
                f"Hugging Face {where}: rope_theta=null must be a number: transformers builds "
                f"no model of it; leave the key out for its default {_DEFAULTS['rope_theta']}"
            )
    rope_theta = _DEFAULTS["rope_theta"] if rope_theta is None else rope_theta
    # transformers 5 takes rope_scaling for rope_parameters, its theta over the top-level
    # one; 4.x ignores a theta there: unequal, the two build other models.
    inner = _hf_value(scaling, "rope_theta", float, None, "rope_scaling") if scaling else None
    if inner is not None and inner != rope_theta:
        raise ValueError(
            f"Hugging Face rope_scaling: rope_theta={inner!r} disagrees with the rope_theta "
            f"{rope_theta!r} of the top level, rope_parameters or the default, which "
            "transformers 4.x reads where 5.x reads this one; set both to the theta meant"
        )
    return rope_theta, rope_scaling


def _hf_scaling(d: Any, where: str, default_kind: str | None = None) -> RopeScaling | None:
    """The RopeScaling a `rope_scaling` (or `rope_parameters`) dict describes: None for
    plain RoPE ("default"), the llama3 scaling, ValueError for anything else and for a
    dict whose "type" and "rope_type" disagree."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}={d!r} must be a dict or null")
    # transformers 4.x lets the legacy "type" override "rope_type", 5.x the other way round:
    # a dict giving both, unequal, is read as another RoPE depending on the version.
    if "type" in d and "rope_type" in d and d["type"] != d["rope_type"]:
        raise ValueError(
            f"{where} gives rope_type={d['rope_type']!r} and type={d['type']!r}, which "
            "transformers versions read differently; give one"
        )
    kind = d.get("rope_type", d.get("type", default_kind))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"{where} type {kind!r} is not supported (only 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"{where} (llama3) lacks {missing}")
    fields = {
        "factor": _hf_value(d, "factor", float, None, where),
        "low_freq_factor": _hf_value(d, "low_freq_factor", float, None, where),
        "high_freq_factor": _hf_value(d, "high_freq_factor", float, None, where),
        "original_max_position_embeddings": _hf_value(
            d, "original_max_position_embeddings", _integral, None, where, "an integer"
        ),
    }
    try:
        return RopeScaling(**fields)
    except ValueError as e:  # RopeScaling's fields are config.json's keys: say where
        message = re.sub(r"\bself\.", "", str(e))
        raise ValueError(f"Hugging Face {where}: {message}") from None


def _integral(value) -> int:
    """`value` as an int if it is integral (8192 or 8192.0); ValueError otherwise. An int
    is taken as it is: float(10**400) raised OverflowError."""
    if is_integer(value):
        return int(value)
    as_float = float(value)
    if not as_float.is_integer():
        raise ValueError(value)
    return int(as_float)


# LlamaConfig's fields whose config.json keys are spelled otherwise.
_HF_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "eos_token_ids": "eos_token_id",
}


# A quoted str as repr writes one (in a value, a list or a dict's key), opening after no
# word character (an apostrophe, "float32's", opens none); else a word, maybe "self."'d.
_QUOTED_OR_WORD = re.compile(r"""(?<!\w)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")|\b(?:self\.)?(\w+)""")


def _in_hf_keys(message: str) -> str:
    """A LlamaConfig error about a Hugging Face config, its fields named by config.json's
    keys, and LlamaConfig's own names for the renamed ones said after it. Quoted strs
    are values from config.json, left as they are even where they spell a field name."""
    renamed = {}  # LlamaConfig's names replaced, in order, once each

    def rename(m: re.Match) -> str:
        if m[1] is not None:  # a quoted value
            return m[1]
        if m[2] in _HF_KEYS:
            renamed[m[2]] = None
        return _HF_KEYS.get(m[2], m[2])

    message = _QUOTED_OR_WORD.sub(rename, message)
    said = ", ".join(f"{name} for {_HF_KEYS[name]}" for name in renamed)
    return f"Hugging Face config: {message}" + (f" (LlamaConfig says {said})" if said else "")


def _hf_default(d: dict[str, Any], key: str, default):
    """d[key] as given, or `default` when absent or null."""
    value = d.get(key)
    return default if value is None else value


def _hf_value(
    d: dict[str, Any], key: str, convert, default, where: str = "config", kind: str = "a number"
):
    """d[key], a JSON number, converted (e.g. float(10000) -> 10000.0), or `default` when
    absent or null; a ValueError naming the key and `kind` when it is no number (a bool,
    a str: "1e-5" was read as 1e-05 although transformers builds no working model of a
    str), does not convert, or is an int too large for a float (OverflowError before)."""
    value = d.get(key)
    if value is None:
        return default
    if not is_real(value):
        raise ValueError(f"Hugging Face {where}: {key}={value!r} must be {kind}")
    try:
        return convert(value)
    except (TypeError, ValueError):
        raise ValueError(f"Hugging Face {where}: {key}={value!r} must be {kind}") from None
    except OverflowError:
        raise ValueError(f"Hugging Face {where}: {key}={value!r} must be a finite number") from None
