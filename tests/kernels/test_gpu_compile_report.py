"""benchmarks/gpu_compile_report.py: the tiling each row reports is the one the kernel
takes for that call (no triton needed: the kernel is traced, not compiled)."""

from __future__ import annotations

import importlib
import sys

import jax
import pytest

from benchmarks import gpu_compile_report as report
from kernels_pallas.gpu.aot import kernel_arg_specs

# The module (kernels_pallas.gpu exports its function under the same name).
gpu_kernel = importlib.import_module("kernels_pallas.gpu.ragged_paged_attention")


def kernels_tiling(monkeypatch, kind: str, heads: str, dtypes: str):
    """The default tiling ragged_paged_attention computes when traced at this point."""
    taken = []

    def default_config(**kw):
        taken.append(report.default_config(**kw))
        return taken[-1]

    monkeypatch.setattr(gpu_kernel, "default_config", default_config)
    tokens, seqs, kw = report.KINDS[kind]
    num_q_heads, num_kv_heads, head_dim = report.HEADS[heads]
    q_dtype, kv_dtype = report.DTYPES[dtypes]
    args = kernel_arg_specs(
        num_tokens=tokens, num_seqs=seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype, num_pages=report.NUM_PAGES,
        page_size=report.PAGE_SIZE, pages_per_seq=report.PAGES_PER_SEQ,
    )  # fmt: skip
    scales = {"k_scale": 0.5, "v_scale": 0.5} if jax.numpy.dtype(kv_dtype).itemsize == 1 else {}
    jax.eval_shape(
        lambda *a: gpu_kernel.ragged_paged_attention(
            *a, sm_scale=head_dim**-0.5, interpret=True, **kw, **scales
        ),
        *args,
    )
    (config,) = taken
    return config


@pytest.mark.parametrize("dtypes", sorted(report.DTYPES))
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_each_row_reports_the_tiling_the_kernel_takes(monkeypatch, kind, dtypes):
    # The report sized tiles by the queries' itemsize, the kernel by the dots' dtype
    # (kernels_pallas.precision): for bfloat16 queries over a float32 cache it reported
    # 4 warps and 128 keys per step at decode, 128 rows and 64 keys at prefill, beside
    # the shared memory and registers of the float32 programs the kernel compiles (8
    # warps and 64 keys; 64 rows and 32 keys).
    assert report.tiling(kind, "llama3.2-1b", dtypes) == kernels_tiling(
        monkeypatch, kind, "llama3.2-1b", dtypes
    )


def test_the_report_covers_a_float32_cache_under_bfloat16_queries():
    # The engine serves it (CacheConfig.kv_dtype="float32" under a bfloat16 model), and
    # it is the pair whose dots change dtype: the report left it out.
    assert report.DTYPES["bf16/f32"] == (jax.numpy.bfloat16, jax.numpy.float32)


def test_without_triton_the_report_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.setattr(sys, "argv", ["gpu_compile_report.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        report.main()
    assert exit_.value.code == 2
    assert "needs the triton package" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_table_marks_a_capability_a_point_was_not_compiled_for(capsys):
    # float8 pages are skipped below compute capability 8.9: their sm_80 column is a dash,
    # and the sm_89 figures stay in the sm_89 column.
    tile = dict(block_m=16, block_k=64, num_warps=4)
    row = dict(tile, kind="decode", heads="gqa8", dtypes="bf16/fp8", cc=89, fits=True)
    row.update(shared_bytes=48 * 1024, registers=96, stack_bytes=0)
    report.print_table([row], [80, 89])
    _, line = capsys.readouterr().out.splitlines()
    sm_80, sm_89 = line.split(" | ")[1:]
    assert sm_80.split() == ["-"] and sm_89.split() == ["48", "96", "0"]
    assert len(sm_80) == len(sm_89)  # the columns stay aligned
