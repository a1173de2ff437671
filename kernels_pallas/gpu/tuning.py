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
    batch) take up to 128 rows so a shared page is read by few blocks.

    Tiles are capped in bytes: query tiles at 32 KiB, key tiles at 32 KiB (decode) or
    16 KiB, both counted in the dtype the dots read (kernels_pallas.precision: int8 and
    float8 pages are widened to the query dtype, bfloat16 queries over a float32 cache to
    float32), and half that for float32 dots, whose exact products run on FMA units, not
    tensor cores, and hold their operands in registers; but no block
    has fewer than 16 rows or keys (Triton's smallest dot), so float32 prefill at
    head_dim 256 takes 16 KiB key tiles, twice its cap; nor fewer rows than one token's
    group of query heads (the kernel needs block_m >= group), so a group of more rows
    than the cap holds sets a larger query tile. Blocks of at least 64 x 128 query
    elements, and float32 queries, take 8 warps. So every default tiling whose group
    fits its capped query tile (at head_dim 256: 16 float32 rows, 64 bfloat16) fits the
    99 KiB of shared memory a GPU of compute capability 8.6 or 8.9 gives one block
    (A100: 163 KiB; H100, H200: 227). A larger group may not: at head_dim 256 on sm_89,
    32 float32 query heads per KV head need 66 KiB, 64 need 100 KiB, and 128 bfloat16
    ones 104 KiB (num_stages=1 fits these two, at 96 and 88 KiB). Triton's compile for
    sm_80, sm_89 and sm_90 spills few or no registers (benchmarks/gpu_compile_report.py;
    the shared memory is tested in tests/kernels/test_gpu_triton_compile.py). Chosen
    from those static figures; timed since on an H200 at one decode shape (64 requests of 8320
    tokens, Llama-3-8B heads, bf16), where it ran 11-12% slower than the best of 16
    tilings (keys split in two, 3 stages; benchmarks/gpu_kernel.py's sweep).
    """
    decode = (max_q_len is not None and max_q_len <= 1) or max_num_tokens <= max_num_seqs
    fma = q_itemsize >= 4  # float32 queries: exact dots on FMA units
    shrink = 2 if fma else 1
    q_tile_bytes = _Q_TILE_BYTES // shrink
    if decode:
        block_m = max(16, _next_pow2(group))
    else:
        q_len = max_num_tokens if max_q_len is None else min(max_q_len, max_num_tokens)
        rows_in_tile = q_tile_bytes // (head_dim * q_itemsize)
        block_m = max(16, _next_pow2(group), min(128, rows_in_tile, _next_pow2(q_len * group)))
    tile_bytes = (32 if decode else 16) * 1024 // shrink
    dot_itemsize = max(kv_itemsize, q_itemsize)
    block_k = max(16, min(128, _next_pow2(tile_bytes // (head_dim * dot_itemsize) + 1) // 2))
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
        num_warps=8 if fma or block_m * head_dim >= 64 * 128 else 4,
        num_stages=2,
    )
