"""LlamaConfig: the shape of a Llama-style decoder, validated, with named presets."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxkv import field_checks
from jaxkv.field_checks import int_fields

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling (Hugging Face `rope_type: "llama3"`).

    Frequencies whose wavelength is longer than `original_max_position_embeddings /
    low_freq_factor` are divided by `factor` (their wavelengths stretched `factor` times),
    those shorter than `original_max_position_embeddings / high_freq_factor` are kept, and
    the band between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _real_field(self, name)
        if self.factor < 1.0:
            raise ValueError(f"{self.factor=} must be >= 1")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"need 0 < {self.low_freq_factor=} < {self.high_freq_factor=}")
        # A position count (positions are int32); past that rope_inv_freq's float division
        # overflowed at the first trace (10**400), long after the config was accepted.
        int_fields(self, "original_max_position_embeddings", minimum=1, maximum=2**31 - 1)


def _token_ids(ids, vocab_size: int) -> tuple[int, ...]:
    """eos_token_ids as a tuple of ints in [0, vocab_size): from one int or None too, as
    Hugging Face configs write eos_token_id; ValueError naming the field otherwise."""
    given = ids
    # A 0-d array (numpy's or JAX's) and the elements of a JAX array are ids as field_checks
    # takes integers: they were refused as "must be token ids" although they were.
    ids = () if ids is None else (ids,) if field_checks.is_integer(ids) else ids
    try:
        ids = tuple(ids)
    except TypeError:
        ids = (None,)
    if any(not field_checks.is_integer(t) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"eos_token_ids={given!r} must be token ids in [0, {vocab_size=})")
    return tuple(int(t) for t in ids)


_F32_MAX_LOG = math.log(float(np.finfo(np.float32).max))
_F32_TINY = float(np.finfo(np.float32).tiny)  # least normal float32, 1.1754944e-38


def _check_rope_angles(config: LlamaConfig) -> None:
    """ValueError naming rope_theta when it is so small that a RoPE angle (position times
    the largest inverse frequency, rope_theta ** -((head_dim - 2) / head_dim), computed in
    float32) overflows at a position below max_position_embeddings: cos(inf) is NaN,
    every logit after it too. Llama 3 scaling only lowers frequencies. Log space: the
    float64 power itself overflowed for rope_theta near 1e-300."""
    d, last = config.head_dim, config.max_position_embeddings - 1
    exponent = (d - 2) / d  # the largest inverse frequency is rope_theta ** -exponent
    log_angle = -exponent * math.log(config.rope_theta) + math.log(max(last, 1))
    if log_angle > _F32_MAX_LOG:
        least = math.exp(-(_F32_MAX_LOG - math.log(max(last, 1))) / exponent)
        raise ValueError(
            f"rope_theta={config.rope_theta!r} is so small that RoPE angles overflow float32 "
            f"below max_position_embeddings={last + 1} (head_dim={d}): it must be >= {least:.3g}"
        )


def _real_field(owner: object, name: str) -> float:
    """The named attribute of `owner` stored back as a Python float (numpy and 0-d JAX
    reals too: a numpy float32 would not go to JSON, and 10000 would write apart from an
    equal 10000.0, giving equal configs other fingerprints); ValueError naming it unless
    a finite real number (not a bool)."""
    value = getattr(owner, name)
    as_float = field_checks.as_float(value)  # NaN for a non-real and for 10**400
    if not math.isfinite(as_float):
        raise ValueError(f"{name}={value!r} must be a finite real number")
    object.__setattr__(owner, name, as_float)
    return as_float


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a decoder-only Llama-style transformer.

    Field names follow the Hugging Face `LlamaConfig` where one exists, so `from_hf_dict` is a
    rename. `head_dim` defaults to `hidden_size // num_heads`. Every instance is validated on
    construction: a config that exists describes a model that can be built.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: derive hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "float32"  # parameter and activation dtype; norms and softmax run in f32
    # Tokens that end a generation (Hugging Face `eos_token_id`, an int or a list): the
    # engine stops a request at them unless its SamplingParams.ignore_eos.
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # from to_dict() / JSON
            try:
                object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
            except (TypeError, ValueError) as e:  # a bad value said "self.factor=0.5 ..."
                raise ValueError(f"rope_scaling={self.rope_scaling!r}: {e}") from e
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be a RopeScaling or None")
        int_fields(self, *_INT_FIELDS)
        for name in ("rope_theta", "rms_norm_eps"):
            value = _real_field(self, name)
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be positive")
        if self.rms_norm_eps < _F32_TINY:  # XLA flushes a subnormal float32 to 0
            raise ValueError(
                f"rms_norm_eps={self.rms_norm_eps!r} is below float32's least normal number "
                f"{_F32_TINY:.8g}: the norms add it in float32, where it is 0 (a zero row "
                "then normalises to NaN)"
            )
        if type(self.tie_word_embeddings) is not bool:
            raise ValueError(f"tie_word_embeddings={self.tie_word_embeddings!r} must be a bool")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads <= 0 or self.num_kv_heads <= 0:
            raise ValueError(f"{self.num_heads=} and {self.num_kv_heads=} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.num_heads=} must be a multiple of {self.num_kv_heads=} (grouped-query)"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"{self.hidden_size=} must be a multiple of {self.num_heads=} "
                    "when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"{self.head_dim=} must be positive and even (RoPE rotates pairs)")
        # A position count (positions are int32); past it the RoPE bound below overflowed.
        if not 0 < self.max_position_embeddings <= 2**31 - 1:
            raise ValueError(f"{self.max_position_embeddings=} must be in [1, 2**31 - 1]")
        _check_rope_angles(self)
        if isinstance(self.dtype, (np.dtype, type)):  # np.float32, jnp.bfloat16: by name
            try:
                object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
            except TypeError:
                pass
        if not isinstance(self.dtype, str) or self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {_DTYPES}")
        object.__setattr__(self, "eos_token_ids", _token_ids(self.eos_token_ids, self.vocab_size))

    # Derived sizes.
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Exact parameter count of `Llama(config)`, by arithmetic (no arrays are built)."""
        h = self.hidden_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def kv_cache_bytes_per_token(self, itemsize: int = 2) -> int:
        """Bytes of K and V one token occupies across all layers, at `itemsize` bytes per
        element (2 by default: a bfloat16 or float16 cache, whatever `dtype` is).
        ValueError unless `itemsize` is an int >= 1."""
        # "2" repeated a str, -1 gave a negative size, 2.5 a fractional one.
        if field_checks.as_int(itemsize) is None or itemsize < 1:
            raise ValueError(f"{itemsize=} must be an int >= 1")
        return 2 * self.num_layers * self.kv_size * int(itemsize)

    # Serialisation.
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_kv_dict(self) -> dict[str, Any]:
        """to_dict() less what a model's KV does not depend on (eos_token_ids), for
        jaxkv.model_fingerprint: KV saved under one EOS is valid under another."""
        fields = self.to_dict()
        del fields["eos_token_ids"]
        return fields

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """The config of a `to_dict()` dict; ValueError for anything but a dict, and naming
        fields LlamaConfig lacks."""
        if not isinstance(d, Mapping):  # None raised TypeError, a list of pairs "unknown fields"
            raise ValueError(f"d={type(d).__name__} must be a dict of LlamaConfig fields")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown LlamaConfig fields {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, dtype: str | None = None) -> LlamaConfig:
        """Build from a Hugging Face Llama `config.json` dict (architectures LlamaForCausalLM).

        RoPE comes from `rope_theta` / `rope_scaling`, or from `rope_parameters` (newer
        transformers), which must then agree with them, as must a `rope_theta` inside
        `rope_scaling` (transformers 5 reads it, 4.x not). `dtype`, when given, overrides the
        dict's. Raises ValueError naming a required key the dict lacks, a bad value (a number
        given as a str or a bool among them; named by its config.json key:
        num_attention_heads, not LlamaConfig's num_heads), a null
        rms_norm_eps, max_position_embeddings or rope_theta (transformers refuses them or
        builds no model; left out, they take its defaults 1e-6, 2048 and 10000), or a
        feature this Llama lacks (another model_type, a sliding window, attention or MLP
        biases, a partial_rotary_factor other than 1, a RoPE type other than "default" and
        "llama3", such as "linear" or "dynamic", named): such a model would load and run
        wrong.
        """
        # The reading lives in hf_config, which imports this module.
        from jaxkv.models.hf_config import llama_config_from_hf

        return llama_config_from_hf(hf, dtype=dtype)

    # Presets.
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named preset (`tiny`, `llama3_2_1b`, `llama3_8b`), optionally with overrides.

        Overriding hidden_size or num_heads without head_dim derives head_dim again
        (hidden_size // num_heads), as building the config from those fields would.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        if ("hidden_size" in overrides or "num_heads" in overrides) and "head_dim" not in overrides:
            overrides = {**overrides, "head_dim": 0}
        return dataclasses.replace(PRESETS[name], **overrides)


def check_config(config: Any) -> None:
    """ValueError naming `config` unless it is a LlamaConfig (a dict of its fields, say,
    raised AttributeError or "unhashable type" from deep inside the model)."""
    if not isinstance(config, LlamaConfig):
        raise ValueError(
            f"config={type(config).__name__} must be a jaxkv.models.LlamaConfig "
            "(LlamaConfig.from_dict reads a dict of its fields)"
        )


_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "max_position_embeddings",
)

PRESETS: dict[str, LlamaConfig] = {
    # Byte-level toy that trains on two CPU cores in minutes (vocab: 256 bytes + 3 specials).
    "tiny": LlamaConfig(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=384,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    # Shapes of meta-llama/Llama-3.2-1B.
    "llama3_2_1b": LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        dtype="bfloat16",
    ),
    # Shapes of meta-llama/Meta-Llama-3-8B.
    "llama3_8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        dtype="bfloat16",
    ),
}
