"""Pallas TPU (Mosaic) kernels: ragged paged attention with LSE, for flat and cascade attention."""

from kernels_pallas.tpu.ragged_paged_attention import check_shapes, ragged_paged_attention
from kernels_pallas.tpu.tuning import (
    TUNED_BLOCK_SIZES,
    BlockSizes,
    detect_tpu_generation,
    generation_from_device_kind,
)

__all__ = [
    "ragged_paged_attention",
    "check_shapes",
    "TUNED_BLOCK_SIZES",
    "BlockSizes",
    "detect_tpu_generation",
    "generation_from_device_kind",
]
