"""A decoder-only Llama-style transformer in flax NNX that attends through jaxkv.

Two forwards share one set of weights:

- `Llama.__call__`: the serving path. A flat, padded batch of scheduled tokens; each layer
  writes its new K/V into that layer's paged cache (`jaxkv.attention.write_kv`) and attends
  through `jaxkv.attention.paged_attention`, so flat or cascade attention, the backend and the
  static shapes all come from the step's `AttentionMetadata`.
- `Llama.dense_forward`: whole sequences with full causal attention and no cache; used for
  training and as the oracle the paged path is tested against.

Weights follow the Hugging Face Llama layout up to a transpose (`kernel = weight.T`), and RoPE
rotates halves as Hugging Face does, so Hugging Face checkpoints load without permutation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import attention
from jaxkv.batch import AttentionMetadata
from jaxkv.field_checks import checked_int, names_a_dtype
from jaxkv.models.config import LlamaConfig, check_config
from kernels_pallas.validation import FLOAT_DTYPES

_INIT_STD = 0.02  # Hugging Face `initializer_range`


@functools.lru_cache(maxsize=16)
def rope_inv_freq(config: LlamaConfig) -> np.ndarray:  # f32[head_dim // 2]
    """Inverse rotary frequencies, with Llama 3 scaling applied when the config asks for it.

    Computed on the host at trace time (a constant of the program); do not mutate the result.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = config.rope_scaling
    if s is not None:
        old_len = s.original_max_position_embeddings
        low_freq_wavelen = old_len / s.low_freq_factor
        high_freq_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(
    x: jax.Array,  # [..., T, num_heads, head_dim]
    positions: jax.Array,  # i32[..., T]
    inv_freq: np.ndarray,  # f32[head_dim // 2]
) -> jax.Array:  # [..., T, num_heads, head_dim]
    """Rotate-half RoPE (the Hugging Face convention): pairs are (i, i + head_dim / 2)."""
    inv_freq = jnp.asarray(inv_freq).reshape((1,) * positions.ndim + (-1,))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, D/2]
    cos = jnp.cos(freqs)[..., None, :]
    sin = jnp.sin(freqs)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def causal_attention(
    q: jax.Array,  # [B, L, num_heads, head_dim]
    k: jax.Array,  # [B, L, num_kv_heads, head_dim]
    v: jax.Array,  # [B, L, num_kv_heads, head_dim]
    sm_scale: float,
) -> jax.Array:  # [B, L, num_heads, head_dim]
    """Plain grouped-query causal attention; scores and softmax in float32."""
    seq_len = q.shape[1]
    group = q.shape[2] // k.shape[2]
    # Repeating K/V to every query head is faster on CPU than a 5-D grouped einsum.
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * sm_scale
    mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, normalised in float32 (as Hugging Face LlamaRMSNorm)."""

    def __init__(self, dim: int, *, eps: float, dtype: Any) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype=dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        weight = jnp.expand_dims(self.weight[...], tuple(range(x.ndim - 1)))
        return weight * x32.astype(x.dtype)


def _linear(n_in: int, n_out: int, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        dtype=dtype,
        param_dtype=dtype,
        kernel_init=nnx.initializers.normal(_INIT_STD),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE; dense or paged."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        h, dt = config.hidden_size, jnp.dtype(config.dtype)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.sm_scale = config.head_dim**-0.5
        self.config = config
        self.q_proj = _linear(h, config.q_size, dt, rngs)
        self.k_proj = _linear(h, config.kv_size, dt, rngs)
        self.v_proj = _linear(h, config.kv_size, dt, rngs)
        self.o_proj = _linear(config.q_size, h, dt, rngs)
        # jaxkv.sharding.TensorParallel, set by jaxkv.sharding.shard_model; None: one device.
        self.tensor_parallel = None

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        inv_freq = rope_inv_freq(self.config)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def dense(
        self,
        x: jax.Array,  # [B, L, hidden]
        positions: jax.Array,  # i32[B, L]
    ) -> jax.Array:  # [B, L, hidden]
        q, k, v = self._qkv(x, positions)
        out = causal_attention(q, k, v, self.sm_scale)
        return self.o_proj(out.reshape(*x.shape[:-1], -1))

    def paged(
        self,
        x: jax.Array,  # [max_num_tokens, hidden]
        positions: jax.Array,  # i32[max_num_tokens]
        kv_pages: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, jax.Array]:  # [max_num_tokens, hidden], new kv_pages
        q, k, v = self._qkv(x, positions)
        # Under tensor parallelism both calls run per shard, on the local heads only.
        attn = attention if self.tensor_parallel is None else self.tensor_parallel
        kv_pages = attn.write_kv(kv_pages, k, v, metadata.slot_mapping)
        out = attn.paged_attention(q, kv_pages, metadata, sm_scale=self.sm_scale)
        return self.o_proj(out.reshape(x.shape[0], -1)), kv_pages


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        h, f, dt = config.hidden_size, config.intermediate_size, jnp.dtype(config.dtype)
        self.gate_proj = _linear(h, f, dt, rngs)
        self.up_proj = _linear(h, f, dt, rngs)
        self.down_proj = _linear(f, h, dt, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        dt = jnp.dtype(config.dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dt)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, dtype=dt
        )
        self.mlp = MLP(config, rngs=rngs)

    def dense(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.self_attn.dense(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))

    def paged(
        self, x: jax.Array, positions: jax.Array, kv_pages: jax.Array, metadata: AttentionMetadata
    ) -> tuple[jax.Array, jax.Array]:
        attn_out, kv_pages = self.self_attn.paged(
            self.input_layernorm(x), positions, kv_pages, metadata
        )
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), kv_pages


class Llama(nnx.Module):
    """Decoder-only Llama-style language model.

    Submodule names mirror Hugging Face (`embed_tokens`, `layers[i].self_attn.q_proj`, ...,
    `norm`, `lm_head`); `lm_head` is absent when `config.tie_word_embeddings`. ValueError
    unless `config` is a LlamaConfig.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        check_config(config)  # a dict raised AttributeError from .dtype
        dt = jnp.dtype(config.dtype)
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=dt,
            param_dtype=dt,
            embedding_init=nnx.initializers.normal(_INIT_STD),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dt)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else _linear(config.hidden_size, config.vocab_size, dt, rngs)
        )

    def logits(self, h: jax.Array) -> jax.Array:  # f32[..., vocab_size]
        """The final norm and the LM head over hidden states `h` ([..., hidden_size])."""
        h = self.norm(h)
        if self.lm_head is None:
            logits = self.embed_tokens.attend(h)
        else:
            logits = self.lm_head(h)
        return logits.astype(jnp.float32)

    def dense_forward(
        self,
        tokens: jax.Array,  # i32[B, L]
    ) -> jax.Array:  # f32[B, L, vocab_size]
        """Logits at every position of whole sequences that start at position 0 (no cache).

        ValueError unless `tokens` is an integer array [batch, length] (checked while
        tracing: its shape and dtype only, not its values, as in __call__; a NaN of an id
        >= vocab_size reaches the earlier positions too, through the masked attention)."""
        _check_int_array("tokens", tokens)
        if tokens.ndim != 2:
            raise ValueError(f"{tokens.shape=} must be [batch, length]")
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer.dense(x, positions)
        return self.logits(x)

    def __call__(
        self,
        input_ids: jax.Array,  # i32[max_num_tokens]
        positions: jax.Array,  # i32[max_num_tokens]
        kv_caches: list[jax.Array],  # num_layers x [num_blocks, block_size, 2*num_kv_heads, D]
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, list[jax.Array]]:  # f32[max_num_seqs, vocab_size], new kv_caches
        """One serving step over a flat padded batch of scheduled tokens.

        Writes every token's K/V into `kv_caches` at `metadata.slot_mapping` and returns the
        logits of each sequence's last scheduled token (`metadata.logits_indices`); rows past
        the batch's number of sequences are padding. Token ids are not checked (a jitted
        step cannot): one >= vocab_size embeds as NaN, a negative one as another token;
        Engine.add_request, greedy_generate and Trainer check theirs.
        """
        hidden, new_caches = self.hidden_states(input_ids, positions, kv_caches, metadata)
        return self.logits(hidden[metadata.logits_indices]), new_caches

    def hidden_states(
        self,
        input_ids: jax.Array,  # i32[max_num_tokens]
        positions: jax.Array,  # i32[max_num_tokens]
        kv_caches: list[jax.Array],
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, list[jax.Array]]:  # [max_num_tokens, hidden_size], new kv_caches
        """The serving step of __call__ up to the last layer's output for every token (before
        the final norm: `logits` applies it), e.g. for logits at more than the last tokens.
        ValueError (while tracing) unless `input_ids` and `positions` are 1-D integer arrays
        of one shape: float positions were rotated by fractional angles without a word."""
        _check_int_array("input_ids", input_ids)
        _check_int_array("positions", positions)
        if input_ids.ndim != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"{input_ids.shape=} and {positions.shape=} must be equal and 1-D")
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)=} must equal num_layers={len(self.layers)}")
        x = self.embed_tokens(input_ids)
        new_caches = []
        for layer, kv_pages in zip(self.layers, kv_caches, strict=True):
            x, kv_pages = layer.paged(x, positions, kv_pages, metadata)
            new_caches.append(kv_pages)
        return x, new_caches

    def init_kv_caches(
        self, num_blocks: int, block_size: int, dtype: Any = None
    ) -> list[jax.Array]:  # num_layers x [num_blocks, block_size, 2*num_kv_heads, head_dim]
        """Zeroed per-layer paged KV caches in the layout of jaxkv.attention (K even, V odd heads).

        On a model from jaxkv.sharding.shard_model they are sharded along combined heads.
        `dtype` (None: the model's) is float32, bfloat16 or float16: the forward passes the
        kernels no k_scale/v_scale, which an int8 or float8 cache needs. ValueError naming
        the argument unless `num_blocks` and `block_size` are ints >= 1 and `dtype` is one of those.
        """
        c = self.config
        tp = self.layers[0].self_attn.tensor_parallel
        if tp is not None:  # it checks the arguments
            from jaxkv.sharding import init_kv_caches

            return init_kv_caches(c, tp, num_blocks, block_size, dtype)
        check_kv_cache_args(num_blocks, block_size, dtype)
        shape = (num_blocks, block_size, 2 * c.num_kv_heads, c.head_dim)
        dt = jnp.dtype(dtype or c.dtype)
        return [jnp.zeros(shape, dt) for _ in range(c.num_layers)]


