"""Attention dispatch: flat or cascade paged attention on the chosen backend, and the KV write.

`paged_attention` runs the main causal pass of AttentionMetadata and every cascade
level (non-causal passes over shared pages), merging them through their LSEs in
float32. The backend comes from the metadata (or an explicit override):

- "xla": kernels_pallas.reference, plain jnp; the default on the CPU;
- "pallas_tpu": the Pallas TPU (Mosaic) kernel; the default on TPU;
- "pallas_gpu": the Pallas GPU kernel; the default on GPUs.

`interpret=True` runs a Pallas backend in interpret mode on the CPU. The result equals
plain causal attention over each request's whole context, whatever the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.batch import BACKENDS, AttentionMetadata, check_values
from jaxkv.field_checks import is_integer, names_a_dtype
from jaxkv.metadata_as_given import check_index_dtypes, check_static_fields
from kernels_pallas import reference
from kernels_pallas.merge import merge_attn_states
from kernels_pallas.static_options import refuse_array_options, with_static_numbers
from kernels_pallas.validation import (
    FLOAT_DTYPES,
    INT32_MAX,
    QUANTIZED_KV_DTYPES,
    check_arrays,
    is_positive_finite,
)

AttentionFn = Callable[..., tuple[jax.Array, jax.Array]]


def default_backend(platform: str | None = None) -> str:
    """The backend for a JAX platform name ("cpu", "tpu", "gpu"/"cuda"); default: jax's.
    Raises ValueError unless `platform` is None or a str (b"tpu" or 5 answered "xla",
    a list raised TypeError "unhashable type")."""
    if platform is not None and not isinstance(platform, str):
        raise ValueError(f"{platform=} must be None or a JAX platform name (a str)")
    platform = platform or jax.default_backend()
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(platform, "xla")


def kernel_for(
    backend: str, *, interpret: bool = False, max_q_len: int | None = None
) -> AttentionFn:
    """A function with the contract of kernels_pallas.reference.ragged_paged_attention."""
    if backend == "xla":
        return functools.partial(reference.ragged_paged_attention, max_q_len=max_q_len)
    if backend == "pallas_tpu":
        from kernels_pallas.tpu import ragged_paged_attention as tpu_kernel

        # On a TPU the chip's own tuning row (larger query tiles read a shared prefix
        # fewer times); elsewhere (interpreting, or lowering for TPU on a CPU host) the
        # defaults, which never ask a device for its kind.
        on_tpu = not interpret and jax.default_backend() == "tpu"
        generation = "auto" if on_tpu else "default"
        return functools.partial(tpu_kernel, interpret=interpret, tpu_generation=generation)
    if backend == "pallas_gpu":
        from kernels_pallas.gpu import ragged_paged_attention as gpu_kernel

        return functools.partial(gpu_kernel, interpret=interpret, max_q_len=max_q_len)
    raise ValueError(f"{backend=} must be one of {BACKENDS}")


def _check_platform(backend: str, interpret: bool, here: str) -> None:
    """ValueError unless a Pallas `backend` runs interpreted or on its own platform."""
    platform = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}.get(backend)
    if platform is not None and not interpret and here != platform:
        raise ValueError(
            f"{backend=} compiles only on a {platform.upper()} and JAX's platform here is "
            f"{here!r}: pass interpret=True to run it in interpret mode"
        )


def check_backend(
    backend: str,
    *,
    interpret: bool,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    q_dtype,
    kv_dtype,
) -> None:
    """Raises ValueError, naming the limit, unless `backend` can run paged attention of
    these shapes and dtypes (per device) here: a Pallas backend compiles only on its own
    platform, and each kernel has its own limits (head_dim, page size, dtypes), which
    tracing it once on tiny arrays shows without compiling (about 0.1 s the first time;
    an accepted combination is remembered)."""
    sizes = dict(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size,
    )  # fmt: skip
    for name, value in sizes.items():  # jax.eval_shape takes head_dim=-1 or 64.0 as given
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if not isinstance(interpret, bool):
        raise ValueError(f"{interpret=} must be a bool")
    dtypes = dict(q_dtype=q_dtype, kv_dtype=kv_dtype)
    for name, value in dtypes.items():
        try:
            # jnp.dtype(None) is float64 (refused under that name), and jnp.dtype of a
            # value (np.float16(1.0), an array) is that value's dtype.
            if not names_a_dtype(value):
                raise TypeError
            dtypes[name] = jnp.dtype(value)
        except TypeError:
            raise ValueError(f"{name}={value!r} must be a dtype") from None
    # Here, not left to the probe: its eval_shape turns float64 into float32 (x64 off).
    _check_dtype_in("q_dtype", dtypes["q_dtype"], FLOAT_DTYPES)
    _check_dtype_in("kv_dtype", dtypes["kv_dtype"], FLOAT_DTYPES + QUANTIZED_KV_DTYPES)
    _check_platform(backend, interpret, jax.default_backend())
    _probe_kernel(
        backend, interpret, *(int(v) for v in sizes.values()), *dtypes.values()
    )  # fmt: skip


@functools.cache  # a refusal raises, so only accepted combinations are kept
def _probe_kernel(
    backend, interpret, num_q_heads, num_kv_heads, head_dim, block_size, q_dtype, kv_dtype
) -> None:
    spec = jax.ShapeDtypeStruct
    i32 = jnp.int32
    args = (
        spec((8, num_q_heads, head_dim), q_dtype),
        spec((2, block_size, 2 * num_kv_heads, head_dim), kv_dtype),
        spec((1,), i32), spec((1, 1), i32), spec((2,), i32), spec((1,), i32),
    )  # fmt: skip
    kernel = kernel_for(backend, interpret=interpret)
    # A quantized cache is read with scales (any: the probe traces shapes only).
    scales = dict(k_scale=1.0, v_scale=1.0) if kv_dtype in QUANTIZED_KV_DTYPES else {}
    for causal in (True, False):  # the main pass and a cascade level's
        jax.eval_shape(functools.partial(kernel, sm_scale=1.0, causal=causal, **scales), *args)


def _check_dtype_in(label: str, dtype, allowed: tuple[np.dtype, ...]) -> None:
    """ValueError "{label}={dtype} must be one of {allowed}" unless `dtype` is allowed."""
    dtype = jnp.dtype(dtype)
    if dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise ValueError(f"{label}={dtype.name} must be one of {names}")


def _check_dtypes_as_given(q, kv_pages, metadata) -> None:
    """ValueError naming q, kv_pages or an index array of the metadata (or of one of its
    levels) of a dtype the kernels do not take, as given: paged_attention's jit turned a
    numpy float64 q into float32 and an int64 page table into int32 (a value past int32
    wrapping to another block's id) without a word, where x64 mode refused them. Values
    without a dtype (a list) are left to the body's check_arrays."""
    given = dict(q=(q, FLOAT_DTYPES), kv_pages=(kv_pages, FLOAT_DTYPES + QUANTIZED_KV_DTYPES))
    for name, (value, allowed) in given.items():
        dtype = getattr(value, "dtype", None)
        if dtype is not None:
            _check_dtype_in(f"{name}.dtype", dtype, allowed)
    check_index_dtypes(metadata)


class checks_as_given(with_static_numbers):  # lower case: a decorator
    """with_static_numbers, its other static options refused by name as arrays, the
    metadata's static fields checked before jit's cache takes 2.0 for 2
    (check_static_fields), the dtypes of q, kv_pages and the index arrays checked as
    given (before jit converts a 64-bit numpy array), concrete metadata's values checked
    (check_values), and outside jit a Pallas backend must run interpreted or on q's
    platform: JAX's own error names neither (a trace may be lowered for another platform
    on purpose). Wraps paged_attention and sharding.sharded_paged_attention."""

    def __call__(self, *args, **options):
        refuse_array_options(options, ("sliding_window", "backend", "interpret", "return_lse"))
        interpret = options.get("interpret")  # None: the metadata's; 1 would run True's program
        if interpret is not None and not isinstance(interpret, bool):
            raise ValueError(f"{interpret=} must be a bool or None (the metadata's)")
        q = args[0] if args else options.get("q")
        metadata = args[2] if len(args) > 2 else options.get("metadata")
        if isinstance(metadata, AttentionMetadata):
            kv_pages = args[1] if len(args) > 1 else options.get("kv_pages")
            check_static_fields(metadata)  # before jit's cache, whose keys take 2.0 for 2
            _check_dtypes_as_given(q, kv_pages, metadata)
            check_values(metadata, q, kv_pages)  # under jit, below, values are unknown
            if not isinstance(q, jax.core.Tracer):
                backend = options.get("backend") or metadata.backend
                interpret = metadata.interpret if interpret is None else interpret
                devices = q.devices() if isinstance(q, jax.Array) else jax.devices()[:1]
                _check_platform(backend, interpret, next(iter(devices)).platform)
        return super().__call__(*args, **options)


@checks_as_given
@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale", "soft_cap", "sliding_window", "k_scale", "v_scale", "backend",
        "interpret", "return_lse",
    ),
)  # fmt: skip
def paged_attention(
    q: jax.Array,  # [max_num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of every scheduled token over its request's cached context.

    Returns out [max_num_tokens, num_q_heads, head_dim] in q.dtype (and lse f32
    [max_num_tokens, num_q_heads] with return_lse). Padded token rows give 0.
    Raises ValueError for q, kv_pages or an index array of the metadata of a dtype the
    kernels do not take, checked as given (a numpy float64 q or int64 page table, which
    jit would convert silently), when cascade levels are combined with a sliding window (the
    planner never plans that: a non-causal prefix pass cannot honour a window), when
    kv_pages holds fewer blocks than the pool of the manager the metadata was built for,
    and, called outside jit, when a Pallas backend would compile for a platform other
    than q's without interpret=True (under jit, lowering for another platform is left
    to the caller) or, on concrete index arrays, a pass's max_q_len is below its longest
    query or an index value is out of range (jaxkv.batch.check_values).
    """
    if not isinstance(metadata, AttentionMetadata):
        raise ValueError(f"metadata={type(metadata).__name__} must be an AttentionMetadata")
    check_arrays(q=q, kv_pages=kv_pages)  # a list failed on .ndim, naming nothing
    if not isinstance(return_lse, bool):  # "no" returned the tuple, by truthiness
        raise ValueError(f"{return_lse=} must be a bool")
    if kv_pages.ndim != 4:  # else a stacked [num_layers, ...] cache reads as a small pool
        raise ValueError(
            f"{kv_pages.shape=} must be [num_blocks, block_size, 2 * num_kv_heads, head_dim]"
        )
    if kv_pages.shape[1] != metadata.block_size:
        # Under jit nothing else notices: slots and page counts would address other keys.
        raise ValueError(
            f"{kv_pages.shape=} must have pages of the metadata's {metadata.block_size=} tokens"
        )
    if metadata.num_blocks is not None and kv_pages.shape[0] < metadata.num_blocks:
        # Under jit an out-of-range page id is clamped: other blocks' keys, no error.
        raise ValueError(
            f"{kv_pages.shape=} must hold the {metadata.num_blocks} blocks of the pool the "
            "metadata's page ids address (KVCacheManager num_blocks)"
        )
    if q.ndim != 3:  # else q.shape[0] below raised IndexError for a scalar
        raise ValueError(f"{q.shape=} must be [max_num_tokens, num_q_heads, head_dim]")
    if q.shape[0] != metadata.max_num_tokens:
        raise ValueError(f"{q.shape=} must have {metadata.max_num_tokens} (padded) tokens")
    if metadata.levels and sliding_window is not None:
        raise ValueError(f"{sliding_window=} cannot be combined with cascade levels")
    backend = metadata.backend if backend is None else backend
    interpret = metadata.interpret if interpret is None else interpret
    options = dict(sm_scale=sm_scale, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale)
    # With cascade levels every pass returns float32 and the merges run on unrounded
    # partial results: the output is rounded to q.dtype once, as flat attention's is.
    options["out_dtype"] = jnp.float32 if metadata.levels else None
    main = kernel_for(backend, interpret=interpret, max_q_len=metadata.max_q_len)
    out, lse = main(
        q,
        kv_pages,
        metadata.kv_lens,
        metadata.page_indices,
        metadata.cu_q_lens,
        metadata.num_seqs,
        causal=True,
        sliding_window=sliding_window,
        **options,
    )
    for level in metadata.levels:
        prefix = kernel_for(backend, interpret=interpret, max_q_len=level.max_q_len)
        out_l, lse_l = prefix(
            q,
            kv_pages,
            level.kv_lens,
            level.page_indices,
            level.cu_q_lens,
            level.num_seqs,
            causal=False,
            **options,
        )
        out, lse = merge_attn_states(out, lse, out_l, lse_l)
    out = out.astype(q.dtype)
    return (out, lse) if return_lse else out


def _quantize(x: jax.Array, dtype, scale: float | None) -> jax.Array:
    """x / scale in `dtype`, finite values of x saturating at the dtype's range (a float16
    or float8 cast of a value out of its range would give inf or NaN, which attention
    would spread to every query), also where x / scale overflows float32. NaN and inf
    in x stay faults that show in a float cache; an integer cache has no NaN or inf:
    inf saturates and NaN is stored as some integer."""
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)  # before the division, whose overflow is the scale's doing
    if scale is not None:
        x = x / scale
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        x = jnp.clip(jnp.round(x), info.min, info.max)
    else:  # float32 too: a finite x whose x / scale overflows saturates, as in a narrower cache
        limit = float(jnp.finfo(dtype).max)
        x = jnp.where(finite, jnp.clip(x, -limit, limit), x)
    return x.astype(dtype)


def int32_slots(slot_mapping):
    """A numpy slot_mapping of a 64-bit integer dtype as int32, every slot outside int32's
    range (past any cache) made -1, which write_kv drops; anything else as given. jit's
    own conversion to int32 wraps: slot 2**32 + 6 became slot 6, a live block's."""
    if not isinstance(slot_mapping, (np.ndarray, np.generic)):
        return slot_mapping
    if slot_mapping.dtype.kind not in "iu" or slot_mapping.dtype.itemsize <= 4:
        return slot_mapping
    narrow = np.full(np.shape(slot_mapping), -1, np.int32)
    inside = (slot_mapping >= 0) & (slot_mapping <= INT32_MAX)
    narrow[inside] = slot_mapping[inside]
    return narrow


