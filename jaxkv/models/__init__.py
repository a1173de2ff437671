"""Small flax NNX models that run on jaxkv's paged attention."""

from __future__ import annotations

from jaxkv.models.checkpoint import (
    TINY_CHECKPOINT,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from jaxkv.models.config import PRESETS, LlamaConfig, RopeScaling
from jaxkv.models.hf_checkpoint import from_hf_tensors, load_hf_safetensors
from jaxkv.models.llama import Llama, make_dense_forward, make_paged_forward
from jaxkv.models.tokenizer import ByteTokenizer

__all__ = [
    "PRESETS",
    "TINY_CHECKPOINT",
    "ByteTokenizer",
    "CheckpointError",
    "Llama",
    "LlamaConfig",
    "RopeScaling",
    "from_hf_tensors",
    "load_checkpoint",
    "load_hf_safetensors",
    "make_dense_forward",
    "make_paged_forward",
    "save_checkpoint",
]