def check_kv_cache_args(num_blocks: Any, block_size: Any, dtype: Any) -> None:
    """ValueError naming the argument unless `num_blocks` and `block_size` are ints >= 1
    and `dtype` None or a cache dtype Llama's forward writes (float32, bfloat16, float16);
    shared by Llama.init_kv_caches and jaxkv.sharding.init_kv_caches."""
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
        checked_int(name, value, minimum=1)  # -1 or 2.0 raised jax's TypeError
    if dtype is not None:
        try:  # a value of a dtype (np.float16(1.0), an array) is no dtype
            kv_dtype = jnp.dtype(dtype) if names_a_dtype(dtype) else None
        except (TypeError, ValueError):  # "floot"
            kv_dtype = None
        if kv_dtype not in FLOAT_DTYPES:  # the kernels read int8 and float8 given scales
            raise ValueError(
                f"dtype={dtype!r} must be None, float32, bfloat16 or float16 (the cache dtypes "
                "Llama's forward writes: a quantized cache needs k_scale and v_scale, which it "
                "does not pass)"
            )


def _check_int_array(name: str, value: Any) -> None:
    """ValueError naming `name` unless `value` is an integer array (numpy, JAX, traced): a
    list failed on .ndim, a float one deep in the embedding or, as positions, not at all."""
    dtype = getattr(value, "dtype", None)
    if getattr(value, "ndim", None) is None or dtype is None:
        raise ValueError(f"{name} must be an integer array, got {type(value).__name__}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} of dtype {dtype} must be an integer array")


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _paged_step(graphdef, state, input_ids, positions, kv_caches, metadata):
    return nnx.merge(graphdef, state)(input_ids, positions, kv_caches, metadata)


