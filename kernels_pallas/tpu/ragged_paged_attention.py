"""Ragged paged attention for TPU (Pallas Mosaic), returning (out, lse): the wrapper.

Contract: the one of `kernels_pallas.reference.ragged_paged_attention` (same arguments,
same (out, lse), causal and non-causal), plus static tuning knobs and `interpret`. This
module checks what Mosaic can take, picks the tiling, folds each KV head's group of
query heads into the rows of one matmul ([T, Hq, D] -> [Hkv, T * G, D]) and calls the
kernel body (`kernels_pallas.tpu.kernel`, whose docstring describes the layout).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.precision import compute_dtype
from kernels_pallas.static_options import check_int_knobs
from kernels_pallas.tpu.kernel import LANES, paged_attention_kernel
from kernels_pallas.tpu.tuning import TUNED_BLOCK_SIZES, block_sizes, detect_tpu_generation
from kernels_pallas.validation import (
    checks_index_values,
    output_dtype,
    validate_ragged_paged_attention_inputs,
)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
Q_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
KV_DTYPES = Q_DTYPES + (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 16, 256


def sublane_tiling(dtype) -> int:
    """Rows of one (rows, 128) Mosaic tile of `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def check_shapes(head_dim: int, page_size: int, q_dtype, *, names=(None, None)) -> None:
    """ValueError unless this kernel takes heads of `head_dim` and pages of `page_size`
    tokens with queries of `q_dtype`: head_dim one of SUPPORTED_HEAD_DIMS, page_size in
    [MIN_PAGE_SIZE, MAX_PAGE_SIZE] and a multiple of the queries' sublane tiling (at
    least 8). `names` say where each came from, for the message (the kernel's own
    check: its arrays' axes; a script: its flags). The kernel applies this rule and no
    other to them, so a caller checking its inputs early need not repeat it."""

    def subject(name, what, value):
        return f"{what}={value}" if name is None else f"{name}={value} ({what})"

    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{subject(names[0], 'head_dim', head_dim)} must be one of {SUPPORTED_HEAD_DIMS}"
        )
    tiling = max(sublane_tiling(q_dtype), 8)
    if not MIN_PAGE_SIZE <= page_size <= MAX_PAGE_SIZE or page_size % tiling:
        raise ValueError(
            f"{subject(names[1], 'page_size', page_size)} must be in [{MIN_PAGE_SIZE}, "
            f"{MAX_PAGE_SIZE}] and a multiple of {tiling} (sublane tiling of "
            f"{jnp.dtype(q_dtype).name})"
        )


def _validate_tpu(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    *,
    num_queries_per_block: int | None,
    num_kv_pages_per_block: int | None,
    num_kv_heads_per_block: int | None,
    vmem_limit_bytes: int | None,
    interpret,
) -> None:
    """What this kernel adds to the shared validation: Mosaic's dtypes and tiling."""
    check_int_knobs(
        num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_kv_heads_per_block=num_kv_heads_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
    )
    if not isinstance(interpret, (bool, pltpu.InterpretParams)):  # "no" would interpret
        raise ValueError(f"{interpret=} must be a bool or a pltpu.InterpretParams")
    head_dim = q.shape[2]
    page_size = kv_pages.shape[1]
    num_kv_heads = kv_pages.shape[2] // 2
    group = q.shape[1] // num_kv_heads
    if jnp.dtype(q.dtype) not in Q_DTYPES:
        raise ValueError(f"{q.dtype=} must be float32 or bfloat16 for the TPU kernel")
    if jnp.dtype(kv_pages.dtype) not in KV_DTYPES:
        raise ValueError(
            f"{kv_pages.dtype=} must be float32, bfloat16, int8 or float8_e4m3fn for the TPU kernel"
        )
    check_shapes(head_dim, page_size, q.dtype, names=("q.shape[2]", "kv_pages.shape[1]"))
    q_tiling = sublane_tiling(q.dtype)
    if num_queries_per_block is not None and (
        num_queries_per_block <= 0 or (num_queries_per_block * group) % q_tiling
    ):
        raise ValueError(
            f"{num_queries_per_block=} must be positive and num_queries_per_block * "
            f"{group=} a multiple of {q_tiling}"
        )
    if num_kv_pages_per_block is not None and num_kv_pages_per_block <= 0:
        raise ValueError(f"{num_kv_pages_per_block=} must be positive")
    if num_kv_heads_per_block is not None:
        combined = 2 * num_kv_heads_per_block
        kv_tiling = sublane_tiling(kv_pages.dtype)
        if (
            num_kv_heads_per_block <= 0
            or num_kv_heads % num_kv_heads_per_block
            or (combined != 2 * num_kv_heads and combined % kv_tiling)
        ):
            raise ValueError(
                f"{num_kv_heads_per_block=} must divide {num_kv_heads=} and be either all of "
                f"them or a multiple of {kv_tiling // 2} (tiling of {kv_pages.dtype})"
            )
    if vmem_limit_bytes is not None and vmem_limit_bytes <= 0:
        raise ValueError(f"{vmem_limit_bytes=} must be positive")


def _default_kv_heads_per_block(num_kv_heads: int, kv_dtype) -> int:
    # A block of combined heads must fill whole sublane tiles of kv_pages for the page DMA,
    # or be every head.
    kv_tiling = sublane_tiling(kv_dtype)
    if (2 * num_kv_heads) % kv_tiling == 0:
        return kv_tiling // 2
    return num_kv_heads


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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
        "interpret",
        "num_queries_per_block",
        "num_kv_pages_per_block",
        "num_kv_heads_per_block",
        "vmem_limit_bytes",
        "tpu_generation",
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
    interpret: bool | pltpu.InterpretParams = False,
    num_queries_per_block: int | None = None,
    num_kv_pages_per_block: int | None = None,
    num_kv_heads_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    tpu_generation: str = "default",
    out_dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Paged attention of a ragged batch on TPU; (out in out_dtype (None: q.dtype), lse
    f32[T, Hq]).

    Semantics are those of `kernels_pallas.reference.ragged_paged_attention`: only the
    first num_seqs sequences (and their page-table rows, lengths) are read; a row that sees
    no key and every row past cu_q_lens[num_seqs] gives out 0 and lse -inf. Both dot
    products run in the wider of q's and a float cache's dtype (kernels_pallas.precision):
    bfloat16 queries over a float32 cache compute in float32.

    Tuning knobs (static; None takes the `tpu_generation` row of `tuning.TUNED_BLOCK_SIZES`
    and no device is queried, except with `tpu_generation="auto"`, which asks the first
    JAX device for its kind): `num_queries_per_block` query tokens per q tile,
    `num_kv_pages_per_block` pages per KV block, `num_kv_heads_per_block` KV heads per grid
    step, `vmem_limit_bytes` Mosaic's scoped VMEM limit. `interpret=True` (or an
    `InterpretParams`) runs the kernel in the TPU interpreter, on any backend.

    Raises ValueError at trace time for arguments the kernel cannot take (head_dim not in
    64/128/256, page size outside 16..256 or not a multiple of the sublane tiling,
    mismatched heads, unsupported dtypes, bad knobs), naming the argument (dtypes are
    checked as given, before jit would turn a numpy float64 q or int64 page table into
    float32 or int32 silently); called on
    concrete arrays, also for index values out of range (a page id past kv_pages, a
    kv_len past its pages; kernels_pallas.validation), before anything runs.

    The kernel is traced with 32-bit types whatever `jax_enable_x64` says, so it is the
    same program either way: under x64, Python ints in its index arithmetic would become
    int64, which Mosaic's memref slices refuse.
    """
    validate_ragged_paged_attention_inputs(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, causal=causal, sliding_window=sliding_window,
        soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale, out_dtype=out_dtype,
    )  # fmt: skip
    _validate_tpu(
        q,
        kv_pages,
        num_queries_per_block=num_queries_per_block,
        num_kv_pages_per_block=num_kv_pages_per_block,
        num_kv_heads_per_block=num_kv_heads_per_block,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=interpret,
    )
    if tpu_generation == "auto":
        tpu_generation = detect_tpu_generation() or "default"
        tpu_generation = tpu_generation if tpu_generation in TUNED_BLOCK_SIZES else "default"
    defaults = block_sizes(tpu_generation)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_combined_kv_heads, _ = kv_pages.shape
    num_kv_heads = num_combined_kv_heads // 2
    group = num_q_heads // num_kv_heads
    max_num_seqs, pages_per_seq = page_indices.shape

    q_tiling = sublane_tiling(q.dtype)
    q_step = q_tiling // math.gcd(group, q_tiling)  # smallest bq with bq * group tiled
    bq = num_queries_per_block
    if bq is None:
        bq = defaults.num_queries_per_block
        if not causal:
            bq = defaults.num_queries_per_block_non_causal
        bq = min(_round_up(bq, q_step), _round_up(num_tokens, q_step))
    pages_per_blk = num_kv_pages_per_block
    if pages_per_blk is None:
        pages_per_blk = min(max(1, defaults.kv_tokens_per_block // page_size), pages_per_seq)
    kv_heads_per_blk = num_kv_heads_per_block or _default_kv_heads_per_block(
        num_kv_heads, kv_pages.dtype
    )
    if vmem_limit_bytes is None:
        vmem_limit_bytes = defaults.vmem_limit_bytes
    # Python ints: Mosaic refuses a numpy int as vmem_limit_bytes when lowering.
    bq, pages_per_blk, kv_heads_per_blk = int(bq), int(pages_per_blk), int(kv_heads_per_blk)
    if vmem_limit_bytes is not None:  # None: Mosaic's own default
        vmem_limit_bytes = int(vmem_limit_bytes)

    padded_tokens = _round_up(num_tokens, bq)
    rows = bq * group
    # Smallest aligned row window that always holds one decode token's `group` rows.
    window_rows = min(rows, _round_up(group + q_tiling - 1, q_tiling))
    # [T, Hq, D] -> [Hkv, T * G, D]: the G query heads of a KV head become matmul rows,
    # in the dots' dtype: bfloat16 queries over a float32 cache run the float32 kernel
    # body (the tiling above stays q's, whose alignment also holds for float32 rows).
    q_rows = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    q_rows = q_rows.astype(compute_dtype(q.dtype, kv_pages.dtype))
    q_rows = q_rows.reshape(padded_tokens, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group, head_dim)

    grid = (num_kv_heads // kv_heads_per_blk, padded_tokens // bq)
    tile_spec = pl.BlockSpec((kv_heads_per_blk, rows, head_dim), lambda h, t, *_: (h, t, 0))
    lse_spec = pl.BlockSpec((kv_heads_per_blk, rows, LANES), lambda h, t, *_: (h, t, 0))
    row_stats = pltpu.VMEM((kv_heads_per_blk, rows, LANES), jnp.float32)
    scratch_shapes = [
        pltpu.VMEM(
            (2, pages_per_blk, page_size, 2 * kv_heads_per_blk, head_dim), kv_pages.dtype
        ),  # kv_bufs
        pltpu.SemaphoreType.DMA((2,)),  # sems
        row_stats,  # m_ref
        row_stats,  # l_ref
        pltpu.VMEM((kv_heads_per_blk, rows, head_dim), jnp.float32),  # acc_ref
    ]
    scalar_prefetch = (kv_lens, page_indices.reshape(-1), cu_q_lens, num_seqs)
    kernel = functools.partial(
        paged_attention_kernel,
        group=group,
        window_rows=window_rows,
        row_align=q_tiling,
        pages_per_seq=pages_per_seq,
        max_num_seqs=max_num_seqs,
        sm_scale=float(sm_scale),
        causal=causal,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    if interpret is True:
        interpret = pltpu.InterpretParams()
    with jax.enable_x64(False):  # see ragged_paged_attention's docstring
        out_rows, lse_rows = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(scalar_prefetch),
                in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY)],
                out_specs=[tile_spec, lse_spec],
                grid=grid,
                scratch_shapes=scratch_shapes,
            ),
            out_shape=[
                jax.ShapeDtypeStruct(q_rows.shape, output_dtype(q, out_dtype)),
                jax.ShapeDtypeStruct((num_kv_heads, padded_tokens * group, LANES), jnp.float32),
            ],
            compiler_params=pltpu.CompilerParams(
                # Grid steps share no state (each starts its own first copy), so both axes
                # may be split across TensorCores.
                dimension_semantics=("parallel", "parallel"),
                vmem_limit_bytes=vmem_limit_bytes,
            ),
            interpret=interpret or False,
            name="jaxkv_ragged_paged_attention",
        )(*scalar_prefetch, q_rows, kv_pages)

    out = out_rows.reshape(num_kv_heads, padded_tokens, group, head_dim).transpose(1, 0, 2, 3)
    out = out.reshape(padded_tokens, num_q_heads, head_dim)[:num_tokens]
    lse = lse_rows[..., 0].reshape(num_kv_heads, padded_tokens, group).transpose(1, 0, 2)
    lse = lse.reshape(padded_tokens, num_q_heads)[:num_tokens]
    return out, lse
