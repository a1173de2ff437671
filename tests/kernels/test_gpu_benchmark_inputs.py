"""benchmarks/gpu_kernel.py: its page tables share exactly what its table says they
share, and a correctness check that raises fails the run."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kernel.py"
_spec = importlib.util.spec_from_file_location("gpu_kernel_benchmark", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_shared_tables_share_the_prefix_pages_only():
    tables, pages_per_copy = bench.decode_tables(3, 64, 20, 16, shared=True, copies=2)
    assert tables.shape == (2, 3, 4 + 2)
    for copy in tables:
        assert np.all(copy[:, :4] == copy[0, :4])  # 64 prefix tokens = 4 shared pages
        own = copy[:, 4:]
        assert len(np.unique(own)) == own.size  # 20 own tokens = 2 pages, never shared
        assert not np.intersect1d(own, copy[0, :4]).size
    # Copies use disjoint pages, none of them the null page 0.
    assert not np.intersect1d(tables[0], tables[1]).size
    assert tables.min() >= 1 and tables.max() < 2 * pages_per_copy


def test_unique_tables_share_no_page():
    tables, pages_per_copy = bench.decode_tables(3, 64, 20, 16, shared=False, copies=1)
    assert len(np.unique(tables)) == tables.size == 3 * 6
    assert tables.min() >= 1 and tables.max() < pages_per_copy


def test_a_check_that_raises_fails_the_run_unless_the_gpu_cannot_convert_float8():
    from benchmarks import gpu_kernel_checks as checks

    q, kv = np.zeros((4, 2, 16), np.float32), np.zeros((2, 16, 2, 16), np.float32)
    meta = [np.zeros(1, np.int32), np.zeros((1, 1), np.int32), np.zeros(2, np.int32)]
    bad = checks._check_one("bad_args", (q, kv, *meta, np.ones(3)), {"sm_scale": 1.0}, True)
    assert not bad["ok"] and not bad["unsupported"] and "num_seqs" in bad["error"]
    old_gpu = {"ok": False, "unsupported": True}  # the kernel's refusal below sm_89
    assert checks.checks_passed([{"ok": True}, old_gpu])
    assert not checks.checks_passed([{"ok": True}, old_gpu, bad])
