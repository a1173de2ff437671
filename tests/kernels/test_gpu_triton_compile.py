"""The GPU kernel through Triton's own compiler, to a cubin, on a machine without a GPU.

Lowering (test_gpu_kernel.py) stops at the Triton dialect module that XLA hands to its
Triton when it compiles the program on a GPU. `kernels_pallas.gpu.aot` compiles that
module the rest of the way with the `triton` package for a compute capability given by
hand, which catches what only the GPU compiler sees: a tile that cannot be laid out, or
a kernel that needs more shared memory per block than the GPU has. Each default tiling
whose group of query heads fits its capped query tile must fit compute capability 8.9
(an L4 or L40: 99 KiB per block, the tightest limit; 8.0 to 8.9 share one code
generation, and an A100's 163 KiB is looser) and 9.0 (an H100 or H200: 227 KiB, with a
code generation of its own); a larger group may outgrow 8.9, as the tuning states.

Runs where `triton` is installed (the test extras install it on Linux x86_64).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from kernels_pallas.gpu.aot import (
    DEVICE_KIND,
    SHARED_BYTES_PER_BLOCK,
    TritonCall,
    _resource_usage,
    compile_triton_call,
    lower_kernel_call,
    lower_triton_calls,
)

pytest.importorskip("triton", reason="needs the triton package (Linux x86_64)")

BF16, F16, F32, I8, FP8 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8, jnp.float8_e4m3fn

# (tokens, sequences, keyword arguments) of the three kinds of call the engine makes.
DECODE = (256, 256, {"max_q_len": 1})
PREFILL = (2048, 8, {})
PREFIX = (256, 1, {"causal": False})  # the cascade prefix pass: one sequence, all queries


def lower_default_call(cc, kind, q_dtype, kv_dtype, num_q_heads, num_kv_heads, head_dim,
                       **kernel_kw) -> TritonCall:  # fmt: skip
    """The one Triton call of the kernel for these shapes, lowered for GPU `cc`."""
    tokens, seqs, kw = kind
    call = lower_kernel_call(
        cc, num_tokens=tokens, num_seqs=seqs, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
        **kw, **kernel_kw,
    )  # fmt: skip
    assert call.verified
    return call


# The largest shared-memory users for each dtype (head_dim 256 prefill),
# and Llama-3-8B heads (32 query, 8 KV, head_dim 128) for decode and the prefix pass.
CASES = {
    "bf16-decode-llama": (DECODE, BF16, BF16, 32, 8, 128),
    "bf16-prefix-llama": (PREFIX, BF16, BF16, 32, 8, 128),
    "bf16-prefill-256": (PREFILL, BF16, BF16, 16, 16, 256),
    "f32-decode-256": (DECODE, F32, F32, 16, 16, 256),
    "f32-prefill-256": (PREFILL, F32, F32, 16, 16, 256),
    "int8-prefill-256": (PREFILL, BF16, I8, 16, 16, 256),
    "fp8-prefill-256": (PREFILL, BF16, FP8, 16, 16, 256),
    # float16 queries over a bfloat16 cache compute in float32: tiled as float32 queries.
    "f16-bf16-prefill-256": (PREFILL, F16, BF16, 16, 16, 256),
    "f16-bf16-decode-256": (DECODE, F16, BF16, 16, 16, 256),
    # So do bfloat16 queries over a float32 cache (its dtype).
    "bf16-f32-prefill-256": (PREFILL, BF16, F32, 16, 16, 256),
    "bf16-f32-decode-256": (DECODE, BF16, F32, 16, 16, 256),
}


@pytest.mark.parametrize("cc", [89, 90])
@pytest.mark.parametrize("case", sorted(CASES))
def test_default_tiling_compiles_and_fits_shared_memory(case, cc):
    call = lower_default_call(cc, *CASES[case])
    binary = compile_triton_call(call, cc)
    assert 0 < binary.shared_bytes <= SHARED_BYTES_PER_BLOCK[cc], binary
    assert binary.registers is not None and 0 < binary.registers <= 255, binary


def test_resource_usage_is_unknown_where_cuobjdump_cannot_tell(tmp_path):
    # A Triton without its cuobjdump, or one that fails on the cubin, leaves registers
    # and stack None (TritonBinary) rather than failing the compile it reports on.
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(b"not a cubin")
    package = tmp_path / "triton"
    fake_triton = SimpleNamespace(__file__=str(package / "__init__.py"))
    assert _resource_usage(fake_triton, cubin) == (None, None)
    tool = package / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\nexit 1\n")
    tool.chmod(0o755)
    assert _resource_usage(fake_triton, cubin) == (None, None)
    tool.write_text("#!/bin/sh\necho 'Function kernel:'\necho ' REG:40 STACK:8 SHARED:0'\n")
    assert _resource_usage(fake_triton, cubin) == (40, 8)


def test_a_tiling_too_big_for_an_a100_is_caught(monkeypatch, tmp_path):
    # 128 float32 query rows of head_dim 256 (the default before query tiles were capped)
    # need 168 KiB of shared memory: more than an A100 gives one block.
    call = lower_default_call(80, PREFILL, F32, F32, 16, 16, 256, block_m=128, num_warps=8)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert compile_triton_call(call, 80).shared_bytes > SHARED_BYTES_PER_BLOCK[80]
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path)  # the caller's, restored


@pytest.mark.parametrize("cc", [89, 90])
def test_a_two_level_cascade_step_compiles(cc):
    # The dispatch as the model calls it: the main pass and the global and groups prefix
    # passes (non-causal, float32 partial results) are three Triton calls.
    from jaxkv.attention import paged_attention
    from tests.attention.test_paged_attention import SM_SCALE, planned_inputs
    from tests.models.test_attention_dispatch import BUCKETS, _cascade_step

    step, plan = _cascade_step()
    md, q, kv = planned_inputs(step, plan, BUCKETS)
    q, kv = jnp.asarray(q, BF16), jnp.asarray(kv, BF16)
    run = lambda q, kv: paged_attention(q, kv, md, sm_scale=SM_SCALE, backend="pallas_gpu")
    _, calls = lower_triton_calls(run, (q, kv), DEVICE_KIND[cc])
    assert len(calls) == 3 and all(call.verified for call in calls)
    for call in calls:
        assert 0 < compile_triton_call(call, cc).shared_bytes <= SHARED_BYTES_PER_BLOCK[cc]


def test_compile_report_writes_a_row_per_tiling(tmp_path, monkeypatch, capsys):
    import json
    import sys

    from benchmarks import gpu_compile_report

    argv = ["gpu_compile_report.py", "--kinds", "decode", "--heads", "llama3.2-1b"]
    argv += ["--dtypes", "bf16", "bf16/fp8", "--cc", "80", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_compile_report.main()
    report = json.loads((tmp_path / "gpu_compile_report.json").read_text())
    # float8 pages need compute capability 8.9: no sm_80 row for them.
    assert [(r["dtypes"], r["cc"]) for r in report["results"]] == [("bf16", 80)]
    assert report["results"][0]["fits"] and report["summary"]["sm_80"]["tilings"] == 1
    assert "decode   llama3.2-1b  bf16" in capsys.readouterr().out


def test_compile_report_summarises_a_capability_with_no_tiling():
    # --dtypes bf16/fp8 --cc 80 skips every point; max() over none raised ValueError
    # before the JSON was written.
    from benchmarks import gpu_compile_report

    assert gpu_compile_report.summary([], [80]) == {
        "sm_80": {"tilings": 0, "shared_limit_kib": 163.0}
    }


@pytest.mark.parametrize(
    ("q_dtype", "num_q_heads", "fits"),
    [(F32, 32, True), (F32, 64, False), (BF16, 64, True), (BF16, 128, False)],
)
def test_a_group_past_the_query_tile_cap_may_outgrow_an_l4(q_dtype, num_q_heads, fits):
    # block_m holds at least one token's whole group of query heads: past the query-tile
    # cap (16 float32 or 64 bfloat16 rows at head_dim 256) the group sets the tile, and
    # the default tiling then needs more than the 99 KiB of compute capability 8.9, as
    # kernels_pallas.gpu.tuning.default_config states; one stage fits it.
    call = lower_default_call(89, PREFILL, q_dtype, q_dtype, num_q_heads, 1, 256)
    shared = compile_triton_call(call, 89).shared_bytes
    assert (shared <= SHARED_BYTES_PER_BLOCK[89]) == fits, shared
    if not fits:
        call = lower_default_call(89, PREFILL, q_dtype, q_dtype, num_q_heads, 1, 256, num_stages=1)
        assert compile_triton_call(call, 89).shared_bytes <= SHARED_BYTES_PER_BLOCK[89]
