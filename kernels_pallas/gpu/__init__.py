"""Pallas GPU kernels (Triton backend): ragged paged attention with LSE."""

from kernels_pallas.gpu.aot import cuda_lowering_target
from kernels_pallas.gpu.ragged_paged_attention import ragged_paged_attention

__all__ = ["cuda_lowering_target", "ragged_paged_attention"]
