"""Pallas GPU kernels (Triton backend): ragged paged attention with LSE."""

from kernels_pallas.gpu.ragged_paged_attention import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
