"""Shared fixtures: very small Llama configs so every test compiles in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxkv.models import LlamaConfig, from_hf_tensors
from tests.models.reference import random_hf_weights


def small_config(**overrides) -> LlamaConfig:
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**base, **overrides})


def hf_config_dict(cfg: LlamaConfig, **extra) -> dict:
    """The Hugging Face `config.json` dict of `cfg`'s sizes, plus `extra` keys."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        **extra,
    }


@pytest.fixture
def config() -> LlamaConfig:
    return small_config()


def random_model(cfg: LlamaConfig, seed: int = 0, std: float = 0.2):
    """A Llama with numpy-random weights: no initialiser programs to compile (fast on CPU)."""
    return from_hf_tensors(cfg, random_hf_weights(cfg, seed, std))


def drop_weights_digest(directory) -> None:
    """Removes the weights' SHA-256 from a saved checkpoint's config.json (as in one written
    by hand), so that a load goes on to check what the weights file holds."""
    file = Path(directory) / "config.json"
    fields = json.loads(file.read_text())
    del fields["params_sha256"]
    file.write_text(json.dumps(fields))
