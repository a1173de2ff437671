"""The GPU kernel through Triton's own compiler, to a cubin, on a machine without a GPU.

Lowering (test_gpu_kernel.py) stops at the Triton dialect module that XLA hands to its
Triton when it compiles the program on a GPU. The `triton` package compiles that module
the rest of the way (GPU layouts, software pipelining, LLVM, PTX, ptxas) for a compute
capability given by hand, which catches what only the GPU compiler sees: a tile that
cannot be laid out, or a kernel that needs more shared memory per block than the GPU
has. Each default tiling must fit compute capability 8.9 (an L4 or L40: 99 KiB per
block, the tightest limit; 8.0 to 8.9 share one code generation, and an A100's 163 KiB
is looser) and 9.0 (an H100 or H200: 227 KiB, with a code generation of its own). XLA
bundles a Triton build of its own, so this is the same compiler pipeline, not the same
build.

Runs where `triton` is installed (the test extras install it on Linux x86_64).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.gpu import ragged_paged_attention
from tests.kernels.triton_modules import TritonCall, lower_for_cuda

triton = pytest.importorskip("triton", reason="needs the triton package (Linux x86_64)")

# Most dynamic shared memory one block may use (CUDA C Programming Guide, compute
# capabilities table): 163 KiB on an A100, 99 KiB on an L4, 227 KiB on an H100 or H200.
SHARED_BYTES_PER_BLOCK = {80: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DEVICE_KIND = {80: "NVIDIA A100", 89: "NVIDIA L4", 90: "NVIDIA H200"}
BF16, F32, I8, FP8 = jnp.bfloat16, jnp.float32, jnp.int8, jnp.float8_e4m3fn

# (tokens, sequences, keyword arguments) of the three kinds of call the engine makes.
DECODE = (256, 256, {"max_q_len": 1})
PREFILL = (2048, 8, {})
PREFIX = (256, 1, {"causal": False})  # the cascade prefix pass: one sequence, all queries


def _lower(monkeypatch, cc, kind, q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim,
           **kernel_kw) -> TritonCall:  # fmt: skip
    tokens, seqs, kw = kind
    pages_per_seq, page_size = 64, 16
    spec = jax.ShapeDtypeStruct
    args = (
        spec((tokens, num_q_heads, head_dim), q_dtype),
        spec((256, page_size, 2 * num_kv_heads, head_dim), kv_dtype),
        spec((seqs,), jnp.int32),
        spec((seqs, pages_per_seq), jnp.int32),
        spec((seqs + 1,), jnp.int32),
        spec((1,), jnp.int32),
    )
    if jnp.dtype(kv_dtype).itemsize == 1:
        kw = {**kw, "k_scale": 0.5, "v_scale": 0.5}
    f = functools.partial(ragged_paged_attention, sm_scale=0.1, **kw, **kernel_kw)
    _, (call,) = lower_for_cuda(f, args, monkeypatch, DEVICE_KIND[cc])
    assert call.verified
    return call


def _compile(call: TritonCall, cc: int, tmp_path, monkeypatch):
    """Triton's compile of `call` for compute capability `cc`, down to a cubin."""
    from triton.backends.compiler import GPUTarget

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))  # a real compile each run
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "ragged_paged_attention_gpu.ttir"
    path.write_text(call.ir)
    options = {"num_warps": call.num_warps, "num_stages": call.num_stages}
    compiled = triton.compile(str(path), target=GPUTarget("cuda", cc, 32), options=options)
    assert compiled.asm["cubin"], "no cubin"
    return compiled


# The largest shared-memory users for each dtype (head_dim 256 prefill),
# and Llama-3-8B heads (32 query, 8 KV, head_dim 128) for decode and the prefix pass.
CASES = {
    "bf16-decode-llama": (BF16, BF16, DECODE, 32, 8, 128),
    "bf16-prefix-llama": (BF16, BF16, PREFIX, 32, 8, 128),
    "bf16-prefill-256": (BF16, BF16, PREFILL, 16, 16, 256),
    "f32-decode-256": (F32, F32, DECODE, 16, 16, 256),
    "f32-prefill-256": (F32, F32, PREFILL, 16, 16, 256),
    "int8-prefill-256": (BF16, I8, PREFILL, 16, 16, 256),
    "fp8-prefill-256": (BF16, FP8, PREFILL, 16, 16, 256),
}


@pytest.mark.parametrize("cc", [89, 90])
@pytest.mark.parametrize("case", sorted(CASES))
def test_default_tiling_compiles_and_fits_shared_memory(case, cc, tmp_path, monkeypatch):
    q_dtype, kv_dtype, kind, num_q_heads, num_kv_heads, head_dim = CASES[case]
    call = _lower(monkeypatch, cc, kind, q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim)
    compiled = _compile(call, cc, tmp_path, monkeypatch)
    assert 0 < compiled.metadata.shared <= SHARED_BYTES_PER_BLOCK[cc], compiled.metadata.shared


def test_a_tiling_too_big_for_an_a100_is_caught(tmp_path, monkeypatch):
    # 128 float32 query rows of head_dim 256 (the default before query tiles were capped)
    # need 168 KiB of shared memory: more than an A100 gives one block.
    call = _lower(monkeypatch, 80, PREFILL, F32, F32, 16, 16, 256, block_m=128, num_warps=8)
    compiled = _compile(call, 80, tmp_path, monkeypatch)
    assert compiled.metadata.shared > SHARED_BYTES_PER_BLOCK[80]


@pytest.mark.parametrize("cc", [89, 90])
def test_a_two_level_cascade_step_compiles(cc, tmp_path, monkeypatch):
    # The dispatch as the model calls it: the main pass and the global and groups prefix
    # passes (non-causal, float32 partial results) are three Triton calls.
    from jaxkv.attention import paged_attention
    from tests.attention.test_paged_attention import SM_SCALE, planned_inputs
    from tests.models.test_attention_dispatch import BUCKETS, _cascade_step

    step, plan = _cascade_step()
    md, q, kv = planned_inputs(step, plan, BUCKETS)
    q, kv = jnp.asarray(q, BF16), jnp.asarray(kv, BF16)
    run = lambda q, kv: paged_attention(q, kv, md, sm_scale=SM_SCALE, backend="pallas_gpu")
    _, calls = lower_for_cuda(run, (q, kv), monkeypatch, DEVICE_KIND[cc])
    assert len(calls) == 3 and all(call.verified for call in calls)
    for i, call in enumerate(calls):
        compiled = _compile(call, cc, tmp_path / str(i), monkeypatch)
        assert 0 < compiled.metadata.shared <= SHARED_BYTES_PER_BLOCK[cc]