@functools.partial(jax.jit, static_argnums=0)
def _dense_step(graphdef, state, tokens):
    return nnx.merge(graphdef, state).dense_forward(tokens)


def check_model(model: Any) -> None:
    """ValueError naming `model` unless it is a Llama: None or another object was taken by
    nnx.split as a model of no weights, and failed only where it was first used."""
    if not isinstance(model, Llama):
        raise ValueError(f"model={type(model).__name__} must be a jaxkv.models.Llama")


def make_paged_forward(
    model: Llama,
) -> Callable[..., tuple[jax.Array, list[jax.Array]]]:
    """Jit `model(input_ids, positions, kv_caches, metadata)` as one program, caches donated.

    The returned function uses the weights `model` holds now (a snapshot); call again after
    changing them. Models of one config share compiled programs; there is one program per
    distinct static metadata (bucket sizes, levels, backend). The caller must use the
    returned caches: the ones passed in are donated. ValueError unless `model` is a Llama.
    """
    check_model(model)
    graphdef, state = _snapshot(model)
    return lambda input_ids, positions, kv_caches, metadata: _paged_step(
        graphdef, state, input_ids, positions, kv_caches, metadata
    )


def make_dense_forward(model: Llama) -> Callable[[jax.Array], jax.Array]:
    """Jit `model.dense_forward(tokens)` over a snapshot of the model's weights; ValueError
    unless `model` is a Llama."""
    check_model(model)
    graphdef, state = _snapshot(model)
    return lambda tokens: _dense_step(graphdef, state, tokens)


def _snapshot(model: Llama) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state) holding the arrays the model holds now: nnx.split's state shares
    the model's Variables, so a later nnx.update of the model would show through it."""
    graphdef, state = nnx.split(model)
    return graphdef, jax.tree.map(lambda x: x, state)
