"""A numpy Llama forward written from the Hugging Face reference, sharing no code with jaxkv.

It reads weights by their Hugging Face names in Hugging Face orientation (`[out, in]`), so
agreement with `Llama.dense_forward` checks both the model's math and the name mapping.
"""

from __future__ import annotations

import numpy as np


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def hf_llama_forward(w: dict[str, np.ndarray], cfg, tokens: np.ndarray) -> np.ndarray:
    """Logits f64[L, vocab] of one sequence `tokens` i32[L] starting at position 0.

    Plain RoPE only: test_numpy_oracle.py holds the reference with Llama 3 scaling."""
    if cfg.rope_scaling is not None:  # it would be ignored, and the logits silently wrong
        raise NotImplementedError("hf_llama_forward has no RoPE scaling")
    w = {k: v.astype(np.float64) for k, v in w.items()}
    seq_len, d = len(tokens), cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    angles = np.outer(np.arange(seq_len), inv_freq)
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]  # [L, 1, D]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(seq_len, cfg.num_heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(seq_len, cfg.num_kv_heads, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(seq_len, cfg.num_kv_heads, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = np.zeros_like(q)
        for head in range(cfg.num_heads):
            kv_head = head // (cfg.num_heads // cfg.num_kv_heads)
            s = q[:, head] @ k[:, kv_head].T / np.sqrt(d)
            s = np.where(np.tri(seq_len, dtype=bool), s, -np.inf)
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv_head]
        x = x + out.reshape(seq_len, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def random_hf_weights(cfg, seed: int = 0, std: float = 0.2) -> dict[str, np.ndarray]:
    """Random f32 weights under Hugging Face names; norms away from 1 so they matter."""
    rng = np.random.default_rng(seed)
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            out[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return out
