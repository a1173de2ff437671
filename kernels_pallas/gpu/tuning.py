"""Default tiling of the GPU ragged paged attention kernel, from static shapes only.

Nothing here asks a device anything, so lowering on a machine without a GPU picks the
same tiling as running on one, and one shape bucket compiles one program. The kernel's
callers may override any knob (see `ragged_paged_attention`).
"""

from __future__ import annotations

from typing import NamedTuple

# Programs the split heuristic aims for: a few waves of a 132-SM H100/H200.
_TARGET_PROGRAMS = 512
_MAX_KV_SPLITS = 32
_Q_TILE_BYTES = 32 * 1024


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class KernelConfig(NamedTuple):
    """Static tiling of one call; see `ragged_paged_attention` for the meaning of each."""

    block_m: int
    block_k: int
    num_kv_splits: int
    num_warps: int
    num_stages: int


def default_config(
    *,
    max_num_tokens: int,
    max_num_seqs: int,
    max_q_len: int | None,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    q_itemsize: int,
    kv_itemsize: int,
    page_size: int,
    pages_per_seq: int,
) -> KernelConfig:
    """Tiling from static shapes only, so that one bucket compiles one program.

    Decode-like calls (max_q_len 1, or no more tokens than sequences) take 16-row blocks
    and long key steps, and split the keys until about `_TARGET_PROGRAMS` programs run.
    Prefill-like calls (including the cascade prefix pass: one sequence holding a whole
    batch) take up to 128 rows so a shared page is read by few blocks. Query tiles
    (at most 32 KiB) and key tiles are capped in bytes so that the compiled kernel fits
    in 99 KiB of shared memory per block, the least a GPU of compute capability 8.0 to
    9.0 gives one block (8.6 and 8.9: 99 KiB; A100: 163; H100, H200: 227); Triton's own
    compile checks the largest tilings of each dtype (test_gpu_triton_compile.py).
    """
    decode = (max_q_len is not None and max_q_len <= 1) or max_num_tokens <= max_num_seqs
    if decode:
        block_m = max(16, _next_pow2(group))
    else:
        q_len = max_num_tokens if max_q_len is None else min(max_q_len, max_num_tokens)
        rows_in_tile = _Q_TILE_BYTES // (head_dim * q_itemsize)
        block_m = max(16, _next_pow2(group), min(128, rows_in_tile, _next_pow2(q_len * group)))
    tile_bytes = (32 if decode else 16) * 1024
    block_k = max(16, min(128, _next_pow2(tile_bytes // (head_dim * kv_itemsize) + 1) // 2))
    tokens_per_block = block_m // group
    if decode:
        busy_programs = max_num_seqs * num_kv_heads
    else:
        busy_programs = -(-max_num_tokens // tokens_per_block) * num_kv_heads
    key_blocks = -(-pages_per_seq * page_size // block_k)
    splits = -(-_TARGET_PROGRAMS // max(1, busy_programs))
    return KernelConfig(
        block_m=block_m,
        block_k=block_k,
        num_kv_splits=max(1, min(splits, key_blocks, _MAX_KV_SPLITS)),
        num_warps=8 if block_m >= 128 else 4,
        num_stages=2,
    )
