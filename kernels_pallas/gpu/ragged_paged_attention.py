"""Ragged paged attention with LSE for NVIDIA GPUs: a Pallas Triton kernel.

Backend: Triton (`pl.pallas_call` with `compiler_params=plgpu.CompilerParams`, `plgpu`
being `jax.experimental.pallas.triton`). Mosaic GPU was probed first, on jax 0.10.2 with
a CPU-only jaxlib: its interpreter (`InterpretGPUParams`) runs on the CPU, a paged gather
(a page id read from a table in global memory, then a TMA copy of `pages.at[page_id]`
into shared memory) and a 64x64x64 warpgroup MMA both interpret correctly and lower for
CUDA (custom call `mosaic_gpu_v2`). So a Mosaic GPU kernel is possible; it was not
chosen, for four reasons:
- float32 queries: warpgroup MMA has no full-float32 mode (tf32 at best, ~1e-3
  relative), so it cannot meet the float32 contract of this kernel; Triton's dot has an
  exact "ieee" mode;
- decode tiles: warpgroup MMA takes 64-row tiles, 16 times the 4 rows (1 token x 4 query
  heads) of a Llama-3 decode step per KV head; int8 / float8 pages must be requantized
  through shared memory to feed it;
- hardware: Mosaic GPU targets Hopper and newer; Triton also runs on Ampere;
- verification: much of a Mosaic GPU kernel (layouts, swizzles, barrier pipelining) is
  checked only on the device, and no GPU was at hand while it was written; the Triton
  module this file emits passes the Triton dialect verifier on the CPU and compiles to a
  cubin for sm_89 and sm_90 with the triton package
  (tests/kernels/test_gpu_triton_compile.py). Since then it has run compiled on an H200
  (jax 0.11.2): its tests pass, and it decodes at up to 85% of the H200's peak HBM
  bandwidth (README, GPU kernel).
Porting the same tiling to Mosaic GPU for bf16 on Hopper is the follow-up once a Hopper
machine can test it. The kernel body uses only loads, stores, dots, reductions and
loops, which the Triton backend lowers on jax 0.10 (and, deprecated but present, on
0.11 and 0.12).

Layout of the work: see `kernels_pallas.gpu.kernel`, the kernel body.

Guarantees: the contract of `kernels_pallas.reference.ragged_paged_attention` (causal
and non-causal, sliding window, soft cap, int8 / float8_e4m3fn KV with scales, GQA);
rows of valid sequences that see no key, and every row past cu_q_lens[num_seqs], give
out 0 and lse -inf; nothing past a sequence's kv_len, no page-table slot past its last
page and no sequence past num_seqs is used in a valid row. float8 pages need a GPU that
converts float8_e4m3fn (compute capability 8.9 or newer). Both dot products run in the
wider of q's and a float cache's dtype (kernels_pallas.precision): float32 for bfloat16
queries over a float32 cache, and for float16 queries over a bfloat16 or float32 cache
(a cache value past float16's range would be inf in float16).

Limits (ValueError at trace time): head_dim must be a power of two >= 16; the knobs
are ints or None: block_m and block_k powers of two >= 16 (Triton block shapes are
powers of two), num_warps a power of two <= 32, num_kv_splits, num_stages and max_q_len
>= 1; `interpret` a bool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.gpu.kernel import paged_attention_kernel
from kernels_pallas.gpu.tuning import default_config
from kernels_pallas.precision import compute_dtype, matmul_precision
from kernels_pallas.static_options import check_int_knobs
from kernels_pallas.validation import (
    checks_index_values,
    output_dtype,
    validate_ragged_paged_attention_inputs,
)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _merge_splits(
    out: jax.Array,  # f32[num_splits, num_rows, head_dim]
    lse: jax.Array,  # f32[num_splits, num_rows]
) -> tuple[jax.Array, jax.Array]:
    """LSE merge of partial results over disjoint key sets; empty splits weigh 0."""
    m = lse.max(axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - m_safe[None]))
    denom = w.sum(axis=0)
    seen = denom != 0  # NaN (from NaN or inf data) must not read as "no keys"
    denom_safe = jnp.where(seen, denom, 1.0)
    merged = (w[..., None] * out).sum(axis=0) / denom_safe[:, None]
    return merged, jnp.where(seen, m_safe + jnp.log(denom_safe), -jnp.inf)


def _gpu_compute_capability() -> float | None:
    """The first local GPU's compute capability (8.0 for an A100), None without a GPU."""
    try:
        return float(jax.local_devices(backend="gpu")[0].compute_capability)
    except (RuntimeError, AttributeError, ValueError, IndexError):
        return None


