"""Validation of ragged paged attention arguments, shared by every backend.

Two kinds of checks, each error naming the argument and what was expected:

- `validate_ragged_paged_attention_inputs`: shapes, dtypes and static options only, so
  it runs while tracing and never forces a device value (its dtype part, `check_dtypes`,
  also runs on the arguments as given, before a jitted entry point converts them);
- `validate_index_values` (applied by the `checks_index_values` decorator of every
  public entry point): the values of the index arrays, on concrete arrays only, before
  anything is traced or run. Under jit the values are unknown and it does nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.scales import check_folded_scales, is_positive_finite
from kernels_pallas.static_options import (
    check_int_knobs,
    check_option_types,
    refuse_array_options,
    static_number_options,
)

QUANTIZED_KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
INT32_MAX = 2**31 - 1


def check_arrays(**arrays) -> None:
    """ValueError naming the first argument that is no numpy or jax array (traced or
    abstract ones included): a list or a Python number failed deep inside with an
    AttributeError or TypeError ('list' object has no attribute 'ndim') naming nothing."""
    for name, value in arrays.items():
        if not isinstance(value, (np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct)):
            raise ValueError(f"{name} must be a numpy or jax array, not {type(value).__name__}")


def _check_kernel_arrays(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    """check_arrays of a kernel entry point's array arguments, each by its name."""
    check_arrays(
        q=q, kv_pages=kv_pages, kv_lens=kv_lens, page_indices=page_indices,
        cu_q_lens=cu_q_lens, num_seqs=num_seqs,
    )  # fmt: skip


