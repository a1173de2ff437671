"""The TPU kernel lowers for TPU on a machine without one, and rejects what it can't take.

Lowering runs Pallas' Mosaic lowering (block shapes against the (8, 128) tiling, the
lowering rules of every op in the kernel body), which the interpreter does not. It does
not run Mosaic's own compiler passes: those need libtpu and a TPU.
"""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.tpu import TUNED_BLOCK_SIZES, ragged_paged_attention

F32, BF16, I8, FP8 = jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn


def _specs(q_dtype, kv_dtype, head_dim, page_size, num_q_heads, num_kv_heads, *, tokens=64):
    max_num_seqs, pages_per_seq = 8, 8
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    return (
        jax.ShapeDtypeStruct((tokens, num_q_heads, head_dim), q_dtype),
        jax.ShapeDtypeStruct((64, page_size, 2 * num_kv_heads, head_dim), kv_dtype),
        i32(max_num_seqs),
        i32(max_num_seqs, pages_per_seq),
        i32(max_num_seqs + 1),
        i32(1),
    )


def _lower(args, **kw) -> str:
    if jnp.dtype(args[1].dtype).itemsize == 1:
        kw = dict(k_scale=0.5, v_scale=0.25, **kw)
    f = functools.partial(ragged_paged_attention, sm_scale=0.125, **kw)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


# A covering grid rather than the full product: every q/kv dtype pair, head_dim, page
# size (16..256) and GQA ratio (1, 3, 4, 7, 8) appears, each row with different partners.
GRID = [
    # q, kv, head_dim, page_size, num_q_heads, num_kv_heads
    (F32, F32, 128, 16, 8, 8),
    (F32, F32, 64, 256, 32, 8),
    (BF16, BF16, 128, 128, 32, 8),  # Llama-3-8B
    (BF16, BF16, 256, 16, 16, 2),
    (BF16, BF16, 64, 32, 4, 4),
    (BF16, BF16, 128, 16, 28, 4),
    (BF16, I8, 128, 64, 32, 8),
    (BF16, I8, 256, 256, 4, 1),
    (BF16, FP8, 128, 32, 16, 16),
    (F32, I8, 64, 128, 12, 4),
    (F32, FP8, 256, 16, 8, 1),
    (BF16, F32, 128, 16, 32, 8),  # computes in float32, the cache's dtype
    (BF16, F32, 64, 32, 12, 4),
    (F32, BF16, 128, 32, 8, 2),  # float32 too: the wider of the two
]


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,head_dim,page_size,num_q_heads,num_kv_heads",
    GRID,
    ids=[
        f"{jnp.dtype(q).name}-{jnp.dtype(kv).name}-d{d}-p{p}-g{hq // hkv}"
        for q, kv, d, p, hq, hkv in GRID
    ],
)
def test_lowers_to_mosaic(q_dtype, kv_dtype, head_dim, page_size, num_q_heads, num_kv_heads):
    args = _specs(q_dtype, kv_dtype, head_dim, page_size, num_q_heads, num_kv_heads)
    assert "tpu_custom_call" in _lower(args)