_MAX_WARPS = 32  # 1024 threads, the most one CUDA block may have


def _validate_knobs(interpret, **knobs) -> None:
    """Each knob an int (numpy ints too, bools not) or None, in range, and `interpret` a
    bool: a float block size failed in `n & (n - 1)` naming nothing, a float split count
    in Pallas's grid check, a float num_warps reached Triton as std::bad_cast, True ran
    as 1, and `interpret="no"` interpreted (by truthiness)."""
    check_int_knobs(**knobs)
    if not isinstance(interpret, bool):
        raise ValueError(f"{interpret=} must be a bool")
    for name in ("max_q_len", "num_kv_splits", "num_stages"):
        if knobs[name] is not None and knobs[name] < 1:
            raise ValueError(f"{name}={knobs[name]} must be >= 1 or None")
    num_warps = knobs["num_warps"]
    if num_warps is not None and not (_is_pow2(num_warps) and num_warps <= _MAX_WARPS):
        # Triton asserts a power of two; more than 32 warps is more threads than a block has.
        raise ValueError(f"{num_warps=} must be a power of two <= {_MAX_WARPS} or None")


def _validate_gpu(
    q: jax.Array, kv_pages: jax.Array, block_m: int, group: int, block_k: int, interpret: bool
) -> None:
    head_dim = q.shape[2]
    if jnp.dtype(kv_pages.dtype) == jnp.dtype(jnp.float8_e4m3fn) and not interpret:
        cc = _gpu_compute_capability()
        if cc is not None and cc < 8.9:
            raise ValueError(
                f"{kv_pages.dtype=} needs a GPU of compute capability >= 8.9 (this one: {cc})"
            )
    if not (_is_pow2(head_dim) and head_dim >= 16):
        raise ValueError(f"{q.shape=}: head_dim must be a power of two >= 16 on the GPU kernel")
    if not (_is_pow2(block_m) and block_m >= 16 and block_m >= group):
        raise ValueError(f"{block_m=} must be a power of two >= max(16, {group=})")
    if not (_is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"{block_k=} must be a power of two >= 16")