def validate_ragged_paged_attention_inputs(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    causal: bool,
    sliding_window: int | None,
    soft_cap: float | None,
    k_scale: float | None,
    v_scale: float | None,
    out_dtype=None,
) -> None:
    """Raises ValueError if the arguments break the layout conventions of the kernels
    (shapes as in kernels_pallas.reference.ragged_paged_attention)."""
    _check_kernel_arrays(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be [max_num_tokens, num_q_heads, head_dim]")
    if kv_pages.ndim != 4:
        raise ValueError(
            f"{kv_pages.shape=} must be [num_pages, page_size, 2 * num_kv_heads, head_dim]"
        )
    _, num_q_heads, head_dim = q.shape
    _, _, num_combined_kv_heads, kv_head_dim = kv_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"{kv_pages.shape=} head_dim must equal {q.shape[2]=}")
    if num_combined_kv_heads % 2 or num_combined_kv_heads < 2:
        raise ValueError(
            f"{kv_pages.shape=}: combined KV heads (axis 2) must be a positive even number (K, V)"
        )
    if 0 in q.shape or 0 in kv_pages.shape:  # padded shapes hold at least one of each
        raise ValueError(f"{q.shape=} and {kv_pages.shape=} must have no zero-size axis")
    num_kv_heads = num_combined_kv_heads // 2
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{q.shape[1]=} (query heads) must be a multiple of {num_kv_heads=}")
    check_dtypes(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if out_dtype is not None and _dtype_or_none(out_dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{out_dtype=} must be None (q's dtype) or float32, bfloat16, float16")
    if jnp.dtype(kv_pages.dtype) in QUANTIZED_KV_DTYPES and (k_scale is None or v_scale is None):
        raise ValueError(f"{kv_pages.dtype=} is quantized: k_scale and v_scale are required")
    if kv_lens.ndim != 1:
        raise ValueError(f"{kv_lens.shape=} must be [max_num_seqs]")
    max_num_seqs = kv_lens.shape[0]
    if page_indices.ndim != 2 or page_indices.shape[0] != max_num_seqs:
        raise ValueError(f"{page_indices.shape=} must be [{max_num_seqs=}, pages_per_seq]")
    if 0 in page_indices.shape:
        raise ValueError(f"{page_indices.shape=}: max_num_seqs and pages_per_seq must be >= 1")
    if cu_q_lens.shape != (max_num_seqs + 1,):
        raise ValueError(f"{cu_q_lens.shape=} must be ({max_num_seqs + 1},) = (max_num_seqs + 1,)")
    if num_seqs.shape != (1,):
        raise ValueError(f"{num_seqs.shape=} must be (1,)")
    if not isinstance(causal, (bool, np.bool_)):  # "no" ran causal, None not, by truthiness
        raise ValueError(f"{causal=} must be a bool")
    if not is_positive_finite(sm_scale):
        raise ValueError(f"{sm_scale=} must be a finite number > 0 in float32, not subnormal")
    for name, value in (("soft_cap", soft_cap), ("k_scale", k_scale), ("v_scale", v_scale)):
        if value is not None and not is_positive_finite(value):
            raise ValueError(
                f"{name}={value!r} must be a finite number > 0 in float32, not subnormal, or None"
            )
    check_folded_scales(sm_scale, soft_cap, k_scale)
    if sliding_window is not None:
        if not causal:
            raise ValueError(f"{sliding_window=} needs causal=True (a prefix pass sees all keys)")
        check_int_knobs(sliding_window=sliding_window)
        if sliding_window < 1:
            raise ValueError(f"{sliding_window=} must be >= 1 or None")
        if sliding_window > INT32_MAX:  # positions are int32; jit's parsing would overflow
            raise ValueError(
                f"{sliding_window=} must be <= 2**31 - 1 (int32 positions); None for no window"
            )


def check_dtypes(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    """ValueError naming the first array argument of a kernel entry point whose dtype no
    kernel takes: q not float32, bfloat16 or float16, kv_pages none of those, int8 or
    float8_e4m3fn, an index array not int32. The checks_index_values decorator runs it on
    the arguments as given, before jit converts them: without jax_enable_x64, jit turns a
    numpy float64 q into float32 and an int64 page table into int32 (wrapping values past
    int32) without a word, where the eager reference and x64 mode refused them."""
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{q.dtype=} must be one of float32, bfloat16, float16")
    if jnp.dtype(kv_pages.dtype) not in FLOAT_DTYPES + QUANTIZED_KV_DTYPES:
        raise ValueError(f"{kv_pages.dtype=} must be a float type, int8 or float8_e4m3fn")
    indices = dict(
        kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens, num_seqs=num_seqs
    )
    for name, arr in indices.items():
        if jnp.dtype(arr.dtype) != jnp.dtype(jnp.int32):
            raise ValueError(f"{name}.dtype={arr.dtype} must be int32")


def _dtype_or_none(x) -> jnp.dtype | None:
    try:
        return jnp.dtype(x)
    except TypeError:
        return None


def output_dtype(q: jax.Array, out_dtype) -> jnp.dtype:
    """The dtype of a kernel's `out`: `out_dtype`, or q's dtype when it is None."""
    return jnp.dtype(q.dtype if out_dtype is None else out_dtype)


def _well_shaped(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> bool:
    """Whether the arrays have the ranks and matching sizes the value checks read."""
    return not (
        np.ndim(q) != 3
        or np.ndim(kv_pages) != 4
        or np.ndim(kv_lens) != 1
        or np.shape(page_indices)[:1] != np.shape(kv_lens)
        or np.ndim(page_indices) != 2
        or np.shape(cu_q_lens) != (np.shape(kv_lens)[0] + 1,)
        or np.shape(num_seqs) != (1,)
    )


def validate_index_values(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    *,
    causal: bool = True,
) -> None:
    """Raises ValueError, naming the first bad entry, unless num_seqs[0] lies in
    [0, max_num_seqs], cu_q_lens[:num_seqs + 1] is non-decreasing from 0 to at most
    max_num_tokens, every valid kv_lens entry lies in [0, pages_per_seq * page_size]
    (and, when `causal`, is at least its sequence's query length: the queries are the
    last q_len of its keys) and every page a valid sequence reads (its first
    ceil(kv_len / page_size) entries) lies in [0, num_pages). Entries no valid sequence
    reads may hold anything.

    Does nothing while tracing (a traced index array), and leaves malformed shapes to
    `validate_ragged_paged_attention_inputs`.
    """
    index_arrays = (kv_lens, page_indices, cu_q_lens, num_seqs)
    if any(isinstance(a, jax.core.Tracer) for a in index_arrays):
        return
    if not _well_shaped(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
        return
    kv_lens, page_indices, cu_q_lens, num_seqs = (np.asarray(a) for a in index_arrays)
    max_num_tokens = np.shape(q)[0]
    num_pages, page_size = np.shape(kv_pages)[:2]
    max_num_seqs, pages_per_seq = page_indices.shape
    n = int(num_seqs[0])
    if not 0 <= n <= max_num_seqs:
        raise ValueError(f"num_seqs[0]={n} must be in [0, {max_num_seqs=}]")
    cu = cu_q_lens[: n + 1].astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens[0]={cu[0]} must be 0 (the first sequence's first token)")
    bad = np.flatnonzero((cu < np.concatenate([[0], cu[:-1]])) | (cu > max_num_tokens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"cu_q_lens[{i}]={cu[i]} must be in [{cu[i - 1]}, {max_num_tokens=}]"
            " (cu_q_lens[:num_seqs + 1] non-decreasing from 0)"
        )
    lens = kv_lens[:n].astype(np.int64)
    capacity = pages_per_seq * page_size
    bad = np.flatnonzero((lens < 0) | (lens > capacity))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"kv_lens[{i}]={lens[i]} must be in [0, {capacity}] "
            f"(pages_per_seq * page_size = {pages_per_seq} * {page_size})"
        )
    if causal:
        bad = np.flatnonzero(lens < np.diff(cu))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"kv_lens[{i}]={lens[i]} must be >= the sequence's query length "
                f"{cu[i + 1] - cu[i]} (causal: its queries are the last q_len of its keys)"
            )
    pages = page_indices[:n]
    read = np.arange(pages_per_seq)[None, :] < -(-lens[:, None] // page_size)
    bad = np.argwhere(read & ((pages < 0) | (pages >= num_pages)))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise ValueError(
            f"page_indices[{i}, {j}]={pages[i, j]} must be in [0, {num_pages=}) "
            f"(sequence {i} reads {-(-lens[i] // page_size)} pages for kv_lens[{i}]={lens[i]})"
        )


def validate_shared_prefix(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # i32[max_num_seqs]
    page_indices: jax.Array,  # i32[max_num_seqs, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[max_num_seqs + 1]
    num_seqs: jax.Array,  # i32[1]
    num_prefix_pages: jax.Array | int,  # i32[]
) -> None:
    """Raises ValueError, naming the first bad entry, unless the cascade precondition holds:
    `num_prefix_pages` lies in [0, pages_per_seq] and every valid sequence with query
    tokens holds sequence 0's first num_prefix_pages page ids (the prefix pass reads row
    0's) and has its first query at or past them (kv_len - q_len >= num_prefix_pages *
    page_size). Either would otherwise give another sequence's keys, or keys after a
    query, without an error. Does nothing while tracing or on malformed shapes, like
    validate_index_values, which it runs first. Raises ValueError naming an argument
    that is no array, or one of a dtype the kernels do not take (check_dtypes: the
    passes get arrays derived from these, so an int64 kv_lens reached them as int32
    with x64 off, and was refused on)."""
    _check_kernel_arrays(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    check_dtypes(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    validate_index_values(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    index_arrays = (kv_lens, page_indices, cu_q_lens, num_seqs, num_prefix_pages)
    if any(isinstance(a, jax.core.Tracer) for a in index_arrays) or not _well_shaped(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs
    ):  # malformed shapes are left to validate_ragged_paged_attention_inputs
        return
    as_array = np.asarray(num_prefix_pages)  # shape (1, 1) broadcast the page table a rank up
    if as_array.size != 1 or as_array.ndim > 1 or not np.issubdtype(as_array.dtype, np.integer):
        raise ValueError(f"{num_prefix_pages=} must be one integer (a scalar or shape (1,))")
    k = int(as_array.reshape(-1)[0])
    page_indices = np.asarray(page_indices)
    pages_per_seq = page_indices.shape[1]
    if not 0 <= k <= pages_per_seq:
        raise ValueError(f"num_prefix_pages={k} must be in [0, {pages_per_seq=}]")
    n = int(np.asarray(num_seqs)[0])
    prefix_len = k * np.shape(kv_pages)[1]
    q_lens = np.diff(np.asarray(cu_q_lens)[: n + 1].astype(np.int64))
    first_pos = np.asarray(kv_lens)[:n].astype(np.int64) - q_lens
    bad = np.flatnonzero((q_lens > 0) & (first_pos < prefix_len))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"sequence {i}'s first query position {first_pos[i]} lies inside the "
            f"{prefix_len} tokens of num_prefix_pages={k}: the non-causal prefix pass "
            "would show it keys after itself"
        )
    differs = (page_indices[:n, :k] != page_indices[:1, :k]) & (q_lens > 0)[:, None]
    bad = np.argwhere(differs)
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise ValueError(
            f"page_indices[{i}, {j}]={page_indices[i, j]} must equal page_indices[0, {j}]="
            f"{page_indices[0, j]}: num_prefix_pages={k} pages must be shared by every "
            "sequence with query tokens (the prefix pass reads sequence 0's)"
        )


def checks_index_values(fn: Callable) -> Callable:
    """Wraps a kernel entry point `fn(q, kv_pages, kv_lens, page_indices, cu_q_lens,
    num_seqs, **options)` so that check_arrays, `check_dtypes` (on the arrays as given,
    before a jit inside `fn` converts a 64-bit numpy array) and `validate_index_values`
    run before it, with static_number_options applied to `options`, any other option
    given as an array refused by name (refuse_array_options: every option of an entry
    point is static) and the types of counts and flags checked (check_option_types),
    all before jit's cache, which takes 2.0 for 2 and 1 for True."""

    @functools.wraps(fn)
    def checked(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options):
        options = static_number_options(options)
        refuse_array_options(options)
        check_option_types(options)
        _check_kernel_arrays(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
        check_dtypes(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
        causal = options.get("causal", True)
        validate_index_values(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, causal=bool(causal)
        )
        return fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **options)

    return checked