@pytest.mark.parametrize(
    "options",
    [
        dict(causal=False),
        dict(sliding_window=100, soft_cap=30.0),
        dict(num_queries_per_block=16, num_kv_pages_per_block=4, vmem_limit_bytes=48 * 2**20),
        dict(num_kv_heads_per_block=8),
        dict(causal=False, out_dtype=F32),  # a cascade pass's float32 partial result
        *[dict(tpu_generation=g) for g in sorted(TUNED_BLOCK_SIZES) if g != "default"],
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_lowers_with_options_without_asking_the_device(options):
    # The device here is no TPU: a kernel that asked it for its TPU kind would fail.
    assert jax.devices()[0].platform != "tpu"
    args = _specs(BF16, BF16, 128, 32, 32, 8, tokens=128)
    assert "tpu_custom_call" in _lower(args, **options)


def _mosaic_modules(monkeypatch) -> list[str]:
    """Collects the text of every Mosaic module the Pallas TPU lowering builds."""
    from jax._src.pallas.mosaic import pallas_call_registration as registration

    lower = registration.lowering.lower_jaxpr_to_pipelined_module
    modules = []

    def lower_and_keep(*args, **kwargs):
        module = lower(*args, **kwargs)
        modules.append(str(module))
        return module

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_pipelined_module", lower_and_keep)
    return modules


@pytest.mark.parametrize("q_dtype", [F32, BF16], ids=["f32", "bf16"])
def test_float32_matmuls_ask_mosaic_for_full_precision(monkeypatch, q_dtype):
    # The interpreter multiplies in full float32 whatever the kernel asks, so the oracle
    # checks on the CPU cannot see this: on a TPU, a float32 matmul at default precision
    # runs in bfloat16 passes, far outside the float32 tolerance of 1e-5. bfloat16
    # queries over a float32 cache multiply in float32 too, not in bfloat16.
    modules = _mosaic_modules(monkeypatch)
    _lower(_specs(q_dtype, F32, 128, 16, 8, 2))
    (module,) = modules
    matmuls = [line for line in module.splitlines() if "tpu.matmul" in line]
    assert matmuls and all("contract_precision<fp32>" in m for m in matmuls), matmuls
    assert not any("bf16" in m for m in matmuls), matmuls


@pytest.mark.parametrize(
    "q_dtype, kv_dtype, mlir_type",
    [(BF16, I8, "bf16"), (BF16, FP8, "bf16"), (F32, BF16, "f32"), (BF16, F32, "f32")],
    ids=["bf16-int8", "bf16-fp8", "f32-bf16", "bf16-f32"],
)
def test_both_operands_of_every_matmul_are_in_the_dots_dtype(
    monkeypatch, q_dtype, kv_dtype, mlir_type
):
    # K and V are converted from the cache dtype in the kernel (through float32, the one
    # conversion Mosaic makes between any two types); the interpreter would multiply
    # mixed operands just as well, so only the lowered module shows that they are.
    modules = _mosaic_modules(monkeypatch)
    _lower(_specs(q_dtype, kv_dtype, 128, 32, 8, 2))
    (module,) = modules
    operands = re.findall(r"tpu\.matmul.*: vector<\w+x(\w+)>, vector<\w+x(\w+)>", module)
    assert operands and all(op == (mlir_type, mlir_type) for op in operands), operands


@pytest.mark.parametrize(
    "heads, knobs, hints",
    [((8, 2), {}, 1), ((32, 16), {"num_kv_heads_per_block": 8}, 4)],
    ids=["row window", "row window and kv-head blocks"],
)
def test_dynamic_offsets_reach_mosaic_as_multiples_of_their_tiling(
    monkeypatch, heads, knobs, hints
):
    # A decode row window's start, and a block of KV heads' first head in each copy,
    # slice VMEM and HBM at offsets Mosaic's compiler (which needs libtpu, not run here)
    # must know to be tile-aligned; without the hint the lowering still succeeds.
    modules = _mosaic_modules(monkeypatch)
    _lower(_specs(BF16, BF16, 128, 16, *heads), **knobs)
    (module,) = modules
    assert len(re.findall(r"tpu\.assume_multiple %\w+, 16 : i32", module)) == hints


def _trace(args, **kw):
    f = functools.partial(ragged_paged_attention, **{"sm_scale": 0.125, **kw})
    return jax.eval_shape(f, *args)


def test_output_shapes():
    out, lse = _trace(_specs(BF16, BF16, 128, 16, 32, 8, tokens=20))
    assert (out.shape, out.dtype) == ((20, 32, 128), jnp.dtype(BF16))
    assert (lse.shape, lse.dtype) == ((20, 32), jnp.dtype(F32))
    out, _ = _trace(_specs(BF16, BF16, 128, 16, 32, 8, tokens=20), out_dtype=F32)
    assert (out.shape, out.dtype) == ((20, 32, 128), jnp.dtype(F32))


@pytest.mark.parametrize(
    "spec,kw,match",
    [
        ((F32, F32, 96, 16, 4, 1), {}, "head_dim"),
        ((F32, F32, 128, 8, 4, 1), {}, "page_size"),
        ((BF16, BF16, 128, 24, 4, 1), {}, "page_size"),
        ((BF16, BF16, 128, 512, 4, 1), {}, "page_size"),
        ((F32, F32, 128, 16, 6, 4), {}, "query heads"),
        ((jnp.float16, jnp.float16, 128, 16, 4, 1), {}, "q.dtype"),
        ((F32, jnp.float16, 128, 16, 4, 1), {}, "kv_pages.dtype"),
        ((BF16, I8, 128, 16, 4, 1), {"k_scale": None}, "k_scale"),
        ((BF16, I8, 128, 16, 4, 1), {"v_scale": None}, "v_scale"),
        ((F32, F32, 128, 16, 4, 1), {"out_dtype": jnp.int8}, "out_dtype"),
        ((F32, F32, 128, 16, 4, 1), {"sm_scale": 0.0}, "sm_scale"),
        ((F32, F32, 128, 16, 4, 1), {"soft_cap": 0.0}, "soft_cap"),
        ((F32, F32, 128, 16, 4, 1), {"sliding_window": 0}, "sliding_window"),
        ((F32, F32, 128, 16, 4, 1), {"num_queries_per_block": 3}, "num_queries_per_block"),
        ((F32, F32, 128, 16, 4, 1), {"num_kv_pages_per_block": 0}, "num_kv_pages_per_block"),
        ((F32, F32, 128, 16, 16, 8), {"num_kv_heads_per_block": 2}, "num_kv_heads_per_block"),
        ((F32, F32, 128, 16, 4, 1), {"vmem_limit_bytes": 0}, "vmem_limit_bytes"),
        ((F32, F32, 128, 16, 4, 1), {"tpu_generation": "v9x"}, "tpu_generation"),
        ((F32, F32, 128, 16, 4, 1), {"causal": False, "sliding_window": 8}, "sliding_window"),
        # Knobs are ints: a float reached jnp.pad or a scratch shape (TypeError naming
        # neither), True ran as 1 and a float VMEM limit went to Mosaic as given.
        ((F32, F32, 128, 16, 4, 1), {"num_queries_per_block": 8.0}, "num_queries_per_block"),
        ((F32, F32, 128, 16, 4, 1), {"num_kv_pages_per_block": 2.0}, "num_kv_pages_per_block"),
        ((F32, F32, 128, 16, 4, 1), {"num_kv_pages_per_block": True}, "num_kv_pages_per_block"),
        ((F32, F32, 128, 16, 16, 8), {"num_kv_heads_per_block": 4.0}, "num_kv_heads_per_block"),
        ((F32, F32, 128, 16, 4, 1), {"vmem_limit_bytes": 1.5e7}, "vmem_limit_bytes"),
        ((F32, F32, 128, 16, 4, 1), {"vmem_limit_bytes": True}, "vmem_limit_bytes"),
        ((F32, F32, 128, 16, 4, 1), {"interpret": "yes"}, "interpret"),
        # Positions are int32: a longer window overflowed in jit's argument parsing.
        ((F32, F32, 128, 16, 4, 1), {"sliding_window": 2**31}, "sliding_window"),
    ],
)
def test_rejects_at_trace_time(spec, kw, match):
    args = _specs(*spec)
    if jnp.dtype(args[1].dtype).itemsize == 1:
        kw = {"k_scale": 0.5, "v_scale": 0.5, **kw}
    with pytest.raises(ValueError, match=match):
        _trace(args, **kw)


def test_rejects_non_int32_index_arrays():
    args = list(_specs(F32, F32, 128, 16, 4, 1))
    args[4] = jax.ShapeDtypeStruct(args[4].shape, jnp.float32)
    with pytest.raises(ValueError, match="cu_q_lens"):
        _trace(args)


def test_numpy_int_knobs_lower_as_python_ints_do():
    # Mosaic refused a numpy vmem_limit_bytes when lowering ("must be an int").
    args = _specs(BF16, BF16, 128, 16, 8, 2)
    knobs = dict(
        num_queries_per_block=16, num_kv_pages_per_block=4, num_kv_heads_per_block=2,
        vmem_limit_bytes=1 << 25,
    )  # fmt: skip
    as_numpy = {k: np.int64(v) for k, v in knobs.items()}
    assert _lower(args, **as_numpy) == _lower(args, **knobs)


def test_auto_generation_tunes_for_the_detected_tpu_and_by_default_for_another(monkeypatch):
    # "auto" asks the device; a generation the table does not know (a newer TPU) or no
    # TPU at all takes the default row, not block_sizes' ValueError for an unknown key.
    module = importlib.import_module("kernels_pallas.tpu.ragged_paged_attention")
    asked = []
    monkeypatch.setattr(module, "block_sizes", lambda g: asked.append(g) or TUNED_BLOCK_SIZES[g])
    args = _specs(BF16, BF16, 128, 16, 32, 8, tokens=20)
    for k, detected in enumerate((None, "v6e", "v99")):
        monkeypatch.setattr(module, "detect_tpu_generation", lambda d=detected: d)
        _trace(args, sm_scale=0.5**k, tpu_generation="auto")  # a new scale: traced anew
    assert asked == ["default", "v6e", "default"]