@checks_index_values
@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "causal",
        "sliding_window",
        "soft_cap",
        "k_scale",
        "v_scale",
        "max_q_len",
        "interpret",
        "block_m",
        "block_k",
        "num_kv_splits",
        "num_warps",
        "num_stages",
        "out_dtype",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    max_q_len: int | None = None,
    interpret: bool = False,
    block_m: int | None = None,
    block_k: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """(out [max_num_tokens, num_q_heads, head_dim] in out_dtype (None: q.dtype), lse
    f32[max_num_tokens, num_q_heads]) with the contract of
    `kernels_pallas.reference.ragged_paged_attention`.

    Only the first num_seqs sequences are valid. `max_q_len` (static) is a sizing hint
    only (1 picks decode tiles); any query length gives correct results. Tuning knobs are
    static: `block_m` rows (tokens x query heads of one KV head) per program,
    `block_k` keys per inner step, `num_kv_splits` partitions of each sequence's
    keys merged through their LSEs, and Triton's `num_warps` / `num_stages`. None picks
    a default from the static shapes. `interpret=True` runs the kernel on the CPU.
    Called on concrete arrays, raises ValueError for index values out of range (a page id
    past kv_pages, a kv_len past its pages; kernels_pallas.validation) before anything runs,
    and for any array of a dtype the kernel does not take as given (a numpy float64 q, an
    int64 page table), which jit would convert silently.
    The kernel is traced with 32-bit types whatever `jax_enable_x64` says, so it is the
    same program either way (under x64, its index arithmetic would run in 64 bits).
    """
    validate_ragged_paged_attention_inputs(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, causal=causal, sliding_window=sliding_window,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype,
    )  # fmt: skip
    _validate_knobs(
        interpret, max_q_len=max_q_len, block_m=block_m, block_k=block_k,
        num_kv_splits=num_kv_splits, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    max_num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_combined_kv_heads, _ = kv_pages.shape
    num_kv_heads = num_combined_kv_heads // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape
    dots_dtype = compute_dtype(q.dtype, kv_pages.dtype)
    default = default_config(
        max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs,
        max_q_len=max_q_len,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        q_itemsize=dots_dtype.itemsize,  # the dots' dtype: float32 for bf16 q over f32
        kv_itemsize=jnp.dtype(kv_pages.dtype).itemsize,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
    )
    # Python ints: a numpy int in the grid reads to Pallas as a dynamic bound, which the
    # Triton backend refuses when lowering for CUDA.
    block_m = int(default.block_m if block_m is None else block_m)
    block_k = int(default.block_k if block_k is None else block_k)
    num_kv_splits = int(default.num_kv_splits if num_kv_splits is None else num_kv_splits)
    num_warps = int(default.num_warps if num_warps is None else num_warps)
    num_stages = int(default.num_stages if num_stages is None else num_stages)
    _validate_gpu(q, kv_pages, block_m, group, block_k, interpret)

    num_rows = max_num_tokens * num_q_heads + block_m
    tokens_per_block = block_m // group
    grid = (max_num_tokens // tokens_per_block + max_num_seqs, num_kv_heads, num_kv_splits)

    out_dtype = output_dtype(q, out_dtype)
    # Splits are merged in float32, so their partial outputs are not rounded first.
    split_dtype = out_dtype if num_kv_splits == 1 else jnp.float32
    kernel = functools.partial(
        paged_attention_kernel,
        sm_scale=float(sm_scale),
        causal=causal,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        block_m=block_m,
        block_k=block_k,
        num_kv_splits=num_kv_splits,
        group=group,
        num_q_heads=num_q_heads,
        max_num_seqs=max_num_seqs,
        num_tokens=max_num_tokens,
        compute_dtype=dots_dtype,
        precision=matmul_precision(dots_dtype),
    )
    whole = pl.BlockSpec()
    kv_block = (num_pages, page_size, None, head_dim)
    with jax.enable_x64(False):  # see ragged_paged_attention's docstring
        out, lse = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[
                whole,  # cu_q_lens
                whole,  # kv_lens
                whole,  # page_indices
                whole,  # num_seqs
                whole,  # q
                pl.BlockSpec(kv_block, lambda i, h, s: (0, 0, 2 * h, 0)),  # K of head h
                pl.BlockSpec(kv_block, lambda i, h, s: (0, 0, 2 * h + 1, 0)),  # V of head h
            ],
            out_specs=[
                pl.BlockSpec((None, num_rows, head_dim), lambda i, h, s: (s, 0, 0)),
                pl.BlockSpec((None, num_rows), lambda i, h, s: (s, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((num_kv_splits, num_rows, head_dim), split_dtype),
                jax.ShapeDtypeStruct((num_kv_splits, num_rows), jnp.float32),
            ],
            compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            interpret=interpret,
            name="ragged_paged_attention_gpu",
        )(
            cu_q_lens,
            kv_lens,
            page_indices,
            num_seqs,
            q.reshape(-1, head_dim),
            kv_pages,
            kv_pages,
        )
    if num_kv_splits == 1:
        out, lse = out[0], lse[0]
    else:
        out, lse = _merge_splits(out, lse)
    out, lse = out[: num_rows - block_m], lse[: num_rows - block_m]

    # Rows no program wrote (outside cu_q_lens[0]:cu_q_lens[num_seqs]) hold whatever the
    # buffer held.
    tok = jnp.arange(max_num_tokens, dtype=jnp.int32)
    tok_valid = (tok >= cu_q_lens[0]) & (tok < cu_q_lens[num_seqs[0]])
    out = out.reshape(max_num_tokens, num_q_heads, head_dim)
    lse = lse.reshape(max_num_tokens, num_q_heads)
    out = jnp.where(tok_valid[:, None, None], out, 0).astype(out_dtype)
    lse = jnp.where(tok_valid[:, None], lse, -jnp.inf)
    return out, lse