def _check_cache_dtype(kv_pages) -> None:
    """ValueError unless kv_pages has a dtype the kernels read (one without a dtype, a
    list, is left to check_arrays)."""
    dtype = getattr(kv_pages, "dtype", None)
    if dtype is not None and jnp.dtype(dtype) not in FLOAT_DTYPES + QUANTIZED_KV_DTYPES:
        raise ValueError(
            f"kv_pages.dtype={dtype} must be float32, bfloat16, float16, int8 or float8_e4m3fn"
        )


class narrows_wide_slots(with_static_numbers):  # lower case: a decorator
    """with_static_numbers, slot_mapping (the fourth argument) passed through
    int32_slots first, outside jit, and kv_pages's dtype checked as given (jit turned a
    numpy float64 cache into a float32 one without a word)."""

    def __call__(self, *args, **options):
        _check_cache_dtype(args[0] if args else options.get("kv_pages"))
        if len(args) > 3:
            args = (*args[:3], int32_slots(args[3]), *args[4:])
        elif "slot_mapping" in options:
            options["slot_mapping"] = int32_slots(options["slot_mapping"])
        return super().__call__(*args, **options)


@narrows_wide_slots
@functools.partial(jax.jit, donate_argnums=0, static_argnames=("k_scale", "v_scale"))
def write_kv(
    kv_pages: jax.Array,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    k: jax.Array,  # [max_num_tokens, num_kv_heads, head_dim]
    v: jax.Array,  # [max_num_tokens, num_kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[max_num_tokens] block_id * block_size + offset
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> jax.Array:
    """Writes each token's K and V into its slot (K at even, V at odd combined heads).

    The cache is donated and updated in place. Padded tokens carry slots inside the null
    block 0, which no valid row ever reads; a negative slot (vLLM's padding) or one past
    the cache writes nothing, also in a numpy int64 slot_mapping (int32_slots).
    Quantized caches store round(x / scale).
    Raises ValueError (at trace time, and for the cache's dtype also as given, before
    jit converts a numpy float64 cache) unless the cache dtype is one the kernels read
    (float32, bfloat16, float16, int8, float8_e4m3fn), each scale is None or a finite
    number > 0, and the shapes agree.
    """
    check_arrays(kv_pages=kv_pages, k=k, v=v)  # a list failed on .dtype, naming nothing
    _check_cache_dtype(kv_pages)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and not is_positive_finite(scale):
            raise ValueError(f"{name}={scale!r} must be a finite number > 0 in float32, or None")
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2 or kv_pages.shape[2] < 2:
        raise ValueError(
            f"{kv_pages.shape=} must be [num_blocks, block_size, 2 * num_kv_heads, head_dim]"
        )
    dtype = getattr(slot_mapping, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError("slot_mapping must be an integer array (AttentionMetadata.slot_mapping)")
    num_blocks, block_size, num_combined, head_dim = kv_pages.shape
    if k.shape != v.shape or k.shape[1:] != (num_combined // 2, head_dim):
        raise ValueError(
            f"{k.shape=} and {v.shape=} must be [max_num_tokens, {num_combined // 2}, {head_dim}]"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"{slot_mapping.shape=} must be ({k.shape[0]},)")
    kv = jnp.stack(
        [_quantize(k, kv_pages.dtype, k_scale), _quantize(v, kv_pages.dtype, v_scale)], axis=2
    ).reshape(k.shape[0], num_combined, head_dim)
    num_slots = num_blocks * block_size
    flat = kv_pages.reshape(num_slots, num_combined, head_dim)
    # Out of range, so dropped: indexing would wrap a -1 round to the cache's last slot.
    slot_mapping = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    flat = flat.at[slot_mapping].set(kv, mode="drop", unique_indices=False)
    return flat.reshape(kv_pages.shape)
