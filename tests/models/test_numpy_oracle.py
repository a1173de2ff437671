"""The model against a float64 numpy Llama written here from the published formulas.

Nothing is shared with jaxkv or tests/models/reference.py: RoPE scaling follows the loop in
Meta's llama3 `apply_scaling`, attention is one query row at a time, and a second route
builds weights in Meta's interleaved-RoPE layout, permutes q/k the way Hugging Face's
`convert_llama_weights_to_hf.py` does, and checks the loaded model against Meta's
complex-number RoPE. Tolerance: float32 model vs float64 reference, logits O(1-10);
|model - ref| <= 1e-4 + 1e-4 |ref| per logit (observed below 5e-6).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.batch import build_attention_metadata
from jaxkv.buckets import BucketConfig
from jaxkv.cascade import CascadePlan
from jaxkv.models import (
    LlamaConfig,
    RopeScaling,
    from_hf_tensors,
    load_hf_safetensors,
    make_dense_forward,
    make_paged_forward,
)
from jaxkv.models.hf_checkpoint import write_safetensors

TOL = dict(rtol=1e-4, atol=1e-4)
# GQA 4:1, head_dim 16 (q_size 64 != hidden 32), Llama 3 scaling with a short original
# context so that high, medium and low frequency bands all occur, an eps large enough to
# matter (activations have rms ~0.2), tied embeddings.
SCALED = LlamaConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=40,
    num_layers=2,
    num_heads=4,
    num_kv_heads=1,
    head_dim=16,
    rope_scaling=RopeScaling(4.0, 1.0, 4.0, 64),
    rms_norm_eps=1e-2,
    tie_word_embeddings=True,
)
PLAIN = LlamaConfig(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=40,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    rope_theta=500.0,
    rms_norm_eps=1e-6,
)


# --- the reference ---------------------------------------------------------------------


def _inv_freq(cfg: LlamaConfig) -> np.ndarray:  # f64[head_dim // 2]
    freqs = [1.0 / cfg.rope_theta ** (i / cfg.head_dim) for i in range(0, cfg.head_dim, 2)]
    s = cfg.rope_scaling
    if s is None:
        return np.array(freqs)
    out = []
    for f in freqs:  # Meta llama-models `apply_scaling`
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return np.array(out)


def _rope(x: np.ndarray, pos: int, freqs: np.ndarray, interleaved: bool) -> np.ndarray:
    """x f64[heads, D] rotated to position `pos`: pairs (i, i + D/2), or (2i, 2i + 1)."""
    rot = np.exp(1j * pos * freqs)
    if interleaved:  # Meta: view_as_complex over adjacent pairs
        z = (x[:, 0::2] + 1j * x[:, 1::2]) * rot
        return np.stack([z.real, z.imag], -1).reshape(x.shape)
    half = x.shape[-1] // 2
    z = (x[:, :half] + 1j * x[:, half:]) * rot
    return np.concatenate([z.real, z.imag], -1)


def _norm(x, w, eps):
    return w * x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def numpy_llama(
    w: dict[str, np.ndarray], cfg: LlamaConfig, tokens, *, interleaved=False, eps=None
) -> np.ndarray:  # f64[L, vocab]
    """LlamaForCausalLM logits of one sequence from position 0, weights under HF names."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    eps = cfg.rms_norm_eps if eps is None else eps
    freqs, d, group = _inv_freq(cfg), cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    x = w["model.embed_tokens.weight"][np.asarray(tokens)]
    for layer in range(cfg.num_layers):
        p = lambda name: w[f"model.layers.{layer}.{name}.weight"]  # noqa: B023
        h = _norm(x, p("input_layernorm"), eps)
        keys, values, out = [], [], []
        for t in range(len(tokens)):
            q = (p("self_attn.q_proj") @ h[t]).reshape(cfg.num_heads, d)
            keys.append(_rope((p("self_attn.k_proj") @ h[t]).reshape(-1, d), t, freqs, interleaved))
            values.append((p("self_attn.v_proj") @ h[t]).reshape(-1, d))
            q = _rope(q, t, freqs, interleaved)
            heads = []
            for head in range(cfg.num_heads):
                k = np.stack([kk[head // group] for kk in keys])  # [t + 1, D]
                v = np.stack([vv[head // group] for vv in values])
                s = k @ q[head] / math.sqrt(d)
                e = np.exp(s - s.max())
                heads.append(e @ v / e.sum())
            out.append(p("self_attn.o_proj") @ np.concatenate(heads))
        x = x + np.stack(out)
        h = _norm(x, p("post_attention_layernorm"), eps)
        g, u = h @ p("mlp.gate_proj").T, h @ p("mlp.up_proj").T
        x = x + (g * u / (1 + np.exp(-g))) @ p("mlp.down_proj").T
    x = _norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


def hf_weights(cfg: LlamaConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        shapes |= {
            f"model.layers.{i}.{name}.weight": shape
            for name, shape in [
                ("self_attn.q_proj", (q, h)),
                ("self_attn.k_proj", (kv, h)),
                ("self_attn.v_proj", (kv, h)),
                ("self_attn.o_proj", (h, q)),
                ("mlp.gate_proj", (cfg.intermediate_size, h)),
                ("mlp.up_proj", (cfg.intermediate_size, h)),
                ("mlp.down_proj", (h, cfg.intermediate_size)),
                ("input_layernorm", (h,)),
                ("post_attention_layernorm", (h,)),
            ]
        }
    return {
        n: (rng.uniform(0.5, 1.5, s) if len(s) == 1 else rng.normal(0, 0.25, s)).astype(np.float32)
        for n, s in shapes.items()
    }


# --- dense ------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [SCALED, PLAIN], ids=["gqa4-scaled-tied", "gqa2-untied"])
def test_dense_forward_equals_numpy_llama(cfg):
    w = hf_weights(cfg, seed=1)
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 24)
    want = numpy_llama(w, cfg, tokens)
    got = np.asarray(make_dense_forward(from_hf_tensors(cfg, w))(jnp.asarray(tokens)[None]))[0]
    np.testing.assert_allclose(got, want, **TOL)
    if cfg.rope_scaling is not None:
        # The scaling and the eps change the logits by far more than the tolerance.
        unscaled = dataclasses.replace(cfg, rope_scaling=None)
        assert not np.allclose(got, numpy_llama(w, unscaled, tokens), **TOL)
        assert not np.allclose(got, numpy_llama(w, cfg, tokens, eps=1e-6), **TOL)


def test_hf_file_of_a_meta_layout_model_matches_metas_interleaved_rope(tmp_path):
    """HF files hold q/k rows permuted for rotate-half; loading needs no further permutation."""
    cfg = SCALED
    meta = hf_weights(cfg, seed=3)  # Meta's row order: RoPE pairs are adjacent rows

    def permute(w, heads):  # convert_llama_weights_to_hf.py
        rows, cols = w.shape
        return w.reshape(heads, rows // heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(w.shape)

    hf = dict(meta)
    for i in range(cfg.num_layers):
        for name, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            hf[key] = permute(meta[key], heads)
    write_safetensors(tmp_path / "model.safetensors", hf)
    model = load_hf_safetensors(tmp_path / "model.safetensors", cfg)
    tokens = np.arange(24) * 7 % cfg.vocab_size  # 24 as above: one compiled program
    got = np.asarray(make_dense_forward(model)(jnp.asarray(tokens)[None]))[0]
    np.testing.assert_allclose(got, numpy_llama(meta, cfg, tokens, interleaved=True), **TOL)
    # The unpermuted Meta weights under rotate-half would be a different model.
    assert not np.allclose(got, numpy_llama(meta, cfg, tokens), **TOL)


# --- paged ------------------------------------------------------------------------------

BLOCK = 4
BUCKETS = BucketConfig(
    max_num_tokens=16,
    max_num_seqs=2,
    max_pages_per_seq=8,
    min_num_tokens=16,
    min_num_seqs=2,
    min_pages_per_seq=8,
)


def test_paged_chunked_prefill_and_decode_equal_numpy_llama():
    cfg = SCALED
    w = hf_weights(cfg, seed=4)
    model = from_hf_tensors(cfg, w)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, cfg.vocab_size, 22), rng.integers(0, cfg.vocab_size, 9)]
    want = [numpy_llama(w, cfg, s) for s in seqs]
    table = rng.permutation(np.arange(1, 17)).reshape(2, 8).astype(np.int32)
    forward = make_paged_forward(model)
    # Unwritten slots hold NaN: reading one poisons the logits.
    caches = [c + jnp.nan for c in model.init_kv_caches(17, BLOCK)]
    # Sequence 0 prefills in chunks of 5, 6 and 11 (block edges at odd offsets) and then
    # decodes; sequence 1 prefills 3 tokens and decodes alongside, one step reversed.
    steps = [
        [(0, 0, 5), (1, 0, 3)],
        [(1, 3, 4), (0, 5, 11)],
        [(0, 11, 20), (1, 4, 5)],
        [(0, 20, 21), (1, 5, 6)],
        [(1, 6, 7), (0, 21, 22)],
    ]
    worst = 0.0
    for step in steps:
        rows = np.array([r for r, _, _ in step], np.int32)
        lens = np.array([b - a for _, a, b in step])
        plan = CascadePlan(np.arange(len(step), dtype=np.int32), rows, np.zeros(2, np.int32), (), 0)
        md = build_attention_metadata(
            block_table=table,
            plan=plan,
            query_lens=lens,
            num_computed_tokens=np.array([a for _, a, _ in step]),
            block_size=BLOCK,
            buckets=BUCKETS,
        )
        md = dataclasses.replace(md, logits_indices=np.arange(md.max_num_tokens, dtype=np.int32))
        ids = np.zeros(md.max_num_tokens, np.int32)
        ids[: lens.sum()] = np.concatenate([seqs[r][a:b] for r, a, b in step])
        logits, caches = forward(ids, md.positions, caches, md)
        logits, start = np.asarray(logits), 0
        for r, a, b in step:
            got = logits[start : start + b - a]
            start += b - a
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want[r][a:b], **TOL)
            worst = max(worst, float(np.abs(got - want[r][a:b]).max()))
    assert worst < 1e-4
